//! Many requests in flight at once through one prefill/decode pair, via the
//! vLLM-style batch API, with every byte verified and memory bounded.

use std::collections::HashSet;
use std::time::Duration;

use kvferry::machines::internal::common::{BlockId, Config, Mode};
use kvferry::machines::Phase;
use kvferry::node::{LoadMeta, LoadRequest, SendRequest};
use kvferry::TransferId;
use kvferry_testkit::model::{self, ModelSpecExt};
use kvferry_testkit::synth::{Cluster, ClusterSpec};

const IN_FLIGHT: u32 = 2000;

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn round(c: &Cluster, base: u64) {
    let d = &c.decode[0].node;
    let p = &c.prefill[0].node;
    // Every decode request is started before any prefill KV exists, so all
    // of them are in flight at once.
    let loads = (0..IN_FLIGHT)
        .map(|i| LoadRequest {
            transfer_id: TransferId(base + u64::from(i)),
            request_id: None,
            prefill: c.target.clone(),
            dst_blocks: vec![vec![BlockId(i)]],
            prefix_blocks: vec![0],
        })
        .collect();
    d.start_load_kv(&LoadMeta {
        loads,
        sends: Vec::new(),
    })
    .unwrap();
    for i in 0..IN_FLIGHT {
        c.prefill[0]
            .kv
            .fill(TransferId(base + u64::from(i)), &[i], 0);
        c.decode[0].kv.clear(&[i]);
    }
    let sends = (0..IN_FLIGHT)
        .map(|i| SendRequest {
            transfer_id: TransferId(base + u64::from(i)),
            request_id: None,
            src_blocks: vec![vec![BlockId(i)]],
            is_last: true,
        })
        .collect();
    p.start_load_kv(&LoadMeta {
        loads: Vec::new(),
        sends,
    })
    .unwrap();
    let mut received = HashSet::new();
    while received.len() < IN_FLIGHT as usize {
        let Ok(e) = c.decode_events.recv_timeout(Duration::from_secs(20)) else {
            panic!(
                "requests did not end: {} of {IN_FLIGHT}; d {:?} p {:?}",
                received.len(),
                d.stats(),
                p.stats()
            );
        };
        let (tid, phase) = (e.transfer_id, e.finished());
        assert_eq!(
            phase,
            Some(Phase::Success),
            "transfer {tid:?}; d {:?} p {:?}",
            d.stats(),
            p.stats()
        );
        received.insert(tid.0);
    }
    for i in 0..IN_FLIGHT {
        assert!(
            c.decode[0]
                .kv
                .verify(TransferId(base + u64::from(i)), &[i], 0)
                .is_ok(),
            "request {i}"
        );
    }
    // The batch API reports every transfer once.
    let (_, got) = d.get_finished();
    let got: HashSet<u64> = got.into_iter().map(|t| t.0).collect();
    assert_eq!(got.len(), received.len());
    assert!(
        got == received,
        "get_finished differs from the notifications"
    );
    let mut sent = HashSet::new();
    while sent.len() < IN_FLIGHT as usize {
        let e = c
            .prefill_events
            .recv_timeout(Duration::from_secs(20))
            .expect("prefill ends");
        if e.finished().is_some() {
            sent.insert(e.transfer_id.0);
        }
    }
    let (p_sent, _) = p.get_finished();
    assert!(p_sent.len() <= IN_FLIGHT as usize);
    assert!(d.block_ids_with_load_errors().is_empty());
}

#[test]
fn two_thousand_requests_in_flight_complete_with_bounded_memory() {
    let model = model::small().with_heads(2).with_head_bytes(16);
    let spec = ClusterSpec {
        layers: 1,
        prefill_blocks: u64::from(IN_FLIGHT),
        decode_blocks: u64::from(IN_FLIGHT),
        timeouts: Config {
            heartbeat_interval: Duration::from_millis(200),
            lease: Duration::from_secs(2),
            ..Config::default()
        },
        ..ClusterSpec::new(model, Mode::Push)
    };
    kvferry_testkit::init_tracing();
    let c = Cluster::start(&spec).unwrap();
    round(&c, 1_000_000);
    let after_first = rss_bytes();
    for r in 1..4 {
        round(&c, 1_000_000 * (r + 1));
    }
    let after_more = rss_bytes();
    // Three more rounds of 2000 may not keep growing memory: the executors'
    // boards, the bridge's peer sets and the node's records stay bounded.
    assert!(
        after_more < after_first + (48 << 20),
        "RSS grew from {after_first} to {after_more} bytes"
    );
    let s = c.decode[0].node.stats();
    assert_eq!(s.ok, 4 * u64::from(IN_FLIGHT));
}
