//! Simulated KV memory of one node: who owns each block right now.
//!
//! A block is `Free` in the engine's pool, `Lent` to one transfer from the
//! moment the engine allocates it for a request until the machine releases
//! it (P: `ReleaseBlocks`; D: `Received` or `LoadFailed`), and on D
//! `Engine`-held while the engine decodes from KV it received. A transfer may
//! touch a block only while the block is lent to that very transfer; the
//! world checks every simulated landing of a write or read against this.
//! Freed blocks are reused last-in first-out, so that a late write lands in
//! a block that already belongs to another request as often as possible.

use kvferry_machines::internal::common::BlockId;
use kvferry_machines::TransferId;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owner {
    Free,
    Lent(TransferId),
    Engine(TransferId),
}

#[derive(Clone, Debug)]
pub(crate) struct Memory {
    owner: Vec<Owner>,
    free: Vec<u32>,
}

impl Memory {
    pub(crate) fn new(blocks: u32) -> Self {
        Memory {
            owner: vec![Owner::Free; blocks as usize],
            free: (0..blocks).rev().collect(),
        }
    }

    /// The node crashed: its memory is gone, the restarted engine starts
    /// with every block free.
    pub(crate) fn reset(&mut self) {
        let n = self.owner.len() as u32;
        *self = Memory::new(n);
    }

    /// Allocates `n` blocks to `transfer`, or nothing when the pool is short.
    pub(crate) fn alloc(&mut self, n: usize, transfer: TransferId) -> Option<Vec<BlockId>> {
        if self.free.len() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.free.pop().expect("length checked above");
            self.owner[b as usize] = Owner::Lent(transfer);
            out.push(BlockId(b));
        }
        Some(out)
    }

    pub(crate) fn owner(&self, b: BlockId) -> Option<Owner> {
        self.owner.get(b.0 as usize).copied()
    }

    /// The machine gave `b` back: it goes to the engine (`keep`) or to the pool.
    pub(crate) fn release(
        &mut self,
        b: BlockId,
        transfer: TransferId,
        keep: bool,
    ) -> Result<(), String> {
        match self.owner(b) {
            Some(Owner::Lent(t)) if t == transfer => {
                if keep {
                    self.owner[b.0 as usize] = Owner::Engine(transfer);
                } else {
                    self.owner[b.0 as usize] = Owner::Free;
                    self.free.push(b.0);
                }
                Ok(())
            }
            other => Err(format!(
                "block {} released by {:?} but its owner is {:?}",
                b.0, transfer, other
            )),
        }
    }

    /// The engine finished decoding from `b`.
    pub(crate) fn engine_free(&mut self, b: BlockId, transfer: TransferId) -> Result<(), String> {
        match self.owner(b) {
            Some(Owner::Engine(t)) if t == transfer => {
                self.owner[b.0 as usize] = Owner::Free;
                self.free.push(b.0);
                Ok(())
            }
            other => Err(format!(
                "block {} freed by the engine for {:?} but its owner is {:?}",
                b.0, transfer, other
            )),
        }
    }

    /// Blocks not back in the pool, with their owner.
    pub(crate) fn leaked(&self) -> Vec<(u32, Owner)> {
        self.owner
            .iter()
            .enumerate()
            .filter(|(_, o)| **o != Owner::Free)
            .map(|(b, o)| (b as u32, *o))
            .collect()
    }
}
