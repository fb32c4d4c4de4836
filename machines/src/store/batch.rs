//! The bounded batches of a save or load: planned up front, posted while
//! the bounds allow, tracked until answered or past their bound.

use std::collections::VecDeque;
use std::time::Instant;

use crate::common::{after, InputError};

use super::{StoreConfig, StoreItem};

/// A posted call: which items it moves and until when it may touch memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Flight {
    pub(crate) id: u32,
    /// Indices into the machine's items.
    pub(crate) items: Vec<usize>,
    pub(crate) bytes: u64,
    /// Posted time plus `op_bound`: after this the call touches nothing.
    pub(crate) deadline: Instant,
}

impl Flight {
    /// Gives every item of this flight `result` (a call that failed as a
    /// whole: its fault, or past its bound).
    pub(crate) fn fail<R: Copy>(&self, results: &mut [R], result: R) {
        for &i in &self.items {
            results[i] = result;
        }
    }
}

/// What became of an answer's batch id.
pub(crate) enum Answer {
    /// The batch was in flight; here it is.
    Current(Flight),
    /// Posted earlier and already given up on (past its bound): absorbed.
    Late,
}

#[derive(Clone, Debug)]
pub(crate) struct Batches {
    planned: VecDeque<(Vec<usize>, u64)>,
    flights: Vec<Flight>,
    posted: u32,
    /// Bytes in flight may not exceed this (loads with a staging budget).
    budget: Option<u64>,
}

impl Batches {
    /// Cuts `order` (indices into `items`) into batches of at most
    /// `max_keys_per_batch` keys and, with a budget, `budget` bytes. Every
    /// single item must fit the budget (the caller checks).
    pub(crate) fn plan(
        items: &[StoreItem],
        order: impl IntoIterator<Item = usize>,
        cfg: &StoreConfig,
        budget: Option<u64>,
    ) -> Batches {
        let mut planned = VecDeque::new();
        let mut cur: Vec<usize> = Vec::new();
        let mut bytes = 0u64;
        for i in order {
            let b = items[i].value_bytes;
            let over_budget = budget.is_some_and(|max| bytes.saturating_add(b) > max);
            if !cur.is_empty() && (cur.len() >= cfg.max_keys_per_batch || over_budget) {
                planned.push_back((std::mem::take(&mut cur), bytes));
                bytes = 0;
            }
            cur.push(i);
            bytes = bytes.saturating_add(b);
        }
        if !cur.is_empty() {
            planned.push_back((cur, bytes));
        }
        Batches {
            planned,
            flights: Vec::new(),
            posted: 0,
            budget,
        }
    }

    /// The next batch to post now, if the in-flight bounds allow it.
    pub(crate) fn post(&mut self, now: Instant, cfg: &StoreConfig) -> Option<Flight> {
        let (_, bytes) = self.planned.front()?;
        if self.flights.len() >= cfg.max_batches_in_flight {
            return None;
        }
        let in_flight: u64 = self.flights.iter().map(|f| f.bytes).sum();
        if (self.budget).is_some_and(|max| in_flight.saturating_add(*bytes) > max) {
            return None;
        }
        let (items, bytes) = self.planned.pop_front()?;
        let flight = Flight {
            id: self.posted,
            items,
            bytes,
            deadline: after(now, cfg.op_bound),
        };
        self.posted += 1;
        self.flights.push(flight.clone());
        Some(flight)
    }

    /// Takes the answer to batch `id` answering for `keys` keys.
    pub(crate) fn answer(&mut self, id: u32, keys: Option<usize>) -> Result<Answer, InputError> {
        let Some(i) = self.flights.iter().position(|f| f.id == id) else {
            return if id < self.posted {
                Ok(Answer::Late)
            } else {
                Err(InputError::Misuse("answer to a batch never posted"))
            };
        };
        if keys.is_some_and(|k| k != self.flights[i].items.len()) {
            return Err(InputError::Misuse(
                "answer for another number of keys than the batch has",
            ));
        }
        Ok(Answer::Current(self.flights.swap_remove(i)))
    }

    /// The flights past their bound at `now`, no longer tracked.
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<Flight> {
        let (gone, kept) = std::mem::take(&mut self.flights)
            .into_iter()
            .partition(|f| now >= f.deadline);
        self.flights = kept;
        gone
    }

    /// Gives up the batches not posted yet; returns their items.
    pub(crate) fn cancel(&mut self) -> Vec<usize> {
        self.planned
            .drain(..)
            .flat_map(|(items, _)| items)
            .collect()
    }

    /// True when nothing is in flight.
    pub(crate) fn is_idle(&self) -> bool {
        self.flights.is_empty()
    }

    /// True when every batch was posted and answered.
    pub(crate) fn is_done(&self) -> bool {
        self.planned.is_empty() && self.flights.is_empty()
    }

    /// The earliest bound of a flight.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.flights.iter().map(|f| f.deadline).min()
    }
}
