//! The block fence: which KV blocks (and items of the aux and state
//! pools, keyed apart from blocks) of this endpoint may be touched now.
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

pub(crate) mod slots;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;

use crate::device::CopyTracker;
use crate::shm::CtlOwner;

pub use slots::FenceKey;
use slots::{slots_in, FenceRegion, Space};

/// The buffers of one pool as the fence sees them: `(base, item_len)`
/// each, and the item count they share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FencePool {
    /// `(base, item_len)` per buffer.
    pub buffers: Vec<(u64, u64)>,
    /// Items per buffer.
    pub items: u64,
}

/// Per-slot open counts over the KV regions and pool buffers of one
/// endpoint.
#[derive(Debug)]
pub struct BlockFence {
    /// Sorted by base address; they never share bytes (the planner's
    /// layout validation refuses that), but for KV regions that interleave
    /// (block-outermost layouts), kept as the first of them.
    regions: Vec<FenceRegion>,
    /// Open count per open slot; a slot absent is closed. A map rather
    /// than a table of counts: its size follows the slots of the live
    /// transfers, whatever sizes the engine registered.
    open: RefCell<HashMap<FenceKey, u32>>,
    /// Slots per space: `[0]` KV blocks, `[1 + p]` items of pool `p`.
    counts: Vec<u64>,
    /// Bumped on every close, so a guard re-checks only after one.
    closes: Cell<u64>,
    /// Shared copies of the open slots, one per endpoint whose peers copy
    /// into this memory through shared mappings (`crate::shm`).
    mirrors: RefCell<Vec<Arc<CtlOwner>>>,
    /// The device copies of the endpoints staging this memory: a close
    /// waits for those in flight on the slots it closes.
    copies: RefCell<Vec<std::rc::Rc<CopyTracker>>>,
}

impl BlockFence {
    /// A fence over KV `regions` (`(base, block_len)` each), `num_blocks`
    /// blocks in each; every block starts closed.
    pub fn new(regions: &[(u64, u64)], num_blocks: u64) -> BlockFence {
        BlockFence::with_pools(regions, num_blocks, &[])
    }

    /// Like [`BlockFence::new`], with the buffers of `pools` fenced per
    /// item beside the KV blocks.
    pub fn with_pools(regions: &[(u64, u64)], num_blocks: u64, pools: &[FencePool]) -> BlockFence {
        let kv = regions.iter().map(|&(base, stride)| FenceRegion {
            base,
            stride,
            count: num_blocks,
            space: Space::Kv,
        });
        let items = pools.iter().enumerate().flat_map(|(p, pool)| {
            pool.buffers.iter().map(move |&(base, stride)| FenceRegion {
                base,
                stride,
                count: pool.items,
                space: Space::Pool(p as u32),
            })
        });
        let mut regions: Vec<FenceRegion> = Vec::new();
        let mut all: Vec<FenceRegion> = kv.chain(items).collect();
        all.sort_by_key(|r| r.base);
        for r in all {
            // KV regions of a block-outermost layout interleave: region
            // `r`'s page of block b lies in block b of the region before
            // it, so that region fences it (a block id names the same
            // block in every KV region).
            let inside = regions.last().is_some_and(|m: &FenceRegion| {
                m.space == Space::Kv
                    && r.space == Space::Kv
                    && m.stride == r.stride
                    && m.count == r.count
                    && r.base - m.base < m.stride
                    && r.base - m.base < m.stride.saturating_mul(m.count)
            });
            if !inside {
                regions.push(r);
            }
        }
        let counts = std::iter::once(num_blocks)
            .chain(pools.iter().map(|p| p.items))
            .collect();
        BlockFence {
            regions,
            open: RefCell::new(HashMap::new()),
            counts,
            closes: Cell::new(0),
            mirrors: RefCell::new(Vec::new()),
            copies: RefCell::new(Vec::new()),
        }
    }

    /// The fenced regions and the slots of each space, for peers that map
    /// ranges to slots themselves.
    pub(crate) fn layout(&self) -> (Vec<FenceRegion>, Vec<u64>) {
        (self.regions.clone(), self.counts.clone())
    }

    /// Mirrors the open slots into `ctl` from now on.
    pub(crate) fn attach(&self, ctl: Arc<CtlOwner>) {
        for &k in self.open.borrow().keys() {
            ctl.set_open(k);
        }
        self.mirrors.borrow_mut().push(ctl);
    }

    /// Makes closes wait for `copies` in flight on the slots they close.
    pub(crate) fn attach_copies(&self, copies: std::rc::Rc<CopyTracker>) {
        self.copies.borrow_mut().push(copies);
    }

    /// Stops waiting for `copies`.
    pub(crate) fn detach_copies(&self, copies: &std::rc::Rc<CopyTracker>) {
        self.copies
            .borrow_mut()
            .retain(|c| !std::rc::Rc::ptr_eq(c, copies));
    }

    /// Stops mirroring into `ctl`.
    pub(crate) fn detach(&self, ctl: &Arc<CtlOwner>) {
        self.mirrors.borrow_mut().retain(|m| !Arc::ptr_eq(m, ctl));
    }

    /// Slots of the space `key` names, 0 for a pool that does not exist.
    fn count_of(&self, key: FenceKey) -> (u64, u64) {
        let (space, slot) = match key {
            FenceKey::Block(id) => (0, id),
            FenceKey::Item { pool, index } => (pool as usize + 1, index),
        };
        (
            self.counts.get(space).copied().unwrap_or(0),
            u64::from(slot),
        )
    }

    /// Opens `keys` (counted: a slot opened twice needs two closes).
    /// Slots past the end are ignored: nothing can address them.
    pub fn open<K: Into<FenceKey>>(&self, keys: impl IntoIterator<Item = K>) {
        let mut open = self.open.borrow_mut();
        for k in keys {
            let k = k.into();
            let (count, slot) = self.count_of(k);
            if slot < count {
                let n = open.entry(k).or_insert(0);
                if *n == 0 {
                    for m in self.mirrors.borrow().iter() {
                        m.set_open(k);
                    }
                }
                *n = n.saturating_add(1);
            }
        }
    }

    /// Closes `keys` once each. A slot that closes for good is closed to
    /// peers' shared-memory copies too, and this returns only once the
    /// copies that saw it open have ended, theirs and this endpoint's
    /// device copies alike.
    pub fn close<K: Into<FenceKey>>(&self, keys: impl IntoIterator<Item = K>) {
        let mut open = self.open.borrow_mut();
        let mut shut = Vec::new();
        for k in keys {
            let k = k.into();
            if let Some(n) = open.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    open.remove(&k);
                    shut.push(k);
                }
            }
        }
        drop(open);
        self.closes.set(self.closes.get().wrapping_add(1));
        for m in self.mirrors.borrow().iter() {
            m.close(&shut);
        }
        if !shut.is_empty() {
            for c in self.copies.borrow().iter() {
                c.drain(|addr, len| self.keys_in(addr, len).iter().any(|k| shut.contains(k)));
            }
        }
    }

    /// How many closes happened so far.
    pub fn closes(&self) -> u64 {
        self.closes.get()
    }

    /// The fenced region `[addr, addr + len)` starts in, and the first and
    /// last of its slots the range touches; `None` for bytes outside
    /// every fenced region.
    fn slots(&self, addr: u64, len: u64) -> Option<(FenceRegion, u64, u64)> {
        slots_in(&self.regions, addr, len)
    }

    /// True if every KV block and pool item that `[addr, addr + len)`
    /// touches is open. Bytes outside the fenced regions are not fenced.
    pub fn allows(&self, addr: u64, len: u64) -> bool {
        let Some((r, first, last)) = self.slots(addr, len) else {
            return true;
        };
        let open = self.open.borrow();
        (first..=last).all(|b| u32::try_from(b).is_ok_and(|b| open.contains_key(&r.key(b))))
    }

    /// The KV blocks and pool items `[addr, addr + len)` touches (none
    /// for bytes outside the fenced regions): what to open for a transfer
    /// known by its memory rather than its block ids.
    pub fn keys_in(&self, addr: u64, len: u64) -> Vec<FenceKey> {
        let Some((r, first, last)) = self.slots(addr, len) else {
            return Vec::new();
        };
        (first..=last)
            .filter_map(|b| u32::try_from(b).ok())
            .map(|b| r.key(b))
            .collect()
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
    fn keys_in_names_the_blocks_a_range_touches() {
        let f = BlockFence::new(&[(10_000, 100), (1_000, 100)], 4);
        let k = |ids: &[u32]| ids.iter().map(|&i| FenceKey::Block(i)).collect::<Vec<_>>();
        assert_eq!(f.keys_in(1_150, 100), k(&[1, 2]));
        assert_eq!(f.keys_in(10_300, 500), k(&[3]), "cut at the region's end");
        assert_eq!(f.keys_in(500, 10), k(&[]), "not fenced");
        assert_eq!(f.keys_in(1_000, 0), k(&[]));
        f.open(f.keys_in(1_150, 100));
        assert!(f.allows(1_150, 100));
    }

    #[test]
    fn interleaved_regions_fence_each_block_of_every_layer() {
        // Block-outermost (vLLM's BLHNC): 3 layers' pages of 100 bytes
        // per 300-byte block, 4 blocks at 1000.
        let f = BlockFence::new(&[(1_000, 300), (1_100, 300), (1_200, 300)], 4);
        f.open([2]);
        for layer in 0..3 {
            let page = 1_000 + 2 * 300 + layer * 100;
            assert!(f.allows(page, 100), "layer {layer}'s page of block 2");
            assert!(
                !f.allows(page - 300, 100),
                "layer {layer}'s page of block 1"
            );
        }
        assert_eq!(f.keys_in(1_700, 100), vec![FenceKey::Block(2)]);
        assert!(!f.allows(1_000 + 3 * 300 + 150, 10), "block 3 is closed");
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
    fn pool_items_are_fenced_apart_from_blocks_of_the_same_id() {
        // KV: 4 blocks of 100 bytes at 1000; pool 0: two buffers of 3
        // items of 8 bytes; pool 1: one buffer of 2 items of 50 bytes.
        let pools = [
            FencePool {
                buffers: vec![(5_000, 8), (6_000, 8)],
                items: 3,
            },
            FencePool {
                buffers: vec![(7_000, 50)],
                items: 2,
            },
        ];
        let f = BlockFence::with_pools(&[(1_000, 100)], 4, &pools);
        f.open([1]);
        assert!(f.allows(1_100, 100), "KV block 1");
        assert!(!f.allows(5_008, 8), "item 1 of pool 0 is not block 1");
        f.open([FenceKey::Item { pool: 0, index: 1 }]);
        assert!(
            f.allows(5_008, 8) && f.allows(6_008, 8),
            "item 1 in both buffers"
        );
        assert!(!f.allows(5_008, 9), "spills into item 2");
        assert!(!f.allows(7_050, 1), "pool 1 is another space");
        assert!(f.allows(5_024, 100), "past the buffer: not fenced");
        f.open([
            FenceKey::Item { pool: 1, index: 2 },
            FenceKey::Item { pool: 9, index: 0 },
        ]);
        assert_eq!(f.open.borrow().len(), 2, "slots past the end are ignored");
        f.close([FenceKey::Item { pool: 0, index: 1 }]);
        assert!(!f.allows(5_008, 8));
        assert!(f.allows(1_100, 100), "the block stays open");
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
