//! Prefill engines addressed by more than their TP rank: data-parallel
//! ranks of one engine, each registered at the bootstrap service under its
//! own DP rank, and decode asking for the one that prefilled a request.

use std::time::{Duration, Instant};

use kvferry::bootstrap::{BootstrapClient, BootstrapServer, RetryPolicy};
use kvferry::node::{BlockId, NodeConfig, Phase, PrefillTarget, Role, TransferId};
use kvferry_testkit::demo_timeouts;
use kvferry_testkit::model;
use kvferry_testkit::synth::{Rank, SynthKv};

/// A node of `c` with synthetic KV registered (the testkit's `Rank`: shut
/// down before its KV drops).
fn engine(c: NodeConfig) -> Rank {
    Rank::start(c, SynthKv::new(model::medium(), 1, 0, 2, 32)).unwrap()
}

fn config(role: Role, engine_id: &str, dp_rank: u32, bootstrap: &str) -> NodeConfig {
    let mut c = NodeConfig::new(role, engine_id);
    c.dp_rank = dp_rank;
    c.bootstrap = Some(bootstrap.to_string());
    // A request sent to the wrong DP rank waits for a chunk that never
    // comes: it must fail by this deadline, not pass.
    c.timeouts = demo_timeouts(2000);
    c
}

/// Moves `tid` from `p` (which prefilled it) to `d`, asking the bootstrap
/// service for engine "p" at `dp_rank`; returns D's phase.
fn transfer(p: &Rank, d: &Rank, addr: &str, dp_rank: u32, tid: TransferId) -> Phase {
    let src = [1 + dp_rank, 5 + dp_rank];
    let dst = [10 + dp_rank, 20 + dp_rank];
    let target = PrefillTarget::Bootstrap {
        addr: addr.to_string(),
        engine_id: "p".into(),
        dp_rank: Some(dp_rank),
    };
    p.send_one(d, &target, tid, (&src, &dst), Duration::from_secs(10))
}

#[test]
fn each_data_parallel_rank_of_a_prefill_engine_is_reached_by_its_rank() {
    let server = BootstrapServer::start("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let p0 = engine(config(Role::Prefill, "p", 0, &addr));
    let p1 = engine(config(Role::Prefill, "p", 1, &addr));
    // Both DP ranks register in the background: wait (bounded) for both.
    let client = BootstrapClient::new(&addr).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let listed = client
            .wait_for_engine("p", 1, RetryPolicy::default())
            .unwrap();
        if listed.contains_key(&0) && listed.contains_key(&1) {
            break;
        }
        assert!(Instant::now() < deadline, "{listed:?}");
        std::thread::yield_now();
    }
    let d = engine(config(Role::Decode, "d", 0, &addr));
    // DP rank 1 first: it must not depend on rank 0 being asked before.
    assert_eq!(transfer(&p1, &d, &addr, 1, TransferId(1)), Phase::Success);
    assert_eq!(transfer(&p0, &d, &addr, 0, TransferId(2)), Phase::Success);
    assert_eq!(transfer(&p1, &d, &addr, 1, TransferId(3)), Phase::Success);
    // Each rank served its own requests and heard of no other.
    assert_eq!((p0.node.stats().ok, p1.node.stats().ok), (1, 2));
    assert_eq!(p0.node.phase(TransferId(1)), None);
    assert_eq!(p1.node.phase(TransferId(2)), None);
}

/// An MLA rank `tp_rank` of `tp_size` that serves its own side channel.
fn mla_rank(role: Role, engine_id: &str, tp_size: u32, tp_rank: u32) -> Rank {
    let mut c = NodeConfig::new(role, engine_id);
    (c.tp_size, c.tp_rank) = (tp_size, tp_rank);
    c.timeouts = demo_timeouts(2000);
    Rank::start(c, SynthKv::new(model::mla(), tp_size, tp_rank, 2, 32)).unwrap()
}

/// A decode rank that sends its `Pull` to a prefill rank it is not paired
/// with (here: a target listing the ranks' side channels out of order) is
/// refused, and both sides fail with `BadMetadata` instead of decode
/// "succeeding" with no bytes.
#[test]
fn a_pull_from_a_decode_rank_the_prefill_rank_does_not_pair_with_is_refused() {
    // MLA, prefill TP 4 → decode TP 2: decode rank 0 reads prefill rank 0;
    // prefill rank 2 sends to nobody (decode rank 0 tells it so).
    let p2 = mla_rank(Role::Prefill, "p", 4, 2);
    let p0 = mla_rank(Role::Prefill, "p", 4, 0);
    let d0 = mla_rank(Role::Decode, "d", 2, 0);
    let unused = "tcp://127.0.0.1:9".to_string();
    let target = PrefillTarget::Direct {
        tp_size: 4,
        pp_size: 1,
        // Rank 0's entry names prefill rank 2; rank 2's names rank 0.
        side_channels: vec![
            p2.node.side_channel_addr(),
            unused.clone(),
            p0.node.side_channel_addr(),
            unused,
        ],
    };
    let tid = TransferId(9);
    p2.kv.fill(tid, &[1, 2], 0);
    let tx = p2.node.sender(tid).unwrap();
    tx.send(vec![vec![BlockId(1), BlockId(2)]], true).unwrap();
    let rx = d0.node.receiver(tid, &target).unwrap();
    rx.request(vec![vec![BlockId(3), BlockId(4)]]).unwrap();
    let bad = Phase::Failed(kvferry::FailReason::BadMetadata);
    assert_eq!(rx.wait(Duration::from_secs(10)), bad, "decode's phase");
    assert_eq!(tx.wait(Duration::from_secs(10)), bad, "prefill's phase");
    // Prefill rank 0 (listed where rank 2 belongs) was told it is not
    // needed, and released at once.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !p0.node.phase(tid).is_some_and(|p| p.is_terminal()) && Instant::now() < deadline {
        std::thread::yield_now();
    }
    let told = p0.node.phase(tid);
    assert_eq!(told, Some(Phase::Success), "the rank told it is not needed");
}

/// Decode aborts a request while its prefill engine is not even listed by
/// the bootstrap service, so no `Pull` ever left. Once the engine
/// registers, decode still resolves its ranks and tells them: prefill
/// releases at once instead of at its bootstrap timeout.
#[test]
fn an_abort_before_the_pull_left_reaches_prefill() {
    let server = BootstrapServer::start("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let long = |role, id| {
        let mut c = config(role, id, 0, &addr);
        // Far beyond the waits below: only the abort can end prefill's side.
        c.timeouts.bootstrap_timeout = Duration::from_secs(60);
        c.timeouts.waiting_timeout = Duration::from_secs(60);
        c.timeouts.claim_timeout = Duration::from_secs(60);
        c.timeouts.hold_limit = Duration::from_secs(120);
        c
    };
    let d = engine(long(Role::Decode, "d"));
    let target = PrefillTarget::Bootstrap {
        addr: addr.clone(),
        engine_id: "p".into(),
        dp_rank: Some(0),
    };
    let tid = TransferId(21);
    let rx = d.node.receiver(tid, &target).unwrap();
    rx.request(vec![vec![BlockId(3)]]).unwrap();
    rx.abort().unwrap();
    let aborted = Phase::Failed(kvferry::FailReason::Aborted(kvferry::AbortReason::Engine));
    assert_eq!(rx.wait(Duration::from_secs(5)), aborted);
    // The prefill engine comes up and starts the request.
    let p = engine(long(Role::Prefill, "p"));
    p.kv.fill(tid, &[1], 0);
    let tx = p.node.sender(tid).unwrap();
    tx.send(vec![vec![BlockId(1)]], true).unwrap();
    let phase = tx.wait(Duration::from_secs(20));
    assert_eq!(phase, Phase::Failed(kvferry::FailReason::PeerAborted));
}
