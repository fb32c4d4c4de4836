//! One save or load as the connector's drivers hold it: the machine, the
//! run it belongs to, and (for a save) what the events of its end need.
//!
//! A request id can save (or load) again after its previous run ended
//! while a call of that run is still out at the backend; the run number
//! travels with every call, and a machine ignores answers of another run,
//! so a late answer never feeds the new one.

use std::time::Instant;

use kvferry_machines::store::load::{self, LoadMachine, LoadReport};
use kvferry_machines::store::save::{self, SaveMachine, SaveReport};
use kvferry_machines::store::{BlockHash, ChunkKey, StoreItem};
use kvferry_machines::{AbortReason, InputError, Machine, Phase, TransferId};

/// Which save or load of a request a call belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Run(pub(super) u64);

/// Which machine a posted call answers to.
#[derive(Clone, Copy, Debug)]
pub(super) enum CallFor {
    SaveExists(TransferId, Run),
    Put(TransferId, Run, u32),
    Get(TransferId, Run, u32),
}

/// What a save's `BlockStored` events name besides its report.
#[derive(Debug, Default)]
pub(super) struct SaveOrigin {
    pub(super) hashes: Vec<Vec<BlockHash>>,
    pub(super) token_ids: Option<Vec<u32>>,
    pub(super) lora: Option<String>,
}

/// A running save.
pub(super) struct SaveRun {
    pub(super) machine: SaveMachine,
    pub(super) run: Run,
    /// Handed out with the release, the save's last action.
    pub(super) origin: SaveOrigin,
}

/// What a save asks the connector to do.
pub(super) enum SaveStep {
    Exists {
        run: Run,
        keys: Vec<ChunkKey>,
    },
    Put {
        run: Run,
        batch: u32,
        items: Vec<StoreItem>,
    },
    /// No call can touch the request's blocks anymore.
    Released {
        report: SaveReport,
        origin: SaveOrigin,
    },
}

impl Machine for SaveRun {
    type Event = (Run, save::Event);
    type Action = SaveStep;

    fn handle_event(&mut self, now: Instant, (run, ev): Self::Event) -> Result<(), InputError> {
        if run != self.run {
            return Ok(());
        }
        self.machine.handle_event(now, ev)
    }

    fn handle_timeout(&mut self, now: Instant) {
        self.machine.handle_timeout(now);
    }

    fn abort(&mut self, now: Instant, reason: AbortReason) {
        self.machine.abort(now, reason);
    }

    fn poll_action(&mut self) -> Option<SaveStep> {
        let run = self.run;
        Some(match self.machine.poll_action()? {
            save::Action::Exists { keys } => SaveStep::Exists { run, keys },
            save::Action::Put { batch, items } => SaveStep::Put { run, batch, items },
            save::Action::Release { report } => SaveStep::Released {
                report,
                origin: std::mem::take(&mut self.origin),
            },
        })
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.machine.poll_timeout()
    }

    fn phase(&self) -> Phase {
        self.machine.phase()
    }
}

/// A running load.
pub(super) struct LoadRun {
    pub(super) machine: LoadMachine,
    pub(super) run: Run,
}

/// What a load asks the connector to do.
pub(super) enum LoadStep {
    Get {
        run: Run,
        batch: u32,
        items: Vec<StoreItem>,
    },
    Finished {
        report: LoadReport,
    },
}

impl Machine for LoadRun {
    type Event = (Run, load::Event);
    type Action = LoadStep;

    fn handle_event(&mut self, now: Instant, (run, ev): Self::Event) -> Result<(), InputError> {
        if run != self.run {
            return Ok(());
        }
        self.machine.handle_event(now, ev)
    }

    fn handle_timeout(&mut self, now: Instant) {
        self.machine.handle_timeout(now);
    }

    fn abort(&mut self, now: Instant, reason: AbortReason) {
        self.machine.abort(now, reason);
    }

    fn poll_action(&mut self) -> Option<LoadStep> {
        let run = self.run;
        Some(match self.machine.poll_action()? {
            load::Action::Get { batch, items, .. } => LoadStep::Get { run, batch, items },
            load::Action::Finished { report } => LoadStep::Finished { report },
        })
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.machine.poll_timeout()
    }

    fn phase(&self) -> Phase {
        self.machine.phase()
    }
}
