//! `kvferry bootstrap` as a user runs it.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use kvferry::bootstrap::{BootstrapClient, RegisterRequest, RetryPolicy};

fn worker(engine_id: &str, dp: u32, tp: u32, pp: u32, addr: &str) -> RegisterRequest {
    RegisterRequest {
        engine_id: engine_id.into(),
        dp_rank: dp,
        tp_rank: tp,
        pp_rank: pp,
        addr: addr.into(),
    }
}

fn quick() -> RetryPolicy {
    RetryPolicy {
        deadline: Duration::from_secs(5),
        ..RetryPolicy::default()
    }
}

#[test]
fn cli_serves_until_sigterm() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["bootstrap", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvferry bootstrap");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    let addr = line
        .trim()
        .rsplit(' ')
        .next()
        .expect("address at the end")
        .to_string();
    let client = BootstrapClient::new(&addr).expect("client");
    client.health().expect("healthy");
    client
        .register(&worker("cli", 0, 0, 0, "tcp://h:1"), quick())
        .expect("register");
    assert_eq!(client.query(None).expect("query").len(), 1);

    // SAFETY: plain kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0);
    let status = child.wait().expect("wait");
    assert!(status.success(), "clean exit on SIGTERM, got {status:?}");
}

#[test]
fn listens_on_loopback_unless_told_otherwise() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["bootstrap", "--help"])
        .output()
        .expect("run kvferry bootstrap --help");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("[default: 127.0.0.1:8998]"), "{help}");
}
