//! Under the spinning poll policy, a task that spins on one socket never
//! keeps the other tasks of its executor from the bytes that arrived on
//! theirs: an idle ping-pong of small batches counts no spin stalls
//! (`TcpThreadStats::spin_stalls`), over 1, 2 or 4 connections.
//!
//! Both endpoints live on one glommio executor, so the initiator's spin for
//! a response and the served connections' spins for their next header run
//! beside the served connections that parked. Batches are dealt
//! round-robin over the connections, so with more than one, each batch
//! lands on a connection whose task may have parked while another spun.

use std::time::Duration;

use glommio::{LocalExecutorBuilder, Placement};
use kvferry::transport::{Desc, Op, PollPolicy, Session, Transport};
use kvferry::transport::{TcpConfig, TcpSession, TcpThreadStats, TcpTransport};

const BLOCK: usize = 4096;
const BATCHES: usize = 300;

/// How the ping-pong reaches the target.
#[derive(Clone, Copy, Debug)]
enum Conns {
    /// One session of this many streams (small batches take the first).
    Streams(usize),
    /// This many one-stream sessions, batches dealt round-robin.
    Sessions(usize),
}

/// Moves `BATCHES` one-descriptor batches of 4 KiB one at a time; returns
/// the executor's counters over them and whether the bytes landed.
fn ping_pong(conns: Conns) -> (TcpThreadStats, bool) {
    let (streams, sessions) = match conns {
        Conns::Streams(n) => (n, 1),
        Conns::Sessions(n) => (1, n),
    };
    let ex = LocalExecutorBuilder::new(Placement::Unbound)
        .make()
        .expect("executor");
    ex.run(async move {
        let config = TcpConfig {
            streams,
            poll: PollPolicy::Spin {
                spin: Duration::from_millis(1),
            },
            ..TcpConfig::default()
        };
        let any = "127.0.0.1:0".parse().unwrap();
        let target = TcpTransport::bind(any, config.clone()).unwrap();
        let initiator = TcpTransport::bind(any, config).unwrap();
        let mut src: Vec<u8> = (0..BLOCK).map(|i| i as u8).collect();
        let mut dst = vec![0u8; BLOCK];
        // SAFETY: both buffers outlive the endpoints, and nothing else
        // touches them while a transfer runs.
        unsafe {
            initiator.register(src.as_mut_ptr(), BLOCK).unwrap();
            target.register(dst.as_mut_ptr(), BLOCK).unwrap();
        }
        let mut open: Vec<TcpSession> = Vec::new();
        for _ in 0..sessions {
            open.push(initiator.open(&target.endpoint_addr()).await.unwrap());
        }
        let batch = [Desc {
            local_addr: src.as_ptr() as u64,
            remote_addr: dst.as_ptr() as u64,
            len_bytes: BLOCK as u64,
        }];
        let before = target.thread_stats();
        for i in 0..BATCHES {
            let session = &open[i % sessions];
            session.transfer(Op::Write, &batch).await.expect("batch");
        }
        let after = target.thread_stats();
        for session in open {
            session.close().await;
        }
        drop((target, initiator));
        let stats = TcpThreadStats {
            spin_stalls: after.spin_stalls - before.spin_stalls,
        };
        (stats, src == dst)
    })
}

#[test]
fn an_idle_ping_pong_never_waits_for_a_spin_to_run_out() {
    for n in [1, 2, 4] {
        for conns in [Conns::Streams(n), Conns::Sessions(n)] {
            let (stats, landed) = ping_pong(conns);
            assert!(landed, "{conns:?}: the bytes did not land");
            assert_eq!(
                stats.spin_stalls, 0,
                "{conns:?}: batches waited for a spinning task"
            );
        }
    }
}
