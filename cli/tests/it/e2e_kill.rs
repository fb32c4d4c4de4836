//! End-to-end with real processes: `kvferry prefill` / `kvferry decode`
//! killed with SIGKILL mid-way. Every request must end by its deadline plus
//! the fence, no byte of a successful request may be wrong, and the
//! survivors must recover.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvferry::bootstrap::{BootstrapClient, BootstrapServer, RetryPolicy};
use kvferry::machines::internal::common::BlockId;
use kvferry::machines::{ModelSpec, Phase};
use kvferry::node::{Event, EventKind, EventSink, Node, NodeConfig, PrefillTarget, Role};
use kvferry::TransferId;
use kvferry_testkit::demo_timeouts;
use kvferry_testkit::model;
use kvferry_testkit::synth::SynthKv;

const TIMEOUT_MS: u64 = 1000;

/// The model the CLI commands use by default.
const MODEL: ModelSpec = model::medium();

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn prefill(bootstrap: &str, delay_ms: u64) -> Proc {
    prefill_on(bootstrap, delay_ms, 0)
}

fn prefill_on(bootstrap: &str, delay_ms: u64, port: u16) -> Proc {
    let child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([
            "prefill",
            "--bootstrap",
            bootstrap,
            "--timeout-ms",
            &TIMEOUT_MS.to_string(),
        ])
        .args(["--delay-ms", &delay_ms.to_string(), "--blocks", "256"])
        .args(["--side-channel-port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvferry prefill");
    Proc(child)
}

fn registered_addr(client: &BootstrapClient) -> Option<String> {
    client
        .query(Some("prefill"))
        .ok()?
        .get(&0)?
        .addr(0, 0)
        .map(str::to_string)
}

fn decode_node() -> (Node, SynthKv, flume::Receiver<Event>) {
    let (tx, rx) = flume::unbounded();
    let mut c = NodeConfig::new(Role::Decode, "decode");
    c.timeouts = demo_timeouts(TIMEOUT_MS);
    c.events = Some(EventSink { tag: 0, tx });
    let kv = SynthKv::new(MODEL, 1, 0, 4, 64);
    let node = Node::start(c).unwrap();
    // SAFETY: the test shuts the node down before `kv` drops (see the end of each test).
    unsafe { node.register_kv_caches(kv.kv_layout()).unwrap() };
    (node, kv, rx)
}

#[test]
fn prefill_killed_mid_transfer_every_request_ends_and_decode_recovers() {
    let server = BootstrapServer::start("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let client = BootstrapClient::new(&addr).unwrap();
    let policy = RetryPolicy {
        deadline: Duration::from_secs(20),
        ..RetryPolicy::default()
    };
    // P answers each request only after 300 ms (its "prefill"), so requests
    // are in flight when it dies.
    let mut p = prefill(&addr, 300);
    client.wait_for_engine("prefill", 1, policy).unwrap();
    let first_addr = registered_addr(&client).unwrap();
    let (node, kv, done) = decode_node();
    let target = PrefillTarget::Bootstrap {
        addr: addr.clone(),
        engine_id: "prefill".into(),
        dp_rank: Some(0),
    };
    let start = |tid: u64| {
        let blocks: Vec<u32> = vec![(tid % 16) as u32 * 4, (tid % 16) as u32 * 4 + 1];
        kv.clear(&blocks);
        let r = node.receiver(TransferId(tid), &target).unwrap();
        r.request(vec![blocks.iter().map(|&b| BlockId(b)).collect()])
            .unwrap();
        (r, blocks)
    };
    // A first request completes and is verified.
    let (r, blocks) = start(1);
    assert_eq!(r.wait(Duration::from_secs(10)), Phase::Success);
    assert!(kv.verify(TransferId(1), &blocks, 0).is_ok());
    // Ten more, then P dies while it "computes" them.
    let live: Vec<_> = (2..12).map(start).collect();
    let killed_at = Instant::now();
    p.0.kill().unwrap();
    let _ = p.0.wait();
    let t = demo_timeouts(TIMEOUT_MS);
    let bound = t.waiting_timeout + t.fence() + Duration::from_millis(500);
    for (r, blocks) in &live {
        let phase = r.wait(bound + Duration::from_secs(1));
        assert!(
            phase.is_terminal(),
            "request {} still {phase:?}",
            r.transfer_id()
        );
        match phase {
            Phase::Success => assert!(kv.verify(r.transfer_id(), blocks, 0).is_ok()),
            Phase::Failed(_) | Phase::Expired => {}
            other => panic!("{other:?}"),
        }
    }
    assert!(
        killed_at.elapsed() <= bound,
        "ended after {:?} (bound {bound:?})",
        killed_at.elapsed()
    );
    assert!(
        node.stats().failed + node.stats().expired >= 1,
        "some requests were in flight"
    );
    // A replacement P registers; decode recovers without restarting.
    let _p2 = prefill(&addr, 0);
    let t0 = Instant::now();
    while registered_addr(&client).as_deref() == Some(first_addr.as_str()) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "replacement never registered"
        );
        std::thread::yield_now();
    }
    let (r, blocks) = start(100);
    assert_eq!(r.wait(Duration::from_secs(10)), Phase::Success);
    assert!(kv.verify(TransferId(100), &blocks, 0).is_ok());
    drop(done);
    node.shutdown(Duration::from_millis(50));
    drop(node);
    drop(kv);
}

#[test]
fn decode_killed_prefill_releases_when_the_lease_runs_out() {
    let (events_tx, events_rx) = flume::unbounded();
    let mut c = NodeConfig::new(Role::Prefill, "prefill");
    c.serve_bootstrap = Some("127.0.0.1:0".into());
    c.timeouts = demo_timeouts(TIMEOUT_MS);
    c.events = Some(EventSink {
        tag: 0,
        tx: events_tx,
    });
    let kv = SynthKv::new(MODEL, 1, 0, 4, 64);
    let node = Node::start(c).unwrap();
    // SAFETY: shut down before `kv` drops, below.
    unsafe { node.register_kv_caches(kv.kv_layout()).unwrap() };
    let addr = node.bootstrap_addr().unwrap();
    let client = BootstrapClient::new(&addr).unwrap();
    let policy = RetryPolicy {
        deadline: Duration::from_secs(20),
        ..RetryPolicy::default()
    };
    client.wait_for_engine("prefill", 1, policy).unwrap();
    let mut d = Proc(
        Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args([
                "decode",
                "--bootstrap",
                &addr,
                "--requests",
                "1",
                "--timeout-ms",
                "20000",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // D's request arrives; P holds blocks for it, then D dies.
    let Event {
        transfer_id,
        kind: EventKind::Requested { blocks_per_group },
        ..
    } = events_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("decode asked")
    else {
        panic!("the first event of a prefill rank that started nothing is a request");
    };
    let tx = node.sender(transfer_id).unwrap();
    d.0.kill().unwrap();
    let _ = d.0.wait();
    let killed_at = Instant::now();
    let blocks: Vec<BlockId> = (0..blocks_per_group[0]).map(BlockId).collect();
    let _ = tx.send(vec![blocks], true);
    let t = demo_timeouts(TIMEOUT_MS);
    let phase = tx.wait(t.lease + t.fence() + Duration::from_secs(2));
    assert!(phase.is_terminal() && phase != Phase::Success, "{phase:?}");
    assert!(
        killed_at.elapsed() < t.lease + t.fence() + Duration::from_secs(1),
        "{:?}",
        killed_at.elapsed()
    );
    let s = node.stats();
    assert_eq!(s.ok + s.failed + s.expired, 1, "released exactly once");
    node.shutdown(Duration::from_millis(50));
    drop(node);
    drop(kv);
}

/// Waits (bounded) for a child to exit.
fn wait_exit(p: &mut Proc, within: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    loop {
        if let Ok(Some(st)) = p.0.try_wait() {
            return Some(st);
        }
        if t0.elapsed() > within {
            return None;
        }
        std::thread::yield_now();
    }
}

#[test]
fn prefill_back_on_the_same_address_clears_the_dead_mark() {
    let server = BootstrapServer::start("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let client = BootstrapClient::new(&addr).unwrap();
    let policy = RetryPolicy {
        deadline: Duration::from_secs(20),
        ..RetryPolicy::default()
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut p = prefill_on(&addr, 0, port);
    client.wait_for_engine("prefill", 1, policy).unwrap();
    let (node, kv, _done) = decode_node();
    let target = PrefillTarget::Bootstrap {
        addr: addr.clone(),
        engine_id: "prefill".into(),
        dp_rank: Some(0),
    };
    let run = |tid: u64| {
        let blocks = [tid as u32 % 32];
        kv.clear(&blocks);
        let r = node.receiver(TransferId(tid), &target).unwrap();
        r.request(vec![vec![BlockId(blocks[0])]]).unwrap();
        let phase = r.wait(Duration::from_secs(10));
        (phase, kv.verify(TransferId(tid), &blocks, 0).is_ok())
    };
    assert_eq!(run(1), (Phase::Success, true));
    p.0.kill().unwrap();
    let _ = p.0.wait();
    // The next request finds P silent: it fails once P is declared dead.
    assert!(matches!(run(2).0, Phase::Failed(_)));
    assert_eq!(node.dead_peers(), 1);
    // P comes back on the same side-channel address: the probe (a hello
    // every heartbeat) is answered and the mark is cleared.
    let _p2 = prefill_on(&addr, 0, port);
    let t0 = Instant::now();
    while node.dead_peers() != 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "dead mark never cleared"
        );
        std::thread::yield_now();
    }
    assert_eq!(run(3), (Phase::Success, true));
    node.shutdown(Duration::from_millis(50));
    drop(node);
    drop(kv);
}

#[test]
fn prefill_process_stops_cleanly_on_sigterm_and_decode_never_hangs() {
    let server = BootstrapServer::start("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    // Decode with no prefill engine at all: every request expires by its
    // deadline and the command exits with a summary.
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([
            "decode",
            "--bootstrap",
            &addr,
            "--requests",
            "3",
            "--timeout-ms",
            "400",
            "--json",
        ])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success());
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["requests"], 3);
    assert_eq!(summary["ok"], 0);
    assert_eq!(
        summary["failed"].as_u64().unwrap() + summary["expired"].as_u64().unwrap(),
        3
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // A prefill process serves, then stops cleanly on SIGTERM.
    let client = BootstrapClient::new(&addr).unwrap();
    let mut p = prefill(&addr, 0);
    let policy = RetryPolicy {
        deadline: Duration::from_secs(20),
        ..RetryPolicy::default()
    };
    client.wait_for_engine("prefill", 1, policy).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([
            "decode",
            "--bootstrap",
            &addr,
            "--requests",
            "20",
            "--timeout-ms",
            "2000",
            "--json",
        ])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success());
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["ok"], 20, "{summary}");
    assert_eq!(summary["verify_errors"], 0);
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(p.0.id() as i32, libc::SIGTERM) };
    let status = wait_exit(&mut p, Duration::from_secs(10)).expect("prefill exits after SIGTERM");
    assert!(status.success(), "{status:?}");
}

#[test]
fn prefill_killed_fails_requests_at_once_by_connection_drop_not_silence() {
    // Heartbeat silence alone would take 15 × 1 s to notice the dead prefill
    // rank, and the requests' own deadlines are longer still; the DEALER's
    // socket monitor sees the connection drop at once. Pull mode: decode
    // fails its requests then and there. Push mode: decode granted leases
    // (with its `Pull`, on a ticket), so it also waits for them to run out
    // plus the fence before it hands the blocks back: 2 s + 1.2 s here.
    for mode in ["pull", "push"] {
        let server = BootstrapServer::start("127.0.0.1:0").unwrap();
        let addr = server.local_addr().to_string();
        let client = BootstrapClient::new(&addr).unwrap();
        let policy = RetryPolicy {
            deadline: Duration::from_secs(20),
            ..RetryPolicy::default()
        };
        // P holds every request for 5 s, so they are all in flight when it dies.
        let child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(["prefill", "--bootstrap", &addr, "--mode", mode])
            .args(["--timeout-ms", &TIMEOUT_MS.to_string()])
            .args(["--delay-ms", "5000", "--blocks", "256"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvferry prefill");
        let mut p = Proc(child);
        client.wait_for_engine("prefill", 1, policy).unwrap();
        let mut c = NodeConfig::new(Role::Decode, "decode");
        c.mode = if mode == "push" {
            kvferry::machines::internal::common::Mode::Push
        } else {
            kvferry::machines::internal::common::Mode::Pull
        };
        c.timeouts = kvferry::machines::internal::common::Config {
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_misses: 15,
            lease: Duration::from_secs(2),
            hold_limit: Duration::from_secs(60),
            bootstrap_timeout: Duration::from_secs(60),
            waiting_timeout: Duration::from_secs(60),
            claim_timeout: Duration::from_secs(60),
            ..demo_timeouts(TIMEOUT_MS)
        };
        let fence = c.timeouts.lease + c.timeouts.fence();
        let kv = SynthKv::new(MODEL, 1, 0, 4, 64);
        let node = Node::start(c).unwrap();
        // SAFETY: the node is shut down before `kv` drops (end of the loop).
        unsafe { node.register_kv_caches(kv.kv_layout()).unwrap() };
        let target = PrefillTarget::Bootstrap {
            addr: addr.clone(),
            engine_id: "prefill".into(),
            dp_rank: Some(0),
        };
        let live: Vec<_> = (1..5u64)
            .map(|tid| {
                let r = node.receiver(TransferId(tid), &target).unwrap();
                r.request(vec![vec![
                    BlockId(tid as u32 * 2),
                    BlockId(tid as u32 * 2 + 1),
                ]])
                .unwrap();
                r
            })
            .collect();
        // Every request reached P (the peer is connected and answered hello).
        let t0 = Instant::now();
        while live
            .iter()
            .any(|r| node.phase(r.transfer_id()) == Some(Phase::Bootstrapping))
        {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{mode}: never resolved"
            );
            std::thread::yield_now();
        }
        let killed_at = Instant::now();
        p.0.kill().unwrap();
        let _ = p.0.wait();
        while node.stats().peers_marked_dead == 0 {
            assert!(
                killed_at.elapsed() < Duration::from_secs(3),
                "{mode}: the dead peer was not noticed at once"
            );
            std::thread::yield_now();
        }
        for r in &live {
            let phase = r.wait(Duration::from_secs(10));
            assert_eq!(
                phase,
                Phase::Failed(kvferry::machines::FailReason::PeerDead),
                "{mode}: request {}",
                r.transfer_id()
            );
        }
        let bound = if mode == "push" {
            fence + Duration::from_secs(1)
        } else {
            Duration::from_secs(2)
        };
        assert!(
            killed_at.elapsed() < bound,
            "{mode}: failed after {:?} (bound {bound:?}); silence detection alone takes 15 s",
            killed_at.elapsed()
        );
        node.shutdown(Duration::from_millis(50));
        drop(node);
        drop(kv);
    }
}
