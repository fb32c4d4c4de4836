//! A seeded deterministic simulator of kvferry's transfer protocol, in the
//! spirit of TigerBeetle's VOPR: the real `SendMachine`/`RecvMachine` on
//! many simulated P and D ranks, a lossy control network that carries the
//! real message encoding, a data plane whose writes and reads land in
//! simulated memory, crashes, partitions, aborts, and a checker that holds
//! the invariants of docs/design.md §2 after every step.
//!
//! * `scenario` draws everything a seed simulates;
//! * `world` runs it on one event queue and a simulated clock;
//! * `network` and `memory` are the simulated wire and KV blocks;
//! * `checker` names the invariants and keeps the counters.
//!
//! # What a seed simulates
//!
//! 1 to 6 P nodes and 1 to 6 D nodes, 4 to 40 requests in push or pull
//! mode, each on 1, 2 or 4 P ranks and 1, 2 or 4 D ranks (heterogeneous TP:
//! a D rank fed by several P ranks, a P rank feeding several D ranks, or an
//! arbitrary pairing), 1 or 2 KV-cache groups, prefix hits, 1 to 4 chunks
//! handed over at random times. Timers are milliseconds (drawn per seed,
//! always passing `Config::validate`), so a run covers ~0.3 s of simulated
//! time in a few milliseconds of real time. One seed in eight is calm (no
//! fault): there every request must succeed.
//!
//! Faults: message delay (hence reordering), a long tail beyond the lease,
//! drop, duplication; symmetric and one-way partitions that heal; node
//! crashes (its machines and memory vanish) and restarts; peer-death
//! detection by the node's own liveness table (`machines::liveness`), one
//! per node over every other, fed on the node's drifting clock: at each
//! heartbeat tick it hears every peer that is up and whose frames reach it
//! (one-way partitions cut only one direction), every delivered frame
//! counts too, and each death it reports (more than
//! `heartbeat_misses * heartbeat_interval` of silence, or a connection
//! reset by a restart) is `PeerDead` to the node's machines paired with
//! that peer; off in one seed in four (no ticks: silence only), fresh on
//! restart, and rare false verdicts beside it; transfers that
//! fail, land partly, or never report (landing up to the bound); engine
//! aborts and client disconnects; planner rejections; slow engines and
//! bootstraps; clocks drifting as far as `fence_margin` covers; FIFO or
//! reordering links. Drivers vary per seed: P's machine is created on D's
//! first `Pull` or D's messages wait for the engine; messages for finished
//! transfers are answered as the node does (`late_answer`: after a success
//! the machine's last words again, else `Abort` to `Pull`, `Ready`,
//! `LeaseRequest`; `AbortAck` to `Abort`), or only late `Pull`s of failed
//! transfers get an `Abort`, or nothing is answered. Resending is drawn
//! per seed (`resend_after` of 1 ms up to the heartbeat, off in one seed in
//! nine).
//!
//! `Scenario::lossy` is the goodput profile: calm runs (no crash,
//! partition, abort or transport fault) that lose a given share of the
//! control messages, with the node's drivers; `Stats::goodput` is the
//! share of requests that succeeded on every rank.
//!
//! # What is checked
//!
//! After every step: exactly one release per P machine and one report per D
//! machine, phase terminal exactly when released, no action after it; every
//! block touch (each block of each write or read lands at its own time in
//! the transfer's span, half of them as late as allowed) hits a block still
//! lent to that transfer on both sides; no release while a transfer of its
//! blocks is in flight; a toucher returns its lease only with nothing in
//! flight and never posts afterwards; every write/read starts inside a lease
//! the granter really granted and maps P's block `prefix + i` onto D's block
//! `i`; `Received` (and P's success) only with every block delivered;
//! in-flight transfers within `max_in_flight`, actions per input bounded;
//! honest input never refused; `poll_timeout` in the future after
//! `handle_timeout`; every message round-trips through the node's wire encoding. At the
//! end: every machine released by the bound its documented timers imply
//! (P: creation + hold limit + fence; D: last progress + waiting + lease +
//! fence), every block back in its pool exactly once.

pub(crate) mod checker;
pub(crate) mod memory;
pub(crate) mod network;
pub(crate) mod rng;
pub(crate) mod scenario;
pub(crate) mod world;

use checker::Violation;
use scenario::{Scenario, Switches};
use world::RunResult;

/// Runs one seed.
pub(crate) fn run_seed(seed: u64, switches: Switches, trace: bool) -> (Scenario, RunResult) {
    let sc = Scenario::generate(seed, switches);
    let r = world::run(&sc, trace);
    (sc, r)
}

/// The command that replays `seed` with the event trace printed.
pub(crate) fn replay_command(seed: u64) -> String {
    format!("KVFERRY_SIM_SEED={seed} cargo test -p kvferry-machines --test it sim_replay -- --nocapture")
}

/// A report for a failing seed: the violation, how to replay it, the
/// scenario and the end of the event trace (the run is replayed with tracing on).
pub(crate) fn explain(seed: u64, switches: Switches, v: &Violation) -> String {
    let (sc, traced) = run_seed(seed, switches, true);
    // The history of the transfer the violation names, with the faults
    // around it: far easier to read than the whole cluster's trace.
    let focus = transfer_named(&v.detail).map(|t| format!("TransferId({t})"));
    let relevant = |line: &&String| match &focus {
        Some(f) => {
            line.contains(f.as_str())
                || line.contains("crashes")
                || line.contains("restarts")
                || line.contains("partition")
                || line.contains("declares")
        }
        None => true,
    };
    let lines: Vec<&String> = traced.trace.iter().filter(relevant).collect();
    let tail = &lines[lines.len().saturating_sub(80)..];
    let mut out = format!(
        "simulator seed {seed} violates an invariant:\n  {v}\nreplay: {}\nscenario: {} P nodes, {} D nodes, {} requests, calm {}, detector {}, crashes {:?}, partitions {:?}, drift {:?} ppm\nconfig: {:?}\nlast events{}:\n",
        if switches == Switches::default() {
            replay_command(seed)
        } else {
            format!("rerun the self-test that switched off {switches:?}")
        },
        sc.n_p,
        sc.n_d,
        sc.requests.len(),
        sc.calm,
        sc.detector,
        sc.crashes,
        sc.partitions,
        sc.drift_ppm,
        sc.cfg,
        match &focus {
            Some(f) => format!(" of {f} and faults"),
            None => String::new(),
        },
    );
    if let Some(r) = transfer_named(&v.detail).and_then(|t| sc.requests.get(t as usize)) {
        out.push_str(&format!("request: {r:?}\n"));
    }
    for line in tail {
        out.push_str("  ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The first `TransferId(n)` a violation's detail names.
fn transfer_named(detail: &str) -> Option<u64> {
    let rest = &detail[detail.find("TransferId(")? + "TransferId(".len()..];
    rest[..rest.find(')')?].parse().ok()
}

/// Shrinks a failing scenario: greedily drops requests, crashes,
/// partitions, aborts and network or transport faults while the run still
/// violates an invariant of the same kind. Returns the smallest scenario
/// found, its violation and how many runs it took.
///
/// The result is a scenario, not a seed (dropping a request shifts every
/// later random draw); print it with `{:#?}` and run it with `world::run`.
pub(crate) fn shrink(sc: &Scenario, kind: checker::Kind) -> (Scenario, Violation, usize) {
    let fails = |c: &Scenario| world::run(c, false).violation.filter(|v| v.kind == kind);
    let mut best = sc.clone();
    let mut violation = fails(&best).expect("shrink needs a failing scenario");
    let mut runs = 1;
    let try_keep =
        |cand: Scenario, best: &mut Scenario, violation: &mut Violation, runs: &mut usize| {
            *runs += 1;
            match fails(&cand) {
                Some(v) => {
                    *best = cand;
                    *violation = v;
                    true
                }
                None => false,
            }
        };
    loop {
        let mut progress = false;
        // Requests, one at a time (transfer ids are indices: renumber).
        let mut i = 0;
        while i < best.requests.len() && best.requests.len() > 1 {
            let mut cand = best.clone();
            cand.requests.remove(i);
            for (k, r) in cand.requests.iter_mut().enumerate() {
                r.id = kvferry_machines::TransferId(k as u64);
            }
            if try_keep(cand, &mut best, &mut violation, &mut runs) {
                progress = true;
            } else {
                i += 1;
            }
        }
        // Whole-run faults, one at a time.
        for i in (0..best.crashes.len()).rev() {
            let mut cand = best.clone();
            cand.crashes.remove(i);
            progress |= try_keep(cand, &mut best, &mut violation, &mut runs);
        }
        for i in (0..best.partitions.len()).rev() {
            let mut cand = best.clone();
            cand.partitions.remove(i);
            progress |= try_keep(cand, &mut best, &mut violation, &mut runs);
        }
        // Per-request faults.
        for i in 0..best.requests.len() {
            let r = &best.requests[i];
            if !r.aborts.is_empty() || r.plan_fail.is_some() || r.false_dead.is_some() {
                let mut cand = best.clone();
                cand.requests[i].aborts.clear();
                cand.requests[i].plan_fail = None;
                cand.requests[i].false_dead = None;
                progress |= try_keep(cand, &mut best, &mut violation, &mut runs);
            }
        }
        // Network and transport faults, all at once.
        let quiet = best.net.drop_ppm == 0
            && best.net.dup_ppm == 0
            && best.net.tail_ppm == 0
            && best.transport.fail_ppm == 0
            && best.transport.hang_ppm == 0;
        if !quiet {
            let mut cand = best.clone();
            cand.net.drop_ppm = 0;
            cand.net.dup_ppm = 0;
            cand.net.tail_ppm = 0;
            cand.transport.fail_ppm = 0;
            cand.transport.hang_ppm = 0;
            progress |= try_keep(cand, &mut best, &mut violation, &mut runs);
        }
        if !progress {
            return (best, violation, runs);
        }
    }
}

/// `explain` plus the shrunk scenario: what a failing campaign prints.
pub(crate) fn report_failure(seed: u64, switches: Switches, v: &Violation) -> String {
    let mut out = explain(seed, switches, v);
    let (small, sv, runs) = shrink(&Scenario::generate(seed, switches), v.kind);
    out.push_str(&format!(
        "shrunk in {runs} runs to {} requests, {} crashes, {} partitions: {sv}\n{small:#?}\n",
        small.requests.len(),
        small.crashes.len(),
        small.partitions.len(),
    ));
    out
}

/// `name` from the environment as a number, or `default`.
pub(crate) fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v} is not a number")),
        Err(_) => default,
    }
}
