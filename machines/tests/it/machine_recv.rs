//! Unit tests of `RecvMachine`: every flow and edge case, both modes.

use std::time::{Duration, Instant};

use kvferry_machines::internal::common::{BlockId, Config, Mode, Msg, PeerId, TICKET_BIT};
use kvferry_machines::internal::recv::{Action, Event, RecvMachine, ResolvedPeer};
use kvferry_machines::{AbortReason, FailReason, InputError, Machine, Phase, TransferId};

const P0: PeerId = PeerId(20);
const P1: PeerId = PeerId(21);

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn blocks(ids: &[u32]) -> Vec<Vec<BlockId>> {
    vec![ids.iter().map(|&b| BlockId(b)).collect()]
}

fn drain(m: &mut RecvMachine) -> Vec<Action> {
    std::iter::from_fn(|| m.poll_action()).collect()
}

fn ev(m: &mut RecvMachine, now: Instant, e: Event) -> Vec<Action> {
    m.handle_event(now, e).expect("event accepted");
    drain(m)
}

fn msg(peer: PeerId, msg: Msg) -> Event {
    Event::Msg { peer, msg }
}

fn send(peer: PeerId, msg: Msg) -> Action {
    Action::Send { peer, msg }
}

fn resolved(peers: &[PeerId]) -> Event {
    Event::PeersResolved {
        peers: peers
            .iter()
            .map(|&peer| ResolvedPeer {
                peer,
                receivers_expected: 1,
                lease_ticket: None,
            })
            .collect(),
        unneeded: Vec::new(),
    }
}

/// The configuration of these tests: the defaults with resending off, so
/// that each test sees only the messages of what it is about; the
/// `resend_*` tests turn it on.
fn base() -> Config {
    Config {
        max_resends: 0,
        ..Config::default()
    }
}

fn machine(t0: Instant, mode: Mode, dst: &[u32], prefix: u32) -> RecvMachine {
    RecvMachine::new(t0, &base(), TransferId(3), mode, blocks(dst), vec![prefix]).unwrap()
}

fn pull_msg(dst: &[u32], prefix: u32, lease_seq: Option<u64>) -> Msg {
    Msg::Pull {
        receivers_expected: 1,
        dst_blocks: blocks(dst),
        prefix_blocks: vec![prefix],
        lease_seq,
    }
}

fn ready(chunk: u32, start: u32, src: &[u32], is_last: bool) -> Msg {
    Msg::Ready {
        chunk,
        start_blocks: vec![start],
        src_blocks: blocks(src),
        is_last,
    }
}

fn read(peer: PeerId, chunk: u32, src: &[u32], dst: &[u32]) -> Action {
    Action::Read {
        peer,
        chunk,
        src_blocks: blocks(src),
        dst_blocks: blocks(dst),
    }
}

fn load_failed(dst: &[u32]) -> Action {
    Action::LoadFailed {
        block_ids: dst.iter().map(|&b| BlockId(b)).collect(),
    }
}

fn assert_peer_error(m: &mut RecvMachine, now: Instant, e: Event) {
    let before = format!("{m:?}");
    let err = m
        .handle_event(now, e)
        .expect_err("bad input must be refused");
    assert!(matches!(err, InputError::Peer(_)), "{err:?}");
    assert_eq!(before, format!("{m:?}"), "machine changed by refused input");
}

// ---- push mode: D grants, P writes ----

#[test]
fn push_flow_grants_and_reports_received() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5, 6], 0);
    assert_eq!(m.phase(), Phase::Bootstrapping);
    assert_eq!(
        ev(&mut m, t0, resolved(&[P0])),
        vec![send(P0, pull_msg(&[5, 6], 0, None))]
    );
    assert_eq!(m.phase(), Phase::WaitingForInput);
    let out = ev(&mut m, t0, msg(P0, Msg::LeaseRequest { seq: 0 }));
    assert_eq!(
        out,
        vec![send(
            P0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 10_000
            }
        )]
    );
    assert_eq!(m.phase(), Phase::Transferring);
    assert_eq!(
        ev(&mut m, t0, msg(P0, Msg::Status { ok: true })),
        vec![Action::Received]
    );
    assert_eq!(m.phase(), Phase::Success);
    assert!(m.is_reported());
}

#[test]
fn push_fan_in_needs_every_sender() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5], 0);
    let out = ev(&mut m, t0, resolved(&[P0, P1]));
    assert_eq!(out.len(), 2);
    assert_eq!(ev(&mut m, t0, msg(P1, Msg::Status { ok: true })), vec![]);
    // A duplicate Status does not count twice.
    assert_eq!(ev(&mut m, t0, msg(P1, Msg::Status { ok: true })), vec![]);
    assert!(!m.is_reported());
    assert_eq!(
        ev(&mut m, t0, msg(P0, Msg::Status { ok: true })),
        vec![Action::Received]
    );
}

#[test]
fn push_local_abort_waits_for_every_ack() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5, 6], 0);
    ev(&mut m, t0, resolved(&[P0, P1]));
    ev(&mut m, t0, msg(P0, Msg::LeaseRequest { seq: 0 }));
    ev(&mut m, t0, msg(P1, Msg::LeaseRequest { seq: 0 }));
    m.abort(t0 + secs(1), AbortReason::ClientDisconnect);
    assert_eq!(
        drain(&mut m),
        vec![send(P0, Msg::Abort), send(P1, Msg::Abort)]
    );
    assert_eq!(
        m.phase(),
        Phase::Transferring,
        "P may still write: blocks not reusable"
    );
    // A lease request that crossed the abort is not granted.
    assert_eq!(
        ev(&mut m, t0 + secs(1), msg(P0, Msg::LeaseRequest { seq: 1 })),
        vec![]
    );
    assert_eq!(ev(&mut m, t0 + secs(2), msg(P0, Msg::AbortAck)), vec![]);
    let out = ev(&mut m, t0 + secs(2), msg(P1, Msg::AbortAck));
    assert_eq!(out, vec![load_failed(&[5, 6])]);
    assert_eq!(
        m.phase(),
        Phase::Failed(FailReason::Aborted(AbortReason::ClientDisconnect))
    );
}

#[test]
fn push_fence_without_ack_is_lease_plus_fence() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5], 0);
    ev(&mut m, t0, resolved(&[P0]));
    ev(&mut m, t0 + secs(4), msg(P0, Msg::LeaseRequest { seq: 0 }));
    m.abort(t0 + secs(5), AbortReason::Engine);
    drain(&mut m);
    // Granted until t0 + 14 s; fence 12 s.
    let end = t0 + secs(26);
    assert_eq!(m.poll_timeout(), Some(end));
    m.handle_timeout(end - Duration::from_millis(1));
    assert_eq!(drain(&mut m), vec![]);
    m.handle_timeout(end);
    assert_eq!(drain(&mut m), vec![load_failed(&[5])]);
}

#[test]
fn push_abort_without_grant_reports_at_once() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5], 0);
    ev(&mut m, t0, resolved(&[P0]));
    m.abort(t0, AbortReason::Engine);
    assert_eq!(drain(&mut m), vec![send(P0, Msg::Abort), load_failed(&[5])]);
}

#[test]
fn push_waiting_deadline_expires_then_fences() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5], 0);
    ev(&mut m, t0, resolved(&[P0]));
    assert_eq!(m.poll_timeout(), Some(t0 + secs(300)));
    ev(
        &mut m,
        t0 + secs(295),
        msg(P0, Msg::LeaseRequest { seq: 0 }),
    );
    m.handle_timeout(t0 + secs(300));
    assert_eq!(drain(&mut m), vec![send(P0, Msg::Abort)]);
    assert!(!m.phase().is_terminal());
    m.handle_timeout(t0 + secs(305 + 12));
    assert_eq!(drain(&mut m), vec![load_failed(&[5])]);
    assert_eq!(m.phase(), Phase::Expired);
}

#[test]
fn push_sender_failure_waits_for_other_senders() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5], 0);
    ev(&mut m, t0, resolved(&[P0, P1]));
    ev(&mut m, t0, msg(P1, Msg::LeaseRequest { seq: 0 }));
    assert_eq!(
        ev(&mut m, t0, msg(P0, Msg::Status { ok: false })),
        vec![send(P1, Msg::Abort)]
    );
    assert_eq!(
        ev(&mut m, t0, msg(P1, Msg::Status { ok: true })),
        vec![load_failed(&[5])]
    );
    assert_eq!(m.phase(), Phase::Failed(FailReason::PeerReported));
}

#[test]
fn push_peer_abort_is_acknowledged() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5], 0);
    ev(&mut m, t0, resolved(&[P0]));
    ev(&mut m, t0, msg(P0, Msg::LeaseRequest { seq: 0 }));
    let out = ev(&mut m, t0, msg(P0, Msg::Abort));
    assert_eq!(out, vec![send(P0, Msg::AbortAck), load_failed(&[5])]);
    assert_eq!(m.phase(), Phase::Failed(FailReason::PeerAborted));
}

#[test]
fn push_peer_dead_still_fences_its_lease() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5], 0);
    ev(&mut m, t0, resolved(&[P0]));
    ev(&mut m, t0, msg(P0, Msg::LeaseRequest { seq: 0 }));
    assert_eq!(
        ev(&mut m, t0, Event::PeerDead { peer: P0 }),
        vec![send(P0, Msg::Abort)]
    );
    // Declared dead is not proof that its writes stopped: wait lease + fence.
    m.handle_timeout(t0 + secs(21));
    assert_eq!(drain(&mut m), vec![]);
    m.handle_timeout(t0 + secs(22));
    assert_eq!(drain(&mut m), vec![load_failed(&[5])]);
    assert_eq!(m.phase(), Phase::Failed(FailReason::PeerDead));
}

#[test]
fn bootstrap_deadline_reports_at_once() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5], 0);
    assert_eq!(m.poll_timeout(), Some(t0 + secs(300)));
    m.handle_timeout(t0 + secs(300));
    assert_eq!(drain(&mut m), vec![load_failed(&[5])]);
    assert_eq!(m.phase(), Phase::Expired);
}

#[test]
fn terminal_absorbs_every_later_input() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5], 0);
    ev(&mut m, t0, resolved(&[P0]));
    ev(&mut m, t0, msg(P0, Msg::Status { ok: true }));
    assert_eq!(m.phase(), Phase::Success);
    let late = [
        msg(P0, Msg::Status { ok: true }),
        msg(P0, Msg::Status { ok: false }),
        msg(P0, Msg::LeaseRequest { seq: 4 }),
        msg(P0, Msg::Abort),
        msg(P0, Msg::AbortAck),
        Event::ReadDone {
            peer: P0,
            chunk: 0,
            ok: true,
        },
        Event::PeerDead { peer: P0 },
        resolved(&[P0]),
    ];
    for e in late {
        assert_eq!(ev(&mut m, t0 + secs(1), e), vec![]);
    }
    m.abort(t0 + secs(2), AbortReason::Engine);
    m.handle_timeout(t0 + secs(5000));
    assert_eq!(drain(&mut m), vec![]);
    assert_eq!(m.phase(), Phase::Success);
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5], 0);
    assert_peer_error(&mut m, t0, msg(P0, Msg::Status { ok: true }));
    ev(&mut m, t0, resolved(&[P0]));
    assert_peer_error(&mut m, t0, msg(P1, Msg::Status { ok: true }));
    assert_peer_error(&mut m, t0, msg(P0, ready(0, 0, &[1], true)));
    assert_peer_error(
        &mut m,
        t0,
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 1,
            },
        ),
    );
    assert_peer_error(&mut m, t0, msg(P0, Msg::AbortAck));
    assert_peer_error(&mut m, t0, msg(P0, Msg::Done { ok: true }));
    assert_peer_error(&mut m, t0, msg(P0, pull_msg(&[1], 0, None)));
    let before = format!("{m:?}");
    assert!(matches!(
        m.handle_event(t0, resolved(&[P1])),
        Err(InputError::Misuse(_))
    ));
    assert!(matches!(
        m.handle_event(
            t0,
            Event::ReadDone {
                peer: P0,
                chunk: 0,
                ok: true
            }
        ),
        Err(InputError::Misuse(_))
    ));
    assert_eq!(before, format!("{m:?}"));
}

#[test]
fn misuse_at_creation_and_resolution() {
    let t0 = Instant::now();
    let cfg = Config {
        max_blocks_per_group: 2,
        max_peers: 2,
        ..base()
    };
    let r = RecvMachine::new(
        t0,
        &cfg,
        TransferId(1),
        Mode::Push,
        blocks(&[1, 2, 3]),
        vec![0],
    );
    assert!(matches!(r, Err(InputError::Misuse(_))));
    let r = RecvMachine::new(t0, &cfg, TransferId(1), Mode::Push, blocks(&[1]), vec![]);
    assert!(matches!(r, Err(InputError::Misuse(_))));
    let mut m =
        RecvMachine::new(t0, &cfg, TransferId(1), Mode::Push, blocks(&[1]), vec![0]).unwrap();
    assert!(matches!(
        m.handle_event(t0, resolved(&[P0, P0])),
        Err(InputError::Misuse(_))
    ));
    assert!(matches!(
        m.handle_event(t0, resolved(&[P0, P1, PeerId(3)])),
        Err(InputError::Misuse(_))
    ));
    assert!(matches!(
        m.handle_event(t0, resolved(&[])),
        Err(InputError::Misuse(_))
    ));
    assert_eq!(m.phase(), Phase::Bootstrapping);
}

// ---- pull mode: D reads under P's lease ----

fn pull_started(t0: Instant, dst: &[u32], prefix: u32, peers: &[PeerId]) -> RecvMachine {
    let mut m = machine(t0, Mode::Pull, dst, prefix);
    let out = ev(&mut m, t0, resolved(peers));
    assert_eq!(out.len(), peers.len());
    for (a, &p) in out.iter().zip(peers) {
        assert_eq!(
            a,
            &send(p, pull_msg(dst, prefix, Some(0))),
            "first lease request rides on Pull"
        );
    }
    m
}

#[test]
fn pull_flow_reads_then_done() {
    let t0 = Instant::now();
    let mut m = pull_started(t0, &[5, 6, 7], 0, &[P0]);
    // Data before the lease: no read may start.
    assert_eq!(ev(&mut m, t0, msg(P0, ready(0, 0, &[1, 2], false))), vec![]);
    assert_eq!(m.phase(), Phase::Transferring);
    let out = ev(
        &mut m,
        t0,
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 10_000,
            },
        ),
    );
    assert_eq!(out, vec![read(P0, 0, &[1, 2], &[5, 6])]);
    assert_eq!(
        ev(&mut m, t0, msg(P0, ready(1, 2, &[3], true))),
        vec![read(P0, 1, &[3], &[7])]
    );
    assert_eq!(
        ev(
            &mut m,
            t0,
            Event::ReadDone {
                peer: P0,
                chunk: 1,
                ok: true
            }
        ),
        vec![]
    );
    let out = ev(
        &mut m,
        t0,
        Event::ReadDone {
            peer: P0,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(
        out,
        vec![send(P0, Msg::Done { ok: true }), Action::Received]
    );
    assert_eq!(m.phase(), Phase::Success);
}

#[test]
fn pull_chunks_out_of_order_and_duplicates() {
    let t0 = Instant::now();
    let mut m = pull_started(t0, &[5, 6], 0, &[P0]);
    ev(
        &mut m,
        t0,
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 10_000,
            },
        ),
    );
    assert_eq!(
        ev(&mut m, t0, msg(P0, ready(1, 1, &[2], true))),
        vec![read(P0, 1, &[2], &[6])]
    );
    assert_eq!(
        ev(&mut m, t0, msg(P0, ready(1, 1, &[2], true))),
        vec![],
        "duplicate"
    );
    assert_eq!(
        ev(
            &mut m,
            t0,
            Event::ReadDone {
                peer: P0,
                chunk: 1,
                ok: true
            }
        ),
        vec![]
    );
    assert!(!m.is_reported(), "chunk 0 still missing");
    assert_peer_error(&mut m, t0, msg(P0, ready(1, 1, &[3], true)));
    assert_peer_error(&mut m, t0, msg(P0, ready(2, 2, &[3], false)));
    assert_peer_error(&mut m, t0, msg(P0, ready(0, 0, &[1], true)));
    assert_eq!(
        ev(&mut m, t0, msg(P0, ready(0, 0, &[1], false))),
        vec![read(P0, 0, &[1], &[5])]
    );
    let out = ev(
        &mut m,
        t0,
        Event::ReadDone {
            peer: P0,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(out.last(), Some(&Action::Received));
}

#[test]
fn pull_fan_in_sends_done_per_peer() {
    let t0 = Instant::now();
    let mut m = pull_started(t0, &[5], 0, &[P0, P1]);
    for p in [P0, P1] {
        ev(
            &mut m,
            t0,
            msg(
                p,
                Msg::LeaseGrant {
                    seq: 0,
                    duration_ms: 10_000,
                },
            ),
        );
        ev(&mut m, t0, msg(p, ready(0, 0, &[1], true)));
    }
    let out = ev(
        &mut m,
        t0,
        Event::ReadDone {
            peer: P1,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(out, vec![send(P1, Msg::Done { ok: true })]);
    let out = ev(
        &mut m,
        t0,
        Event::ReadDone {
            peer: P0,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(
        out,
        vec![send(P0, Msg::Done { ok: true }), Action::Received]
    );
}

#[test]
fn pull_read_failure_returns_lease_after_other_reads() {
    let t0 = Instant::now();
    let mut m = pull_started(t0, &[5, 6], 0, &[P0]);
    ev(
        &mut m,
        t0,
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 10_000,
            },
        ),
    );
    ev(&mut m, t0, msg(P0, ready(0, 0, &[1], false)));
    ev(&mut m, t0, msg(P0, ready(1, 1, &[2], true)));
    assert_eq!(
        ev(
            &mut m,
            t0,
            Event::ReadDone {
                peer: P0,
                chunk: 0,
                ok: false
            }
        ),
        vec![]
    );
    let out = ev(
        &mut m,
        t0,
        Event::ReadDone {
            peer: P0,
            chunk: 1,
            ok: true,
        },
    );
    assert_eq!(
        out,
        vec![send(P0, Msg::Done { ok: false }), load_failed(&[5, 6])]
    );
    assert_eq!(m.phase(), Phase::Failed(FailReason::Transport));
}

#[test]
fn pull_no_read_after_lease_ran_out() {
    let t0 = Instant::now();
    let mut m = pull_started(t0, &[5], 0, &[P0]);
    // The grant took 9 s to arrive: the lease ends at t0 + 10 s regardless.
    ev(
        &mut m,
        t0 + secs(9),
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 10_000,
            },
        ),
    );
    m.handle_timeout(t0 + secs(9));
    let renew = drain(&mut m);
    assert_eq!(renew, vec![send(P0, Msg::LeaseRequest { seq: 1 })]);
    assert_eq!(
        ev(&mut m, t0 + secs(10), msg(P0, ready(0, 0, &[1], true))),
        vec![]
    );
    let out = ev(
        &mut m,
        t0 + secs(11),
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 1,
                duration_ms: 10_000,
            },
        ),
    );
    assert_eq!(out, vec![read(P0, 0, &[1], &[5])]);
}

#[test]
fn pull_local_abort_waits_for_reads_then_aborts() {
    let t0 = Instant::now();
    let mut m = pull_started(t0, &[5], 0, &[P0]);
    ev(
        &mut m,
        t0,
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 10_000,
            },
        ),
    );
    ev(&mut m, t0, msg(P0, ready(0, 0, &[1], true)));
    m.abort(t0, AbortReason::Engine);
    assert_eq!(drain(&mut m), vec![]);
    let out = ev(
        &mut m,
        t0,
        Event::ReadDone {
            peer: P0,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(out, vec![send(P0, Msg::Abort), load_failed(&[5])]);
    // Its acknowledgement arrives later: absorbed.
    assert_eq!(ev(&mut m, t0, msg(P0, Msg::AbortAck)), vec![]);
}

#[test]
fn pull_peer_abort_acked_after_reads_end_by_bound() {
    let t0 = Instant::now();
    let mut m = pull_started(t0, &[5], 0, &[P0]);
    ev(
        &mut m,
        t0,
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 10_000,
            },
        ),
    );
    ev(&mut m, t0, msg(P0, ready(0, 0, &[1], true)));
    assert_eq!(ev(&mut m, t0 + secs(1), msg(P0, Msg::Abort)), vec![]);
    m.handle_timeout(t0 + secs(10));
    assert_eq!(
        drain(&mut m),
        vec![send(P0, Msg::AbortAck), load_failed(&[5])]
    );
    assert_eq!(m.phase(), Phase::Failed(FailReason::PeerAborted));
    assert_eq!(
        ev(
            &mut m,
            t0 + secs(11),
            Event::ReadDone {
                peer: P0,
                chunk: 0,
                ok: true
            }
        ),
        vec![]
    );
}

#[test]
fn pull_prefix_hit_and_bad_metadata() {
    let t0 = Instant::now();
    let mut m = pull_started(t0, &[5], 1, &[P0]);
    ev(
        &mut m,
        t0,
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 10_000,
            },
        ),
    );
    assert_eq!(
        ev(&mut m, t0, msg(P0, ready(0, 0, &[1, 2], false))),
        vec![read(P0, 0, &[2], &[5])]
    );
    let out = ev(&mut m, t0, msg(P0, ready(1, 2, &[3], true)));
    assert_eq!(
        out,
        vec![],
        "P has more blocks than D can take: waits for the read in flight"
    );
    let out = ev(
        &mut m,
        t0,
        Event::ReadDone {
            peer: P0,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(
        out,
        vec![send(P0, Msg::Done { ok: false }), load_failed(&[5])]
    );
    assert_eq!(m.phase(), Phase::Failed(FailReason::BadMetadata));
}

#[test]
fn pull_waiting_deadline_is_renewed_by_progress_only() {
    let t0 = Instant::now();
    let cfg = Config {
        waiting_timeout: secs(20),
        ..base()
    };
    let mut m = RecvMachine::new(
        t0,
        &cfg,
        TransferId(1),
        Mode::Pull,
        blocks(&[5, 6]),
        vec![0],
    )
    .unwrap();
    ev(&mut m, t0, resolved(&[P0]));
    ev(
        &mut m,
        t0,
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 10_000,
            },
        ),
    );
    m.handle_timeout(t0 + secs(14));
    assert_eq!(drain(&mut m), vec![send(P0, Msg::LeaseRequest { seq: 1 })]);
    ev(
        &mut m,
        t0 + secs(14),
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 1,
                duration_ms: 10_000,
            },
        ),
    );
    assert_eq!(
        ev(&mut m, t0 + secs(15), msg(P0, ready(0, 0, &[1], false))),
        vec![read(P0, 0, &[1], &[5])]
    );
    ev(
        &mut m,
        t0 + secs(16),
        Event::ReadDone {
            peer: P0,
            chunk: 0,
            ok: true,
        },
    );
    // Lease traffic keeps flowing, but no more data.
    let mut now = t0 + secs(16);
    while !m.is_reported() {
        now = m.poll_timeout().unwrap();
        m.handle_timeout(now);
        for a in drain(&mut m) {
            if let Action::Send {
                msg: Msg::LeaseRequest { seq },
                peer,
            } = a
            {
                ev(
                    &mut m,
                    now,
                    msg(
                        peer,
                        Msg::LeaseGrant {
                            seq,
                            duration_ms: 10_000,
                        },
                    ),
                );
            }
        }
    }
    assert_eq!(now, t0 + secs(36));
    assert_eq!(m.phase(), Phase::Expired);
}

#[test]
fn in_flight_reads_are_bounded() {
    let t0 = Instant::now();
    let cfg = Config {
        max_in_flight: 1,
        ..base()
    };
    let mut m = RecvMachine::new(
        t0,
        &cfg,
        TransferId(1),
        Mode::Pull,
        blocks(&[5, 6]),
        vec![0],
    )
    .unwrap();
    ev(&mut m, t0, resolved(&[P0]));
    ev(
        &mut m,
        t0,
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 10_000,
            },
        ),
    );
    assert_eq!(
        ev(&mut m, t0, msg(P0, ready(0, 0, &[1], false))),
        vec![read(P0, 0, &[1], &[5])]
    );
    assert_eq!(ev(&mut m, t0, msg(P0, ready(1, 1, &[2], true))), vec![]);
    assert_eq!(
        ev(
            &mut m,
            t0,
            Event::ReadDone {
                peer: P0,
                chunk: 0,
                ok: true
            }
        ),
        vec![read(P0, 1, &[2], &[6])]
    );
    let cfg = Config {
        max_chunks: 2,
        ..base()
    };
    let mut m = RecvMachine::new(
        t0,
        &cfg,
        TransferId(1),
        Mode::Pull,
        blocks(&[5, 6]),
        vec![0],
    )
    .unwrap();
    ev(&mut m, t0, resolved(&[P0]));
    assert_peer_error(&mut m, t0, msg(P0, ready(2, 2, &[3], true)));
}

#[test]
fn pull_fewer_blocks_than_destination_is_bad_metadata() {
    let t0 = Instant::now();
    let mut m = pull_started(t0, &[5, 6], 0, &[P0]);
    ev(
        &mut m,
        t0,
        msg(
            P0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 10_000,
            },
        ),
    );
    let out = ev(&mut m, t0, msg(P0, ready(0, 0, &[1], true)));
    assert_eq!(
        out,
        vec![send(P0, Msg::Done { ok: false }), load_failed(&[5, 6])]
    );
    assert_eq!(m.phase(), Phase::Failed(FailReason::BadMetadata));
}

#[test]
fn push_peer_with_a_ticket_gets_a_grant_with_the_pull() {
    let t0 = Instant::now();
    let cfg = base();
    let mut m = machine(t0, Mode::Push, &[5, 6], 0);
    let out = ev(
        &mut m,
        t0,
        Event::PeersResolved {
            peers: vec![
                ResolvedPeer {
                    peer: P0,
                    receivers_expected: 1,
                    lease_ticket: Some(42),
                },
                ResolvedPeer {
                    peer: P1,
                    receivers_expected: 1,
                    lease_ticket: None,
                },
            ],
            unneeded: Vec::new(),
        },
    );
    assert_eq!(
        out,
        vec![
            // The `Pull` announces the ticket grant behind it.
            send(P0, pull_msg(&[5, 6], 0, Some(42))),
            send(
                P0,
                Msg::LeaseGrant {
                    seq: 42 | TICKET_BIT,
                    duration_ms: cfg.lease.as_millis() as u64,
                },
            ),
            send(P1, pull_msg(&[5, 6], 0, None)),
        ]
    );
    // The grant counts: an abort now waits for P0's lease to come back (or
    // run out plus the fence), but not for P1, which was granted nothing.
    m.abort(t0, AbortReason::Engine);
    let out = drain(&mut m);
    assert!(out.contains(&send(P0, Msg::Abort)), "{out:?}");
    assert!(!m.phase().is_terminal(), "waits for P0's lease");
    ev(
        &mut m,
        t0 + Duration::from_millis(1),
        msg(P0, Msg::AbortAck),
    );
    assert!(m.phase().is_terminal(), "{:?}", m.phase());
}

// ---- resending what may have been lost ----

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Resending on: first after 100 ms, doubling up to the 1 s heartbeat,
/// three times at most while the peer is silent.
fn resending(t0: Instant, mode: Mode, dst: &[u32]) -> RecvMachine {
    let cfg = Config {
        resend_after: ms(100),
        max_resends: 3,
        heartbeat_interval: secs(1),
        ..Config::default()
    };
    RecvMachine::new(t0, &cfg, TransferId(3), mode, blocks(dst), vec![0]).unwrap()
}

fn resend(peer: PeerId, msg: Msg) -> Action {
    Action::Resend { peer, msg }
}

#[test]
fn resend_pull_backs_off_and_gives_up_while_p_is_silent() {
    let t0 = Instant::now();
    let mut m = resending(t0, Mode::Push, &[5]);
    ev(&mut m, t0, resolved(&[P0]));
    let mut sent = Vec::new();
    for step in [100, 300, 700] {
        assert_eq!(m.poll_timeout(), Some(t0 + ms(step)));
        m.handle_timeout(t0 + ms(step));
        sent.push(drain(&mut m));
    }
    let again = vec![resend(P0, pull_msg(&[5], 0, None))];
    assert_eq!(sent, vec![again.clone(), again.clone(), again.clone()]);
    // Three resends and not a word back: only the waiting deadline is left.
    assert_eq!(m.poll_timeout(), Some(t0 + secs(300)));
    // P speaks (a lease request): it is alive, so resending resumes at the
    // backoff reached (800 ms), then stays at the 1 s heartbeat interval.
    ev(&mut m, t0 + secs(2), msg(P0, Msg::LeaseRequest { seq: 0 }));
    for step in [2800, 3800] {
        assert_eq!(m.poll_timeout(), Some(t0 + ms(step)));
        m.handle_timeout(t0 + ms(step));
        assert_eq!(drain(&mut m), again);
    }
    // Its `Status` ends the transfer; nothing is resent after it.
    let out = ev(&mut m, t0 + secs(4), msg(P0, Msg::Status { ok: true }));
    assert_eq!(out, vec![Action::Received]);
    assert_eq!(m.poll_timeout(), None);
}

#[test]
fn resent_pull_in_pull_mode_asks_for_a_lease_again() {
    let t0 = Instant::now();
    let mut m = resending(t0, Mode::Pull, &[5]);
    assert_eq!(
        ev(&mut m, t0, resolved(&[P0])),
        vec![send(P0, pull_msg(&[5], 0, Some(0)))]
    );
    m.handle_timeout(t0 + ms(100));
    assert_eq!(drain(&mut m), vec![resend(P0, pull_msg(&[5], 0, Some(1)))]);
    // The grant answering the resent `Pull` counts from when it was asked.
    let grant = Msg::LeaseGrant {
        seq: 1,
        duration_ms: 10_000,
    };
    assert_eq!(ev(&mut m, t0 + ms(150), msg(P0, grant)), vec![]);
    let out = ev(&mut m, t0 + ms(150), msg(P0, ready(0, 0, &[1], true)));
    assert_eq!(out, vec![read(P0, 0, &[1], &[5])]);
}

#[test]
fn a_finished_d_rank_answers_a_resent_ready_with_done_again() {
    let t0 = Instant::now();
    let mut m = resending(t0, Mode::Pull, &[5, 6]);
    ev(&mut m, t0, resolved(&[P0, P1]));
    for p in [P0, P1] {
        let grant = Msg::LeaseGrant {
            seq: 0,
            duration_ms: 10_000,
        };
        ev(&mut m, t0, msg(p, grant));
    }
    ev(&mut m, t0, msg(P0, ready(0, 0, &[1, 2], true)));
    let done = ev(
        &mut m,
        t0,
        Event::ReadDone {
            peer: P0,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(done, vec![send(P0, Msg::Done { ok: true })]);
    // P0's `Done` was lost: P0 resends its last `Ready`, and D (still
    // waiting for P1) says `Done` again.
    let again = ev(&mut m, t0 + ms(50), msg(P0, ready(0, 0, &[1, 2], true)));
    assert_eq!(again, vec![resend(P0, Msg::Done { ok: true })]);
    assert_eq!(m.phase(), Phase::Transferring);
}

#[test]
fn unneeded_is_told_again_when_the_request_ends() {
    let t0 = Instant::now();
    let mut m = resending(t0, Mode::Push, &[5]);
    let resolved = Event::PeersResolved {
        peers: vec![ResolvedPeer {
            peer: P0,
            receivers_expected: 1,
            lease_ticket: None,
        }],
        unneeded: vec![P1],
    };
    assert_eq!(
        ev(&mut m, t0, resolved),
        vec![send(P1, Msg::Unneeded), send(P0, pull_msg(&[5], 0, None))]
    );
    let out = ev(&mut m, t0 + ms(10), msg(P0, Msg::Status { ok: true }));
    assert_eq!(out, vec![resend(P1, Msg::Unneeded), Action::Received]);
}

/// Layouts that pair only by a rule kvferry lacks: the request fails
/// `Unsupported`; in push mode the lease granted to the peer waits for its
/// `NotPaired` (a lease return) or for lease plus fence.
#[test]
fn unsupported_layouts_fail_the_request_as_unsupported() {
    let t0 = Instant::now();
    let mut m = machine(t0, Mode::Push, &[5], 0);
    ev(&mut m, t0, resolved(&[P0]));
    ev(&mut m, t0, msg(P0, Msg::LeaseRequest { seq: 0 }));
    assert_eq!(
        ev(&mut m, t0, Event::Unsupported { peer: P0 }),
        vec![send(P0, Msg::Abort)]
    );
    assert_eq!(m.phase(), Phase::Transferring);
    assert_eq!(
        ev(&mut m, t0, msg(P0, Msg::NotPaired)),
        vec![load_failed(&[5])]
    );
    assert_eq!(m.phase(), Phase::Failed(FailReason::Unsupported));
    // Before any peer is known the verdict changes nothing.
    let mut m = machine(t0, Mode::Pull, &[5], 0);
    assert_eq!(ev(&mut m, t0, Event::Unsupported { peer: P0 }), vec![]);
    assert_eq!(m.phase(), Phase::Bootstrapping);
}
