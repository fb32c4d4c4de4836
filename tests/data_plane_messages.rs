//! Side-channel messages over the data plane fall back to ZeroMQ, losing
//! nothing, when the peer does not take them (`data_plane_messages` off on
//! its node), and the sender stops trying that peer after the first refusal.

use std::time::Duration;

use kvferry::machines::common::{BlockId, Config};
use kvferry::machines::layout::{LayoutKind, ModelSpec, Region};
use kvferry::machines::Phase;
use kvferry::node::{KvLayout, Node, NodeConfig, PrefillTarget, Role};

const MODEL: ModelSpec = ModelSpec {
    layout: LayoutKind::Hnd,
    total_kv_heads: 1,
    block_tokens: 1,
    head_bytes: 64,
};
const BLOCKS: u64 = 16;
const BLOCK_LEN: usize = 64;

fn node(role: Role, data_plane_messages: bool) -> (Node, Box<[u8]>) {
    let mut c = NodeConfig::new(role, "e");
    c.data_plane_messages = data_plane_messages;
    c.timeouts = Config {
        bootstrap_timeout: Duration::from_secs(10),
        waiting_timeout: Duration::from_secs(10),
        heartbeat_interval: Duration::from_millis(100),
        ..Config::default()
    };
    let node = Node::start(c).expect("node starts");
    let mut mem = vec![0u8; BLOCKS as usize * BLOCK_LEN].into_boxed_slice();
    let layout = KvLayout {
        model: MODEL,
        num_blocks: BLOCKS,
        regions: vec![Region {
            base: mem.as_mut_ptr() as u64,
            block_len: BLOCK_LEN as u64,
            kv_block_len: BLOCK_LEN as u64,
        }],
    };
    // SAFETY: `mem` is dropped after the node in every test (declared
    // later in the returned tuple's owner, and the node is shut down first).
    unsafe { node.register_kv_caches(layout).expect("register") };
    (node, mem)
}

fn one(id: u32) -> Vec<Vec<BlockId>> {
    vec![vec![BlockId(id)]]
}

#[test]
fn a_peer_that_refuses_gets_everything_over_zeromq() {
    // Prefill refuses data-plane messages; decode tries them.
    let (p, mut p_mem) = node(Role::Prefill, false);
    let (d, d_mem) = node(Role::Decode, true);
    let target = PrefillTarget::Direct {
        tp_size: 1,
        side_channels: vec![p.side_channel_addr()],
    };
    let requests = 12u32;
    for t in 0..requests {
        let (src, dst) = (t % 8, 8 + t % 8);
        let pattern = |i: usize| (i as u8) ^ (t as u8).wrapping_mul(31);
        for (i, b) in p_mem[src as usize * BLOCK_LEN..][..BLOCK_LEN]
            .iter_mut()
            .enumerate()
        {
            *b = pattern(i);
        }
        let rx = d.receiver(u64::from(t) + 1, &target).unwrap();
        rx.request(one(dst)).unwrap();
        let tx = p.sender(u64::from(t) + 1).unwrap();
        tx.send(one(src), true).unwrap();
        assert_eq!(
            rx.wait(Duration::from_secs(10)),
            Phase::Success,
            "request {t}"
        );
        // Prefill reports its end after its last message left: wait for it
        // too, so that its counters are complete below.
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
    let (ps, ds) = (p.stats(), d.stats());
    // Decode's session to prefill opens after the first request; its first
    // notification (a `Pull` and its ticket) is refused and resent over
    // ZeroMQ, and nothing more is tried.
    assert_eq!(ds.data_plane_messages, 0, "{ds:?}");
    assert!(
        (1..=2).contains(&ds.data_plane_fallbacks),
        "one refused notification, then no more tries: {ds:?}"
    );
    // Prefill does not send over the data plane at all.
    assert_eq!(
        (ps.data_plane_messages, ps.data_plane_fallbacks),
        (0, 0),
        "{ps:?}"
    );
    assert_eq!((ps.ok, ds.ok), (u64::from(requests), u64::from(requests)));
    drop((p, d));
}
