//! Runs the real `kvferry` binary on good and bad specs.

use serde_json::Value;
use std::io::Write;
use std::process::{Command, Output, Stdio};

// The spec as the binary reads it, to compare its output with a plan made
// in-process.
#[allow(dead_code)]
#[path = "../../src/plan/spec.rs"]
mod spec;

fn kvferry(args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvferry");
    // The child may exit before reading all of a bad spec; that is fine.
    let _ = child.stdin.take().expect("stdin").write_all(stdin);
    child.wait_with_output().expect("wait for kvferry")
}

fn plan_file(name: &str) -> Value {
    let path = format!(
        "{}/../examples/specs/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = kvferry(&["plan", "--spec", &path], b"");
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is JSON")
}

fn example(name: &str) -> Value {
    let path = format!(
        "{}/../examples/specs/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn descriptors(out: &Value) -> Vec<[u64; 3]> {
    serde_json::from_value(out["descriptors"].clone()).unwrap()
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap()
}

/// Runs the binary on a spec given on stdin and checks the failure shape:
/// status 2, nothing on stdout, exactly one line on stderr.
fn expect_rejected(spec: &[u8], needle: &str) {
    let out = kvferry(&["plan", "--spec", "-"], spec);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(out.stdout.is_empty());
    assert_eq!(stderr.matches('\n').count(), 1, "one line: {stderr:?}");
    assert!(stderr.starts_with("kvferry plan: "), "{stderr}");
    assert!(stderr.contains(needle), "{needle:?} not in {stderr:?}");
}

fn mutated(name: &str, f: impl FnOnce(&mut Value)) -> Vec<u8> {
    let mut spec = example(name);
    f(&mut spec);
    serde_json::to_vec(&spec).unwrap()
}

#[test]
fn hetero_tp_example_writes_head_slices_per_token() {
    let spec = example("hetero_tp");
    let out = plan_file("hetero_tp");
    assert_eq!(out["transfer"], Value::Bool(true));
    let ds = descriptors(&out);
    // 2 regions x 3 blocks x 16 tokens, none adjacent: prefill rank 1 holds
    // heads 2..4, a 2 x 256-byte slice of each token of a 4-head decode row.
    assert_eq!(ds.len(), 2 * 3 * 16);
    let p = &spec["prefill"]["regions"][0];
    let d = &spec["decode"]["regions"][0];
    let src0 = u(&p["base"]) + 10 * u(&p["block_len"]);
    let dst0 = u(&d["base"]) + 200 * u(&d["block_len"]) + 2 * 256;
    assert_eq!(ds[0], [src0, dst0, 512]);
    assert_eq!(ds[1], [src0 + 512, dst0 + 1024, 512]);
    // batch_descriptors_max is 32 in this spec.
    let batches: Vec<[usize; 2]> = serde_json::from_value(out["batches"].clone()).unwrap();
    assert_eq!(batches, vec![[0, 32], [32, 32], [64, 32]]);
}

#[test]
fn every_example_plans_and_matches_the_library() {
    for name in [
        "homogeneous_hnd",
        "hetero_tp",
        "tp_1_to_2",
        "mla",
        "partial_hit",
    ] {
        let out = plan_file(name);
        let text = std::fs::read_to_string(format!(
            "{}/../examples/specs/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap();
        let lib = spec::plan_from_json(&text).unwrap();
        let want: Vec<[u64; 3]> = lib
            .descriptors
            .iter()
            .map(|d| [d.src, d.dst, d.len])
            .collect();
        assert_eq!(descriptors(&out), want, "{name}");
        assert_eq!(out["transfer"], Value::Bool(!want.is_empty()), "{name}");
        let batches: Vec<[usize; 2]> = serde_json::from_value(out["batches"].clone()).unwrap();
        let lib_batches: Vec<[usize; 2]> = lib.batches.iter().map(|b| [b.first, b.count]).collect();
        assert_eq!(batches, lib_batches, "{name}");
    }
}

#[test]
fn homogeneous_example_coalesces_runs() {
    // Pairs 40..44 -> 3..7 form one run; 97 -> 7 and 98 -> 500 stand alone.
    let spec = example("homogeneous_hnd");
    let ds = descriptors(&plan_file("homogeneous_hnd"));
    let kv = 4 * 16 * 256;
    assert_eq!(ds.len(), 3 * 4);
    let p = u(&spec["prefill"]["regions"][0]["base"]);
    let d = u(&spec["decode"]["regions"][0]["base"]);
    assert_eq!(ds[0], [p + 40 * kv, d + 3 * kv, 4 * kv]);
    assert_eq!(ds[1], [p + 97 * kv, d + 7 * kv, kv]);
    assert_eq!(ds[2], [p + 98 * kv, d + 500 * kv, kv]);
}

#[test]
fn partial_hit_example_sends_only_missing_blocks_in_small_batches() {
    let spec = example("partial_hit");
    let out = plan_file("partial_hit");
    let ds = descriptors(&out);
    let kv = 8 * 16 * 256;
    let p = u(&spec["prefill"]["regions"][0]["base"]);
    let d = u(&spec["decode"]["regions"][0]["base"]);
    // Group 0 sends prefill 5,6 -> 50,51; group 1 sends 20..23 -> 60..63,
    // cut at batch_bytes_max = 65536.
    assert_eq!(ds[0], [p + 5 * kv, d + 50 * kv, 2 * kv]);
    assert_eq!(ds[1], [p + 20 * kv, d + 60 * kv, 65536]);
    assert_eq!(ds[2], [p + 20 * kv + 65536, d + 60 * kv + 65536, kv]);
    assert_eq!(ds.len(), 6);
    let batches: Vec<[usize; 2]> = serde_json::from_value(out["batches"].clone()).unwrap();
    assert!(batches.iter().all(|b| b[1] == 1), "{batches:?}");
}

#[test]
fn unpaired_ranks_transfer_nothing() {
    // Decode rank 1 of 2 holds heads 4..8; prefill rank 1 of 4 holds 2..4.
    let spec = mutated("hetero_tp", |s| s["decode"]["tp_rank"] = 1.into());
    let out = kvferry(&["plan", "--spec", "-"], &spec);
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["transfer"], Value::Bool(false));
    assert_eq!(v["descriptors"], Value::Array(vec![]));
    assert_eq!(v["batches"], Value::Array(vec![]));
}

#[test]
fn malformed_json_is_rejected_on_one_line() {
    expect_rejected(b"", "malformed spec");
    expect_rejected(b"{\"model\": ", "malformed spec");
    expect_rejected(b"\xff\xfe\x00garbage", "valid UTF-8");
    expect_rejected(b"[1, 2, 3]", "malformed spec");
    let text = String::from_utf8(mutated("mla", |_| {})).unwrap();
    expect_rejected(
        text.replace("\"mla\"", "\"abc\"").as_bytes(),
        "unknown variant",
    );
    expect_rejected(&mutated("mla", |s| s["extra"] = 1.into()), "unknown field");
    expect_rejected(
        &mutated("mla", |s| s["prefill"]["num_blocks"] = (-1).into()),
        "malformed spec",
    );
    let huge = String::from_utf8(mutated("mla", |s| s["prefill"]["num_blocks"] = 7.into()))
        .unwrap()
        .replacen("\"num_blocks\":7", "\"num_blocks\":18446744073709551616", 1);
    expect_rejected(huge.as_bytes(), "malformed spec");
}

#[test]
fn invalid_specs_are_rejected_on_one_line() {
    expect_rejected(
        &mutated("hetero_tp", |s| {
            s["decode_blocks"] = serde_json::json!([[1], [2]])
        }),
        "KV group count differs",
    );
    expect_rejected(
        &mutated("hetero_tp", |s| {
            s["decode_blocks"] = serde_json::json!([[1, 2, 3, 4]])
        }),
        "fewer than decode",
    );
    expect_rejected(
        &mutated("hetero_tp", |s| {
            s["prefill_blocks"] = serde_json::json!([[1, 2, 1024]])
        }),
        "not below num_blocks",
    );
    expect_rejected(
        &mutated("hetero_tp", |s| {
            s["decode_blocks"] = serde_json::json!([[5, 6, 5]])
        }),
        "more than once",
    );
    expect_rejected(
        &mutated("hetero_tp", |s| {
            s["prefill"]["regions"][0]["kv_block_len"] = 16384.into()
        }),
        "kv_block_len 16384 is not",
    );
    expect_rejected(
        &mutated("hetero_tp", |s| s["prefill"]["tp_size"] = 3.into()),
        "neither divides",
    );
    expect_rejected(
        &mutated("hetero_tp", |s| {
            s["decode"]["regions"][1]["base"] = u64::MAX.into()
        }),
        "overflows",
    );
    expect_rejected(
        &mutated("hetero_tp", |s| {
            let base = s["decode"]["regions"][0]["base"].clone();
            s["decode"]["regions"][1]["base"] = base;
        }),
        "overlap",
    );
    expect_rejected(
        &mutated("mla", |s| {
            s["decode"]["regions"][2]["kv_block_len"] = 1.into()
        }),
        "mla region 2",
    );
    expect_rejected(
        &mutated("homogeneous_hnd", |s| {
            s["decode"]["regions"].as_array_mut().unwrap().pop();
        }),
        "region count differs",
    );
    expect_rejected(
        &mutated("homogeneous_hnd", |s| s["batch_descriptors_max"] = 0.into()),
        "at least 1",
    );
    expect_rejected(
        &mutated("homogeneous_hnd", |s| {
            s["batch_bytes_max"] = 1.into();
            s["descriptors_max"] = 1000.into();
        }),
        "descriptors_max = 1000",
    );
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        vec!["plan"],
        vec!["plan", "--spec"],
        vec!["plan", "--spec", "/nonexistent/spec.json"],
        vec!["plan", "--spec", "x", "--bogus", "1"],
        vec!["plan", "stray"],
    ] {
        let out = kvferry(&args, b"");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.matches('\n').count(), 1, "{args:?}: {stderr:?}");
    }
}
