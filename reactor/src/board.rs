//! The completion board: where engine threads read the phase of their
//! transfers without a round trip to the executor.

use std::collections::HashMap;

use kvferry_machines::{Phase, TransferId};

use crate::sync::{lock, Mutex};

/// Why the board refused a reservation.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BoardError {
    /// The transfer is already on the board (live, or finished and not yet
    /// collected by `get_finished`).
    #[error("transfer {0:?} is already known")]
    Duplicate(TransferId),
    /// The executor already holds its maximum number of transfers.
    #[error("executor {executor} already holds its maximum of {max} transfers")]
    Full {
        /// Executor index.
        executor: usize,
        /// Its configured maximum.
        max: usize,
    },
    /// No executor with that index.
    #[error("no executor {executor} (there are {executors})")]
    NoSuchExecutor {
        /// Requested index.
        executor: usize,
        /// Number of executors.
        executors: usize,
    },
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    executor: usize,
    phase: Phase,
}

#[derive(Debug)]
struct Inner {
    entries: HashMap<TransferId, Entry>,
    /// Entries per executor; never above `max_per_executor`.
    per_executor: Vec<usize>,
}

/// Latest phase of every transfer a reactor holds, shared between the
/// executors (writers) and engine threads (readers).
///
/// A transfer is on the board from the moment its creation is accepted
/// ([`CompletionBoard::reserve`], on the engine thread) until its completion
/// is collected with `get_finished` ([`CompletionBoard::remove`]). That span
/// covers the machine's life in its driver plus the time its completion
/// waits in the completion channel, so counting entries per executor bounds
/// the driver's slab *and* the completion channel: a caller that stops
/// draining completions gets [`BoardError::Full`], not unbounded memory.
///
/// One mutex guards the map: every operation is a hash lookup, and engine
/// threads poll at most once per scheduler step, so contention is low and a
/// lock keeps the reasoning (and the loom model) simple.
#[derive(Debug)]
pub struct CompletionBoard {
    inner: Mutex<Inner>,
    max_per_executor: usize,
}

impl CompletionBoard {
    /// An empty board for `executors` executors holding at most
    /// `max_per_executor` transfers each.
    pub fn new(executors: usize, max_per_executor: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                entries: HashMap::with_capacity(
                    executors.saturating_mul(max_per_executor).min(1 << 16),
                ),
                per_executor: vec![0; executors],
            }),
            max_per_executor,
        }
    }

    /// Puts a new transfer on the board for `executor`, in `Bootstrapping`.
    pub fn reserve(&self, transfer_id: TransferId, executor: usize) -> Result<(), BoardError> {
        let mut inner = lock(&self.inner);
        let executors = inner.per_executor.len();
        let Some(count) = inner.per_executor.get(executor).copied() else {
            return Err(BoardError::NoSuchExecutor {
                executor,
                executors,
            });
        };
        if inner.entries.contains_key(&transfer_id) {
            return Err(BoardError::Duplicate(transfer_id));
        }
        if count >= self.max_per_executor {
            return Err(BoardError::Full {
                executor,
                max: self.max_per_executor,
            });
        }
        inner.entries.insert(
            transfer_id,
            Entry {
                executor,
                phase: Phase::Bootstrapping,
            },
        );
        inner.per_executor[executor] = count + 1;
        Ok(())
    }

    /// Records the latest phase of a transfer. Returns false (and changes
    /// nothing) when the transfer is not on the board.
    pub fn publish(&self, transfer_id: TransferId, phase: Phase) -> bool {
        let mut inner = lock(&self.inner);
        match inner.entries.get_mut(&transfer_id) {
            Some(entry) => {
                entry.phase = phase;
                true
            }
            None => false,
        }
    }

    /// Latest phase of a transfer, or `None` when it is not on the board.
    pub fn phase(&self, transfer_id: TransferId) -> Option<Phase> {
        lock(&self.inner).entries.get(&transfer_id).map(|e| e.phase)
    }

    /// Executor that holds a transfer.
    pub fn executor_of(&self, transfer_id: TransferId) -> Option<usize> {
        lock(&self.inner)
            .entries
            .get(&transfer_id)
            .map(|e| e.executor)
    }

    /// True when `transfer_id` is on the board for `executor` and has not
    /// ended (one look, under one lock).
    pub fn is_live_on(&self, transfer_id: TransferId, executor: usize) -> bool {
        lock(&self.inner)
            .entries
            .get(&transfer_id)
            .is_some_and(|e| e.executor == executor && !e.phase.is_terminal())
    }

    /// Takes a transfer off the board (its completion was collected, or its
    /// creation was never delivered). Returns its last phase.
    pub fn remove(&self, transfer_id: TransferId) -> Option<Phase> {
        let mut inner = lock(&self.inner);
        let entry = inner.entries.remove(&transfer_id)?;
        // The count was incremented when the entry was inserted, so it is at
        // least one here.
        inner.per_executor[entry.executor] -= 1;
        Some(entry.phase)
    }

    /// Transfers on the board for `executor`.
    pub fn len_for(&self, executor: usize) -> usize {
        lock(&self.inner)
            .per_executor
            .get(executor)
            .copied()
            .unwrap_or(0)
    }

    /// Transfers on the board in total.
    pub fn len(&self) -> usize {
        lock(&self.inner).entries.len()
    }

    /// True when no transfer is on the board.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The per-executor limit.
    pub fn max_per_executor(&self) -> usize {
        self.max_per_executor
    }
}
