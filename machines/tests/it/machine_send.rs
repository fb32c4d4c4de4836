//! Unit tests of `SendMachine`: every flow and edge case, both modes.

use std::time::{Duration, Instant};

use kvferry_machines::internal::common::{BlockId, Config, Mode, Msg, PeerId};
use kvferry_machines::internal::send::{Action, Event, SendMachine};
use kvferry_machines::{AbortReason, FailReason, InputError, Machine, Phase, TransferId};

const D0: PeerId = PeerId(10);
const D1: PeerId = PeerId(11);

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn ms(m: u64) -> Duration {
    Duration::from_millis(m)
}

fn blocks(ids: &[u32]) -> Vec<Vec<BlockId>> {
    vec![ids.iter().map(|&b| BlockId(b)).collect()]
}

fn drain(m: &mut SendMachine) -> Vec<Action> {
    std::iter::from_fn(|| m.poll_action()).collect()
}

fn ev(m: &mut SendMachine, now: Instant, e: Event) -> Vec<Action> {
    m.handle_event(now, e).expect("event accepted");
    drain(m)
}

fn msg(peer: PeerId, msg: Msg) -> Event {
    Event::Msg { peer, msg }
}

fn pull(receivers: u16, dst: &[u32], prefix: u32, lease_seq: Option<u64>) -> Msg {
    Msg::Pull {
        receivers_expected: receivers,
        dst_blocks: blocks(dst),
        prefix_blocks: vec![prefix],
        lease_seq,
    }
}

fn chunk(src: &[u32], is_last: bool) -> Event {
    Event::ChunkReady {
        src_blocks: blocks(src),
        is_last,
    }
}

fn grant(seq: u64) -> Msg {
    Msg::LeaseGrant {
        seq,
        duration_ms: 10_000,
    }
}

fn send(peer: PeerId, msg: Msg) -> Action {
    Action::Send { peer, msg }
}

fn write(peer: PeerId, chunk: u32, src: &[u32], dst: &[u32]) -> Action {
    Action::Write {
        peer,
        chunk,
        src_blocks: blocks(src),
        dst_blocks: blocks(dst),
        status_after: false,
    }
}

/// The peer's last write, with nothing else in flight to it: the driver
/// delivers `Status{ok: true}` behind it.
fn write_last(peer: PeerId, chunk: u32, src: &[u32], dst: &[u32]) -> Action {
    Action::Write {
        peer,
        chunk,
        src_blocks: blocks(src),
        dst_blocks: blocks(dst),
        status_after: true,
    }
}

fn release(outcome: Phase) -> Action {
    Action::ReleaseBlocks { outcome }
}

fn push_machine(t0: Instant) -> SendMachine {
    SendMachine::new(t0, &Config::default(), TransferId(7), Mode::Push)
}

fn pull_machine(t0: Instant) -> SendMachine {
    SendMachine::new(t0, &Config::default(), TransferId(7), Mode::Pull)
}

/// Asserts that `e` is refused with a peer error and leaves the machine as it was.
fn assert_peer_error(m: &mut SendMachine, now: Instant, e: Event) {
    let before = format!("{m:?}");
    let err = m
        .handle_event(now, e)
        .expect_err("bad input must be refused");
    assert!(matches!(err, InputError::Peer(_)), "{err:?}");
    assert_eq!(before, format!("{m:?}"), "machine changed by refused input");
}

#[test]
fn a_status_the_write_could_not_carry_is_sent_by_the_machine() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, None)));
    ev(&mut m, t0, chunk(&[1, 2], true));
    assert_eq!(
        ev(&mut m, t0, msg(D0, grant(0))),
        vec![write_last(D0, 0, &[1, 2], &[5, 6])]
    );
    // The driver reports that the `Status` did not ride the write...
    assert_eq!(ev(&mut m, t0, Event::StatusNotCarried { peer: D0 }), vec![]);
    // ...and once the write's completion arrives, the machine sends it
    // itself, before it releases: its actions are the whole record.
    let out = ev(
        &mut m,
        t0,
        Event::WriteDone {
            peer: D0,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(
        out,
        vec![send(D0, Msg::Status { ok: true }), release(Phase::Success)]
    );
}

#[test]
fn status_not_carried_without_a_closing_write_is_misuse() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, None)));
    let err = m
        .handle_event(t0, Event::StatusNotCarried { peer: D0 })
        .expect_err("no closing write is in flight");
    assert!(matches!(err, InputError::Misuse(_)), "{err:?}");
}

#[test]
fn push_whole_request_with_d_info_first() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    assert_eq!(m.phase(), Phase::Bootstrapping);
    assert_eq!(
        ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, None))),
        vec![send(D0, Msg::LeaseRequest { seq: 0 })]
    );
    assert_eq!(m.phase(), Phase::WaitingForInput);
    // KV ready but no lease yet: nothing may be written.
    assert_eq!(ev(&mut m, t0, chunk(&[1, 2], true)), vec![]);
    assert_eq!(m.phase(), Phase::Transferring);
    assert_eq!(
        ev(&mut m, t0, msg(D0, grant(0))),
        vec![write_last(D0, 0, &[1, 2], &[5, 6])]
    );
    let out = ev(
        &mut m,
        t0,
        Event::WriteDone {
            peer: D0,
            chunk: 0,
            ok: true,
        },
    );
    // The driver delivered the `Status` behind the write.
    assert_eq!(out, vec![release(Phase::Success)]);
    assert_eq!(m.phase(), Phase::Success);
    assert!(m.is_released());
    assert_eq!(m.poll_timeout(), None);
}

#[test]
fn push_whole_request_with_kv_first() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    assert_eq!(ev(&mut m, t0, chunk(&[1, 2], true)), vec![]);
    assert_eq!(m.phase(), Phase::Bootstrapping);
    let t1 = t0 + secs(1);
    assert_eq!(
        ev(&mut m, t1, msg(D0, pull(1, &[5, 6], 0, None))),
        vec![send(D0, Msg::LeaseRequest { seq: 0 })]
    );
    assert_eq!(
        ev(&mut m, t1, msg(D0, grant(0))),
        vec![write_last(D0, 0, &[1, 2], &[5, 6])]
    );
    let out = ev(
        &mut m,
        t1,
        Event::WriteDone {
            peer: D0,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(out, vec![release(Phase::Success)]);
}

#[test]
fn push_chunked_with_prefix_hit_maps_positions() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    // D already holds P's first block: P's position i lands in dst[i - 1].
    ev(&mut m, t0, msg(D0, pull(1, &[50, 51, 52], 1, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    assert_eq!(
        ev(&mut m, t0, chunk(&[1, 2], false)),
        vec![write(D0, 0, &[2], &[50])]
    );
    assert_eq!(
        ev(&mut m, t0, chunk(&[3, 4], true)),
        vec![write(D0, 1, &[3, 4], &[51, 52])]
    );
    // Completions in any order; Status only after the last.
    assert_eq!(
        ev(
            &mut m,
            t0,
            Event::WriteDone {
                peer: D0,
                chunk: 1,
                ok: true
            }
        ),
        vec![]
    );
    let out = ev(
        &mut m,
        t0,
        Event::WriteDone {
            peer: D0,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(
        out,
        vec![send(D0, Msg::Status { ok: true }), release(Phase::Success)]
    );
}

#[test]
fn push_chunk_entirely_in_prefix_needs_no_write() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[50], 2, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    assert_eq!(ev(&mut m, t0, chunk(&[1, 2], false)), vec![]);
    assert_eq!(
        ev(&mut m, t0, chunk(&[3], true)),
        vec![write_last(D0, 1, &[3], &[50])]
    );
    let out = ev(
        &mut m,
        t0,
        Event::WriteDone {
            peer: D0,
            chunk: 1,
            ok: true,
        },
    );
    assert_eq!(out, vec![release(Phase::Success)]);
}

#[test]
fn push_fan_out_counts_completion_per_peer() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(2, &[5], 0, None)));
    assert_eq!(m.phase(), Phase::Bootstrapping, "one of two D ranks known");
    ev(&mut m, t0, msg(D1, pull(2, &[8], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    ev(&mut m, t0, msg(D1, grant(0)));
    let out = ev(&mut m, t0, chunk(&[1], true));
    assert_eq!(
        out,
        vec![write_last(D0, 0, &[1], &[5]), write_last(D1, 0, &[1], &[8])]
    );
    let out = ev(
        &mut m,
        t0,
        Event::WriteDone {
            peer: D1,
            chunk: 0,
            ok: true,
        },
    );
    // Each write carried its peer's `Status`; one peer done is not enough.
    assert_eq!(out, vec![]);
    assert!(!m.is_released());
    let out = ev(
        &mut m,
        t0,
        Event::WriteDone {
            peer: D0,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(out, vec![release(Phase::Success)]);
}

#[test]
fn push_lease_counts_from_the_request_not_the_grant() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, None)));
    // The grant arrives 8 s late: only 2 s of lease are left.
    ev(&mut m, t0 + secs(8), msg(D0, grant(0)));
    assert_eq!(m.lease_valid_until(D0), Some(t0 + secs(10)));
    assert_eq!(
        ev(&mut m, t0 + secs(9), chunk(&[1], false)),
        vec![write(D0, 0, &[1], &[5])]
    );
    // Past the lease: the next chunk waits for a fresh grant.
    m.handle_timeout(t0 + ms(10_500));
    let renew = drain(&mut m);
    assert_eq!(renew, vec![send(D0, Msg::LeaseRequest { seq: 1 })]);
    assert_eq!(ev(&mut m, t0 + ms(10_600), chunk(&[2], true)), vec![]);
    assert_eq!(
        ev(&mut m, t0 + secs(11), msg(D0, grant(1))),
        vec![write(D0, 1, &[2], &[6])]
    );
}

#[test]
fn push_grant_longer_than_own_lease_is_clipped() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None)));
    ev(
        &mut m,
        t0,
        msg(
            D0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: u64::MAX,
            },
        ),
    );
    assert_eq!(m.lease_valid_until(D0), Some(t0 + secs(10)));
}

#[test]
fn push_heartbeat_renews_lease_and_claim() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    ev(&mut m, t0, chunk(&[1], false));
    ev(
        &mut m,
        t0,
        Event::WriteDone {
            peer: D0,
            chunk: 0,
            ok: true,
        },
    );
    // Renew every 5 s for 100 s with prompt grants: the claim (30 s) never fires.
    // The lease request of step n is the machine's n-th (seq 0 rode on the Pull).
    for seq in 1..=20u64 {
        let now = t0 + secs(5 * seq);
        assert_eq!(m.poll_timeout(), Some(now));
        m.handle_timeout(now);
        assert_eq!(drain(&mut m), vec![send(D0, Msg::LeaseRequest { seq })]);
        ev(&mut m, now, msg(D0, grant(seq)));
    }
    assert_eq!(m.phase(), Phase::Transferring);
}

#[test]
fn push_claim_expires_when_d_is_silent() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, None)));
    ev(&mut m, t0, chunk(&[1], false));
    let mut now;
    loop {
        now = m.poll_timeout().expect("a live machine has a deadline");
        m.handle_timeout(now);
        drain(&mut m);
        if m.is_released() {
            break;
        }
    }
    assert_eq!(now, t0 + secs(30));
    assert_eq!(m.phase(), Phase::Expired);
}

#[test]
fn push_claim_is_capped_by_hold_limit() {
    let t0 = Instant::now();
    let cfg = Config {
        hold_limit: secs(40),
        ..Config::default()
    };
    let mut m = SendMachine::new(t0, &cfg, TransferId(1), Mode::Push);
    ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, None)));
    ev(&mut m, t0, chunk(&[1], false));
    // D answers every renewal, but the KV is never complete.
    let mut now;
    loop {
        now = m.poll_timeout().unwrap();
        m.handle_timeout(now);
        let out = drain(&mut m);
        if m.is_released() {
            assert!(out.contains(&release(Phase::Expired)));
            break;
        }
        let mut pending = out;
        while let Some(a) = pending.pop() {
            match a {
                Action::Send {
                    msg: Msg::LeaseRequest { seq },
                    ..
                } => pending.extend(ev(&mut m, now, msg(D0, grant(seq)))),
                Action::Write { peer, chunk, .. } => pending.extend(ev(
                    &mut m,
                    now,
                    Event::WriteDone {
                        peer,
                        chunk,
                        ok: true,
                    },
                )),
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    assert_eq!(now, t0 + secs(40));
}

#[test]
fn push_bootstrap_deadline_expires() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    assert_eq!(m.poll_timeout(), Some(t0 + secs(300)));
    m.handle_timeout(t0 + secs(299));
    assert_eq!(drain(&mut m), vec![]);
    m.handle_timeout(t0 + secs(300));
    assert_eq!(drain(&mut m), vec![release(Phase::Expired)]);
}

#[test]
fn push_local_abort_waits_for_in_flight_write() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    ev(&mut m, t0, chunk(&[1], true));
    m.abort(t0, AbortReason::Engine);
    assert_eq!(
        drain(&mut m),
        vec![],
        "a write is in flight: no release, no abort yet"
    );
    assert!(!m.phase().is_terminal());
    let out = ev(
        &mut m,
        t0 + secs(1),
        Event::WriteDone {
            peer: D0,
            chunk: 0,
            ok: true,
        },
    );
    let failed = Phase::Failed(FailReason::Aborted(AbortReason::Engine));
    assert_eq!(out, vec![send(D0, Msg::Abort), release(failed)]);
    assert_eq!(m.phase(), failed);
}

#[test]
fn push_abort_with_lost_completion_releases_after_transfer_bound() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    ev(&mut m, t0, chunk(&[1], true));
    m.abort(t0 + secs(1), AbortReason::Shutdown);
    assert_eq!(m.poll_timeout(), Some(t0 + secs(10)));
    m.handle_timeout(t0 + secs(10));
    let out = drain(&mut m);
    assert_eq!(
        out.last(),
        Some(&release(Phase::Failed(FailReason::Aborted(
            AbortReason::Shutdown
        ))))
    );
    // The completion shows up later: absorbed.
    assert_eq!(
        ev(
            &mut m,
            t0 + secs(11),
            Event::WriteDone {
                peer: D0,
                chunk: 0,
                ok: true
            }
        ),
        vec![]
    );
}

#[test]
fn push_write_past_its_bound_fails_as_transport() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    ev(&mut m, t0, chunk(&[1], true));
    m.handle_timeout(t0 + secs(10));
    let out = drain(&mut m);
    assert_eq!(
        out,
        vec![
            send(D0, Msg::Status { ok: false }),
            release(Phase::Failed(FailReason::Transport))
        ]
    );
}

#[test]
fn push_peer_abort_is_acknowledged_after_writes() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(2, &[5], 0, None)));
    ev(&mut m, t0, msg(D1, pull(2, &[6], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    // Not the last chunk, so the write carries no `Status` (see below).
    ev(&mut m, t0, chunk(&[1], false));
    assert_eq!(
        ev(&mut m, t0, msg(D0, Msg::Abort)),
        vec![send(D1, Msg::Status { ok: false })]
    );
    let out = ev(
        &mut m,
        t0,
        Event::WriteDone {
            peer: D0,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(
        out,
        vec![
            send(D0, Msg::AbortAck),
            release(Phase::Failed(FailReason::PeerAborted))
        ]
    );
}

#[test]
fn push_abort_from_a_peer_whose_last_write_carries_the_status_waits_for_the_write() {
    let t0 = Instant::now();
    // The write lands: the `Status` behind it reached D, which may have
    // ended before its answer to a lease renewal (the `Abort`) came.
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    assert_eq!(
        ev(&mut m, t0, chunk(&[1], true)),
        vec![write_last(D0, 0, &[1], &[5])]
    );
    assert_eq!(ev(&mut m, t0, msg(D0, Msg::Abort)), vec![]);
    assert!(!m.is_released());
    let done = |ok| Event::WriteDone {
        peer: D0,
        chunk: 0,
        ok,
    };
    assert_eq!(ev(&mut m, t0, done(true)), vec![release(Phase::Success)]);
    // The write fails (D's fence stopped it, say): the request fails, and
    // D, which may or may not have had the `Status`, hears so.
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    ev(&mut m, t0, chunk(&[1], true));
    assert_eq!(ev(&mut m, t0, msg(D0, Msg::Abort)), vec![]);
    assert_eq!(
        ev(&mut m, t0, done(false)),
        vec![
            send(D0, Msg::Status { ok: false }),
            release(Phase::Failed(FailReason::Transport))
        ]
    );
}

#[test]
fn push_last_write_carries_the_status_only_when_nothing_else_is_in_flight() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    ev(&mut m, t0, chunk(&[1], false));
    // Chunk 0 is still in flight: a `Status` behind chunk 1 could reach D
    // before chunk 0 landed, so the machine sends it itself, later.
    assert_eq!(
        ev(&mut m, t0, chunk(&[2], true)),
        vec![write(D0, 1, &[2], &[6])]
    );
    let done = |chunk| Event::WriteDone {
        peer: D0,
        chunk,
        ok: true,
    };
    assert_eq!(ev(&mut m, t0, done(0)), vec![]);
    assert_eq!(
        ev(&mut m, t0, done(1)),
        vec![send(D0, Msg::Status { ok: true }), release(Phase::Success)]
    );
}

#[test]
fn push_write_failure_fails_transfer() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    ev(&mut m, t0, chunk(&[1], false));
    let out = ev(
        &mut m,
        t0,
        Event::WriteDone {
            peer: D0,
            chunk: 0,
            ok: false,
        },
    );
    assert_eq!(
        out,
        vec![
            send(D0, Msg::Status { ok: false }),
            release(Phase::Failed(FailReason::Transport))
        ]
    );
}

#[test]
fn push_peer_dead_fails_fast() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, None)));
    // Another peer's death does not concern this transfer.
    assert_eq!(ev(&mut m, t0, Event::PeerDead { peer: D1 }), vec![]);
    let out = ev(&mut m, t0, Event::PeerDead { peer: D0 });
    assert_eq!(
        out,
        vec![
            send(D0, Msg::Status { ok: false }),
            release(Phase::Failed(FailReason::PeerDead))
        ]
    );
}

#[test]
fn push_blocks_beyond_destination_are_bad_metadata() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    let out = ev(&mut m, t0, chunk(&[1, 2], true));
    assert_eq!(
        out.last(),
        Some(&release(Phase::Failed(FailReason::BadMetadata)))
    );
}

#[test]
fn plan_failure_is_bad_metadata() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None)));
    let out = ev(&mut m, t0, Event::PlanFailed { peer: D0 });
    assert_eq!(
        out.last(),
        Some(&release(Phase::Failed(FailReason::BadMetadata)))
    );
}

#[test]
fn terminal_absorbs_every_later_input() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    m.handle_timeout(t0 + secs(300));
    assert_eq!(drain(&mut m), vec![release(Phase::Expired)]);
    let late = [
        Event::WriteDone {
            peer: D0,
            chunk: 0,
            ok: true,
        },
        msg(D0, pull(1, &[5], 0, None)),
        msg(D0, Msg::Status { ok: true }),
        msg(D0, Msg::Status { ok: true }),
        msg(D0, grant(0)),
        msg(D0, Msg::Abort),
        chunk(&[1], true),
        Event::PeerDead { peer: D0 },
    ];
    for e in late {
        assert_eq!(ev(&mut m, t0 + secs(301), e), vec![]);
        assert_eq!(m.phase(), Phase::Expired);
    }
    m.abort(t0 + secs(302), AbortReason::ClientDisconnect);
    m.handle_timeout(t0 + secs(10_000));
    assert_eq!(drain(&mut m), vec![]);
    assert_eq!(m.phase(), Phase::Expired);
}

#[test]
fn abort_after_success_is_absorbed() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    ev(&mut m, t0, chunk(&[1], true));
    ev(
        &mut m,
        t0,
        Event::WriteDone {
            peer: D0,
            chunk: 0,
            ok: true,
        },
    );
    m.abort(t0, AbortReason::Engine);
    assert_eq!(ev(&mut m, t0, msg(D0, Msg::Abort)), vec![]);
    assert_eq!(m.phase(), Phase::Success);
}

#[test]
fn bad_peer_input_is_refused_and_changes_nothing() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    assert_peer_error(&mut m, t0, msg(D0, pull(0, &[5], 0, None)));
    assert_peer_error(&mut m, t0, msg(D0, pull(1000, &[5], 0, None)));
    assert_peer_error(
        &mut m,
        t0,
        msg(
            D0,
            Msg::Pull {
                receivers_expected: 1,
                dst_blocks: blocks(&[5]),
                prefix_blocks: vec![],
                lease_seq: None,
            },
        ),
    );
    assert_peer_error(&mut m, t0, msg(D0, grant(0)));
    ev(&mut m, t0, msg(D0, pull(2, &[5], 0, None)));
    assert_peer_error(&mut m, t0, msg(D1, pull(3, &[5], 0, None)));
    assert_peer_error(&mut m, t0, msg(D0, pull(2, &[6], 0, None)));
    assert_peer_error(&mut m, t0, msg(D0, grant(1)));
    assert_peer_error(&mut m, t0, msg(D0, Msg::Done { ok: true }));
    assert_peer_error(&mut m, t0, msg(D0, Msg::LeaseRequest { seq: 0 }));
    assert_peer_error(&mut m, t0, msg(D0, Msg::AbortAck));
    assert_peer_error(&mut m, t0, msg(D0, Msg::Status { ok: true }));
    ev(&mut m, t0, msg(D1, pull(2, &[5], 0, None)));
    assert_peer_error(&mut m, t0, msg(PeerId(99), pull(2, &[5], 0, None)));
    // A duplicate Pull is fine.
    assert_eq!(ev(&mut m, t0, msg(D0, pull(2, &[5], 0, None))), vec![]);
}

#[test]
fn misuse_is_refused() {
    let t0 = Instant::now();
    let cfg = Config {
        max_chunks: 2,
        ..Config::default()
    };
    let mut m = SendMachine::new(t0, &cfg, TransferId(1), Mode::Push);
    ev(&mut m, t0, chunk(&[1], false));
    ev(&mut m, t0, chunk(&[2], false));
    let before = format!("{m:?}");
    assert!(matches!(
        m.handle_event(t0, chunk(&[3], true)),
        Err(InputError::Misuse(_))
    ));
    assert!(matches!(
        m.handle_event(
            t0,
            Event::WriteDone {
                peer: D0,
                chunk: 0,
                ok: true
            }
        ),
        Err(InputError::Misuse(_))
    ));
    assert_eq!(before, format!("{m:?}"));
    let mut m = push_machine(t0);
    ev(&mut m, t0, chunk(&[1], true));
    assert!(matches!(
        m.handle_event(t0, chunk(&[2], true)),
        Err(InputError::Misuse(_))
    ));
}

#[test]
fn in_flight_writes_are_bounded() {
    let t0 = Instant::now();
    let cfg = Config {
        max_in_flight: 1,
        ..Config::default()
    };
    let mut m = SendMachine::new(t0, &cfg, TransferId(1), Mode::Push);
    ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    assert_eq!(
        ev(&mut m, t0, chunk(&[1], false)),
        vec![write(D0, 0, &[1], &[5])]
    );
    assert_eq!(
        ev(&mut m, t0, chunk(&[2], true)),
        vec![],
        "limit of one write in flight"
    );
    assert_eq!(
        ev(
            &mut m,
            t0,
            Event::WriteDone {
                peer: D0,
                chunk: 0,
                ok: true
            }
        ),
        vec![write_last(D0, 1, &[2], &[6])]
    );
}

// ---- pull mode: P grants, D reads ----

#[test]
fn pull_flow_grants_announces_and_releases_on_done() {
    let t0 = Instant::now();
    let mut m = pull_machine(t0);
    let out = ev(&mut m, t0, msg(D0, pull(1, &[], 0, Some(0))));
    assert_eq!(
        out,
        vec![send(
            D0,
            Msg::LeaseGrant {
                seq: 0,
                duration_ms: 10_000
            }
        )]
    );
    let out = ev(&mut m, t0, chunk(&[1, 2], false));
    assert_eq!(
        out,
        vec![send(
            D0,
            Msg::Ready {
                chunk: 0,
                start_blocks: vec![0],
                src_blocks: blocks(&[1, 2]),
                is_last: false
            }
        )]
    );
    let out = ev(&mut m, t0, chunk(&[3], true));
    assert_eq!(
        out,
        vec![send(
            D0,
            Msg::Ready {
                chunk: 1,
                start_blocks: vec![2],
                src_blocks: blocks(&[3]),
                is_last: true
            }
        )]
    );
    assert_eq!(
        ev(&mut m, t0, msg(D0, Msg::Done { ok: true })),
        vec![release(Phase::Success)]
    );
}

#[test]
fn pull_late_peer_catches_up_on_earlier_chunks() {
    let t0 = Instant::now();
    let mut m = pull_machine(t0);
    ev(&mut m, t0, chunk(&[1], false));
    ev(&mut m, t0, chunk(&[2], true));
    let out = ev(&mut m, t0, msg(D0, pull(1, &[], 0, None)));
    assert_eq!(out.len(), 2);
    assert!(matches!(
        &out[1],
        Action::Send {
            msg: Msg::Ready {
                chunk: 1,
                is_last: true,
                ..
            },
            ..
        }
    ));
}

#[test]
fn pull_done_before_last_chunk_is_a_peer_error() {
    let t0 = Instant::now();
    let mut m = pull_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[], 0, Some(0))));
    ev(&mut m, t0, chunk(&[1], false));
    assert_peer_error(&mut m, t0, msg(D0, Msg::Done { ok: true }));
    assert_peer_error(&mut m, t0, msg(D0, grant(0)));
    assert_peer_error(
        &mut m,
        t0,
        msg(
            D0,
            Msg::Ready {
                chunk: 0,
                start_blocks: vec![0],
                src_blocks: blocks(&[1]),
                is_last: true,
            },
        ),
    );
}

#[test]
fn pull_local_abort_waits_for_ack() {
    let t0 = Instant::now();
    let mut m = pull_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[], 0, Some(0))));
    ev(&mut m, t0, chunk(&[1], true));
    m.abort(t0, AbortReason::Engine);
    assert_eq!(drain(&mut m), vec![send(D0, Msg::Abort)]);
    assert_eq!(
        m.phase(),
        Phase::Transferring,
        "D may be reading: not released"
    );
    // Lease renewals are refused while draining.
    assert_eq!(
        ev(&mut m, t0, msg(D0, Msg::LeaseRequest { seq: 1 })),
        vec![]
    );
    let out = ev(&mut m, t0 + secs(1), msg(D0, Msg::AbortAck));
    assert_eq!(
        out,
        vec![release(Phase::Failed(FailReason::Aborted(
            AbortReason::Engine
        )))]
    );
}

#[test]
fn pull_silent_reader_releases_after_lease_plus_fence() {
    let t0 = Instant::now();
    let mut m = pull_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[], 0, Some(0))));
    ev(&mut m, t0 + secs(3), msg(D0, Msg::LeaseRequest { seq: 1 }));
    ev(&mut m, t0 + secs(3), chunk(&[1], true));
    ev(&mut m, t0 + secs(4), Event::PeerDead { peer: D0 });
    // Granted until t0 + 13 s; the fence is 2 s + 10 s.
    let fence_end = t0 + secs(13) + secs(12);
    assert_eq!(m.poll_timeout(), Some(fence_end));
    m.handle_timeout(fence_end - ms(1));
    assert_eq!(drain(&mut m), vec![]);
    m.handle_timeout(fence_end);
    assert_eq!(
        drain(&mut m),
        vec![release(Phase::Failed(FailReason::PeerDead))]
    );
}

#[test]
fn pull_grants_are_capped_by_hold_limit() {
    let t0 = Instant::now();
    let cfg = Config {
        hold_limit: secs(12),
        ..Config::default()
    };
    let mut m = SendMachine::new(t0, &cfg, TransferId(1), Mode::Pull);
    ev(&mut m, t0, msg(D0, pull(1, &[], 0, Some(0))));
    ev(&mut m, t0, chunk(&[1], false));
    let out = ev(&mut m, t0 + secs(5), msg(D0, Msg::LeaseRequest { seq: 1 }));
    assert_eq!(
        out,
        vec![send(
            D0,
            Msg::LeaseGrant {
                seq: 1,
                duration_ms: 7_000
            }
        )]
    );
    assert_eq!(
        ev(&mut m, t0 + secs(12), msg(D0, Msg::LeaseRequest { seq: 2 })),
        vec![],
        "hold limit reached"
    );
}

#[test]
fn pull_done_failure_is_peer_reported() {
    let t0 = Instant::now();
    let mut m = pull_machine(t0);
    ev(&mut m, t0, msg(D0, pull(2, &[], 0, Some(0))));
    ev(&mut m, t0, msg(D1, pull(2, &[], 0, Some(0))));
    ev(&mut m, t0, chunk(&[1], true));
    let out = ev(&mut m, t0, msg(D0, Msg::Done { ok: false }));
    assert_eq!(out, vec![send(D1, Msg::Abort)]);
    let out = ev(&mut m, t0, msg(D1, Msg::Done { ok: false }));
    assert_eq!(out, vec![release(Phase::Failed(FailReason::PeerReported))]);
}

#[test]
fn pull_done_failure_of_an_unpaired_peer_fails_for_the_drivers_reason() {
    let t0 = Instant::now();
    let reason = FailReason::Unsupported;
    let mut m = pull_machine(t0);
    ev(&mut m, t0, msg(D0, pull(2, &[], 0, Some(0))));
    ev(&mut m, t0, msg(D1, pull(2, &[], 0, Some(0))));
    ev(&mut m, t0, chunk(&[1], true));
    // Settled like its `Done { ok: false }`: D0 owes nothing more, D1 is
    // told, and the reason is the driver's, not `PeerReported`.
    let out = ev(&mut m, t0, Event::UnpairedDone { peer: D0, reason });
    assert_eq!(out, vec![send(D1, Msg::Abort)]);
    let out = ev(&mut m, t0, Event::UnpairedDone { peer: D1, reason });
    assert_eq!(out, vec![release(Phase::Failed(reason))]);
    // From a D rank whose `Pull` never came, too.
    let mut m = pull_machine(t0);
    let out = ev(&mut m, t0, Event::UnpairedDone { peer: D1, reason });
    assert_eq!(out, vec![release(Phase::Failed(reason))]);
}

#[test]
fn abort_from_unknown_d_rank_ends_the_request() {
    let t0 = Instant::now();
    let mut m = pull_machine(t0);
    let out = ev(&mut m, t0, msg(D1, Msg::Abort));
    assert_eq!(
        out,
        vec![
            send(D1, Msg::AbortAck),
            release(Phase::Failed(FailReason::PeerAborted))
        ]
    );
}

#[test]
fn unknown_d_is_bounded_by_bootstrap_not_claim() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, chunk(&[1], true));
    // D may wait long for decode memory before it can send its Pull.
    assert_eq!(m.poll_timeout(), Some(t0 + secs(300)));
    ev(&mut m, t0 + secs(100), msg(D0, pull(1, &[5], 0, None)));
    // Known now: its silence is measured by the claim.
    assert_eq!(
        m.poll_timeout(),
        Some(t0 + secs(105)),
        "lease renewal first"
    );
    let mut now = t0 + secs(100);
    while !m.is_released() {
        now = m.poll_timeout().unwrap();
        m.handle_timeout(now);
        drain(&mut m);
    }
    assert_eq!(now, t0 + secs(130));
    assert_eq!(m.phase(), Phase::Expired);
}

#[test]
fn config_validation() {
    assert_eq!(Config::default().validate(), Ok(()));
    let bad = Config {
        lease: secs(5),
        ..Config::default()
    };
    assert!(matches!(bad.validate(), Err(InputError::Misuse(_))));
    let bad = Config {
        max_in_flight: 0,
        ..Config::default()
    };
    assert!(matches!(bad.validate(), Err(InputError::Misuse(_))));
    assert_eq!(Config::default().fence(), secs(12));
}

#[test]
fn hold_limit_bounds_a_machine_whose_kv_never_comes() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None)));
    let mut now = t0;
    while !m.is_released() {
        now = m.poll_timeout().unwrap();
        m.handle_timeout(now);
        for a in drain(&mut m) {
            if let Action::Send {
                msg: Msg::LeaseRequest { seq },
                ..
            } = a
            {
                ev(&mut m, now, msg(D0, grant(seq)));
            }
        }
    }
    assert_eq!(now, t0 + secs(480));
    assert_eq!(m.phase(), Phase::Expired);
}

#[test]
fn push_fewer_blocks_than_destination_is_bad_metadata() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5, 6, 7], 0, None)));
    ev(&mut m, t0, msg(D0, grant(0)));
    assert_eq!(
        ev(&mut m, t0, chunk(&[1], false)),
        vec![write(D0, 0, &[1], &[5])]
    );
    // The request ends one block short of D's list: D would keep a block without KV.
    assert_eq!(ev(&mut m, t0, chunk(&[2], true)), vec![]);
    let out = ev(
        &mut m,
        t0,
        Event::WriteDone {
            peer: D0,
            chunk: 0,
            ok: true,
        },
    );
    assert_eq!(
        out,
        vec![
            send(D0, Msg::Status { ok: false }),
            release(Phase::Failed(FailReason::BadMetadata))
        ]
    );
}

#[test]
fn push_several_groups_align_per_group() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    let b = |ids: &[u32]| ids.iter().map(|&x| BlockId(x)).collect::<Vec<_>>();
    // Group 0: D holds P's first block. Group 1 (say a sliding-window group): no prefix.
    let pull = Msg::Pull {
        receivers_expected: 1,
        dst_blocks: vec![b(&[50, 51]), b(&[60])],
        prefix_blocks: vec![1, 0],
        lease_seq: None,
    };
    ev(&mut m, t0, msg(D0, pull));
    ev(&mut m, t0, msg(D0, grant(0)));
    let out = ev(
        &mut m,
        t0,
        Event::ChunkReady {
            src_blocks: vec![b(&[1, 2]), b(&[7])],
            is_last: false,
        },
    );
    assert_eq!(
        out,
        vec![Action::Write {
            peer: D0,
            chunk: 0,
            src_blocks: vec![b(&[2]), b(&[7])],
            dst_blocks: vec![b(&[50]), b(&[60])],
            status_after: false,
        }]
    );
    let out = ev(
        &mut m,
        t0,
        Event::ChunkReady {
            src_blocks: vec![b(&[3]), b(&[])],
            is_last: true,
        },
    );
    assert_eq!(
        out,
        vec![Action::Write {
            peer: D0,
            chunk: 1,
            src_blocks: vec![b(&[3]), b(&[])],
            dst_blocks: vec![b(&[51]), b(&[])],
            status_after: false,
        }]
    );
    // A chunk with another group count is the engine's mistake.
    let mut m2 = push_machine(t0);
    ev(
        &mut m2,
        t0,
        Event::ChunkReady {
            src_blocks: vec![b(&[1])],
            is_last: false,
        },
    );
    let err = m2.handle_event(
        t0,
        Event::ChunkReady {
            src_blocks: vec![b(&[2]), b(&[3])],
            is_last: true,
        },
    );
    assert!(matches!(err, Err(InputError::Misuse(_))));
}

#[test]
fn push_ticket_grant_writes_without_waiting_for_a_lease_round_trip() {
    let t0 = Instant::now() + secs(100);
    let mut m = push_machine(t0);
    // KV first, then D's `Pull` and its ticket grant (one burst from D).
    // The `Pull` announces the grant, so P does not ask for a lease.
    assert_eq!(ev(&mut m, t0, chunk(&[1, 2], true)), vec![]);
    assert_eq!(
        ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, Some(7)))),
        vec![]
    );
    // The ticket was sent 2 s ago; the lease counts from then.
    let out = ev(
        &mut m,
        t0,
        Event::TicketGrant {
            peer: D0,
            sent_at: t0 - secs(2),
            duration_ms: 10_000,
        },
    );
    assert_eq!(out, vec![write_last(D0, 0, &[1, 2], &[5, 6])]);
    assert_eq!(m.lease_valid_until(D0), Some(t0 + secs(8)));
}

#[test]
fn push_ticket_grant_counts_from_the_ticket_and_is_capped() {
    let t0 = Instant::now() + secs(100);
    let cfg = Config::default();
    // A ticket older than the lease gives nothing: no write.
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None)));
    ev(&mut m, t0, chunk(&[1], true));
    let old = Event::TicketGrant {
        peer: D0,
        sent_at: t0 - cfg.lease - ms(1),
        duration_ms: 10_000,
    };
    assert_eq!(ev(&mut m, t0, old), vec![]);
    // A ticket "from the future" counts from now, and a longer grant than
    // our lease is capped by it.
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None)));
    ev(
        &mut m,
        t0,
        Event::TicketGrant {
            peer: D0,
            sent_at: t0 + secs(30),
            duration_ms: u64::MAX,
        },
    );
    assert_eq!(m.lease_valid_until(D0), Some(t0 + cfg.lease));
    // A ticket grant that overtook its `Pull` is dropped, not an error; in
    // pull mode it is the peer's error.
    let mut m = push_machine(t0);
    let early = Event::TicketGrant {
        peer: D1,
        sent_at: t0,
        duration_ms: 10_000,
    };
    assert_eq!(ev(&mut m, t0, early.clone()), vec![]);
    assert_eq!(m.lease_valid_until(D1), None);
    let mut m = pull_machine(t0);
    ev(&mut m, t0, msg(D1, pull(1, &[5], 0, Some(0))));
    assert_peer_error(&mut m, t0, early);
}

#[test]
fn push_pull_announcing_a_ticket_defers_the_lease_request() {
    let t0 = Instant::now() + secs(100);
    let cfg = Config::default();
    // Without an announced ticket P asks at once.
    let mut m = push_machine(t0);
    ev(&mut m, t0, chunk(&[1], true));
    assert_eq!(
        ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None))),
        vec![send(D0, Msg::LeaseRequest { seq: 0 })]
    );
    // With one it waits; if the grant never comes it asks when a lost
    // answer would be resent (the machine's timer says when).
    let mut m = push_machine(t0);
    ev(&mut m, t0, chunk(&[1], true));
    assert_eq!(ev(&mut m, t0, msg(D0, pull(1, &[5], 0, Some(3)))), vec![]);
    let due = t0 + cfg.resend_after;
    assert!(
        m.poll_timeout().is_some_and(|t| t <= due),
        "{:?}",
        m.poll_timeout()
    );
    m.handle_timeout(due - ms(1));
    assert_eq!(drain(&mut m), vec![]);
    m.handle_timeout(due);
    assert_eq!(drain(&mut m), vec![send(D0, Msg::LeaseRequest { seq: 0 })]);
    // A refused ticket makes it ask at once, once.
    let mut m = push_machine(t0);
    ev(&mut m, t0, chunk(&[1], true));
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, Some(3))));
    assert_eq!(
        ev(&mut m, t0, Event::TicketRefused { peer: D0 }),
        vec![send(D0, Msg::LeaseRequest { seq: 0 })]
    );
    assert_eq!(
        ev(&mut m, t0 + ms(1), Event::TicketRefused { peer: D0 }),
        vec![send(D0, Msg::LeaseRequest { seq: 1 })],
        "a second refusal asks again: the lease is still not live"
    );
    // After a live ticket grant a refusal changes nothing.
    let mut m = push_machine(t0);
    ev(&mut m, t0, chunk(&[1], true));
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, Some(3))));
    let granted = ev(
        &mut m,
        t0,
        Event::TicketGrant {
            peer: D0,
            sent_at: t0,
            duration_ms: 10_000,
        },
    );
    assert_eq!(granted, vec![write_last(D0, 0, &[1], &[5])]);
    assert_eq!(ev(&mut m, t0, Event::TicketRefused { peer: D0 }), vec![]);
    // In pull mode a refusal is the peer's error.
    let mut m = pull_machine(t0);
    ev(&mut m, t0, msg(D1, pull(1, &[5], 0, Some(0))));
    assert_peer_error(&mut m, t0, Event::TicketRefused { peer: D1 });
}

#[test]
fn push_ticket_grant_that_overtook_its_pull_applies_when_the_pull_comes() {
    let t0 = Instant::now() + secs(100);
    let mut m = push_machine(t0);
    ev(&mut m, t0, chunk(&[1, 2], true));
    let early = Event::TicketGrant {
        peer: D0,
        sent_at: t0 - secs(1),
        duration_ms: 10_000,
    };
    assert_eq!(ev(&mut m, t0, early), vec![]);
    assert_eq!(m.lease_valid_until(D0), None, "no peer yet");
    // The `Pull` brings the peer: the kept ticket makes the lease live at
    // once, counted from when the ticket was sent, and nothing is asked.
    assert_eq!(
        ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, Some(7)))),
        vec![write_last(D0, 0, &[1, 2], &[5, 6])]
    );
    assert_eq!(m.lease_valid_until(D0), Some(t0 + secs(9)));
    // Without an announcement too (the grant is what counts).
    let mut m = push_machine(t0);
    ev(&mut m, t0, chunk(&[1], true));
    ev(
        &mut m,
        t0,
        Event::TicketGrant {
            peer: D0,
            sent_at: t0,
            duration_ms: 10_000,
        },
    );
    assert_eq!(
        ev(&mut m, t0, msg(D0, pull(1, &[5], 0, None))),
        vec![write_last(D0, 0, &[1], &[5])]
    );
}

// ---- resending what may have been lost ----

fn resend(peer: PeerId, msg: Msg) -> Action {
    Action::Resend { peer, msg }
}

fn ready(chunk: u32, start: u32, src: &[u32], is_last: bool) -> Msg {
    Msg::Ready {
        chunk,
        start_blocks: vec![start],
        src_blocks: blocks(src),
        is_last,
    }
}

#[test]
fn a_resent_pull_of_a_finished_push_peer_gets_its_status_again() {
    let t0 = Instant::now();
    let mut m = push_machine(t0);
    ev(&mut m, t0, msg(D0, pull(2, &[5], 0, None)));
    ev(&mut m, t0, msg(D1, pull(2, &[6], 0, None)));
    ev(&mut m, t0, chunk(&[1], true));
    assert_eq!(
        ev(&mut m, t0, msg(D0, grant(0))),
        vec![write_last(D0, 0, &[1], &[5])]
    );
    let done = Event::WriteDone {
        peer: D0,
        chunk: 0,
        ok: true,
    };
    assert_eq!(ev(&mut m, t0, done), vec![]);
    // The `Status` riding D0's write was lost: D0 resends its `Pull`.
    let again = ev(&mut m, t0 + ms(200), msg(D0, pull(2, &[5], 0, None)));
    assert_eq!(again, vec![resend(D0, Msg::Status { ok: true })]);
    // D1, not finished, only shows it is alive with its resent `Pull`.
    assert_eq!(
        ev(&mut m, t0 + ms(200), msg(D1, pull(2, &[6], 0, None))),
        vec![]
    );
}

#[test]
fn a_resent_pull_in_pull_mode_is_granted_and_told_every_chunk_again() {
    let t0 = Instant::now();
    let mut m = pull_machine(t0);
    ev(&mut m, t0, msg(D0, pull(1, &[5, 6], 0, Some(0))));
    ev(&mut m, t0, chunk(&[1], false));
    ev(&mut m, t0, chunk(&[2], true));
    let out = ev(&mut m, t0 + ms(200), msg(D0, pull(1, &[5, 6], 0, Some(1))));
    assert_eq!(
        out,
        vec![
            send(D0, grant(1)),
            resend(D0, ready(0, 0, &[1], false)),
            resend(D0, ready(1, 1, &[2], true)),
        ]
    );
}

#[test]
fn the_last_ready_is_resent_until_done_comes() {
    let t0 = Instant::now();
    let cfg = Config {
        resend_after: ms(100),
        max_resends: 2,
        heartbeat_interval: secs(1),
        ..Config::default()
    };
    let mut m = SendMachine::new(t0, &cfg, TransferId(7), Mode::Pull);
    ev(&mut m, t0, msg(D0, pull(1, &[5], 0, Some(0))));
    assert_eq!(
        ev(&mut m, t0, chunk(&[1], true)),
        vec![send(D0, ready(0, 0, &[1], true))]
    );
    // D0's `Done` is overdue: the last `Ready` again, after 100 then 200 ms,
    // then nothing while D0 stays silent (the claim bounds the rest).
    for at in [100, 300] {
        m.handle_timeout(t0 + ms(at));
        assert_eq!(drain(&mut m), vec![resend(D0, ready(0, 0, &[1], true))]);
    }
    m.handle_timeout(t0 + ms(700));
    assert_eq!(drain(&mut m), vec![]);
    // Its `Done` ends the transfer; nothing is resent after it.
    let out = ev(&mut m, t0 + ms(800), msg(D0, Msg::Done { ok: true }));
    assert_eq!(out, vec![release(Phase::Success)]);
    assert_eq!(m.poll_timeout(), None);
}

#[test]
fn an_unpaired_pull_is_refused_with_the_drivers_reason() {
    for reason in [FailReason::BadMetadata, FailReason::Unsupported] {
        let t0 = Instant::now();
        let mut m = push_machine(t0);
        let out = ev(&mut m, t0, Event::UnpairedPull { peer: D0, reason });
        assert_eq!(
            out,
            vec![send(D0, Msg::NotPaired), release(Phase::Failed(reason))]
        );
        // Terminal at once (nothing was written or granted): a resent
        // `Pull` is absorbed; the node's late answer repeats `NotPaired`.
        let out = ev(&mut m, t0, Event::UnpairedPull { peer: D0, reason });
        assert_eq!(out, vec![]);
        assert_eq!(m.phase(), Phase::Failed(reason));
    }
}
