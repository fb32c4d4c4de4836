//! `kvferry demo --soak` as a user runs it: a short soak with hundreds of
//! requests in flight and many aborts, judged by its JSON summary and its
//! exit status.

use std::process::Command;

#[test]
fn short_soak_verifies_every_request_and_leaves_nothing_live() {
    // Short deadlines bound the drain: an abort that never reaches the peer
    // (see `aborts.ended_expired`) ends within the deadline plus the fence.
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([
            "demo",
            "--soak",
            "3",
            "--concurrency",
            "300",
            "--abort-ratio",
            "0.2",
            "--seed",
            "7",
            "--timeout-ms",
            "2000",
            "--json",
        ])
        .output()
        .expect("run kvferry demo --soak");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let j: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no JSON on stdout ({e}); stderr: {stderr}"));
    let n = |k: &str| {
        j[k].as_u64()
            .unwrap_or_else(|| panic!("{k} missing or not a count: {j}"))
    };
    assert_eq!(n("verify_errors"), 0, "{j}");
    assert_eq!(n("non_terminal"), 0, "{j}");
    assert_eq!(n("blocks_outstanding"), 0, "{j}");
    assert!(n("ok") > 0, "{j}");
    assert!(n("aborted") > 0, "{j}");
    // Every request started is accounted for exactly once.
    assert_eq!(
        n("ok") + n("failed") + n("aborted") + n("expired") + n("refused"),
        n("requests"),
        "{j}"
    );
    // Hundreds in flight: the soak kept the pipe full, not one at a time.
    assert!(n("requests") > 300, "{j}");
    let aborts = &j["aborts"];
    for k in ["decode_side", "prefill_side", "both_sides", "before_kv"] {
        assert!(aborts[k].as_u64().unwrap() > 0, "aborts.{k}: {j}");
    }
    for role in ["prefill", "decode"] {
        let r = &j[role];
        let count = |k: &str| r[k].as_u64().unwrap();
        assert_eq!(count("live_after_drain"), 0, "{role}: {j}");
        assert!(count("machines_created") >= n("requests") - n("refused"));
        // Every terminal phase a node counted is either one of the machines
        // the soak created or a notification it could not place (a second
        // machine for a transfer that had finished there).
        let strays = j["stray"][role].as_u64().unwrap();
        assert_eq!(
            count("terminal"),
            count("machines_created") + strays,
            "{role}: {j}"
        );
    }
    assert_eq!(
        j["stray"]["prefill"].as_u64().unwrap() + j["stray"]["decode"].as_u64().unwrap(),
        n("stray_notifications"),
        "{j}"
    );
    // The RSS figures are present and ordered as their definitions say.
    let (warm, max, end) = (n("rss_warmup_kib"), n("rss_max_kib"), n("rss_end_kib"));
    assert!(warm > 0 && max >= warm && max >= end, "{j}");
    assert!(j["rss_samples"].as_array().unwrap().len() >= 3, "{j}");
    // A three-second debug run is too short for a fair RSS verdict, so it
    // is not asserted; the exit status must agree with it and with the rest.
    let flat = j["rss_flat"].as_bool().expect("rss_flat");
    assert_eq!(
        out.status.success(),
        flat,
        "exit status vs verdict: {j}\n{stderr}"
    );
}

#[test]
fn soak_rejects_bad_options_with_usage_status() {
    for (args, option) in [
        (&["demo", "--soak", "0"][..], "--soak"),
        (
            &["demo", "--soak", "2", "--abort-ratio", "1.5"][..],
            "--abort-ratio",
        ),
        (
            &["demo", "--soak", "2", "--requests", "5"][..],
            "--requests",
        ),
        (
            &["demo", "--soak", "2", "--concurrency", "0"][..],
            "--concurrency",
        ),
        (
            &["demo", "--soak", "2", "--warmup-s", "2"][..],
            "--warmup-s",
        ),
        (&["demo", "--abort-ratio", "0.1"][..], "--soak"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(args)
            .output()
            .expect("run kvferry");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.starts_with("kvferry demo"), "{stderr}");
        assert_eq!(stderr.matches('\n').count(), 1, "one line: {stderr:?}");
        assert!(stderr.contains(option), "{option} not in {stderr:?}");
    }
}
