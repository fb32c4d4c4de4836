//! The engine memory a connector may touch, and the only way to a
//! [`Scatter`]: every segment checked against the registered regions
//! before any backend reads or writes it.

use kvferry_machines::{BlockId, RankLayout};

use super::backend::{Scatter, Segment};

/// Why a layout cannot be registered, or a block not be addressed.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    /// The layout registers no region.
    #[error("the layout has no region")]
    NoRegions,
    /// A region's per-block bytes exceed its block stride, or are zero.
    #[error("region {region}: {kv_block_len} KV bytes in a block of {block_len}")]
    BadRegion {
        /// The region.
        region: usize,
        /// Its KV bytes per block.
        kv_block_len: u64,
        /// Its block stride.
        block_len: u64,
    },
    /// A region's end does not fit in the address space.
    #[error("region {region} ends past the address space")]
    RegionOverflow {
        /// The region.
        region: usize,
    },
    /// Two regions share bytes: a get into one block would write another.
    #[error("regions {a} and {b} overlap")]
    Overlap {
        /// One region.
        a: usize,
        /// The other.
        b: usize,
    },
    /// A block id past the registered blocks.
    #[error("block {block} is not below the {num_blocks} registered blocks")]
    BlockOutOfRange {
        /// The block.
        block: u32,
        /// Blocks per region.
        num_blocks: u64,
    },
}

/// The regions an engine registered, validated once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegisteredMemory {
    layout: RankLayout,
}

impl RegisteredMemory {
    /// Checks `layout`: at least one region, KV bytes within each block's
    /// stride, every region's `num_blocks × block_len` bytes addressable,
    /// and no two regions overlapping.
    pub fn new(layout: RankLayout) -> Result<RegisteredMemory, MemoryError> {
        if layout.regions.is_empty() {
            return Err(MemoryError::NoRegions);
        }
        let mut spans = Vec::with_capacity(layout.regions.len());
        for (i, r) in layout.regions.iter().enumerate() {
            if r.kv_block_len == 0 || r.kv_block_len > r.block_len {
                return Err(MemoryError::BadRegion {
                    region: i,
                    kv_block_len: r.kv_block_len,
                    block_len: r.block_len,
                });
            }
            let end = (layout.num_blocks.checked_mul(r.block_len))
                .and_then(|n| r.base.checked_add(n))
                .ok_or(MemoryError::RegionOverflow { region: i })?;
            spans.push((r.base, end, i));
        }
        spans.sort_unstable();
        // The region reaching furthest so far: any later one starting
        // before its end shares bytes with it.
        let mut furthest: Option<(u64, usize)> = None;
        for &(base, end, i) in &spans {
            if let Some((reach, a)) = furthest {
                if base < reach && base < end {
                    return Err(MemoryError::Overlap { a, b: i });
                }
            }
            if furthest.is_none_or(|(reach, _)| end > reach) {
                furthest = Some((end, i));
            }
        }
        Ok(RegisteredMemory { layout })
    }

    /// The layout as registered.
    pub fn layout(&self) -> &RankLayout {
        &self.layout
    }

    /// Bytes of one block's value: its KV bytes in every region.
    pub fn value_bytes(&self) -> u64 {
        kvferry_machines::store::value_bytes(&self.layout)
    }

    /// Checks that `block` is a registered block.
    pub fn check_block(&self, block: BlockId) -> Result<(), MemoryError> {
        if u64::from(block.0) >= self.layout.num_blocks {
            return Err(MemoryError::BlockOutOfRange {
                block: block.0,
                num_blocks: self.layout.num_blocks,
            });
        }
        Ok(())
    }

    /// The value of `block`: its KV bytes in each region, in region order.
    /// Each segment lies inside its region (`new` bounded the regions,
    /// `check_block` the block).
    pub fn scatter(&self, block: BlockId) -> Result<Scatter, MemoryError> {
        self.check_block(block)?;
        let b = u64::from(block.0);
        let segments = (self.layout.regions.iter())
            .map(|r| Segment {
                // Below `base + num_blocks × block_len`, which `new`
                // checked fits, since `b < num_blocks` and
                // `kv_block_len <= block_len`.
                addr: r.base + b * r.block_len,
                len: r.kv_block_len,
            })
            .collect();
        Ok(Scatter::checked(segments))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_machines::{Region, Stage};

    fn layout(regions: Vec<Region>, num_blocks: u64) -> RankLayout {
        RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks,
            regions,
            stage: Stage::SINGLE,
            pools: Vec::new(),
        }
    }

    fn region(base: u64, block_len: u64, kv_block_len: u64) -> Region {
        Region {
            base,
            block_len,
            kv_block_len,
        }
    }

    #[test]
    fn segments_stay_inside_their_regions() {
        let m = RegisteredMemory::new(layout(
            vec![region(0x1000, 64, 48), region(0x2000, 32, 32)],
            4,
        ))
        .unwrap();
        let s = m.scatter(BlockId(3)).unwrap();
        assert_eq!(
            s.segments(),
            &[
                Segment {
                    addr: 0x1000 + 192,
                    len: 48
                },
                Segment {
                    addr: 0x2000 + 96,
                    len: 32
                }
            ]
        );
        assert_eq!(s.len(), 80);
        assert_eq!(
            m.scatter(BlockId(4)),
            Err(MemoryError::BlockOutOfRange {
                block: 4,
                num_blocks: 4
            })
        );
    }

    #[test]
    fn bad_layouts_are_refused() {
        let over = layout(vec![region(u64::MAX - 10, 8, 8)], 4);
        assert_eq!(
            RegisteredMemory::new(over),
            Err(MemoryError::RegionOverflow { region: 0 })
        );
        let wide = layout(vec![region(0, 8, 9)], 4);
        assert!(matches!(
            RegisteredMemory::new(wide),
            Err(MemoryError::BadRegion { region: 0, .. })
        ));
        let overlap = layout(vec![region(0, 8, 8), region(31, 8, 8)], 4);
        assert_eq!(
            RegisteredMemory::new(overlap),
            Err(MemoryError::Overlap { a: 0, b: 1 })
        );
        assert_eq!(
            RegisteredMemory::new(layout(vec![], 4)),
            Err(MemoryError::NoRegions)
        );
    }
}
