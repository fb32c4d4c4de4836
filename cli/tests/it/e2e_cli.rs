//! `kvferry demo` as a user runs it: exit status and the JSON summary.

use std::process::Command;

fn demo(args: &[&str]) -> (i32, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .arg("demo")
        .args(args)
        .output()
        .expect("run kvferry demo");
    let json = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (out.status.code().unwrap_or(-1), json)
}

#[test]
fn demo_json_summary_counts_every_request() {
    for args in [
        &[
            "--requests",
            "60",
            "--concurrency",
            "8",
            "--layers",
            "2",
            "--json",
        ][..],
        &[
            "--requests",
            "30",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "1",
            "--mode",
            "pull",
            "--json",
        ][..],
        &[
            "--requests",
            "30",
            "--layout",
            "mla",
            "--decode-tp",
            "2",
            "--transport",
            "local",
            "--json",
        ][..],
    ] {
        let (code, j) = demo(args);
        assert_eq!(code, 0, "{args:?}: {j}");
        let requests = j["requests"].as_u64().unwrap();
        assert_eq!(j["ok"].as_u64().unwrap(), requests, "{args:?}: {j}");
        assert_eq!(j["verify_errors"], 0);
        assert_eq!(j["failed"], 0);
        assert_eq!(j["expired"], 0);
        assert!(j["bytes"].as_u64().unwrap() > 0);
        for key in ["gbps", "p50_ms", "p99_ms"] {
            assert!(j[key].as_f64().unwrap() >= 0.0, "{key}");
        }
    }
}

/// Prefill TP 8 → decode TP 2 with 4 KV heads: half the prefill ranks send
/// to nobody. Every prefill rank still ends every request with `Success`
/// (the unpaired ones are told), none by expiring its hold.
#[test]
fn demo_json_reports_every_prefill_rank_of_every_request() {
    let args = [
        "--requests",
        "40",
        "--prefill-tp",
        "8",
        "--decode-tp",
        "2",
        "--heads",
        "4",
        "--json",
    ];
    let (code, j) = demo(&args);
    assert_eq!(code, 0, "{j}");
    assert_eq!(j["ok"], 40, "{j}");
    let p = &j["prefill"];
    assert_eq!(p["ok"], 8 * 40, "{j}");
    assert_eq!((&p["failed"], &p["expired"]), (&0.into(), &0.into()), "{j}");
    assert!(p["held_ms_max"].as_f64().unwrap() >= 0.0, "{j}");
}

#[test]
fn demo_rejects_bad_options_with_status_2() {
    assert_eq!(demo(&["--layout", "diagonal"]).0, 2);
    assert_eq!(demo(&["--no-such-option", "1"]).0, 2);
    // A model the TP sizes do not fit is refused before any request runs.
    assert_eq!(demo(&["--heads", "3", "--prefill-tp", "2", "--json"]).0, 1);
}

/// Three KV-cache groups, two of them with a sliding window of 32 tokens
/// (16-token blocks: 3 of a request's 4 blocks move): every byte verified,
/// and exactly the window's blocks moved.
#[test]
fn demo_moves_several_groups_and_only_the_windows_blocks() {
    let base = ["--requests", "40", "--json"];
    let (code, one) = demo(&base);
    assert_eq!(code, 0, "{one}");
    let args = [&base[..], &["--groups", "3", "--window-tokens", "32"]].concat();
    let (code, j) = demo(&args);
    assert_eq!(code, 0, "{j}");
    assert_eq!(
        (&j["ok"], &j["verify_errors"]),
        (&40.into(), &0.into()),
        "{j}"
    );
    // 4 + 3 + 3 blocks per request against 4.
    let (a, b) = (one["bytes"].as_u64().unwrap(), j["bytes"].as_u64().unwrap());
    assert_eq!(b * 4, a * 10, "{one} {j}");
}

#[test]
fn demo_with_a_store_saves_dedups_looks_up_loads_and_verifies() {
    let (code, r) = demo(&["--store", "inproc", "--requests", "6", "--json"]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["requests"], 6);
    assert_eq!(r["verify_errors"], 0);
    assert_eq!(r["load_errors"], 0);
    // The requests share a prefix: stored once, found stored after.
    assert!(r["saved_blocks"].as_u64().unwrap() > 0, "{r}");
    assert!(r["dedup_skipped"].as_u64().unwrap() > 0, "{r}");
    assert!(r["loaded_blocks"].as_u64().unwrap() > 0, "{r}");
    assert!(r["lookup_hit_tokens"].as_u64().unwrap() > 0, "{r}");
    let (code, _) = demo(&["--store", "nosuch://127.0.0.1:6379"]);
    assert_eq!(code, 2);
}

/// 3 000 requests store 6 GB of blocks of their own through the in-process
/// store's 1 GiB: the run's peak RSS is its pool and that store, not its
/// requests.
#[test]
// Reaped by `wait4`, which also gives the child's own peak RSS.
#[allow(clippy::zombie_processes)]
fn the_store_demo_runs_in_a_fixed_pool_whatever_the_number_of_requests() {
    let requests = 3000u64;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["demo", "--store", "inproc", "--json"])
        .args(["--requests", &requests.to_string()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn kvferry demo");
    let mut out = String::new();
    let stdout = child.stdout.take().expect("piped stdout");
    std::io::Read::read_to_string(&mut std::io::BufReader::new(stdout), &mut out).unwrap();
    // SAFETY: all zeroes is a valid `rusage` (integers and timevals).
    let mut usage = unsafe { std::mem::zeroed::<libc::rusage>() };
    let mut status = 0;
    // SAFETY: our own child, reaped here once, into valid out-pointers.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32);
    let r: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{r}"
    );
    assert_eq!(r["verify_errors"], 0, "{r}");
    assert_eq!(
        r["loaded_blocks"],
        requests * 24,
        "every block came back: {r}"
    );
    let pool = r["pool_bytes"].as_u64().unwrap();
    let peak = usage.ru_maxrss as u64 * 1024;
    assert!(peak < 2 << 30, "peak RSS {peak} over 2 GiB");
    assert!(
        peak < pool + (1 << 30) + (256 << 20),
        "peak RSS {peak} over the pool ({pool}), the store's 1 GiB and 256 MiB"
    );
}

#[test]
fn demo_against_a_store_server_process_verifies_every_byte() {
    let mut server = crate::stores::StoreServe::start(256 << 20);
    let (code, r) = demo(&["--store", &server.url, "--requests", "64", "--json"]);
    let commits = server.metric("kvferry_store_commits_total");
    // Signals end it cleanly (its stats on stderr); the drop kills it else.
    // SAFETY: a child process we spawned and have not reaped.
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    let status = server.child.wait().expect("the server exits");
    assert_eq!(code, 0, "{}: {r}", server.url);
    assert_eq!(r["verify_errors"], 0);
    assert_eq!(r["load_errors"], 0);
    assert!(r["loaded_blocks"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(
        r["saved_blocks"], commits,
        "each block the demo stored, committed once"
    );
    assert!(
        status.success(),
        "SIGTERM stops the server cleanly: {status}"
    );
}

/// `--store redis://` against a `redis-server` of the test's own: every
/// block the demo says it stored is one key in Redis.
#[test]
fn demo_against_redis_verifies_every_byte() {
    let redis = crate::stores::Redis::start(&[]);
    let (code, r) = demo(&["--store", &redis.url(), "--requests", "64", "--json"]);
    let keys: u64 = redis.cli("dbsize").parse().unwrap_or(0);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        (&r["verify_errors"], &r["load_errors"]),
        (&0.into(), &0.into()),
        "{r}"
    );
    assert!(r["dedup_skipped"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["saved_blocks"], keys, "each stored block is one key: {r}");
}

/// `--transport mooncake` with the library from `MOONCAKE_TE_LIB` (the fake
/// engine here: its batches are memcpy within the demo's process), push and
/// pull, every byte verified; a missing library is a clear error.
#[test]
fn demo_over_the_mooncake_transport_verifies_every_byte() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mooncake-fake-cli");
    let lib = mooncake_sys::fake::build(&dir).expect("the fake library builds");
    for mode in ["push", "pull"] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args([
                "demo",
                "--transport",
                "mooncake",
                "--mooncake-protocol",
                "tcp",
            ])
            .args([
                "--mode",
                mode,
                "--requests",
                "40",
                "--prefill-tp",
                "2",
                "--json",
            ])
            .env(mooncake_sys::TE_LIB_ENV, &lib)
            .output()
            .expect("run kvferry demo");
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        assert!(
            out.status.success(),
            "{mode}: {j} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(j["ok"], j["requests"], "{mode}: {j}");
        assert_eq!(j["verify_errors"], 0, "{mode}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([
            "demo",
            "--transport",
            "mooncake",
            "--requests",
            "1",
            "--json",
        ])
        .env(
            mooncake_sys::TE_LIB_ENV,
            "/nonexistent/libtransfer_engine.so",
        )
        .output()
        .expect("run kvferry demo");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(
            "no Mooncake library could be loaded; tried: /nonexistent/libtransfer_engine.so"
        ),
        "{stderr}"
    );
}

/// `--store mooncake://MASTER` with the store library from
/// `MOONCAKE_STORE_LIB` (the fake store here: a table in the demo's
/// process): saves, dedup, lookup hits, loads, every byte verified; an
/// unreachable master is exit status 1 with the library's error.
#[test]
fn demo_with_a_mooncake_store_verifies_every_byte() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mooncake-fake-cli-store");
    let lib = mooncake_sys::fake::build_store(&dir).expect("the fake store builds");
    let run = |url: &str| {
        Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(["demo", "--store", url, "--requests", "6", "--json"])
            .env(mooncake_sys::STORE_LIB_ENV, &lib)
            .output()
            .expect("run kvferry demo")
    };
    let out = run("mooncake://127.0.0.1:50051");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert!(
        out.status.success(),
        "{r} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(r["verify_errors"], 0, "{r}");
    assert_eq!(r["load_errors"], 0, "{r}");
    assert!(r["dedup_skipped"].as_u64().unwrap() > 0, "{r}");
    assert!(r["loaded_blocks"].as_u64().unwrap() > 0, "{r}");
    let out = run("mooncake://unreachable:1");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("mooncake_store_setup failed"), "{stderr}");
}
