//! Descriptors and the bounded batches they are posted in.

use std::ops::Range;

use crate::layout::BatchLimits;

use super::error::PlanError;
use super::maps::{RegionMap, Run};

/// One copy: `len` bytes from `src` (prefill memory) to `dst` (decode memory).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Descriptor {
    /// Source address on the prefill rank.
    pub src: u64,
    /// Destination address on the decode rank.
    pub dst: u64,
    /// Bytes to copy; never zero in a plan.
    pub len: u64,
}

/// A batch: `count` descriptors starting at index `first`, posted together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Batch {
    /// Index of the batch's first descriptor.
    pub first: usize,
    /// Number of descriptors in the batch (at least one).
    pub count: usize,
}

impl Batch {
    /// The batch's descriptor indices.
    pub fn range(&self) -> Range<usize> {
        self.first..self.first + self.count
    }
}

/// Appends descriptors, cutting them at the batch byte limit so every
/// descriptor fits in a batch, and refusing to grow past `descriptors_max`.
pub(super) struct Sink<'a> {
    pub(super) out: &'a mut Vec<Descriptor>,
    pub(super) bytes_max: u64,
    pub(super) descriptors_max: usize,
    /// Where batches go, if the caller wants them.
    pub(super) batches: Option<&'a mut Vec<Batch>>,
    pub(super) batcher: Batcher,
    pub(super) limits: &'a BatchLimits,
}

impl Sink<'_> {
    /// Cuts batches over the descriptors written since the last call, each
    /// at most `len_max` bytes.
    #[inline]
    pub(super) fn cut_batches(&mut self, len_max: u64) {
        if let Some(batches) = self.batches.as_deref_mut() {
            self.batcher
                .feed_bounded(self.out, self.limits, batches, len_max);
        }
    }

    pub(super) fn finish_batches(&mut self) {
        self.cut_batches(self.bytes_max);
        if let Some(batches) = self.batches.as_deref_mut() {
            self.batcher.finish(batches);
        }
    }

    pub(super) fn too_many(&self) -> PlanError {
        PlanError::TooManyDescriptors {
            max: self.descriptors_max,
        }
    }

    #[inline]
    pub(super) fn emit(
        &mut self,
        mut src: u64,
        mut dst: u64,
        mut len: u64,
    ) -> Result<(), PlanError> {
        while len > 0 {
            if self.out.len() >= self.descriptors_max {
                return Err(self.too_many());
            }
            let take = len.min(self.bytes_max);
            self.out.push(Descriptor {
                src,
                dst,
                len: take,
            });
            len -= take;
            // The sum may pass the top of the address space only when the
            // loop ends, so it is never used.
            src = src.wrapping_add(take);
            dst = dst.wrapping_add(take);
        }
        Ok(())
    }

    /// One copy per run of whole blocks; the caller checked that none
    /// exceeds the byte limit. A single `extend` over a slice iterator lets
    /// the compiler drop the per-element capacity check.
    pub(super) fn extend_runs(&mut self, map: &RegionMap, runs: &[Run]) -> Result<(), PlanError> {
        if self.descriptors_max - self.out.len().min(self.descriptors_max) < runs.len() {
            return Err(self.too_many());
        }
        // Validation bounds every address: block ids are below num_blocks
        // and the region's last byte fits in u64.
        self.out.extend(runs.iter().map(|run| Descriptor {
            src: map.src_base + run.src * map.src_block_len + map.src_off,
            dst: map.dst_base + run.dst * map.dst_block_len + map.dst_off,
            len: map.len * run.len,
        }));
        Ok(())
    }
}

/// Cuts `descriptors` into consecutive batches of at most
/// `batch_descriptors_max` descriptors and `batch_bytes_max` bytes, into
/// `batches` (cleared first). A descriptor longer than the byte limit (which
/// the planner never emits) gets a batch of its own.
pub fn split_batches(descriptors: &[Descriptor], limits: &BatchLimits, batches: &mut Vec<Batch>) {
    batches.clear();
    let mut batcher = Batcher::default();
    batcher.feed(descriptors, limits, batches);
    batcher.finish(batches);
}

/// Incremental batch cutting over a growing descriptor vector.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Batcher {
    /// Index of the first descriptor not yet seen.
    pub(super) next: usize,
    /// The open batch.
    pub(super) first: usize,
    pub(super) count: usize,
    pub(super) bytes: u64,
}

impl Batcher {
    /// Takes in `descriptors[self.next..]`, closing full batches.
    #[inline]
    pub(super) fn feed(
        &mut self,
        descriptors: &[Descriptor],
        limits: &BatchLimits,
        batches: &mut Vec<Batch>,
    ) {
        let count_max = limits.batch_descriptors_max.max(1);
        let Some(new) = descriptors.get(self.next..) else {
            return;
        };
        for d in new {
            if self.count == count_max || limits.batch_bytes_max.saturating_sub(self.bytes) < d.len
            {
                self.finish(batches);
            }
            self.count += 1;
            self.bytes = self.bytes.saturating_add(d.len);
        }
        self.next = descriptors.len();
    }

    /// Like [`Batcher::feed`] when every new descriptor is at most
    /// `len_max` bytes. If a full batch of such descriptors cannot reach the
    /// byte limit, batches are cut by count alone, in O(batches) instead of
    /// O(descriptors).
    #[inline]
    pub(super) fn feed_bounded(
        &mut self,
        descriptors: &[Descriptor],
        limits: &BatchLimits,
        batches: &mut Vec<Batch>,
        len_max: u64,
    ) {
        let count_max = limits.batch_descriptors_max.max(1);
        let room = count_max.saturating_sub(self.count) as u64;
        let by_count_alone = len_max
            .checked_mul(count_max as u64)
            .is_some_and(|b| b <= limits.batch_bytes_max)
            && self.bytes.saturating_add(len_max.saturating_mul(room)) <= limits.batch_bytes_max;
        let end = descriptors.len();
        if !by_count_alone || self.next > end {
            self.feed(descriptors, limits, batches);
            return;
        }
        let open_before = self.first;
        let mut i = self.next;
        while i < end {
            if self.count == count_max {
                batches.push(Batch {
                    first: self.first,
                    count: self.count,
                });
                self.first += self.count;
                self.count = 0;
            }
            let take = (count_max - self.count).min(end - i);
            self.count += take;
            i += take;
        }
        // Only the open batch's bytes matter from here on: add the new
        // descriptors to it, or sum it afresh if it was opened in this call
        // (then it holds at most `count_max` descriptors, all new).
        let (from, base) = if self.first == open_before {
            (self.next, self.bytes)
        } else {
            (self.first, 0)
        };
        self.bytes = descriptors[from..end]
            .iter()
            .fold(base, |sum, d| sum.saturating_add(d.len));
        self.next = end;
    }

    /// Closes the open batch, if any.
    #[inline]
    pub(super) fn finish(&mut self, batches: &mut Vec<Batch>) {
        if self.count > 0 {
            batches.push(Batch {
                first: self.first,
                count: self.count,
            });
            self.first += self.count;
            self.count = 0;
            self.bytes = 0;
        }
    }
}
