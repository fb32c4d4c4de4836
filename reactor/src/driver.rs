//! The driver: feeds the machines of one executor and keeps one timer for all
//! of them.
//!
//! [`Driver`] is the executor-agnostic core: it owns the machines, routes
//! inputs, drains actions into an [`ActionSink`], tracks deadlines and
//! produces [`Completion`]s. It never reads a clock or waits; the glommio
//! loop in `executor.rs` supplies `now`, arms the one timer at
//! [`Driver::poll_timeout`], and calls [`Driver::handle_timers`] when it fires.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvferry_machines::{AbortReason, InputError, Machine, Phase, TransferId};
use slab::Slab;

/// Executes what machines ask for. Implemented by the node: send a control
/// message, post a transfer batch, release blocks to the engine.
///
/// `execute` is called on the executor thread, inside the driver, and must
/// not block or wait. Work that takes time (a transfer, a send on a busy
/// socket) is spawned as a local task on the executor; when it finishes it
/// reports back as an event through the [`crate::EventPoster`] the sink got
/// at construction (see [`crate::ExecutorContext`]), and the driver feeds
/// that event to the machine like any other input.
pub trait ActionSink<M: Machine> {
    /// Executes (or starts) one action of the machine of `transfer_id`.
    fn execute(&mut self, transfer_id: TransferId, action: M::Action);

    /// Called with the initial phase when a machine is inserted, then after
    /// every phase change, once the actions of that input were drained;
    /// `machine` is the machine whose phase it is. The default does nothing.
    fn on_phase(&mut self, transfer_id: TransferId, machine: &M, phase: Phase, now: Instant) {
        let _ = (transfer_id, machine, phase, now);
    }

    /// Called after a terminal phase, which `on_phase` saw first, became
    /// visible to other threads (the executor's completion board): where
    /// the sink wakes whoever waits for it. The default does nothing.
    fn on_published(&mut self, transfer_id: TransferId, phase: Phase) {
        let _ = (transfer_id, phase);
    }

    /// An event for a transfer that has no machine here (it ended, or
    /// never was here), which the executor drops after this call: a peer's
    /// message in it may still deserve an answer, so that the peer does
    /// not wait out its deadline. The default does nothing.
    fn on_late_event(&mut self, transfer_id: TransferId, event: M::Event) {
        let _ = (transfer_id, event);
    }
}

/// Limits of one driver.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverConfig {
    /// Machines alive plus completions not yet taken with
    /// [`Driver::poll_completion`]. Inserting beyond it is
    /// [`DriverError::Full`].
    pub max_machines: usize,
    /// Actions drained from one machine per input before the driver moves
    /// on to other work; the rest are drained by [`Driver::drive_pending`].
    /// Keeps one chatty machine from starving the others.
    pub max_actions_per_input: usize,
}

impl Default for DriverConfig {
    fn default() -> Self {
        Self {
            max_machines: 16_384,
            max_actions_per_input: 1_024,
        }
    }
}

impl DriverConfig {
    /// A config with `max_machines` and defaults for the rest.
    pub fn with_max_machines(max_machines: usize) -> Self {
        Self {
            max_machines,
            ..Self::default()
        }
    }
}

/// Misuse of a driver. Peer misbehaviour arrives as [`DriverError::Input`].
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DriverError {
    /// The driver already holds `max` machines (alive or with an
    /// uncollected completion).
    #[error("driver full: {max} machines")]
    Full {
        /// The configured maximum.
        max: usize,
    },
    /// A machine for this transfer already exists.
    #[error("transfer {0:?} already has a machine")]
    Duplicate(TransferId),
    /// No machine for this transfer (never created, or already finished).
    #[error("no machine for transfer {0:?}")]
    Unknown(TransferId),
    /// The machine refused the event; it is unchanged.
    #[error("transfer {transfer_id:?}: {error}")]
    Input {
        /// Which machine refused.
        transfer_id: TransferId,
        /// Why.
        error: InputError,
    },
}

/// How a transfer left its driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The machine reached a terminal phase, drained its actions and has no
    /// deadline left.
    Finished {
        /// The terminal phase (`Success`, `Failed`, `Expired`).
        phase: Phase,
        /// The `now` of the input that made it terminal.
        terminal_at: Instant,
    },
    /// The executor refused to create the machine.
    Rejected(RejectReason),
    /// Shutdown's grace period ran out before the machine finished; it was
    /// dropped in `last_phase`.
    Dropped {
        /// Phase when it was dropped.
        last_phase: Phase,
    },
}

/// Why an executor refused a `Create` it had accepted into its mailbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// The executor was shutting down when it read the command.
    ShuttingDown,
    /// The driver was full or already had the transfer (only possible when
    /// the driver is used without the board's admission control).
    Refused,
}

/// Record of one transfer leaving a driver, for `get_finished`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The transfer.
    pub transfer_id: TransferId,
    /// Index of the executor that held it.
    pub executor: usize,
    /// How it ended.
    pub outcome: Outcome,
}

#[derive(Debug)]
struct Slot<M> {
    transfer_id: TransferId,
    machine: M,
    span: tracing::Span,
    /// Last phase reported to the sink.
    phase: Phase,
    /// When the machine first reported a terminal phase.
    terminal_at: Option<Instant>,
    /// The deadline currently in the heap for this slot, with its sequence
    /// number; heap entries that do not match are stale.
    armed: Option<(Instant, u64)>,
    /// True while the machine has actions left over from a capped drain.
    pending: bool,
}

/// One deadline in the heap: (when, unique sequence, slab key). The sequence
/// makes entries of a reused slab key distinguishable and orders equal
/// deadlines by arming order.
type DeadlineEntry = Reverse<(Instant, u64, usize)>;

/// Owns the machines of one executor and drives them.
///
/// Deadlines live in one min-heap with lazy invalidation: when a machine's
/// `poll_timeout` changes, the new deadline is pushed and the old entry is
/// left behind; an entry is honoured only if its sequence number is still
/// the one recorded in the machine's slot. Stale entries are skipped when
/// they reach the top and the heap is compacted when they outnumber the
/// live machines, so it stays bounded by a small multiple of the number of
/// machines.
#[derive(Debug)]
pub struct Driver<M: Machine> {
    executor: usize,
    config: DriverConfig,
    slots: Slab<Slot<M>>,
    index: HashMap<TransferId, usize>,
    deadlines: BinaryHeap<DeadlineEntry>,
    next_seq: u64,
    /// Keys whose action drain stopped at `max_actions_per_input`.
    pending: VecDeque<usize>,
    completions: VecDeque<Completion>,
    /// Scratch space for `handle_timers`, kept to avoid reallocating.
    due: Vec<(usize, u64)>,
}

impl<M: Machine> Driver<M> {
    /// An empty driver for executor `executor`.
    pub fn new(executor: usize, config: DriverConfig) -> Self {
        let initial = config.max_machines.min(1024);
        Self {
            executor,
            config,
            slots: Slab::with_capacity(initial),
            index: HashMap::with_capacity(initial),
            deadlines: BinaryHeap::with_capacity(initial),
            next_seq: 0,
            pending: VecDeque::new(),
            completions: VecDeque::new(),
            due: Vec::new(),
        }
    }

    /// Machines alive.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when `transfer_id` has a machine here.
    pub fn contains(&self, transfer_id: TransferId) -> bool {
        self.index.contains_key(&transfer_id)
    }

    /// True when no machine is alive.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Entries in the deadline heap, stale ones included (bounded by about
    /// twice the number of machines).
    pub fn deadline_entries(&self) -> usize {
        self.deadlines.len()
    }

    /// Phase of a live machine.
    pub fn phase(&self, transfer_id: TransferId) -> Option<Phase> {
        let key = *self.index.get(&transfer_id)?;
        Some(self.slots[key].machine.phase())
    }

    /// Adds a machine and drains whatever it wants to do right away.
    pub fn insert<S: ActionSink<M>>(
        &mut self,
        now: Instant,
        transfer_id: TransferId,
        machine: M,
        sink: &mut S,
    ) -> Result<(), DriverError> {
        if self.index.contains_key(&transfer_id) {
            return Err(DriverError::Duplicate(transfer_id));
        }
        // Uncollected completions count against the limit so that a caller
        // who never collects them cannot grow the completion queue forever.
        if self.slots.len() + self.completions.len() >= self.config.max_machines {
            return Err(DriverError::Full {
                max: self.config.max_machines,
            });
        }
        let span = tracing::debug_span!(
            "transfer",
            transfer_id = transfer_id.0,
            executor = self.executor
        );
        let phase = machine.phase();
        span.in_scope(|| tracing::debug!(?phase, "created"));
        let key = self.slots.insert(Slot {
            transfer_id,
            machine,
            span,
            phase,
            terminal_at: phase.is_terminal().then_some(now),
            armed: None,
            pending: false,
        });
        self.index.insert(transfer_id, key);
        // Report the initial phase too, so observers (the completion board)
        // start from the machine's own phase rather than a guess.
        sink.on_phase(transfer_id, &self.slots[key].machine, phase, now);
        self.after_input(key, now, sink);
        Ok(())
    }

    /// Feeds one event to the machine of `transfer_id`.
    pub fn handle_event<S: ActionSink<M>>(
        &mut self,
        now: Instant,
        transfer_id: TransferId,
        event: M::Event,
        sink: &mut S,
    ) -> Result<(), DriverError> {
        let key = *self
            .index
            .get(&transfer_id)
            .ok_or(DriverError::Unknown(transfer_id))?;
        let slot = &mut self.slots[key];
        let result = slot.span.in_scope(|| slot.machine.handle_event(now, event));
        if let Err(error) = result {
            slot.span
                .in_scope(|| tracing::debug!(%error, "event refused"));
            // The machine is unchanged after a refused input, so there is
            // nothing to drain.
            return Err(DriverError::Input { transfer_id, error });
        }
        self.after_input(key, now, sink);
        Ok(())
    }

    /// Aborts the machine of `transfer_id`.
    pub fn abort<S: ActionSink<M>>(
        &mut self,
        now: Instant,
        transfer_id: TransferId,
        reason: AbortReason,
        sink: &mut S,
    ) -> Result<(), DriverError> {
        let key = *self
            .index
            .get(&transfer_id)
            .ok_or(DriverError::Unknown(transfer_id))?;
        self.abort_key(key, now, reason, sink);
        Ok(())
    }

    /// Aborts every live machine (shutdown). Returns how many there were.
    pub fn abort_all<S: ActionSink<M>>(
        &mut self,
        now: Instant,
        reason: AbortReason,
        sink: &mut S,
    ) -> usize {
        let keys: Vec<usize> = self.slots.iter().map(|(key, _)| key).collect();
        for &key in &keys {
            // A machine aborted earlier in this loop may already be gone
            // only if it is this one; keys are unique, so each is live here.
            if self.slots.contains(key) {
                self.abort_key(key, now, reason, sink);
            }
        }
        keys.len()
    }

    fn abort_key<S: ActionSink<M>>(
        &mut self,
        key: usize,
        now: Instant,
        reason: AbortReason,
        sink: &mut S,
    ) {
        let slot = &mut self.slots[key];
        slot.span.in_scope(|| {
            tracing::debug!(?reason, "abort");
            slot.machine.abort(now, reason);
        });
        self.after_input(key, now, sink);
    }

    /// Earliest live deadline, if any. Arm the executor's one timer here.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        // Bounded by the heap's length: each iteration pops one stale entry.
        while let Some(&Reverse((when, seq, key))) = self.deadlines.peek() {
            if self.is_live_entry(key, seq) {
                return Some(when);
            }
            self.deadlines.pop();
        }
        None
    }

    /// Calls `handle_timeout(now)` on every machine whose deadline is at or
    /// before `now`, in deadline order. Returns how many machines it woke.
    ///
    /// Deadlines a machine sets at or before `now` while being woken are not
    /// handled in this call (that could loop forever on a machine that keeps
    /// asking for the past); they are due at the next call, which the
    /// caller makes at once because [`Driver::poll_timeout`] is in the past.
    pub fn handle_timers<S: ActionSink<M>>(&mut self, now: Instant, sink: &mut S) -> usize {
        let mut due = std::mem::take(&mut self.due);
        due.clear();
        // Bounded by the heap's length at entry: nothing is pushed while
        // collecting.
        while let Some(&Reverse((when, seq, key))) = self.deadlines.peek() {
            if when > now {
                break;
            }
            self.deadlines.pop();
            if self.is_live_entry(key, seq) {
                due.push((key, seq));
            }
        }
        let mut woken = 0;
        for &(key, seq) in &due {
            // An earlier machine's actions cannot touch this slot (sinks have
            // no access to the driver), but re-check to stay correct if that
            // ever changes.
            if !self.is_live_entry(key, seq) {
                continue;
            }
            let slot = &mut self.slots[key];
            slot.armed = None;
            slot.span.in_scope(|| slot.machine.handle_timeout(now));
            self.after_input(key, now, sink);
            woken += 1;
        }
        self.due = due;
        woken
    }

    /// True while some machine has actions left from a capped drain; call
    /// [`Driver::drive_pending`] on the next turn.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Continues draining machines whose drain was capped. Each gets one
    /// more capped drain, in the order they were capped.
    pub fn drive_pending<S: ActionSink<M>>(&mut self, now: Instant, sink: &mut S) {
        // Bounded: at most the number of keys queued at entry; keys capped
        // again are queued behind and wait for the next call.
        let rounds = self.pending.len();
        for _ in 0..rounds {
            let Some(key) = self.pending.pop_front() else {
                break;
            };
            if let Some(slot) = self.slots.get_mut(key) {
                slot.pending = false;
                self.after_input(key, now, sink);
            }
        }
    }

    /// Records a creation the executor refused as a completion, so the
    /// caller that was told "accepted" still hears exactly once about it.
    /// Not counted against `max_machines`: the caller's admission control
    /// (the completion board) already counted the transfer.
    pub fn push_rejection(&mut self, transfer_id: TransferId, reason: RejectReason) {
        self.completions.push_back(Completion {
            transfer_id,
            executor: self.executor,
            outcome: Outcome::Rejected(reason),
        });
    }

    /// Next completion, if any.
    pub fn poll_completion(&mut self) -> Option<Completion> {
        self.completions.pop_front()
    }

    /// Drops every live machine without further input (end of shutdown
    /// grace). Each becomes an [`Outcome::Dropped`] completion.
    pub fn drop_all(&mut self) -> usize {
        let dropped = self.slots.len();
        for slot in self.slots.drain() {
            slot.span
                .in_scope(|| tracing::debug!(phase = ?slot.phase, "dropped at shutdown"));
            self.completions.push_back(Completion {
                transfer_id: slot.transfer_id,
                executor: self.executor,
                outcome: Outcome::Dropped {
                    last_phase: slot.machine.phase(),
                },
            });
        }
        self.index.clear();
        self.deadlines.clear();
        self.pending.clear();
        dropped
    }

    fn is_live_entry(&self, key: usize, seq: u64) -> bool {
        self.slots
            .get(key)
            .is_some_and(|slot| slot.armed.is_some_and(|(_, armed_seq)| armed_seq == seq))
    }

    /// Everything that follows an input: drain actions (capped), report a
    /// phase change, re-arm the deadline, remove the machine when done.
    fn after_input<S: ActionSink<M>>(&mut self, key: usize, now: Instant, sink: &mut S) {
        // Split the borrows: the slot stays borrowed while the heap and the
        // queues are updated.
        let Self {
            executor,
            config,
            slots,
            index,
            deadlines,
            next_seq,
            pending,
            completions,
            ..
        } = self;
        let slot = &mut slots[key];
        let transfer_id = slot.transfer_id;
        let _entered = slot.span.clone().entered();

        let mut drained = 0;
        while drained < config.max_actions_per_input {
            match slot.machine.poll_action() {
                Some(action) => {
                    sink.execute(transfer_id, action);
                    drained += 1;
                }
                None => break,
            }
        }
        if drained == config.max_actions_per_input && !slot.pending {
            // We stopped at the cap, maybe with actions left: come back on
            // the next turn rather than starve the other machines.
            slot.pending = true;
            pending.push_back(key);
        }

        let phase = slot.machine.phase();
        if phase != slot.phase {
            tracing::debug!(from = ?slot.phase, to = ?phase, "phase");
            slot.phase = phase;
            if phase.is_terminal() && slot.terminal_at.is_none() {
                slot.terminal_at = Some(now);
            }
            sink.on_phase(transfer_id, &slot.machine, phase, now);
        }

        let deadline = slot.machine.poll_timeout();
        if deadline != slot.armed.map(|(when, _)| when) {
            slot.armed = deadline.map(|when| {
                let seq = *next_seq;
                *next_seq += 1;
                deadlines.push(Reverse((when, seq, key)));
                (when, seq)
            });
        }

        if let (Some(terminal_at), false, None) = (slot.terminal_at, slot.pending, slot.armed) {
            tracing::debug!(?phase, "finished");
            slots.remove(key);
            index.remove(&transfer_id);
            completions.push_back(Completion {
                transfer_id,
                executor: *executor,
                outcome: Outcome::Finished { phase, terminal_at },
            });
        }
        drop(_entered);
        self.compact_deadlines();
    }

    /// Drops stale heap entries once they outnumber live machines, keeping
    /// the heap within about twice the number of machines.
    fn compact_deadlines(&mut self) {
        if self.deadlines.len() > 2 * self.slots.len() + 64 {
            let slots = &self.slots;
            self.deadlines.retain(|&Reverse((_, seq, key))| {
                slots
                    .get(key)
                    .is_some_and(|slot| slot.armed.is_some_and(|(_, armed_seq)| armed_seq == seq))
            });
        }
    }
}

/// Rounds `deadline` up to the next multiple of `tick` counted from `epoch`,
/// so that deadlines falling in the same tick share one timer wake-up.
/// A zero `tick` returns `deadline` unchanged.
pub fn round_up_to_tick(deadline: Instant, epoch: Instant, tick: Duration) -> Instant {
    let tick_ns = tick.as_nanos();
    if tick_ns == 0 || deadline <= epoch {
        return deadline;
    }
    let since_ns = (deadline - epoch).as_nanos();
    let ticks = since_ns.div_ceil(tick_ns);
    // Saturate instead of overflowing for absurd deadlines (years away).
    let rounded_ns = u64::try_from(ticks.saturating_mul(tick_ns)).unwrap_or(u64::MAX);
    epoch
        .checked_add(Duration::from_nanos(rounded_ns))
        .unwrap_or(deadline)
}
