//! What became of a save, key by key: what the save machine reports and
//! what the pressure and the events read, apart from the machine.

use crate::common::{AbortReason, FailReason, Phase};

use super::{StoreFault, StoreItem};

/// What became of one key of a save.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveKeyResult {
    /// This save stored it.
    Stored,
    /// It was stored already (existence check, or a racing writer).
    Deduped,
    /// The store was full.
    Full,
    /// The store refused a value this large.
    TooLarge,
    /// The put failed or was not answered within its bound.
    Failed,
    /// Never put: the save stopped first.
    NotAttempted,
}

/// How a save ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveEnd {
    /// Every key was attempted.
    Done,
    /// Not attempted at all: the request met a full store before.
    Skipped,
    /// A put was answered "full"; the rest was not attempted.
    StoreFull,
    /// A whole call failed.
    Fault(StoreFault),
    /// The request timed out.
    Expired,
    /// The request was aborted.
    Aborted(AbortReason),
}

/// The outcome of a save, key by key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SaveReport {
    /// How it ended.
    pub end: SaveEnd,
    /// The items, as planned.
    pub items: Vec<StoreItem>,
    /// `results[i]` for `items[i]`.
    pub results: Vec<SaveKeyResult>,
}

impl SaveReport {
    fn count(&self, r: SaveKeyResult) -> usize {
        self.results.iter().filter(|&&x| x == r).count()
    }

    /// Keys this save stored.
    pub fn stored(&self) -> usize {
        self.count(SaveKeyResult::Stored)
    }

    /// Keys found stored already.
    pub fn deduped(&self) -> usize {
        self.count(SaveKeyResult::Deduped)
    }

    /// True when every key is in the store now.
    pub fn is_complete(&self) -> bool {
        (self.results.iter()).all(|r| matches!(r, SaveKeyResult::Stored | SaveKeyResult::Deduped))
    }

    /// The phase a save with this report ends in.
    pub(super) fn phase(&self) -> Phase {
        match self.end {
            SaveEnd::Done if self.is_complete() => Phase::Success,
            SaveEnd::Expired => Phase::Expired,
            SaveEnd::Aborted(r) => Phase::Failed(FailReason::Aborted(r)),
            SaveEnd::Done | SaveEnd::Skipped | SaveEnd::StoreFull | SaveEnd::Fault(_) => {
                Phase::Failed(FailReason::Transport)
            }
        }
    }
}
