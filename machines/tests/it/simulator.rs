//! Deterministic simulation of the transfer protocol (see `sim/mod.rs`).
//!
//! * `sim_campaign` runs `KVFERRY_SIM_SEEDS` seeds (default 3000) starting at
//!   `KVFERRY_SIM_SEED_START` (default 0) on `KVFERRY_SIM_JOBS` threads
//!   (default 1; each seed is one single-threaded simulation) and fails with
//!   the seed, the violated invariant, the replay command and the event trace.
//! * `sim_replay` replays `KVFERRY_SIM_SEED` with its trace, or, without it,
//!   checks that runs are deterministic.
//! * `sim_teeth_*` switch one safeguard off and assert the simulator notices.
//!
//! Long campaign:
//! `KVFERRY_SIM_SEEDS=100000 KVFERRY_SIM_JOBS=8 cargo test --release -p kvferry-machines --test it sim_campaign -- --nocapture`
//! (or `KVFERRY_SIM_SEEDS=100000 cargo test --release sim` for every simulator test).

use crate::sim;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use sim::checker::{Kind, Stats};
use sim::scenario::{Scenario, Switches};

/// Runs the scenarios `draw` gives for seeds `start..start + seeds` on
/// `jobs` threads (each seed is one single-threaded simulation); returns
/// the summed counters and the lowest failing seed found, if any. Workers
/// stop taking seeds after a failure.
fn campaign(
    draw: impl Fn(u64) -> Scenario + Sync,
    start: u64,
    seeds: u64,
    jobs: u64,
) -> (Stats, Option<(u64, sim::checker::Violation)>) {
    let next = AtomicU64::new(start);
    let failed = AtomicBool::new(false);
    let results: Vec<(Stats, Option<(u64, sim::checker::Violation)>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..jobs.max(1))
            .map(|_| {
                s.spawn(|| {
                    let mut stats = Stats::default();
                    let mut first = None;
                    while !failed.load(Ordering::Relaxed) {
                        let seed = next.fetch_add(1, Ordering::Relaxed);
                        if seed >= start + seeds {
                            break;
                        }
                        let r = sim::world::run(&draw(seed), false);
                        stats.add(&r.stats);
                        if let Some(v) = r.violation {
                            failed.store(true, Ordering::Relaxed);
                            first = Some((seed, v));
                        }
                    }
                    (stats, first)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("simulator worker panicked"))
            .collect()
    });
    let mut total = Stats::default();
    let mut first: Option<(u64, sim::checker::Violation)> = None;
    for (stats, f) in results {
        total.add(&stats);
        if let Some((seed, v)) = f {
            if first.as_ref().is_none_or(|(s, _)| seed < *s) {
                first = Some((seed, v));
            }
        }
    }
    (total, first)
}

#[test]
fn sim_campaign() {
    let seeds = sim::env_u64("KVFERRY_SIM_SEEDS", 3000);
    let start = sim::env_u64("KVFERRY_SIM_SEED_START", 0);
    let jobs = sim::env_u64("KVFERRY_SIM_JOBS", 1);
    let began = Instant::now();
    let draw = |seed| Scenario::generate(seed, Switches::default());
    let (total, failure) = campaign(draw, start, seeds, jobs);
    if let Some((seed, v)) = failure {
        panic!("{}", sim::report_failure(seed, Switches::default(), &v));
    }
    let secs = began.elapsed().as_secs_f64();
    println!(
        "sim_campaign: seeds {start}..{} on {jobs} thread(s) in {secs:.2} s = {:.0} seeds/s",
        start + seeds,
        seeds as f64 / secs
    );
    println!("{total}");
    // The campaign must actually exercise what it claims to: successes on
    // both sides, and every kind of fault.
    if seeds >= 500 {
        let checks = [
            ("P successes", total.p_success),
            ("D receptions", total.d_received),
            ("P failures", total.p_failed),
            ("D load failures", total.d_failed),
            ("expiries", total.expired),
            ("dropped messages", total.dropped),
            ("duplicated messages", total.duplicated),
            ("messages cut by partitions", total.cut),
            ("failed transfers", total.ops_failed),
            ("hung transfers", total.ops_hung),
            ("touches of dead memory", total.late_drops),
            ("crashes", total.crashes),
            ("partitions", total.partitions),
            ("PeerDead verdicts", total.peer_dead),
            ("aborts", total.aborts),
            ("plan failures", total.plan_failures),
            ("false PeerDead verdicts", total.false_dead),
            ("heartbeat ticks", total.beats),
            ("peers declared dead for silence", total.silent_deaths),
            (
                "peers declared dead for a dropped connection",
                total.dropped_deaths,
            ),
            ("dead peers heard again", total.revivals),
            ("messages buffered before creation", total.buffered),
            ("pull requests", total.pull),
            ("push requests", total.push),
            ("releases through the fence", total.fenced),
            ("resent messages", total.resent),
        ];
        for (what, n) in checks {
            assert!(n > 0, "the campaign never produced {what}:\n{total}");
        }
        // Every way a request can end shows up on both sides.
        for side in ["P", "D"] {
            for outcome in [
                "Success",
                "Expired",
                "Failed(Transport)",
                "Failed(PeerReported)",
                "Failed(PeerDead)",
                "Failed(PeerAborted)",
                "Failed(BadMetadata)",
                "Failed(Aborted(Engine))",
                "Failed(Aborted(ClientDisconnect))",
                "Failed(Aborted(Shutdown))",
            ] {
                let key = format!("{side} {outcome}");
                assert!(
                    total.outcomes.get(&key).is_some_and(|&n| n > 0),
                    "no {key} in the campaign:\n{total}"
                );
            }
        }
        // Most requests in calm runs and many overall must succeed, or the
        // simulator only tests failure paths.
        assert!(
            total.d_received * 3 > total.d_received + total.d_failed,
            "too few successes:\n{total}"
        );
    }
}

/// Share of control messages the goodput runs lose.
const LOSS_PPM: u32 = 20_000;
/// Goodput the machines' resends must keep at that loss.
const MIN_GOODPUT: f64 = 0.995;

/// The goodput campaign: `KVFERRY_SIM_SEEDS` (default 3000) lossy
/// scenarios, `scenario_fix` applied to each.
fn lossy_campaign(scenario_fix: impl Fn(&mut Scenario) + Sync) -> Stats {
    let seeds = sim::env_u64("KVFERRY_SIM_SEEDS", 3000);
    let start = sim::env_u64("KVFERRY_SIM_SEED_START", 0);
    let jobs = sim::env_u64("KVFERRY_SIM_JOBS", 1);
    let draw = |seed| {
        let mut sc = Scenario::lossy(seed, LOSS_PPM);
        scenario_fix(&mut sc);
        sc
    };
    let (total, failure) = campaign(draw, start, seeds, jobs);
    if let Some((seed, v)) = failure {
        panic!(
            "lossy seed {seed} violates an invariant: {v}\n{:#?}",
            draw(seed)
        );
    }
    println!("lossy seeds {start}..{}:\n{total}", start + seeds);
    total
}

#[test]
fn sim_goodput_with_lost_messages() {
    // With 2 % of the control messages lost and nothing else failing, the
    // resends recover almost every request, and break no invariant.
    let total = lossy_campaign(|_| {});
    assert!(total.dropped > 0 && total.resent > 0, "{total}");
    assert!(total.requests_judged > 0, "{total}");
    assert!(
        total.goodput() >= MIN_GOODPUT,
        "goodput {:.4} under {MIN_GOODPUT} at {LOSS_PPM} ppm lost:\n{total}",
        total.goodput()
    );
}

#[test]
fn sim_teeth_goodput_without_resends() {
    // The same runs with resending off: lost messages fail requests at
    // their deadlines, and the goodput falls under the bound.
    let total = lossy_campaign(|sc| sc.cfg.max_resends = 0);
    assert_eq!(total.resent, 0);
    assert!(
        total.goodput() < MIN_GOODPUT,
        "goodput {:.4} without resends: the goodput test has no teeth\n{total}",
        total.goodput()
    );
}

#[test]
fn sim_replay() {
    if let Ok(seed) = std::env::var("KVFERRY_SIM_SEED") {
        let seed: u64 = seed.trim().parse().expect("KVFERRY_SIM_SEED is a number");
        let (sc, r) = sim::run_seed(seed, Switches::default(), true);
        for line in &r.trace {
            println!("{line}");
        }
        println!("{:#?}", sc.cfg);
        println!("{}", r.stats);
        if let Some(v) = &r.violation {
            panic!("{}", sim::report_failure(seed, Switches::default(), v));
        }
        return;
    }
    // Without a seed: the same seed twice gives the same run, event for event.
    for seed in 0..20 {
        let (_, a) = sim::run_seed(seed, Switches::default(), true);
        let (_, b) = sim::run_seed(seed, Switches::default(), true);
        assert!(!a.trace.is_empty(), "seed {seed} traced nothing");
        assert_eq!(a.trace, b.trace, "seed {seed} is not deterministic");
        assert!(
            a.violation.is_none(),
            "{}",
            sim::explain(seed, Switches::default(), a.violation.as_ref().unwrap())
        );
    }
}

/// Runs seeds with `switches` until one violates an invariant of `kinds`.
fn find_violation(
    switches: Switches,
    kinds: &[Kind],
    max_seeds: u64,
) -> (u64, sim::checker::Violation) {
    for seed in 0..max_seeds {
        let (_, r) = sim::run_seed(seed, switches, false);
        if let Some(v) = r.violation {
            assert!(
                kinds.contains(&v.kind),
                "seed {seed}: expected one of {kinds:?}, found {v}"
            );
            // What a failure report looks like (shown with --nocapture).
            println!("{}", sim::explain(seed, switches, &v));
            return (seed, v);
        }
    }
    panic!("no violation in {max_seeds} seeds with {switches:?}: the simulator has no teeth");
}

#[test]
fn sim_teeth_transport_bound() {
    // A data plane that lets transfers land after the bound it promised
    // breaks the fence: the checker must see a block touched after release.
    let switches = Switches {
        late_touches: true,
        ..Switches::default()
    };
    let (seed, v) = find_violation(
        switches,
        &[Kind::ReadAfterRelease, Kind::WriteAfterRelease],
        300,
    );
    println!("late touches caught at seed {seed}: {v}");
}

#[test]
fn sim_teeth_clock_drift() {
    // Clocks that drift ten times more than `fence_margin` covers let a
    // toucher's lease (on its slow clock) outlast the granter's fence (on
    // its fast clock): the margin is what keeps leases safe under drift.
    let switches = Switches {
        excess_drift: true,
        ..Switches::default()
    };
    let (seed, v) = find_violation(
        switches,
        &[
            Kind::ReadAfterRelease,
            Kind::WriteAfterRelease,
            Kind::ReleasedInFlight,
        ],
        2000,
    );
    println!("excess clock drift caught at seed {seed}: {v}");
}

#[test]
fn sim_teeth_ticket_counted_from_arrival() {
    // A lease ticket counted from when the grant arrived instead of from
    // when P sent the ticket outlasts the lease D granted: the checker must
    // see a write without D's lease (or into released memory).
    let switches = Switches {
        ticket_from_grant_time: true,
        ..Switches::default()
    };
    let (seed, v) = find_violation(
        switches,
        &[
            Kind::NoLease,
            Kind::WriteAfterRelease,
            Kind::ReleasedInFlight,
        ],
        4000,
    );
    println!("ticket counted from arrival caught at seed {seed}: {v}");
}

#[test]
fn sim_memory_model_catches_misuse() {
    use kvferry_machines::internal::common::BlockId;
    use kvferry_machines::TransferId;
    use sim::memory::{Memory, Owner};

    let (a, b) = (TransferId(1), TransferId(2));
    let mut mem = Memory::new(4);
    let blocks = mem.alloc(3, a).expect("pool has 4 blocks");
    assert!(mem.alloc(2, b).is_none(), "only one block left");
    assert_eq!(mem.owner(blocks[0]), Some(Owner::Lent(a)));
    // Released by someone else, or twice: refused.
    assert!(mem.release(blocks[0], b, false).is_err());
    mem.release(blocks[0], a, false).expect("first release");
    assert!(
        mem.release(blocks[0], a, false).is_err(),
        "double release must be caught"
    );
    // Freed blocks are reused first, so late writes hit another request.
    let again = mem.alloc(1, b).expect("a block is free");
    assert_eq!(again[0], blocks[0]);
    // D keeps received KV until decode is done.
    mem.release(blocks[1], a, true).expect("received");
    assert_eq!(mem.owner(blocks[1]), Some(Owner::Engine(a)));
    assert!(
        mem.engine_free(blocks[2], a).is_err(),
        "still lent, not engine-held"
    );
    mem.engine_free(blocks[1], a).expect("decode done");
    assert_eq!(mem.leaked().len(), 2, "{:?}", mem.leaked());
    assert_eq!(mem.owner(BlockId(99)), None);
}

#[test]
fn sim_network_partitions_cut_the_right_way() {
    use sim::network::cut;
    // Nodes 0 and 2 on one side.
    let mask = 0b101;
    assert!(cut(mask, false, 0, 1) && cut(mask, false, 1, 0));
    assert!(!cut(mask, false, 0, 2) && !cut(mask, false, 1, 3));
    // One way: the masked side is not heard, but hears.
    assert!(cut(mask, true, 0, 1));
    assert!(!cut(mask, true, 1, 0));
    assert!(!cut(mask, true, 0, 2));
}

#[test]
fn sim_seeds_draw_different_scenarios() {
    use sim::scenario::Scenario;
    let a = Scenario::generate(1, Switches::default());
    let b = Scenario::generate(1, Switches::default());
    let c = Scenario::generate(2, Switches::default());
    assert_eq!(
        format!("{a:?}"),
        format!("{b:?}"),
        "a seed must draw the same scenario"
    );
    assert_ne!(format!("{a:?}"), format!("{c:?}"), "seeds must differ");
    // Over many seeds, every shape shows up: fan-in, fan-out, push, pull, chunking, prefixes.
    let mut fan_in = false;
    let mut fan_out = false;
    let mut chunked = false;
    let mut prefix = false;
    for seed in 0..200 {
        for r in &Scenario::generate(seed, Switches::default()).requests {
            fan_in |= r.pairs.iter().any(|ps| ps.len() > 1);
            fan_out |= (0..r.p_nodes.len()).any(|i| r.receivers_expected(i) > 1);
            chunked |= r.chunks.len() > 1;
            prefix |= r.prefix.iter().any(|&p| p > 0);
        }
    }
    assert!(
        fan_in && fan_out && chunked && prefix,
        "{fan_in} {fan_out} {chunked} {prefix}"
    );
}

#[test]
fn sim_teeth_lost_timers() {
    // A driver that does not arm `poll_timeout` leaves requests hanging
    // (vllm#35943): the liveness check must say so.
    let switches = Switches {
        lose_timers: true,
        ..Switches::default()
    };
    let (seed, v) = find_violation(switches, &[Kind::Liveness, Kind::SpuriousFailure], 50);
    println!("lost timers caught at seed {seed}: {v}");
}

#[test]
fn sim_shrink_keeps_the_violation() {
    // Shrinking a failing scenario keeps a violation of the same kind in a
    // scenario no larger than the original.
    let switches = Switches {
        lose_timers: true,
        ..Switches::default()
    };
    let (seed, v) = find_violation(switches, &[Kind::Liveness, Kind::SpuriousFailure], 50);
    let original = sim::scenario::Scenario::generate(seed, switches);
    let (small, sv, runs) = sim::shrink(&original, v.kind);
    assert_eq!(sv.kind, v.kind);
    assert!(small.requests.len() <= original.requests.len());
    assert!(small.crashes.len() <= original.crashes.len());
    let again = sim::world::run(&small, false)
        .violation
        .expect("the shrunk scenario still fails");
    assert_eq!(again.kind, v.kind);
    println!(
        "seed {seed}: {} requests -> {} in {runs} runs; {sv}",
        original.requests.len(),
        small.requests.len()
    );
}

#[test]
fn sim_teeth_late_pull_abort_after_success() {
    // A P driver that answers a duplicated `Pull` with `Abort` after the
    // transfer succeeded lets that `Abort` overtake the `Status{ok: true}`:
    // the D rank fails although all its KV landed. The simulator found this
    // (seed 18796 of the jittery profile); drivers answer late `Pull`s with
    // `Abort` only after a failed transfer.
    let switches = Switches {
        abort_after_success: true,
        ..Switches::default()
    };
    let (seed, v) = find_violation(switches, &[Kind::SpuriousFailure], 400);
    assert!(v.detail.contains("PeerAborted"), "{v}");
    println!("abort after success caught at seed {seed}: {v}");
}

#[test]
fn sim_teeth_no_fence() {
    // A granter that reuses its blocks as soon as it gives up, without
    // waiting for the lease to come back or run out, is sglang PR#24580 (D
    // reuses pages before ABORT_ACK, late writes land in them) and, in pull
    // mode, vllm#21570 (P frees blocks D still reads).
    let switches = Switches {
        disable_fence: true,
        ..Switches::default()
    };
    let (seed, v) = find_violation(
        switches,
        &[
            Kind::ReadAfterRelease,
            Kind::WriteAfterRelease,
            Kind::ReleasedInFlight,
        ],
        300,
    );
    println!("disabled fence caught at seed {seed}: {v}");
}

#[test]
fn sim_teeth_ignore_in_flight() {
    // A toucher that releases (or returns its lease) with transfers still in
    // flight lets them land after the other side reused the blocks.
    let switches = Switches {
        ignore_in_flight: true,
        ..Switches::default()
    };
    let (seed, v) = find_violation(
        switches,
        &[
            Kind::ReadAfterRelease,
            Kind::WriteAfterRelease,
            Kind::ReleasedInFlight,
        ],
        300,
    );
    println!("ignored in-flight transfers caught at seed {seed}: {v}");
}

/// Regression (found by the simulator, seed 4359 before the fix): a D rank
/// fed by two P ranks got `Status{ok: true}` from one of them, then an
/// `Abort` from the same P rank (its driver answering a duplicated `Pull`
/// after the transfer finished, as the machines' docs ask). The D rank
/// failed the whole request and aborted the other P rank, although every
/// block from the first had landed. An `Abort` from a peer that already
/// finished is stale: its data is complete and it holds no lease.
#[test]
fn sim_regression_abort_from_finished_peer_is_stale() {
    use std::time::{Duration, Instant};

    use kvferry_machines::internal::common::{BlockId, Config, Mode, Msg, PeerId};
    use kvferry_machines::internal::recv::{Action, Event, RecvMachine, ResolvedPeer};
    use kvferry_machines::{Machine, Phase, TransferId};

    let (p3, p4) = (PeerId(3), PeerId(4));
    let cfg = Config::default();
    let t0 = Instant::now();
    let ms = |m: u64| t0 + Duration::from_millis(m);
    let drain = |m: &mut RecvMachine| std::iter::from_fn(|| m.poll_action()).collect::<Vec<_>>();
    for mode in [Mode::Push, Mode::Pull] {
        let dst = vec![vec![BlockId(0), BlockId(1)]];
        let mut m = RecvMachine::new(t0, &cfg, TransferId(16), mode, dst, vec![0]).expect("valid");
        let peers = vec![
            ResolvedPeer {
                peer: p3,
                receivers_expected: 1,
                lease_ticket: None,
            },
            ResolvedPeer {
                peer: p4,
                receivers_expected: 1,
                lease_ticket: None,
            },
        ];
        m.handle_event(
            ms(1),
            Event::PeersResolved {
                peers,
                unneeded: Vec::new(),
            },
        )
        .expect("resolved");
        drain(&mut m);
        // P3 delivers everything.
        match mode {
            Mode::Push => {
                let status = Msg::Status { ok: true };
                m.handle_event(
                    ms(2),
                    Event::Msg {
                        peer: p3,
                        msg: status,
                    },
                )
                .expect("status");
            }
            Mode::Pull => {
                let grant = Msg::LeaseGrant {
                    seq: 0,
                    duration_ms: 10_000,
                };
                m.handle_event(
                    ms(2),
                    Event::Msg {
                        peer: p3,
                        msg: grant,
                    },
                )
                .expect("grant");
                let ready = Msg::Ready {
                    chunk: 0,
                    start_blocks: vec![0],
                    src_blocks: vec![vec![BlockId(7), BlockId(8)]],
                    is_last: true,
                };
                m.handle_event(
                    ms(3),
                    Event::Msg {
                        peer: p3,
                        msg: ready,
                    },
                )
                .expect("ready");
                let read = drain(&mut m);
                assert!(
                    read.iter()
                        .any(|a| matches!(a, Action::Read { peer, .. } if *peer == p3)),
                    "{read:?}"
                );
                m.handle_event(
                    ms(4),
                    Event::ReadDone {
                        peer: p3,
                        chunk: 0,
                        ok: true,
                    },
                )
                .expect("read done");
            }
        }
        drain(&mut m);
        // The stale Abort from P3 must not end the request.
        m.handle_event(
            ms(5),
            Event::Msg {
                peer: p3,
                msg: Msg::Abort,
            },
        )
        .expect("abort absorbed");
        let acts = drain(&mut m);
        assert!(
            !m.phase().is_terminal(),
            "{mode:?}: failed on a stale Abort: {:?} {acts:?}",
            m.phase()
        );
        assert!(
            !acts
                .iter()
                .any(|a| matches!(a, Action::Send { peer, msg: Msg::Abort } if *peer == p4)),
            "{mode:?}: aborted the other P rank: {acts:?}"
        );
        // P4 still completes the request.
        match mode {
            Mode::Push => {
                let status = Msg::Status { ok: true };
                m.handle_event(
                    ms(6),
                    Event::Msg {
                        peer: p4,
                        msg: status,
                    },
                )
                .expect("status");
            }
            Mode::Pull => {
                let grant = Msg::LeaseGrant {
                    seq: 0,
                    duration_ms: 10_000,
                };
                m.handle_event(
                    ms(6),
                    Event::Msg {
                        peer: p4,
                        msg: grant,
                    },
                )
                .expect("grant");
                let ready = Msg::Ready {
                    chunk: 0,
                    start_blocks: vec![0],
                    src_blocks: vec![vec![BlockId(9), BlockId(10)]],
                    is_last: true,
                };
                m.handle_event(
                    ms(7),
                    Event::Msg {
                        peer: p4,
                        msg: ready,
                    },
                )
                .expect("ready");
                drain(&mut m);
                m.handle_event(
                    ms(8),
                    Event::ReadDone {
                        peer: p4,
                        chunk: 0,
                        ok: true,
                    },
                )
                .expect("read done");
            }
        }
        let acts = drain(&mut m);
        assert!(acts.contains(&Action::Received), "{mode:?}: {acts:?}");
        assert_eq!(m.phase(), Phase::Success);
    }
}

/// Regression (found by the simulator, seed 358 with drivers answering
/// like the node): a P rank in pull mode got `Done{ok: true}` from one D
/// rank, then an `Abort` from the same D rank (its driver answering a
/// duplicated `Ready` after the transfer ended). The P rank failed the
/// request and aborted the other D rank, although every read had ended.
#[test]
fn sim_regression_abort_from_finished_d_rank_is_stale() {
    use std::time::{Duration, Instant};

    use kvferry_machines::internal::common::{BlockId, Config, Mode, Msg, PeerId};
    use kvferry_machines::internal::send::{Action, Event, SendMachine};
    use kvferry_machines::{Machine, Phase, TransferId};

    let (d4, d5) = (PeerId(4), PeerId(5));
    let t0 = Instant::now();
    let ms = |m: u64| t0 + Duration::from_millis(m);
    let drain = |m: &mut SendMachine| std::iter::from_fn(|| m.poll_action()).collect::<Vec<_>>();
    let mut m = SendMachine::new(t0, &Config::default(), TransferId(6), Mode::Pull);
    let pull = |seq| Msg::Pull {
        receivers_expected: 2,
        dst_blocks: vec![vec![BlockId(0)]],
        prefix_blocks: vec![0],
        lease_seq: Some(seq),
    };
    m.handle_event(
        ms(1),
        Event::Msg {
            peer: d4,
            msg: pull(0),
        },
    )
    .expect("pull d4");
    m.handle_event(
        ms(1),
        Event::Msg {
            peer: d5,
            msg: pull(0),
        },
    )
    .expect("pull d5");
    let chunk = Event::ChunkReady {
        src_blocks: vec![vec![BlockId(9)]],
        is_last: true,
    };
    m.handle_event(ms(2), chunk).expect("chunk");
    drain(&mut m);
    m.handle_event(
        ms(3),
        Event::Msg {
            peer: d5,
            msg: Msg::Done { ok: true },
        },
    )
    .expect("done d5");
    drain(&mut m);
    // The stale Abort from D5 must not end the request.
    m.handle_event(
        ms(4),
        Event::Msg {
            peer: d5,
            msg: Msg::Abort,
        },
    )
    .expect("abort absorbed");
    let acts = drain(&mut m);
    assert!(
        !m.phase().is_terminal(),
        "failed on a stale Abort: {:?} {acts:?}",
        m.phase()
    );
    assert!(
        !acts
            .iter()
            .any(|a| matches!(a, Action::Send { peer, msg: Msg::Abort } if *peer == d4)),
        "aborted the other D rank: {acts:?}"
    );
    m.handle_event(
        ms(5),
        Event::Msg {
            peer: d4,
            msg: Msg::Done { ok: true },
        },
    )
    .expect("done d4");
    let acts = drain(&mut m);
    assert!(
        acts.contains(&Action::ReleaseBlocks {
            outcome: Phase::Success
        }),
        "{acts:?}"
    );
}
