//! The block fence: which KV blocks of this endpoint may be touched now.
//!
//! The machines decide when a request's blocks are handed back to the
//! engine; from then on no byte of them may be written (decode) or read
//! (prefill). Timers cannot guarantee that on their own: bytes a peer sent
//! before it gave up still sit in our socket buffer, and a batch future is
//! dropped only when its task is next polled. The fence makes it exact: the
//! node opens a request's blocks when it first hands them to the data plane
//! and closes them in the same executor turn that reports the request done,
//! and both transport ends ask the fence right before every system call that
//! touches registered memory. Everything runs on one executor thread, so no
//! call can slip between the close and the report.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// One KV region: `num_blocks` blocks of `block_len` bytes from `base`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FenceRegion {
    base: u64,
    block_len: u64,
}

/// Per-block open counts over the KV regions of one endpoint.
#[derive(Debug)]
pub struct BlockFence {
    /// Sorted by base address.
    regions: Vec<FenceRegion>,
    num_blocks: u64,
    /// Open count per open block; a block absent is closed. A map rather
    /// than a table of `num_blocks` counts: its size follows the blocks of
    /// the live transfers, whatever `num_blocks` the engine registered.
    open: RefCell<HashMap<u32, u32>>,
    /// Bumped on every close, so a guard re-checks only after one.
    closes: Cell<u64>,
}

impl BlockFence {
    /// A fence over `regions` (`(base, block_len)` each), `num_blocks` blocks
    /// in each; every block starts closed.
    pub fn new(regions: &[(u64, u64)], num_blocks: u64) -> BlockFence {
        let mut regions: Vec<FenceRegion> = regions
            .iter()
            .map(|&(base, block_len)| FenceRegion { base, block_len })
            .collect();
        regions.sort_by_key(|r| r.base);
        BlockFence {
            regions,
            num_blocks,
            open: RefCell::new(HashMap::new()),
            closes: Cell::new(0),
        }
    }

    /// Opens `blocks` (counted: a block opened twice needs two closes).
    /// Ids past the end are ignored: nothing can address them.
    pub fn open(&self, blocks: impl IntoIterator<Item = u32>) {
        let mut open = self.open.borrow_mut();
        for b in blocks {
            if u64::from(b) < self.num_blocks {
                let n = open.entry(b).or_insert(0);
                *n = n.saturating_add(1);
            }
        }
    }

    /// Closes `blocks` once each.
    pub fn close(&self, blocks: impl IntoIterator<Item = u32>) {
        let mut open = self.open.borrow_mut();
        for b in blocks {
            if let Some(n) = open.get_mut(&b) {
                *n -= 1;
                if *n == 0 {
                    open.remove(&b);
                }
            }
        }
        self.closes.set(self.closes.get().wrapping_add(1));
    }

    /// How many closes happened so far.
    pub fn closes(&self) -> u64 {
        self.closes.get()
    }

    /// True if every KV block that `[addr, addr + len)` touches is open.
    /// Bytes outside the KV regions are not fenced.
    pub fn allows(&self, addr: u64, len: u64) -> bool {
        if len == 0 {
            return true;
        }
        let i = self.regions.partition_point(|r| r.base <= addr);
        let Some(r) = i.checked_sub(1).map(|i| self.regions[i]) else {
            return true;
        };
        let span = r.block_len.saturating_mul(self.num_blocks);
        let off = addr - r.base;
        if r.block_len == 0 || off >= span {
            return true;
        }
        let first = off / r.block_len;
        let last = (off.saturating_add(len - 1) / r.block_len).min(self.num_blocks - 1);
        let open = self.open.borrow();
        (first..=last).all(|b| u32::try_from(b).is_ok_and(|b| open.contains_key(&b)))
    }

    /// True if every `(addr, len)` range is allowed.
    pub fn allows_all(&self, ranges: impl IntoIterator<Item = (u64, u64)>) -> bool {
        ranges.into_iter().all(|(a, l)| self.allows(a, l))
    }
}

/// Checks a fixed set of ranges against a fence, re-checking only after a
/// close (opens never revoke anything).
pub(crate) struct Guard<'a> {
    fence: Option<&'a BlockFence>,
    checked_at: Cell<Option<u64>>,
}

impl<'a> Guard<'a> {
    pub(crate) fn new(fence: Option<&'a BlockFence>) -> Guard<'a> {
        Guard {
            fence,
            checked_at: Cell::new(None),
        }
    }

    /// True if the ranges may still be touched.
    pub(crate) fn check(&self, ranges: impl IntoIterator<Item = (u64, u64)>) -> bool {
        let Some(f) = self.fence else { return true };
        let now = f.closes();
        if self.checked_at.get() == Some(now) {
            return true;
        }
        let ok = f.allows_all(ranges);
        if ok {
            self.checked_at.set(Some(now));
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_open_close_and_span() {
        // Two regions of 4 blocks of 100 bytes.
        let f = BlockFence::new(&[(10_000, 100), (1_000, 100)], 4);
        assert!(!f.allows(1_000, 1));
        f.open([1, 2]);
        assert!(f.allows(1_100, 200), "blocks 1 and 2 of the first region");
        assert!(f.allows(10_150, 100), "same ids in the other region");
        assert!(!f.allows(1_100, 201), "spills into block 3");
        assert!(!f.allows(1_099, 2), "starts in block 0");
        assert!(f.allows(500, 10), "below every region: not fenced");
        assert!(f.allows(1_400, 10), "past the region: not fenced");
        f.open([2]);
        f.close([2]);
        assert!(f.allows(1_200, 100), "still opened once");
        f.close([1, 2]);
        assert!(!f.allows(1_100, 1));
        assert!(!f.allows(1_200, 1));
        f.open([99]);
        f.close([99]);
    }

    #[test]
    fn a_huge_registration_costs_nothing_up_front() {
        let f = BlockFence::new(&[(0, 16)], 1 << 40);
        f.open([u32::MAX]);
        assert!(f.allows(u64::from(u32::MAX) * 16, 16));
        assert!(!f.allows(u64::from(u32::MAX) * 16 + 16, 1), "id past u32");
        f.close([u32::MAX]);
        assert!(!f.allows(u64::from(u32::MAX) * 16, 16));
        assert!(f.open.borrow().is_empty());
    }

    #[test]
    fn guard_rechecks_after_a_close() {
        let f = BlockFence::new(&[(0, 10)], 2);
        f.open([0]);
        let g = Guard::new(Some(&f));
        assert!(g.check([(0, 10)]));
        f.open([1]);
        assert!(g.check([(0, 10)]));
        f.close([0]);
        assert!(!g.check([(0, 10)]));
        assert!(Guard::new(None).check([(0, 10)]));
    }
}
