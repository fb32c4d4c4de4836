//! End-to-end: a decode rank that aborts a request before it asked for
//! the KV (SGLang's `init` → `send_metadata` window: the receiver knows
//! the prefill engine, not yet its own blocks) still tells the prefill
//! ranks, which release the KV they hold for it at once instead of at
//! their bootstrap timeout; nothing lands in the decode rank's memory, and
//! the next request between the same ranks moves as usual.

use std::time::{Duration, Instant};

use kvferry::machines::internal::common::{BlockId, Config, Mode};
use kvferry::machines::{FailReason, Phase};
use kvferry::TransferId;
use kvferry_testkit::model::{self, ModelSpecExt};
use kvferry_testkit::synth::{Cluster, ClusterSpec};

/// What a prefill rank would wait for an unclaimed request: far past the
/// bound the test holds the release to.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(30);
/// How soon the prefill ranks must release a request aborted early.
const RELEASED_WITHIN: Duration = Duration::from_secs(1);

fn spec(mode: Mode, prefill_tp: u32) -> ClusterSpec {
    ClusterSpec {
        prefill_blocks: 32,
        decode_blocks: 32,
        prefill_tp,
        timeouts: Config {
            bootstrap_timeout: BOOTSTRAP_TIMEOUT,
            waiting_timeout: BOOTSTRAP_TIMEOUT,
            heartbeat_interval: Duration::from_millis(100),
            ..Config::default()
        },
        bootstrap: Some("127.0.0.1:0".into()),
        data_plane_messages: false,
        ..ClusterSpec::new(model::small().with_heads(2), mode)
    }
}

fn ids(blocks: &[u32]) -> Vec<Vec<BlockId>> {
    vec![blocks.iter().map(|&b| BlockId(b)).collect()]
}

/// Moves `tid` between the ranks and checks every byte.
fn moves(c: &Cluster, tid: TransferId, (src, dst): (&[u32], &[u32])) {
    c.fill(tid, src);
    c.start_request(tid, src, dst, 0).unwrap();
    let phases = c.wait_decode(tid, Duration::from_secs(10));
    assert!(phases.iter().all(|p| *p == Phase::Success), "{phases:?}");
    assert_eq!(c.verify(tid, dst, 0), 0);
}

/// `warm`: a request moved first, so the decode ranks know the prefill
/// ranks' route, and the bridge finds them before the abort lands.
fn run(spec: &ClusterSpec, warm: bool) {
    let c = Cluster::start(spec).expect("cluster starts");
    let (src, dst) = ([1, 2, 3], [20, 21, 22]);
    if warm {
        moves(&c, TransferId(6), (&src, &dst));
    }
    let tid = TransferId(7);
    c.fill(tid, &src);
    for r in &c.decode {
        r.kv.clear(&dst);
    }
    for r in &c.prefill {
        r.node.sender(tid).unwrap().send(ids(&src), true).unwrap();
    }
    let started = Instant::now();
    for r in &c.decode {
        r.node.receiver(tid, &c.target).unwrap().abort().unwrap();
    }
    let prefill = c.wait_prefill(tid, 5 * RELEASED_WITHIN);
    let waited = started.elapsed();
    assert!(
        prefill
            .iter()
            .all(|p| *p == Phase::Failed(FailReason::PeerAborted)),
        "prefill phases {prefill:?}"
    );
    assert!(
        waited < RELEASED_WITHIN,
        "prefill ranks released the KV after {waited:?}"
    );
    let decode = c.wait_decode(tid, Duration::from_secs(5));
    assert!(decode
        .iter()
        .all(|p| p.is_terminal() && *p != Phase::Success));
    assert!(c.decode.iter().all(|r| r.untouched(&dst)), "bytes landed");
    // The ranks go on: the next request moves every byte.
    moves(&c, TransferId(8), (&src, &dst));
}

#[test]
fn push_prefill_releases_a_request_aborted_before_decode_asked() {
    run(&spec(Mode::Push, 1), false);
}

#[test]
fn pull_prefill_ranks_release_a_request_aborted_before_decode_asked() {
    run(&spec(Mode::Pull, 2), false);
}

#[test]
fn a_known_route_still_tells_the_prefill_ranks_of_an_early_abort() {
    for mode in [Mode::Push, Mode::Pull] {
        run(&spec(mode, 2), true);
    }
}
