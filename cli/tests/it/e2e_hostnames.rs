//! `kvferry prefill` and `kvferry decode` as separate processes that name
//! each other and the bootstrap service by host name (`localhost`; every
//! socket still binds 127.0.0.1).

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

#[test]
fn prefill_and_decode_processes_reach_each_other_by_host_name() {
    let server = BootstrapServer::start("127.0.0.1:0").unwrap();
    let addr = format!("localhost:{}", server.local_addr().port());
    let _p = Proc(
        Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(["prefill", "--bootstrap", &addr, "--host", "localhost"])
            .args(["--engine-id", "p", "--timeout-ms", "1500"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let policy = RetryPolicy {
        deadline: Duration::from_secs(20),
        ..RetryPolicy::default()
    };
    let listed = BootstrapClient::new(&addr)
        .unwrap()
        .wait_for_engine("p", 1, policy)
        .unwrap();
    // The prefill process registered the name it was given.
    let side_channel = listed[&0].addr(0, 0).unwrap();
    assert!(side_channel.starts_with("tcp://localhost:"), "{listed:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["decode", "--bootstrap", &addr, "--host", "localhost"])
        .args(["--engine-id", "d", "--prefill-engine-id", "p"])
        .args(["--requests", "4", "--timeout-ms", "1500", "--json"])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["ok"], 4, "{summary}");
    assert_eq!(summary["verify_errors"], 0, "{summary}");
}
