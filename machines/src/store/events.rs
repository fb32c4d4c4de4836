//! KV events of the store tier, in the shapes of vLLM's `BlockStored`,
//! `BlockRemoved` and `AllBlocksCleared`, collected per engine step.
//!
//! A KV-aware router tracks which prefixes each tier holds from these
//! events. [`stored_events`] turns a save's report into `BlockStored`
//! events: one per run of consecutive blocks of a group that this save
//! stored (blocks found stored already were announced by whoever stored
//! them), with the parent hash of the run's first block taken from the
//! request's own hash chain, not from the previous event: after dedup and
//! replica striding, the previous event's block is often not the parent.
//! An [`EventLog`] holds a bounded queue of events until the engine
//! collects a step's worth ([`EventLog::take`], vLLM's `get_kv_events`);
//! an event that does not fit is dropped and counted. Encoding and
//! publishing the events (vLLM's msgpack batches over ZeroMQ) is the
//! driver's, not this crate's.

use super::key::{BlockHash, GroupSpec};
use super::save::{SaveKeyResult, SaveReport};

/// Where a block is held (vLLM's `MEDIUM_*` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Device memory.
    Gpu,
    /// Host memory (a RAM store).
    Cpu,
    /// Disk or another store tier.
    Storage,
}

impl Medium {
    /// The name vLLM's events carry: `GPU`, `CPU`, `STORAGE`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
        }
    }
}

/// Consecutive blocks of one group were stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockStored {
    /// The blocks' hashes, in order.
    pub block_hashes: Vec<BlockHash>,
    /// The hash of the block before the first one, in the same group.
    pub parent_block_hash: Option<BlockHash>,
    /// The blocks' tokens, when the engine gave them (else empty).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Where they are held.
    pub medium: Medium,
    /// The KV-cache group.
    pub group: u32,
    /// The LoRA adapter, if any.
    pub lora_name: Option<String>,
}

/// A KV event (vLLM's `KVCacheEvent` variants).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks were stored.
    BlockStored(BlockStored),
    /// Blocks were removed (evicted, deleted).
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<BlockHash>,
        /// Where they were held.
        medium: Medium,
        /// Their group, when known.
        group: Option<u32>,
    },
    /// Every block of the medium is gone.
    AllBlocksCleared,
}

/// The request's side of a save, for its events.
#[derive(Clone, Copy, Debug)]
pub struct EventSource<'a> {
    /// The engine's groups, by group id.
    pub groups: &'a [GroupSpec],
    /// Per group, the request's block hashes (the parent chain).
    pub hashes: &'a [Vec<BlockHash>],
    /// The request's tokens, if the events should carry them.
    pub token_ids: Option<&'a [u32]>,
    /// The LoRA adapter, if any.
    pub lora_name: Option<&'a str>,
    /// Where the store holds blocks.
    pub medium: Medium,
}

/// The `BlockStored` events of a save (see the module docs).
pub fn stored_events(report: &SaveReport, src: &EventSource) -> Vec<KvEvent> {
    let mut stored: Vec<(u32, u32, BlockHash)> = (report.items.iter().zip(&report.results))
        .filter(|(_, r)| **r == SaveKeyResult::Stored)
        .map(|(it, _)| (it.group, it.index, it.hash))
        .collect();
    stored.sort_unstable_by_key(|&(g, i, _)| (g, i));
    let mut out: Vec<BlockStored> = Vec::new();
    let mut prev: Option<(u32, u32)> = None;
    for (g, i, hash) in stored {
        let Some(spec) = src.groups.get(g as usize) else {
            continue;
        };
        let tokens = block_tokens(src.token_ids, spec.block_tokens, i);
        match out.last_mut() {
            Some(run) if prev == Some((g, i.wrapping_sub(1))) => {
                run.block_hashes.push(hash);
                run.token_ids.extend_from_slice(tokens);
            }
            _ => out.push(BlockStored {
                block_hashes: vec![hash],
                parent_block_hash: parent(src.hashes, g, i),
                token_ids: tokens.to_vec(),
                block_size: spec.block_tokens,
                medium: src.medium,
                group: g,
                lora_name: src.lora_name.map(str::to_owned),
            }),
        }
        prev = Some((g, i));
    }
    out.into_iter().map(KvEvent::BlockStored).collect()
}

/// The hash of block `index - 1` of group `group`, if the chain has it.
fn parent(hashes: &[Vec<BlockHash>], group: u32, index: u32) -> Option<BlockHash> {
    let before = index.checked_sub(1)?;
    hashes.get(group as usize)?.get(before as usize).copied()
}

/// The tokens of block `index`, or none when the engine gave too few.
fn block_tokens(tokens: Option<&[u32]>, block: u32, index: u32) -> &[u32] {
    let start = index as usize * block as usize;
    tokens
        .and_then(|t| t.get(start..start + block as usize))
        .unwrap_or(&[])
}

/// A bounded queue of events until the engine collects a step's worth.
#[derive(Clone, Debug)]
pub struct EventLog {
    events: Vec<KvEvent>,
    max_events: usize,
    dropped: u64,
}

impl EventLog {
    /// An empty log holding at most `max_events` events.
    pub fn new(max_events: usize) -> EventLog {
        EventLog {
            events: Vec::new(),
            max_events,
            dropped: 0,
        }
    }

    /// Queues `events`; those that do not fit are dropped and counted.
    pub fn extend(&mut self, events: impl IntoIterator<Item = KvEvent>) {
        for e in events {
            if self.events.len() < self.max_events {
                self.events.push(e);
            } else {
                self.dropped += 1;
            }
        }
    }

    /// The events since the last call (vLLM's `get_kv_events`).
    pub fn take(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Events dropped so far for want of room.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}
