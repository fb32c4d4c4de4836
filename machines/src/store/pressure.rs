//! Store pressure: the memory, per connector, that the store said it is full.
//!
//! When a put is answered "full" (Mooncake's `NO_AVAILABLE_HANDLE`), the
//! save machine stops putting the rest of that save, and the connector
//! skips later saves of the same request until some save anywhere stores a
//! value again: a full store frees space by evicting, and hammering it with
//! the rest of a long prompt only fails more puts. The state lives in one
//! [`Pressure`] value per connector (the driver owns it next to its
//! machines; there is no global), fed with each finished save's report
//! ([`Pressure::handle_report`]) and asked before each new save
//! ([`Pressure::admit`]). Its request set is bounded
//! ([`Pressure::new`]); when full, the oldest request is forgotten, which
//! at worst lets that request try a save again.

use std::collections::VecDeque;

use crate::common::TransferId;

use super::report::{SaveEnd, SaveReport};

/// Counters of the pressure path, for the connector's stats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PressureStats {
    /// Saves that stopped on a "full" answer.
    pub full_saves: u64,
    /// Saves skipped because their request met a full store.
    pub skipped_saves: u64,
    /// Times a later successful save cleared the pressure.
    pub clears: u64,
}

/// Per-connector memory of a full store. See the module docs.
#[derive(Clone, Debug)]
pub struct Pressure {
    /// Requests whose saves are skipped while the pressure lasts.
    skipped: VecDeque<TransferId>,
    max_requests: usize,
    stats: PressureStats,
}

impl Pressure {
    /// No pressure; remembers at most `max_requests` requests (at least 1).
    pub fn new(max_requests: usize) -> Pressure {
        Pressure {
            skipped: VecDeque::new(),
            max_requests: max_requests.max(1),
            stats: PressureStats::default(),
        }
    }

    /// True while some request met a full store and no save succeeded since.
    pub fn is_active(&self) -> bool {
        !self.skipped.is_empty()
    }

    /// Whether a new save of `request` may go ahead; a refused one is counted.
    pub fn admit(&mut self, request: TransferId) -> bool {
        if self.skipped.contains(&request) {
            self.stats.skipped_saves += 1;
            return false;
        }
        true
    }

    /// Takes a finished save's report: a "full" answer puts its request
    /// under pressure; a save that stored a value without meeting a full
    /// store clears the pressure for every request.
    pub fn handle_report(&mut self, request: TransferId, report: &SaveReport) {
        if report.end == SaveEnd::StoreFull {
            self.stats.full_saves += 1;
            if !self.skipped.contains(&request) {
                if self.skipped.len() >= self.max_requests {
                    self.skipped.pop_front();
                }
                self.skipped.push_back(request);
            }
        } else if report.stored() > 0 && self.is_active() {
            self.stats.clears += 1;
            self.skipped.clear();
        }
    }

    /// The request finished: nothing more of it will be saved.
    pub fn forget(&mut self, request: TransferId) {
        self.skipped.retain(|r| *r != request);
    }

    /// The counters so far.
    pub fn stats(&self) -> PressureStats {
        self.stats
    }
}
