//! The fence's slots: what one is called ([`FenceKey`]), the spaces they
//! fall in (KV blocks, each pool's items), the regions of memory they tile
//! and which of them an address range touches. A leaf of plain data and
//! arithmetic: the fence counts opens of these slots, and the shared-memory
//! side mirrors them in its control file (`shm::ctl`) and maps its peers'
//! copies to them (`shm::hello`, `shm::link`), so both name them here and
//! the control file needs nothing of the fence that mirrors into it.

/// What the fence counts opens of: a KV block (one id names that block in
/// every KV region) or one item of a pool (aux or state buffers, indexed
/// per request; the index names that item in every buffer of the pool).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FenceKey {
    /// KV block `id`.
    Block(u32),
    /// Item `index` of pool `pool`.
    Item {
        /// The pool, in the layout's order.
        pool: u32,
        /// The item.
        index: u32,
    },
}

impl From<u32> for FenceKey {
    fn from(id: u32) -> FenceKey {
        FenceKey::Block(id)
    }
}

/// What a fenced range of memory is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Space {
    Kv,
    Pool(u32),
}

impl Space {
    /// Its index among a fence's spaces: KV blocks first, then each pool.
    pub(crate) fn index(self) -> usize {
        match self {
            Space::Kv => 0,
            Space::Pool(p) => p as usize + 1,
        }
    }

    pub(crate) fn from_index(i: u64) -> Option<Space> {
        match i {
            0 => Some(Space::Kv),
            i => u32::try_from(i - 1).ok().map(Space::Pool),
        }
    }
}

/// One fenced region: `count` slots of `stride` bytes from `base`, each
/// slot a KV block or a pool item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FenceRegion {
    pub(crate) base: u64,
    pub(crate) stride: u64,
    pub(crate) count: u64,
    pub(crate) space: Space,
}

impl FenceRegion {
    pub(crate) fn key(&self, slot: u32) -> FenceKey {
        match self.space {
            Space::Kv => FenceKey::Block(slot),
            Space::Pool(pool) => FenceKey::Item { pool, index: slot },
        }
    }
}

/// The fenced region `[addr, addr + len)` starts in among `regions`
/// (sorted by base), and the first and last of its slots the range
/// touches; `None` for bytes outside every fenced region. Both ends of a
/// shared-memory copy map ranges to slots with this.
pub(crate) fn slots_in(
    regions: &[FenceRegion],
    addr: u64,
    len: u64,
) -> Option<(FenceRegion, u64, u64)> {
    if len == 0 {
        return None;
    }
    let i = regions.partition_point(|r| r.base <= addr);
    let r = i.checked_sub(1).map(|i| regions[i])?;
    let span = r.stride.saturating_mul(r.count);
    let off = addr - r.base;
    if r.stride == 0 || off >= span {
        return None;
    }
    let first = off / r.stride;
    let last = (off.saturating_add(len - 1) / r.stride).min(r.count - 1);
    Some((r, first, last))
}
