//! `kvferry prefill --transport mooncake` and `kvferry decode --transport
//! mooncake` as two processes over the real Mooncake Transfer Engine and
//! its `tcp` protocol, every byte verified. Gated: it runs only where
//! `MOONCAKE_TE_LIB` names the real `libtransfer_engine.so` (see
//! docs/mooncake.md; `scripts/test-mooncake.sh` runs it in a private
//! network namespace, as Mooncake's engine listens on every interface).
//! Elsewhere it passes at once, saying so.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvferry::bootstrap::{BootstrapClient, BootstrapServer, RetryPolicy};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn real_library() -> Option<String> {
    let lib = std::env::var(mooncake_sys::TE_LIB_ENV).ok()?;
    // The fake library is no evidence about the real one.
    (!lib.contains("fake")).then_some(lib)
}

fn mooncake(cmd: &mut Command, lib: &str, mode: &str) {
    cmd.args([
        "--transport",
        "mooncake",
        "--mooncake-protocol",
        "tcp",
        "--mode",
        mode,
    ])
    .env(mooncake_sys::TE_LIB_ENV, lib)
    .env("MC_TCP_BIND_ADDRESS", "127.0.0.1");
}

fn run(lib: &str, mode: &str) {
    let server = BootstrapServer::start("127.0.0.1:0").unwrap();
    let addr = format!("127.0.0.1:{}", server.local_addr().port());
    let mut p = Command::new(env!("CARGO_BIN_EXE_kvferry"));
    p.args([
        "prefill",
        "--bootstrap",
        &addr,
        "--engine-id",
        "p",
        "--timeout-ms",
        "20000",
    ]);
    mooncake(&mut p, lib, mode);
    let _p = Proc(p.stdout(Stdio::null()).spawn().unwrap());
    let policy = RetryPolicy {
        deadline: Duration::from_secs(60),
        ..RetryPolicy::default()
    };
    BootstrapClient::new(&addr)
        .unwrap()
        .wait_for_engine("p", 1, policy)
        .unwrap();
    let mut d = Command::new(env!("CARGO_BIN_EXE_kvferry"));
    d.args([
        "decode",
        "--bootstrap",
        &addr,
        "--engine-id",
        "d",
        "--prefill-engine-id",
        "p",
    ])
    .args(["--requests", "64", "--timeout-ms", "20000", "--json"]);
    mooncake(&mut d, lib, mode);
    let out = d.output().unwrap();
    assert!(out.status.success(), "{mode}: {out:?}");
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    println!("{mode}: {summary}");
    assert_eq!(summary["ok"], 64, "{mode}: {summary}");
    assert_eq!(summary["verify_errors"], 0, "{mode}: {summary}");
}

#[test]
fn prefill_and_decode_processes_move_every_byte_over_the_real_engine() {
    let Some(lib) = real_library() else {
        eprintln!(
            "MOONCAKE_TE_LIB names no real libtransfer_engine.so: skipped (docs/mooncake.md)"
        );
        return;
    };
    run(&lib, "push");
    run(&lib, "pull");
}
