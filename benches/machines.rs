//! State-machine event throughput: one P machine and one D machine driven
//! through a full request lifecycle (bootstrap, lease, chunks, transfers,
//! completion) with instant delivery, in push and pull mode. The reported
//! throughput is in events (inputs fed to either machine) per second.
//!
//! Run: `cargo bench --bench machines`

use std::collections::VecDeque;
use std::hint::black_box;
use std::time::Instant;

use kvferry_machines::internal::common::{BlockId, Config, Mode, Msg, PeerId};
use kvferry_machines::internal::recv::{self, RecvMachine, ResolvedPeer};
use kvferry_machines::internal::send::{self, SendMachine};
use kvferry_machines::{Machine, Phase, TransferId};
use kvferry_testkit::bench::{self, Throughput};

const P: PeerId = PeerId(1);
const D: PeerId = PeerId(2);

/// Runs one lifecycle and returns the number of events fed.
fn lifecycle(mode: Mode, chunks: u32, blocks_per_chunk: u32, cfg: &Config, now: Instant) -> u64 {
    let dst: Vec<BlockId> = (0..chunks * blocks_per_chunk)
        .map(|b| BlockId(10_000 + b))
        .collect();
    let mut p = SendMachine::new(now, cfg, TransferId(9), mode);
    let mut d =
        RecvMachine::new(now, cfg, TransferId(9), mode, vec![dst], vec![0]).expect("valid request");
    let mut to_p: VecDeque<send::Event> = VecDeque::new();
    let mut to_d: VecDeque<recv::Event> = VecDeque::new();
    let mut events = 0u64;
    to_d.push_back(recv::Event::PeersResolved {
        peers: vec![ResolvedPeer {
            peer: P,
            receivers_expected: 1,
            lease_ticket: None,
        }],
        unneeded: Vec::new(),
    });
    let mut next_chunk = 0;
    loop {
        if let Some(e) = to_d.pop_front() {
            d.handle_event(now, e).expect("honest input");
            events += 1;
            while let Some(a) = d.poll_action() {
                match a {
                    recv::Action::Send { msg, .. } | recv::Action::Resend { msg, .. } => {
                        to_p.push_back(send::Event::Msg { peer: D, msg })
                    }
                    recv::Action::Read { chunk, .. } => to_d.push_back(recv::Event::ReadDone {
                        peer: P,
                        chunk,
                        ok: true,
                    }),
                    recv::Action::Received | recv::Action::LoadFailed { .. } => {}
                }
            }
        } else if let Some(e) = to_p.pop_front() {
            p.handle_event(now, e).expect("honest input");
            events += 1;
            while let Some(a) = p.poll_action() {
                match a {
                    send::Action::Send { msg, .. } | send::Action::Resend { msg, .. } => {
                        to_d.push_back(recv::Event::Msg { peer: P, msg })
                    }
                    send::Action::Write {
                        chunk,
                        status_after,
                        ..
                    } => {
                        // The driver's part: the `Status` riding the last write.
                        if status_after {
                            to_d.push_back(recv::Event::Msg {
                                peer: P,
                                msg: Msg::Status { ok: true },
                            });
                        }
                        to_p.push_back(send::Event::WriteDone {
                            peer: D,
                            chunk,
                            ok: true,
                        })
                    }
                    send::Action::ReleaseBlocks { .. } => {}
                }
            }
        } else if next_chunk < chunks {
            // The engine finishes the next chunk once the queues are idle.
            let src = (next_chunk * blocks_per_chunk..(next_chunk + 1) * blocks_per_chunk)
                .map(BlockId)
                .collect();
            to_p.push_back(send::Event::ChunkReady {
                src_blocks: vec![src],
                is_last: next_chunk + 1 == chunks,
            });
            next_chunk += 1;
        } else {
            break;
        }
    }
    assert_eq!(p.phase(), Phase::Success);
    assert_eq!(d.phase(), Phase::Success);
    // The machine's timers are read once per event by a real driver.
    black_box(p.poll_timeout());
    black_box(d.poll_timeout());
    events
}

fn bench_lifecycle() {
    let cfg = Config::default();
    let now = Instant::now();
    let mut group = bench::group("machines_lifecycle");
    for mode in [Mode::Push, Mode::Pull] {
        for (chunks, blocks) in [(1u32, 64u32), (16, 4)] {
            let events = lifecycle(mode, chunks, blocks, &cfg, now);
            group.throughput(Throughput::Elements(events));
            let id = format!("{mode:?}/{chunks}chunks_x{blocks}blocks_{events}events");
            group.bench(&id, |b| {
                b.iter(|| lifecycle(mode, black_box(chunks), blocks, &cfg, now))
            });
        }
    }
}

/// Steady-state lease renewal: the per-transfer heartbeat a driver feeds to
/// thousands of idle transfers.
fn bench_renewal() {
    // No hold limit in practice: the machine must stay live for every iteration.
    let cfg = Config {
        hold_limit: std::time::Duration::from_secs(1 << 40),
        ..Config::default()
    };
    let t0 = Instant::now();
    let mut group = bench::group("machines_renewal");
    group.throughput(Throughput::Elements(2));
    let mut p = SendMachine::new(t0, &cfg, TransferId(1), Mode::Push);
    p.handle_event(
        t0,
        send::Event::Msg {
            peer: D,
            msg: Msg::Pull {
                receivers_expected: 1,
                dst_blocks: vec![vec![BlockId(1)]],
                prefix_blocks: vec![0],
                lease_seq: None,
            },
        },
    )
    .unwrap();
    while p.poll_action().is_some() {}
    let mut now = t0;
    group.bench("push_timeout_plus_grant", |b| {
        b.iter(|| {
            now += cfg.heartbeat_interval;
            p.handle_timeout(now);
            while let Some(a) = p.poll_action() {
                if let send::Action::Send {
                    msg: Msg::LeaseRequest { seq },
                    ..
                } = a
                {
                    p.handle_event(
                        now,
                        send::Event::Msg {
                            peer: D,
                            msg: Msg::LeaseGrant {
                                seq,
                                duration_ms: 10_000,
                            },
                        },
                    )
                    .unwrap();
                }
            }
        })
    });
    assert!(
        !p.phase().is_terminal(),
        "the renewal bench ran into a deadline"
    );
}

fn main() {
    bench_lifecycle();
    bench_renewal();
}
