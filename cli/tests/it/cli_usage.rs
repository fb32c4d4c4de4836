//! The command line itself: help for every command, and usage errors as
//! exit status 2 with one line on stderr naming the problem.

use std::process::{Command, Output};

fn kvferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(args)
        .output()
        .expect("run kvferry")
}

#[test]
fn every_command_has_help() {
    for (args, mentions) in [
        (&["help"][..], "bootstrap"),
        (&["--help"][..], "decode"),
        (&["help", "demo"][..], "--soak"),
        (&["plan", "--help"][..], "--spec"),
        (&["bench", "--help"][..], "transport"),
        (&["bench", "transport", "--help"][..], "--block-bytes"),
        (&["bootstrap", "--help"][..], "--listen"),
        (&["demo", "--help"][..], "--abort-ratio"),
        (&["demo", "--soak", "3", "--help"][..], "--warmup-s"),
        (&["prefill", "--help"][..], "--delay-ms"),
        (&["decode", "--help"][..], "--transfer-base"),
    ] {
        let out = kvferry(args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
        assert!(
            stdout.contains(mentions),
            "{args:?}: {mentions} not in {stdout}"
        );
        assert!(out.stderr.is_empty(), "{args:?}: {out:?}");
    }
}

#[test]
fn help_shows_the_defaults() {
    let out = kvferry(&["demo", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for default in [
        "Requests to run (1000 with --store) [default: 2000]",
        "Requests in flight (16 with --store) [default: 64]",
        "KV layout [default: hnd]",
        "--concurrency 2000 --layers 2",
    ] {
        assert!(help.contains(default), "{default:?} not in {help}");
    }
}

/// Runs `args` and checks the usage-error shape: status 2, nothing on
/// stdout, one line on stderr that starts with `command` and contains every
/// `needle`.
fn expect_usage_error(args: &[&str], command: &str, needles: &[&str]) {
    let out = kvferry(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(out.stdout.is_empty(), "{args:?}");
    assert_eq!(stderr.matches('\n').count(), 1, "{args:?}: {stderr:?}");
    assert!(stderr.starts_with(&format!("{command}: ")), "{stderr:?}");
    for needle in needles {
        assert!(stderr.contains(needle), "{needle:?} not in {stderr:?}");
    }
}

#[test]
fn unknown_options_are_named_on_one_line() {
    for (args, command) in [
        (&["plan", "--spec", "x", "--bogus"][..], "kvferry plan"),
        (
            &["bench", "transport", "--bogus"][..],
            "kvferry bench transport",
        ),
        (&["bootstrap", "--bogus", "1"][..], "kvferry bootstrap"),
        (&["demo", "--bogus"][..], "kvferry demo"),
        (
            &["prefill", "--bootstrap", "a", "--bogus"][..],
            "kvferry prefill",
        ),
        (
            &["decode", "--bootstrap", "a", "--bogus"][..],
            "kvferry decode",
        ),
    ] {
        expect_usage_error(args, command, &["--bogus"]);
    }
    expect_usage_error(&["frobnicate"], "kvferry", &["frobnicate"]);
}

#[test]
fn malformed_values_are_named_on_one_line() {
    for (args, command, needles) in [
        (
            &["demo", "--requests", "many"][..],
            "kvferry demo",
            &["--requests", "many"][..],
        ),
        (
            &["demo", "--layout", "diagonal"][..],
            "kvferry demo",
            &["--layout", "diagonal", "hnd"][..],
        ),
        (
            &["demo", "--heads", "0"][..],
            "kvferry demo",
            &["--heads", "0"][..],
        ),
        (
            &["bench", "transport", "--block-bytes", "1x"][..],
            "kvferry bench transport",
            &["--block-bytes", "1x"][..],
        ),
        (
            &["bench", "transport", "--streams", "65"][..],
            "kvferry bench transport",
            &["--streams"][..],
        ),
        (
            &["prefill", "--bootstrap", "a", "--tp-size", "-1"][..],
            "kvferry prefill",
            &["--tp-size", "-1"][..],
        ),
        (
            &["decode", "--bootstrap", "a", "--timeout-ms", "1.5"][..],
            "kvferry decode",
            &["--timeout-ms", "1.5"][..],
        ),
        (
            &["decode", "--requests", "3"][..],
            "kvferry decode",
            &["--bootstrap"][..],
        ),
        (
            &["bootstrap", "--listen"][..],
            "kvferry bootstrap",
            &["--listen"][..],
        ),
    ] {
        expect_usage_error(args, command, needles);
    }
}

#[test]
fn no_command_prints_the_help_on_stderr_with_status_2() {
    let out = kvferry(&[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Usage: kvferry"));
}
