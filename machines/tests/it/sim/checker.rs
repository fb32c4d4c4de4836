//! The invariants (docs/design.md §2) as the simulator checks them, the first
//! violation of a run, and the counters a campaign reports.
//!
//! The world keeps ground truth the machines cannot see (block owners,
//! transfer spans, grants as the granter made them) and calls these checks
//! after every step; the liveness bounds are derived from the documented
//! timers, not from the machines' own deadlines.

use std::collections::BTreeMap;
use std::fmt;

use kvferry_machines::internal::common::Config;
use kvferry_machines::Phase;

use super::scenario::T;

/// Which invariant broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    /// A machine released or reported twice.
    ExactlyOnce,
    /// Phase and release disagree (terminal without release, or the reverse,
    /// or the phase changed after it was terminal).
    PhaseMismatch,
    /// A machine emitted an action after its release or report.
    ActionAfterRelease,
    /// P's block was read (by P's write or D's read) after P released it.
    ReadAfterRelease,
    /// D's block was written (by P's write or D's read) after D released it.
    WriteAfterRelease,
    /// A side released blocks while a transfer touching them was still in flight.
    ReleasedInFlight,
    /// A write or read started without a live lease from the granter.
    NoLease,
    /// `Received` (or P's success) without every block delivered, or a
    /// block mapped to the wrong place.
    DataLoss,
    /// More writes or reads in flight than `max_in_flight`.
    Unbounded,
    /// A machine was not terminal by its deadline plus the fence, or never.
    Liveness,
    /// Every block must end back in its pool, released exactly once.
    Leak,
    /// A machine refused input from an honest peer or driver.
    Refused,
    /// After `handle_timeout`, the next deadline did not lie in the future.
    TimerStuck,
    /// A message did not survive the wire encoding, or went somewhere odd.
    Protocol,
    /// No fault at all, yet a request did not succeed.
    SpuriousFailure,
}

#[derive(Clone, Debug)]
pub(crate) struct Violation {
    pub at: T,
    pub kind: Kind,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} at t={}.{:03} ms: {}",
            self.kind,
            self.at / 1000,
            self.at % 1000,
            self.detail
        )
    }
}

/// Counters of one run, summed over a campaign.
#[derive(Clone, Debug)]
pub(crate) struct Stats {
    pub runs: u64,
    pub calm_runs: u64,
    pub jittery_runs: u64,
    pub steps: u64,
    pub requests: u64,
    pub push: u64,
    pub pull: u64,
    pub machines: u64,
    pub rejected_ranks: u64,
    pub p_success: u64,
    pub p_failed: u64,
    pub d_received: u64,
    pub d_failed: u64,
    pub expired: u64,
    pub messages: u64,
    pub dropped: u64,
    pub duplicated: u64,
    pub cut: u64,
    pub ops: u64,
    pub ops_failed: u64,
    pub ops_hung: u64,
    pub touches: u64,
    pub late_drops: u64,
    pub crashes: u64,
    pub partitions: u64,
    pub peer_dead: u64,
    pub aborts: u64,
    pub plan_failures: u64,
    pub created_on_pull: u64,
    /// `Unneeded` messages delivered to unpaired P ranks.
    pub unneeded: u64,
    pub engine_late: u64,
    pub late_pull_aborts: u64,
    /// Messages the machines sent again (`Action::Resend`).
    pub resent: u64,
    /// Requests all of whose ranks were created, and of those the ones
    /// every rank of which succeeded (goodput).
    pub requests_judged: u64,
    pub requests_ok: u64,
    /// Push-mode leases granted on a ticket with the `Pull` (no round trip).
    pub ticket_grants: u64,
    /// Push-mode `Status` delivered behind its write, before the write's
    /// acknowledgement.
    pub status_riding: u64,
    /// ... of which the acknowledgement was lost (P hears a failure).
    pub acks_lost: u64,
    pub spurious_aborts: u64,
    pub stale_aborts: u64,
    pub false_dead: u64,
    /// Heartbeat ticks of the nodes' liveness tables.
    pub beats: u64,
    /// Deaths the tables reported: peers silent too long, dropped connections.
    pub silent_deaths: u64,
    pub dropped_deaths: u64,
    /// Peers a table had marked dead and heard from again.
    pub revivals: u64,
    pub buffered: u64,
    pub sim_us: u64,
    /// Failed granters that released only after a lease ran out (the fence path).
    pub fenced: u64,
    /// Closest a release came to its liveness bound, in µs.
    pub min_slack_us: u64,
    /// Terminal phases reached, per side (`"P Failed(Transport)"`, ...).
    pub outcomes: BTreeMap<String, u64>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            runs: 0,
            calm_runs: 0,
            jittery_runs: 0,
            steps: 0,
            requests: 0,
            push: 0,
            pull: 0,
            machines: 0,
            rejected_ranks: 0,
            p_success: 0,
            p_failed: 0,
            d_received: 0,
            d_failed: 0,
            expired: 0,
            messages: 0,
            dropped: 0,
            duplicated: 0,
            cut: 0,
            ops: 0,
            ops_failed: 0,
            ops_hung: 0,
            touches: 0,
            late_drops: 0,
            crashes: 0,
            partitions: 0,
            peer_dead: 0,
            aborts: 0,
            plan_failures: 0,
            created_on_pull: 0,
            unneeded: 0,
            engine_late: 0,
            late_pull_aborts: 0,
            resent: 0,
            requests_judged: 0,
            requests_ok: 0,
            ticket_grants: 0,
            status_riding: 0,
            acks_lost: 0,
            spurious_aborts: 0,
            stale_aborts: 0,
            false_dead: 0,
            beats: 0,
            silent_deaths: 0,
            dropped_deaths: 0,
            revivals: 0,
            buffered: 0,
            sim_us: 0,
            fenced: 0,
            min_slack_us: u64::MAX,
            outcomes: BTreeMap::new(),
        }
    }
}

impl Stats {
    /// Share of the judged requests that succeeded on every rank.
    pub(crate) fn goodput(&self) -> f64 {
        self.requests_ok as f64 / self.requests_judged.max(1) as f64
    }

    pub(crate) fn add(&mut self, o: &Stats) {
        self.runs += o.runs;
        self.calm_runs += o.calm_runs;
        self.jittery_runs += o.jittery_runs;
        self.steps += o.steps;
        self.requests += o.requests;
        self.push += o.push;
        self.pull += o.pull;
        self.machines += o.machines;
        self.rejected_ranks += o.rejected_ranks;
        self.p_success += o.p_success;
        self.p_failed += o.p_failed;
        self.d_received += o.d_received;
        self.d_failed += o.d_failed;
        self.expired += o.expired;
        self.messages += o.messages;
        self.dropped += o.dropped;
        self.duplicated += o.duplicated;
        self.cut += o.cut;
        self.ops += o.ops;
        self.ops_failed += o.ops_failed;
        self.ops_hung += o.ops_hung;
        self.touches += o.touches;
        self.late_drops += o.late_drops;
        self.crashes += o.crashes;
        self.partitions += o.partitions;
        self.peer_dead += o.peer_dead;
        self.aborts += o.aborts;
        self.plan_failures += o.plan_failures;
        self.created_on_pull += o.created_on_pull;
        self.unneeded += o.unneeded;
        self.engine_late += o.engine_late;
        self.late_pull_aborts += o.late_pull_aborts;
        self.resent += o.resent;
        self.requests_judged += o.requests_judged;
        self.requests_ok += o.requests_ok;
        self.ticket_grants += o.ticket_grants;
        self.status_riding += o.status_riding;
        self.acks_lost += o.acks_lost;
        self.spurious_aborts += o.spurious_aborts;
        self.stale_aborts += o.stale_aborts;
        self.false_dead += o.false_dead;
        self.beats += o.beats;
        self.silent_deaths += o.silent_deaths;
        self.dropped_deaths += o.dropped_deaths;
        self.revivals += o.revivals;
        self.buffered += o.buffered;
        self.sim_us += o.sim_us;
        self.fenced += o.fenced;
        self.min_slack_us = self.min_slack_us.min(o.min_slack_us);
        for (k, n) in &o.outcomes {
            *self.outcomes.entry(k.clone()).or_insert(0) += n;
        }
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "runs {} ({} where every request must succeed, {} of them with duplicates, reordering and drift), steps {}, simulated {:.1} s",
            self.runs,
            self.calm_runs,
            self.jittery_runs,
            self.steps,
            self.sim_us as f64 / 1e6
        )?;
        writeln!(
            f,
            "requests {} (push {}, pull {}), machines {}, ranks not created (node down or pool empty) {}",
            self.requests, self.push, self.pull, self.machines, self.rejected_ranks
        )?;
        writeln!(
            f,
            "P released: {} success, {} failed/expired; D reported: {} received, {} load-failed; expired {}",
            self.p_success, self.p_failed, self.d_received, self.d_failed, self.expired
        )?;
        writeln!(
            f,
            "granters that waited out a lease (fence) {}, closest release to its liveness bound {} µs",
            self.fenced, self.min_slack_us
        )?;
        writeln!(
            f,
            "goodput: {} of {} requests succeeded on every rank ({:.3} %), messages resent {}",
            self.requests_ok,
            self.requests_judged,
            self.goodput() * 100.0,
            self.resent
        )?;
        writeln!(f, "outcomes: {:?}", self.outcomes)?;
        writeln!(
            f,
            "P machines created on a Pull {}, Unneeded delivered {}, engine after the transfer gave up {}, late messages answered {}, D PeerAborted although every P succeeded {}, failed on an Abort from a peer that had reported success {}",
            self.created_on_pull, self.unneeded, self.engine_late, self.late_pull_aborts, self.spurious_aborts, self.stale_aborts
        )?;
        writeln!(
            f,
            "messages {} (dropped {}, duplicated {}, cut by partitions {}, buffered before creation {}), lease ticket grants {}, Status riding its write {} (acknowledgement lost {})",
            self.messages, self.dropped, self.duplicated, self.cut, self.buffered, self.ticket_grants, self.status_riding, self.acks_lost
        )?;
        writeln!(
            f,
            "writes/reads {} (failed {}, never completed {}), block touches {} (on dead memory {})",
            self.ops, self.ops_failed, self.ops_hung, self.touches, self.late_drops
        )?;
        writeln!(
            f,
            "faults: crashes {}, partitions {}, PeerDead delivered {} (false positives {}), aborts {}, plan failures {}",
            self.crashes, self.partitions, self.peer_dead, self.false_dead, self.aborts, self.plan_failures
        )?;
        write!(
            f,
            "liveness tables: beats {}, deaths reported {} silent + {} dropped, peers heard again {}",
            self.beats, self.silent_deaths, self.dropped_deaths, self.revivals
        )
    }
}

/// P must be released by its creation plus the hold limit plus the fence:
/// the hold counts from creation, every grant is capped by it, and every
/// write it posted ends within the transfer bound (part of the fence).
pub(crate) fn p_bound(cfg: &Config, created: T) -> T {
    created + us(cfg.hold_limit) + us(cfg.fence())
}

/// D must report by the end of its waiting (renewed by each progress) plus
/// one lease plus the fence; before the P ranks are resolved, by the end of
/// the bootstrap timeout.
pub(crate) fn d_bound(cfg: &Config, created: T, resolved: Option<T>, last_progress: T) -> T {
    match resolved {
        None => created + us(cfg.bootstrap_timeout),
        Some(r) => r.max(last_progress) + us(cfg.waiting_timeout) + us(cfg.lease) + us(cfg.fence()),
    }
}

pub(crate) fn us(d: std::time::Duration) -> T {
    d.as_micros() as T
}

/// The phase must be terminal exactly when the machine released, and equal
/// to the outcome it released with.
pub(crate) fn phase_consistent(phase: Phase, released: Option<Phase>) -> Result<(), String> {
    match released {
        Some(outcome) if phase == outcome => Ok(()),
        Some(outcome) => Err(format!(
            "released with {outcome:?} but the phase is {phase:?}"
        )),
        None if phase.is_terminal() => Err(format!(
            "phase {phase:?} is terminal but nothing was released"
        )),
        None => Ok(()),
    }
}
