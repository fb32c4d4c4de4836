//! Side-channel messages over the data plane fall back to ZeroMQ, losing
//! nothing, when the peer does not take them (`data_plane_messages` off on
//! its node), and the sender stops trying that peer after the first refusal.

use std::time::Duration;

use kvferry::machines::internal::common::{BlockId, Config};
use kvferry::machines::Phase;
use kvferry::machines::{ModelSpec, Region};
use kvferry::node::{KvLayout, Node, NodeConfig, NodeStats, PrefillTarget, Role};
use kvferry::TransferId;
use kvferry_testkit::model;

const MODEL: ModelSpec = model::flat(64);
const BLOCKS: u64 = 16;
const BLOCK_LEN: usize = 64;

fn start(role: Role, data_plane_messages: bool) -> Node {
    let mut c = NodeConfig::new(role, "e");
    c.data_plane_messages = data_plane_messages;
    c.timeouts = Config {
        bootstrap_timeout: Duration::from_secs(10),
        waiting_timeout: Duration::from_secs(10),
        heartbeat_interval: Duration::from_millis(100),
        ..Config::default()
    };
    Node::start(c).expect("node starts")
}

/// The node's KV memory: `BLOCKS` blocks, and the layout naming it.
fn kv_memory() -> (Box<[u8]>, KvLayout) {
    let mut mem = vec![0u8; BLOCKS as usize * BLOCK_LEN].into_boxed_slice();
    let layout = KvLayout {
        model: MODEL,
        first_region: 0,
        pools: Vec::new(),
        num_blocks: BLOCKS,
        regions: vec![Region {
            base: mem.as_mut_ptr() as u64,
            block_len: BLOCK_LEN as u64,
            kv_block_len: BLOCK_LEN as u64,
        }],
    };
    (mem, layout)
}

fn node(role: Role, data_plane_messages: bool) -> (Node, Box<[u8]>) {
    let node = start(role, data_plane_messages);
    let (mem, layout) = kv_memory();
    // SAFETY: `mem` is dropped after the node in every test (declared
    // later in the returned tuple's owner, and the node is shut down first).
    unsafe { node.register_kv_caches(layout).expect("register") };
    (node, mem)
}

fn one(id: u32) -> Vec<Vec<BlockId>> {
    vec![vec![BlockId(id)]]
}

/// Runs `requests` push-mode requests one after another from a P node to
/// a D node, checking every byte; returns both nodes' stats.
fn run(p_messages: bool, d_messages: bool, requests: u32) -> (NodeStats, NodeStats) {
    let (p, mut p_mem) = node(Role::Prefill, p_messages);
    let (d, d_mem) = node(Role::Decode, d_messages);
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![p.side_channel_addr()],
    };
    for t in 0..requests {
        let (src, dst) = (t % 8, 8 + t % 8);
        let pattern = |i: usize| (i as u8) ^ (t as u8).wrapping_mul(31);
        for (i, b) in p_mem[src as usize * BLOCK_LEN..][..BLOCK_LEN]
            .iter_mut()
            .enumerate()
        {
            *b = pattern(i);
        }
        let rx = d.receiver(TransferId(u64::from(t) + 1), &target).unwrap();
        rx.request(one(dst)).unwrap();
        let tx = p.sender(TransferId(u64::from(t) + 1)).unwrap();
        tx.send(one(src), true).unwrap();
        assert_eq!(
            rx.wait(Duration::from_secs(10)),
            Phase::Success,
            "request {t}"
        );
        assert_eq!(
            tx.wait(Duration::from_secs(10)),
            Phase::Success,
            "request {t}"
        );
        let got = &d_mem[dst as usize * BLOCK_LEN..][..BLOCK_LEN];
        assert!(
            got.iter().enumerate().all(|(i, b)| *b == pattern(i)),
            "request {t}: bytes differ"
        );
    }
    let stats = (p.stats(), d.stats());
    assert_eq!(
        (stats.0.ok, stats.1.ok),
        (u64::from(requests), u64::from(requests))
    );
    drop((p, d));
    stats
}

#[test]
fn a_peer_that_refuses_gets_everything_over_zeromq() {
    let requests = 12u32;
    let (ps, ds) = run(false, true, requests);
    assert_eq!(ds.data_plane_messages, 0, "{ds:?}");
    assert!(
        (1..=2).contains(&ds.data_plane_fallbacks),
        "one refused notification, then no more tries: {ds:?}"
    );
    assert_eq!(
        (
            ps.data_plane_messages,
            ps.data_plane_fallbacks,
            ps.statuses_behind_writes
        ),
        (0, 0, 0),
        "{ps:?}"
    );
}

/// P's closing `Status` rides its last write: once the data-plane session
/// is open, each request's `Status` reaches D behind the KV bytes, none
/// over ZeroMQ. When D takes no data-plane messages, the trailer comes back
/// undeliverable after the bytes landed and P sends the `Status` over
/// ZeroMQ instead: every request still succeeds with every byte.
#[test]
fn the_closing_status_rides_the_last_write_or_falls_back() {
    let requests = 12u32;
    let (ps, ds) = run(true, true, requests);
    // The first request or two go over ZeroMQ while the session opens.
    assert!(
        ps.statuses_behind_writes >= u64::from(requests) - 2,
        "P's Status rode its writes: {ps:?}"
    );
    assert!(ps.data_plane_messages >= ps.statuses_behind_writes);
    assert!(ds.data_plane_messages >= u64::from(requests) - 2, "{ds:?}");
    assert_eq!(ps.data_plane_fallbacks, 0, "{ps:?}");

    let (ps, _) = run(true, false, requests);
    assert_eq!(ps.statuses_behind_writes, 0, "D takes none: {ps:?}");
    assert!(ps.data_plane_messages <= 1, "{ps:?}");
    assert!(ps.data_plane_fallbacks >= 1, "{ps:?}");
}

/// `Node::batch` holds the executors' wake-ups until it returns, but a wait
/// inside it still sees its own request through: the node's waits release
/// what the batch held first. An abort with no peer involved is seen only
/// by the executor, so nothing else could wake it; a transfer through a
/// live pair inside one batch completes too.
#[test]
fn a_wait_inside_a_batch_does_not_hold_its_own_request_back() {
    let (p, mut p_mem) = node(Role::Prefill, true);
    let (d, d_mem) = node(Role::Decode, true);
    let phase = Node::batch(|| {
        let tx = p.sender(TransferId(100)).unwrap();
        tx.abort().unwrap();
        // Well inside every machine timeout (10 s): a held wake-up would
        // leave the executor asleep past it.
        tx.wait(Duration::from_secs(3))
    });
    assert!(matches!(phase, Phase::Failed(_)), "{phase:?}");
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![p.side_channel_addr()],
    };
    for t in 1..=4u64 {
        let (src, dst) = (t as u32, 8 + t as u32);
        p_mem[src as usize * BLOCK_LEN..][..BLOCK_LEN].fill(t as u8 ^ 0x5a);
        let (d_phase, p_phase) = Node::batch(|| {
            let rx = d.receiver(TransferId(t), &target).unwrap();
            rx.request(one(dst)).unwrap();
            let tx = p.sender(TransferId(t)).unwrap();
            tx.send(one(src), true).unwrap();
            (
                rx.wait(Duration::from_secs(3)),
                tx.wait(Duration::from_secs(3)),
            )
        });
        assert_eq!(
            (d_phase, p_phase),
            (Phase::Success, Phase::Success),
            "request {t}"
        );
        assert!(
            d_mem[dst as usize * BLOCK_LEN..][..BLOCK_LEN]
                .iter()
                .all(|b| *b == t as u8 ^ 0x5a),
            "request {t}: bytes differ"
        );
    }
    drop((p, d));
}

/// Inside `Node::batch`, the node's calls that need an executor to act
/// still get it: registering memory (which waits for the executor) and an
/// engine polling `phase` in a loop until its request ends.
#[test]
fn registration_and_polling_inside_a_batch_make_progress() {
    let p = start(Role::Prefill, true);
    let (mem, layout) = kv_memory();
    let started = std::time::Instant::now();
    // SAFETY: `mem` outlives the node (the node is dropped first below).
    let registered = Node::batch(|| unsafe { p.register_kv_caches(layout) });
    assert!(registered.is_ok(), "{registered:?}");
    // An abort is seen by the executor only; poll until it shows, well
    // inside the machine's timeouts.
    let phase = Node::batch(|| {
        let tx = p.sender(TransferId(7)).unwrap();
        tx.abort().unwrap();
        loop {
            let phase = tx.poll();
            if phase.is_terminal() || started.elapsed() > Duration::from_secs(5) {
                return phase;
            }
            std::thread::yield_now();
        }
    });
    assert!(matches!(phase, Phase::Failed(_)), "{phase:?}");
    drop(p);
    drop(mem);
}
