//! Prefix lookup: how many leading tokens of a request the store holds for
//! every rank and group, from one batched existence call.
//!
//! [`Lookup::new`] lists every key to ask about (one call, one round trip);
//! [`Lookup::resolve`] turns the store's answer into a [`LookupHit`]. The
//! rules:
//!
//! * A block of a group counts only when every shard's key of it exists
//!   (every head slice and every pipeline stage of the engine).
//! * A hit length `L` is a multiple of the least common multiple of the
//!   groups' block sizes ([`lcm_block_tokens`]), at most the request's
//!   tokens, and covered by every group's hashes.
//! * At `L`, a full-attention group needs its blocks `0 .. L / block` and
//!   a sliding-window group only the blocks that hold the `window - 1`
//!   tokens before `L` ([`blocks_needed`], the load mask): the tokens from
//!   `L` on attend no further back.
//! * The answer is the largest `L` whose needed blocks are all stored.
//!
//! A save stores, per group, the union of the blocks needed at every hit
//! length it could serve ([`store_mask`]), so a saved prefix is found again.

use std::ops::Range;

use super::key::{BlockHash, ChunkKey, GroupSpec, Keyspace, RequestScope};
use super::StorePlanError;

/// The least common multiple of the groups' block sizes: hit lengths are
/// multiples of it.
pub fn lcm_block_tokens(groups: &[GroupSpec]) -> Result<u32, StorePlanError> {
    let mut lcm: u64 = 1;
    for g in groups {
        let b = u64::from(g.block_tokens);
        if b == 0 {
            return Err(StorePlanError::BlockSizes);
        }
        lcm = lcm / gcd(lcm, b) * b;
        if lcm > u64::from(u32::MAX) {
            return Err(StorePlanError::BlockSizes);
        }
    }
    Ok(lcm as u32)
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The blocks of `group` that an engine must hold to go on from a hit of
/// `tokens` tokens (a multiple of the group's block size): all leading
/// blocks for full attention, the window before `tokens` for a sliding
/// window.
pub fn blocks_needed(group: &GroupSpec, tokens: u32) -> Range<u32> {
    let end = tokens / group.block_tokens;
    match group.window_tokens {
        None => 0..end,
        Some(w) => {
            let first_token = tokens.saturating_sub(w.saturating_sub(1));
            (first_token / group.block_tokens).min(end)..end
        }
    }
}

/// Per block of `group`, whether a save of the first `tokens` tokens
/// stores it: the blocks needed at every hit length (multiple of `lcm`)
/// up to `tokens`.
pub fn store_mask(group: &GroupSpec, lcm: u32, tokens: u32) -> Vec<bool> {
    let end = tokens / group.block_tokens;
    let mut mask = vec![false; end as usize];
    // Both ends of `blocks_needed` grow with the hit length, so each hit
    // marks only what lies past the previous one: linear in the blocks.
    let mut marked_to = 0;
    let mut hit = lcm;
    while hit <= tokens && lcm > 0 {
        let needed = blocks_needed(group, hit);
        for i in needed.start.max(marked_to)..needed.end {
            mask[i as usize] = true;
        }
        marked_to = marked_to.max(needed.end);
        hit = match hit.checked_add(lcm) {
            Some(h) => h,
            None => break,
        };
    }
    mask
}

/// What a lookup found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LookupHit {
    /// Leading tokens stored for every rank and group (vLLM's
    /// `get_num_new_matched_tokens`, before subtracting local hits).
    pub tokens: u32,
    /// Per group, the blocks to load for it ([`blocks_needed`]).
    pub load: Vec<Range<u32>>,
}

/// One prefix lookup: the keys to ask about, then the hit. See the module docs.
#[derive(Clone, Debug)]
pub struct Lookup {
    groups: Vec<GroupSpec>,
    lcm: u32,
    /// The longest hit the request allows.
    max_tokens: u32,
    shards: usize,
    /// Per group, the blocks asked about.
    blocks: Vec<u32>,
    keys: Vec<ChunkKey>,
}

impl Lookup {
    /// Lists the keys of the first `token_len` tokens of a request whose
    /// block hashes per group are `hashes` (an engine that must compute at
    /// least one token passes one less than the prompt length).
    pub fn new(
        keyspace: &Keyspace,
        scope: &RequestScope,
        token_len: u32,
        hashes: &[Vec<BlockHash>],
        max_keys: usize,
    ) -> Result<Lookup, StorePlanError> {
        let groups = keyspace.groups().to_vec();
        if hashes.len() != groups.len() {
            return Err(StorePlanError::GroupCount {
                got: hashes.len(),
                want: groups.len(),
            });
        }
        let lcm = lcm_block_tokens(&groups)?;
        let covered = (groups.iter().zip(hashes))
            .map(|(g, h)| u64::from(g.block_tokens).saturating_mul(h.len() as u64))
            .fold(u64::from(token_len), u64::min) as u32;
        let max_tokens = covered / lcm * lcm;
        let shards = keyspace.shards();
        let blocks: Vec<u32> = groups.iter().map(|g| max_tokens / g.block_tokens).collect();
        let count = blocks
            .iter()
            .map(|&b| b as usize * shards.len())
            .sum::<usize>();
        if count > max_keys {
            return Err(StorePlanError::TooManyKeys {
                count,
                max: max_keys,
            });
        }
        let mut keys = Vec::with_capacity(count);
        for (g, (&n, h)) in blocks.iter().zip(hashes).enumerate() {
            for hash in &h[..n as usize] {
                for shard in &shards {
                    keys.push(keyspace.key(shard, scope, g as u32, hash)?);
                }
            }
        }
        Ok(Lookup {
            groups,
            lcm,
            max_tokens,
            shards: shards.len(),
            blocks,
            keys,
        })
    }

    /// The keys to ask the store about, in one batched existence call.
    pub fn keys(&self) -> &[ChunkKey] {
        &self.keys
    }

    /// The hit, from the store's answer: `exists[i]` for `keys()[i]`.
    pub fn resolve(&self, exists: &[bool]) -> Result<LookupHit, StorePlanError> {
        if exists.len() != self.keys.len() {
            return Err(StorePlanError::AnswerLength {
                got: exists.len(),
                want: self.keys.len(),
            });
        }
        // Per group, stored[i]: every shard holds block i. As prefix
        // counts, so that "a range is all stored" is one subtraction.
        let mut stored_before: Vec<Vec<u32>> = Vec::with_capacity(self.groups.len());
        let mut answers = exists.chunks(self.shards.max(1));
        for &n in &self.blocks {
            let mut counts = Vec::with_capacity(n as usize + 1);
            counts.push(0u32);
            for _ in 0..n {
                let all = answers.next().is_some_and(|a| a.iter().all(|&e| e));
                counts.push(counts.last().copied().unwrap_or(0) + u32::from(all));
            }
            stored_before.push(counts);
        }
        let all_stored = |g: usize, r: &Range<u32>| {
            let c = &stored_before[g];
            c[r.end as usize] - c[r.start as usize] == r.end - r.start
        };
        let mut tokens = self.max_tokens;
        loop {
            let ok = (self.groups.iter().enumerate())
                .all(|(g, spec)| all_stored(g, &blocks_needed(spec, tokens)));
            if ok || tokens == 0 {
                break;
            }
            tokens -= self.lcm;
        }
        let load = (self.groups.iter())
            .map(|g| blocks_needed(g, tokens))
            .collect();
        Ok(LookupHit { tokens, load })
    }
}
