//! A seeded deterministic simulator of kvferry's transfer protocol, in the
//! spirit of TigerBeetle's VOPR: the real `SendMachine`/`RecvMachine` on
//! many simulated P and D ranks, a lossy control network that carries the
//! real message encoding, a data plane whose writes and reads land in
//! simulated memory, crashes, partitions, aborts, and a checker that holds
//! the invariants of DESIGN.md §2 after every step.
//!
//! * `scenario` draws everything a seed simulates;
//! * `world` runs it on one event queue and a simulated clock;
//! * `network` and `memory` are the simulated wire and KV blocks;
//! * `checker` names the invariants and keeps the counters.

pub mod checker;
pub mod memory;
pub mod network;
pub mod rng;
pub mod scenario;
pub mod world;

use checker::Violation;
use scenario::{Scenario, Switches};
use world::RunResult;

/// Runs one seed.
pub fn run_seed(seed: u64, switches: Switches, trace: bool) -> (Scenario, RunResult) {
    let sc = Scenario::generate(seed, switches);
    let r = world::run(&sc, trace);
    (sc, r)
}

/// The command that replays `seed` with the event trace printed.
pub fn replay_command(seed: u64) -> String {
    format!("KVFERRY_SIM_SEED={seed} cargo test -p kvferry-machines --test sim sim_replay -- --nocapture")
}

/// A report for a failing seed: the violation, how to replay it, the
/// scenario and the end of the event trace (the run is replayed with tracing on).
pub fn explain(seed: u64, switches: Switches, v: &Violation) -> String {
    let (sc, traced) = run_seed(seed, switches, true);
    let tail: Vec<&String> = traced
        .trace
        .iter()
        .rev()
        .take(80)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let mut out = format!(
        "simulator seed {seed} violates an invariant:\n  {v}\nreplay: {}\nscenario: {} P nodes, {} D nodes, {} requests, calm {}, detector {}, crashes {:?}, partitions {:?}\nconfig: {:?}\nlast events:\n",
        replay_command(seed),
        sc.n_p,
        sc.n_d,
        sc.requests.len(),
        sc.calm,
        sc.detector,
        sc.crashes,
        sc.partitions,
        sc.cfg,
    );
    for line in tail {
        out.push_str("  ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// `name` from the environment as a number, or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v} is not a number")),
        Err(_) => default,
    }
}
