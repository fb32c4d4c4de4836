//! `kvferry prefill` and `kvferry decode` as separate processes, addressed
//! by engine id and data-parallel rank.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvferry::bootstrap::{BootstrapClient, BootstrapServer, QueryResponse, RetryPolicy};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `kvferry decode` pulling from engine "p" through the bootstrap service
/// at `addr`, with `extra` options; its JSON summary.
fn decode_with(addr: &str, extra: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["decode", "--bootstrap", addr, "--prefill-engine-id", "p"])
        .args(["--timeout-ms", "1500", "--json"])
        .args(extra)
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Five requests of decode engine "d" to engine "p" at `dp_rank`.
fn decode(addr: &str, dp_rank: &str) -> serde_json::Value {
    let args = ["--engine-id", "d", "--prefill-dp-rank", dp_rank];
    decode_with(addr, &[&args[..], &["--requests", "5"]].concat())
}

/// `kvferry prefill` of engine "p" with `extra` options, once the
/// bootstrap service at `addr` lists it; what the service lists.
fn prefill(addr: &str, extra: &[&str]) -> (Proc, QueryResponse) {
    prefill_stage(addr, extra, 1)
}

/// Like [`prefill`], waiting until `stages` pipeline stages are listed.
fn prefill_stage(addr: &str, extra: &[&str], stages: usize) -> (Proc, QueryResponse) {
    let p = Proc(
        Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(["prefill", "--bootstrap", addr, "--engine-id", "p"])
            .args(["--timeout-ms", "1500"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let client = BootstrapClient::new(addr).unwrap();
    let policy = RetryPolicy {
        deadline: Duration::from_secs(20),
        ..RetryPolicy::default()
    };
    let listed = client.wait_for_stages("p", 1, stages, policy).unwrap();
    (p, listed)
}

#[test]
fn decode_pulls_from_the_prefill_engines_dp_rank_it_names() {
    let server = BootstrapServer::start("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let (_p, listed) = prefill(&addr, &["--dp-rank", "1"]);
    assert!(
        listed.contains_key(&1),
        "registered under dp rank 1: {listed:?}"
    );
    let summary = decode(&addr, "1");
    assert_eq!(summary["ok"], 5, "{summary}");
    assert_eq!(summary["verify_errors"], 0, "{summary}");
    // Nothing serves dp rank 0 of that engine: those requests end by their
    // deadline, none succeeds.
    let summary = decode(&addr, "0");
    assert_eq!(summary["ok"], 0, "{summary}");
}

/// `kvferry decode --groups 3` against `kvferry prefill`: every group's
/// blocks come from the prefill process, each verified against its group's
/// pattern, three times the bytes of one group.
#[test]
fn decode_and_prefill_processes_move_several_kv_cache_groups() {
    let server = BootstrapServer::start("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let (_p, _) = prefill(&addr, &[]);
    // Transfer ids are never reused: each run has ids of its own.
    let run = |groups: &str, base: &str| {
        let args = [
            "--groups",
            groups,
            "--transfer-base",
            base,
            "--requests",
            "5",
        ];
        decode_with(&addr, &args)
    };
    let (one, three) = (run("1", "1"), run("3", "100"));
    for s in [&one, &three] {
        assert_eq!(
            (&s["ok"], &s["verify_errors"]),
            (&5.into(), &0.into()),
            "{s}"
        );
    }
    let bytes = |s: &serde_json::Value| s["bytes"].as_u64().unwrap();
    assert_eq!(bytes(&three), 3 * bytes(&one), "{one} {three}");
}

/// Two `kvferry prefill` processes, the two pipeline stages of engine "p"
/// (each holding half of the layers), feed one `kvferry decode` process
/// without pipeline parallelism: every layer's bytes verified on decode.
#[test]
fn decode_pulls_every_layer_from_two_prefill_stages() {
    let server = BootstrapServer::start("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let stage = ["--pp-size", "2", "--pp-rank"];
    let (_p0, _) = prefill(&addr, &[&stage[..], &["0"]].concat());
    let (_p1, listed) = prefill_stage(&addr, &[&stage[..], &["1"]].concat(), 2);
    assert_eq!(listed[&0].pp_size(), 2, "{listed:?}");
    let summary = decode(&addr, "0");
    assert_eq!(summary["ok"], 5, "{summary}");
    assert_eq!(summary["verify_errors"], 0, "{summary}");
}

/// `kvferry decode --request-id-prefix cmpl-` names its requests by string
/// request ids, as vLLM routers do: the prefill process serves them under
/// the ids' hashes. Requests to a data-parallel rank nobody serves end by
/// their deadline, and the summary names each one.
#[test]
fn decode_names_its_requests_by_string_request_ids() {
    let server = BootstrapServer::start("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let (_p, _) = prefill(&addr, &[]);
    let run = |prefix: &str, dp_rank: &str| {
        let args = ["--prefill-dp-rank", dp_rank, "--request-id-prefix", prefix];
        decode_with(&addr, &[&args[..], &["--requests", "3"]].concat())
    };
    let first = run("cmpl-6f2c-", "0");
    assert_eq!(
        (&first["ok"], &first["verify_errors"]),
        (&3.into(), &0.into()),
        "{first}"
    );
    assert!(first.get("failed_request_ids").is_none(), "{first}");
    let lost = run("cmpl-7a1d-", "1");
    assert_eq!(lost["ok"], 0, "{lost}");
    // In the order they ended.
    let mut failed: Vec<&str> = (lost["failed_request_ids"].as_array())
        .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    failed.sort_unstable();
    assert_eq!(
        failed,
        ["cmpl-7a1d-1", "cmpl-7a1d-2", "cmpl-7a1d-3"],
        "{lost}"
    );
}
