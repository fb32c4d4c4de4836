//! `kvferry bench transport --baseline iperf3` and `--sweep`, against a
//! stand-in `iperf3` on PATH that records how it was called and reports a
//! fixed 1 GB/s, so the runs are checked without timing anything.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A stand-in iperf3: the server announces it listens and exits, the
/// client prints iperf3's JSON for 8e9 bits/s received.
const FAKE_IPERF3: &str = r#"#!/bin/sh
echo "$*" >> "${0%/*}/calls"
case " $* " in
  *" -s "*) echo "Server listening on 5201 (test #1)" ;;
  *) echo '{"end":{"sum_received":{"bits_per_second":8e9}}}' ;;
esac
"#;

/// A fresh directory for one test.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvferry-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a scratch directory");
    dir
}

/// A directory holding only the stand-in iperf3.
fn fake_iperf3_dir(name: &str) -> PathBuf {
    let dir = scratch_dir(name);
    let exe = dir.join("iperf3");
    std::fs::write(&exe, FAKE_IPERF3).expect("write the stand-in");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

fn kvferry_with_path(path: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(args)
        .env("PATH", path)
        .output()
        .expect("run kvferry")
}

fn calls(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("calls"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn a_missing_iperf3_is_a_one_line_usage_error_before_measuring() {
    let empty = scratch_dir("no-iperf3");
    let args = ["bench", "transport", "--transport", "local"];
    let out = kvferry_with_path(&empty, &[&args[..], &["--baseline", "iperf3"]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(out.stdout.is_empty(), "measured before failing: {out:?}");
    assert_eq!(stderr.matches('\n').count(), 1, "{stderr:?}");
    assert!(
        stderr.starts_with("kvferry bench transport: --baseline iperf3: iperf3 is not on PATH"),
        "{stderr:?}"
    );
}

#[test]
fn the_iperf3_baseline_runs_with_the_same_message_size_and_prints_the_ratio() {
    let dir = fake_iperf3_dir("iperf3-baseline");
    let out = kvferry_with_path(
        &dir,
        &[
            "bench",
            "transport",
            "--transport",
            "local",
            "--block-bytes",
            "8192",
            "--batch",
            "2",
            "--seconds",
            "0.05",
            "--baseline",
            "iperf3",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["iperf3_gbps"], 1.0, "{v}");
    assert_eq!(v["iperf3_len"], 8192, "{v}");
    let ratio = v["ratio_to_iperf3"].as_f64().expect("a ratio");
    assert!((ratio - v["gbps"].as_f64().unwrap()).abs() < 1e-9, "{v}");
    let calls = calls(&dir);
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls[0].starts_with("-s -1 "), "{calls:?}");
    assert!(calls[1].starts_with("-c 127.0.0.1 "), "{calls:?}");
    assert!(calls[1].contains(" -l 8192 -t 1"), "{calls:?}");
    // Pinned like the bench: client with the initiator on core 0, server
    // with the target on core 1, whenever the bench pins.
    let pinned = std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2;
    assert_eq!(calls[0].ends_with(" -A 1"), pinned, "{calls:?}");
    assert_eq!(calls[1].ends_with(" -A 0"), pinned, "{calls:?}");
}

#[test]
fn a_sweep_writes_every_transport_and_baseline_at_every_block_size() {
    let dir = fake_iperf3_dir("sweep");
    let (csv, samples) = (dir.join("sweep.csv"), dir.join("samples.csv"));
    let out = kvferry_with_path(
        &dir,
        &[
            "bench",
            "transport",
            "--sweep",
            "--sweep-max-bytes",
            "16384",
            "--point-seconds",
            "0.02",
            "--streams",
            "1",
            "--csv",
            csv.to_str().unwrap(),
            "--samples",
            samples.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let table = std::fs::read_to_string(&csv).expect("the CSV");
    let mut lines = table.lines();
    assert_eq!(
        lines.next(),
        Some("block_bytes,batch,streams,transport,gbps,p50_us,p99_us")
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    let has = |block: &str, batch: &str, transport: &str| {
        rows.iter()
            .any(|r| r[0] == block && r[1] == batch && r[3] == transport)
    };
    for block in ["4096", "16384"] {
        for transport in ["tcp", "shm", "local", "memcpy", "iperf3"] {
            assert!(has(block, "32", transport), "{block} {transport}: {table}");
        }
    }
    assert!(
        has("4096", "1", "tcp") && has("4096", "1", "shm") && has("4096", "1", "local"),
        "{table}"
    );
    assert_eq!(rows.len(), 13, "{table}");
    for r in &rows {
        let transport_row = ["tcp", "shm", "local"].contains(&r[3]);
        assert_eq!(!r[5].is_empty(), transport_row, "{r:?}");
    }
    let samples = std::fs::read_to_string(&samples).expect("the samples");
    assert!(
        samples.starts_with("transport,seq,latency_us\n"),
        "{samples}"
    );
    for transport in ["tcp,", "shm,", "local,"] {
        assert!(
            samples.lines().any(|l| l.starts_with(transport)),
            "{transport}"
        );
    }
}
