//! The fence handshake of shared-memory copies, over any atomic words: the
//! control file's words in the transport, loom's in
//! `transport/tests/loom_shm.rs`, which model-checks exactly these
//! functions.
//!
//! A lane is four words: `seq` (odd while a copy runs) and the `space`,
//! `first` and `last` slot the copy touches. The store of an odd `seq`
//! and the loads of the fence's words after it are separated by a
//! sequentially consistent fence, as are the owner's clear of a bit and
//! its look at the lanes after it (Dekker): at least one side sees the
//! other's store.

/// One shared 64-bit word.
pub trait Word {
    /// Loads it.
    fn get(&self) -> u64;
    /// Stores `v`.
    fn set(&self, v: u64);
    /// Clears the bits of `mask`.
    fn clear(&self, mask: u64);
    /// Sets the bits of `mask`.
    fn raise(&self, mask: u64);
    /// A sequentially consistent fence.
    fn fence();
}

impl Word for std::sync::atomic::AtomicU64 {
    fn get(&self) -> u64 {
        self.load(std::sync::atomic::Ordering::SeqCst)
    }
    fn set(&self, v: u64) {
        self.store(v, std::sync::atomic::Ordering::SeqCst)
    }
    fn clear(&self, mask: u64) {
        self.fetch_and(!mask, std::sync::atomic::Ordering::SeqCst);
    }
    fn raise(&self, mask: u64) {
        self.fetch_or(mask, std::sync::atomic::Ordering::SeqCst);
    }
    fn fence() {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A lane's words.
pub struct Lane<'a, W> {
    /// Odd while a copy runs.
    pub seq: &'a W,
    /// The space, first and last slot of the copy.
    pub range: [&'a W; 3],
}

/// The initiator enters a copy of `range`: publishes it, then asks
/// `allowed` (the generation and the slots' bits). Returns the odd
/// sequence to leave with; the lane is left at once when not allowed.
pub fn enter<W: Word>(
    lane: &Lane<'_, W>,
    range: [u64; 3],
    allowed: impl FnOnce() -> bool,
) -> Result<u64, u64> {
    for (w, v) in lane.range.iter().zip(range) {
        w.set(v);
    }
    let seq = lane.seq.get() | 1;
    lane.seq.set(seq);
    W::fence();
    if allowed() {
        Ok(seq)
    } else {
        leave(lane, seq);
        Err(seq)
    }
}

/// The initiator leaves the copy it entered at `seq`.
pub fn leave<W: Word>(lane: &Lane<'_, W>, seq: u64) {
    lane.seq.set(seq.wrapping_add(1));
}

/// The owner, after clearing bits (or bumping the generation): the
/// sequence to wait for the lane to leave when it is in a copy that
/// `hits` its range, `None` when there is nothing to wait for.
pub fn busy<W: Word>(lane: &Lane<'_, W>, hits: impl FnOnce(u64, u64, u64) -> bool) -> Option<u64> {
    W::fence();
    let seq = lane.seq.get();
    if seq.is_multiple_of(2) {
        return None;
    }
    let [s, f, l] = lane.range.map(Word::get);
    // Read again: a lane that moved on ended the copy seen first, and a
    // copy that started since saw the owner's store.
    (lane.seq.get() == seq && hits(s, f, l)).then_some(seq)
}
