//! Counters the executors bump and any thread may read.

use crate::sync::{AtomicU64, Ordering};

/// Reactor-wide counters, shared by every executor and read by engine threads.
///
/// Each counter is monotonic. The one cross-counter guarantee readers get is
/// the one `kvferry stats` relies on: a snapshot never shows more
/// `finished` transfers than `created` ones. Writers bump `created` before
/// the transfer can possibly finish, and publish `finished` with `Release`;
/// [`Stats::snapshot`] reads `finished` first with `Acquire`, so every
/// creation that happened before those finishes is visible when `created`
/// is read afterwards. The loom model `stats_snapshot_never_shows_more_finished_than_created`
/// checks exactly this.
#[derive(Debug, Default)]
pub struct Stats {
    created: AtomicU64,
    finished: AtomicU64,
    rejected: AtomicU64,
    dropped: AtomicU64,
    mailbox_full: AtomicU64,
    late_events: AtomicU64,
    input_errors: AtomicU64,
    timer_wakes: AtomicU64,
    max_timer_lag_ns: AtomicU64,
    yields_after_ends: AtomicU64,
}

/// A point-in-time copy of [`Stats`].
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Machines inserted into a driver.
    pub created: u64,
    /// Machines removed after reaching a terminal phase (includes aborts at
    /// shutdown that finished within the grace period).
    pub finished: u64,
    /// `Create` commands an executor refused (shutting down, capacity).
    pub rejected: u64,
    /// Machines dropped without reaching a terminal phase because the
    /// shutdown grace period ran out.
    pub dropped: u64,
    /// Submissions refused because an executor's mailbox was full.
    pub mailbox_full: u64,
    /// Events that arrived for a transfer its driver no longer holds.
    pub late_events: u64,
    /// Events a machine refused with an `InputError` (peer or misuse).
    pub input_errors: u64,
    /// Times an executor woke up because its deadline timer fired.
    pub timer_wakes: u64,
    /// Worst observed delay between the instant a deadline timer was armed
    /// for and the instant the executor actually ran it, in nanoseconds.
    pub max_timer_lag_ns: u64,
    /// Times an executor gave its core away after requests ended (see
    /// `ReactorConfig::yield_after_ends_below`).
    pub yields_after_ends: u64,
}

impl Stats {
    /// All counters at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts a machine inserted into a driver. Must happen before the same
    /// machine's [`Stats::add_finished`] (see the type docs for why).
    pub fn add_created(&self) {
        self.created.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a machine removed after reaching a terminal phase.
    pub fn add_finished(&self) {
        // Release pairs with the Acquire in `snapshot`: whoever sees this
        // increment also sees the `add_created` that preceded it.
        self.finished.fetch_add(1, Ordering::Release);
    }

    /// Counts a refused `Create`.
    pub fn add_rejected(&self) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a machine dropped at the end of the shutdown grace period.
    pub fn add_dropped(&self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a submission refused for back-pressure.
    pub fn add_mailbox_full(&self) {
        self.mailbox_full.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an event for a transfer the driver no longer holds.
    pub fn add_late_event(&self) {
        self.late_events.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an event a machine refused.
    pub fn add_input_error(&self) {
        self.input_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one deadline-timer wake-up and how late it ran.
    pub fn add_timer_wake(&self, lag_ns: u64) {
        self.timer_wakes.fetch_add(1, Ordering::Relaxed);
        self.max_timer_lag_ns.fetch_max(lag_ns, Ordering::Relaxed);
    }

    /// Counts one yield of the core after requests ended.
    pub fn add_yield_after_ends(&self) {
        self.yields_after_ends.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        // `finished` first, with Acquire: see the type docs.
        let finished = self.finished.load(Ordering::Acquire);
        StatsSnapshot {
            created: self.created.load(Ordering::Relaxed),
            finished,
            rejected: self.rejected.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            mailbox_full: self.mailbox_full.load(Ordering::Relaxed),
            late_events: self.late_events.load(Ordering::Relaxed),
            input_errors: self.input_errors.load(Ordering::Relaxed),
            timer_wakes: self.timer_wakes.load(Ordering::Relaxed),
            max_timer_lag_ns: self.max_timer_lag_ns.load(Ordering::Relaxed),
            yields_after_ends: self.yields_after_ends.load(Ordering::Relaxed),
        }
    }
}
