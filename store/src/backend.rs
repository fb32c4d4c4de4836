//! The one interface every store backend implements: [`StoreBackend`].
//!
//! # Sync, on a thread of its own
//!
//! The trait is synchronous: each method may block until the store
//! answered. A backend is never called from the engine's thread nor from a
//! glommio executor; [`super::worker::BackendWorker`] owns it on a
//! dedicated thread and takes calls over a bounded flume channel, so the
//! connector (and any glommio task, through flume's async receive) only
//! ever posts and collects. The planned Redis and Mooncake backends fit
//! this shape as they are: a Redis client pipelines one batch on its
//! socket and waits for the replies; Mooncake's C API (`mooncake_store_batch_put_from`,
//! `mooncake_store_batch_get_into`, `mooncake_store_batch_is_exist`)
//! blocks the calling thread. An async trait on glommio would fit neither
//! without a thread of its own anyway.
//!
//! # Memory
//!
//! Puts read and gets write the engine's memory through [`Scatter`] lists:
//! per key, the `(address, length)` segments of the block's value in the
//! order of the registered regions. A `Scatter` is made only by
//! [`super::memory::RegisteredMemory`], which checks every segment against
//! the regions the engine registered, so a backend given one may touch
//! exactly those bytes and no others (Mooncake registers the same regions
//! as its buffers, a Redis client copies them into its socket).
//!
//! # The deadline
//!
//! Each call carries its deadline: the time posted plus
//! `StoreConfig::op_bound`. A backend must not touch a call's memory after
//! it; it answers [`CallError::Timeout`] instead (sockets with a timeout,
//! Mooncake's own transfer timeout). The save and load machines give the
//! blocks back to the engine once a call is past its deadline, so this is
//! what keeps a late put from reading a block that is someone else's.

use std::time::Instant;

use kvferry_machines::store::load::GetResult;
use kvferry_machines::store::save::PutResult;
use kvferry_machines::store::{ChunkKey, StoreFault};
use kvferry_machines::RankLayout;

/// One contiguous piece of engine memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Its first byte.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// The segments of one value, each inside the engine's registered memory.
/// Made only by [`super::memory::RegisteredMemory::scatter`] (or the
/// unsafe [`Scatter::from_raw`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scatter {
    segments: Vec<Segment>,
    len: u64,
}

impl Scatter {
    /// A scatter list over arbitrary memory.
    ///
    /// # Safety
    ///
    /// Every segment must be memory that stays valid, and that nothing
    /// else reads (for a get) or writes (for a put or get), until the call
    /// it is given to has answered or passed its deadline.
    pub unsafe fn from_raw(segments: Vec<Segment>) -> Scatter {
        Scatter::checked(segments)
    }

    /// Called once the segments were checked against registered memory.
    pub(crate) fn checked(segments: Vec<Segment>) -> Scatter {
        let len = (segments.iter()).fold(0u64, |s, seg| s.saturating_add(seg.len));
        Scatter { segments, len }
    }

    /// The segments, in value order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Bytes of the value: the segments' lengths summed.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when the value has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies the value out of engine memory, segment after segment.
    /// `out` must be exactly [`Scatter::len`] bytes.
    pub fn read_into(&self, out: &mut [u8]) {
        assert_eq!(out.len() as u64, self.len, "buffer of the value's length");
        let mut at = 0usize;
        for seg in &self.segments {
            let n = seg.len as usize;
            // SAFETY: the segment lies in registered memory (or was vouched
            // for by `from_raw`), and `out` has room for it.
            unsafe {
                std::ptr::copy_nonoverlapping(seg.addr as *const u8, out[at..].as_mut_ptr(), n);
            }
            at += n;
        }
    }

    /// Copies `value` into engine memory, segment after segment. `value`
    /// must be exactly [`Scatter::len`] bytes: a backend checks the length
    /// before (a wrong one is [`ItemError::WrongSize`]), so no byte lands
    /// past a block.
    pub fn write_from(&self, value: &[u8]) {
        assert_eq!(
            value.len() as u64,
            self.len,
            "value of the scatter's length"
        );
        let mut at = 0usize;
        for seg in &self.segments {
            let n = seg.len as usize;
            // SAFETY: as in `read_into`; `value[at..at + n]` exists since
            // the lengths were compared above.
            unsafe {
                std::ptr::copy_nonoverlapping(value[at..].as_ptr(), seg.addr as *mut u8, n);
            }
            at += n;
        }
    }
}

/// One key of a batched put: its value is read from `from`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutItem {
    /// The key.
    pub key: ChunkKey,
    /// Where its value is.
    pub from: Scatter,
}

/// One key of a batched get: its value is written into `into`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GetItem {
    /// The key.
    pub key: ChunkKey,
    /// Where its value goes; its length is the value's expected length.
    pub into: Scatter,
}

/// Why one key of a batch failed while the call as a whole was answered.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ItemError {
    /// No such key, or its put is not committed yet.
    #[error("not found")]
    NotFound,
    /// The store has no room (Mooncake's `NO_AVAILABLE_HANDLE`, Redis's
    /// OOM reply): the pressure path.
    #[error("the store is full")]
    Full,
    /// The store refuses a value this large.
    #[error("value too large for the store")]
    TooLarge,
    /// The stored value has another length than asked for; nothing was
    /// written.
    #[error("stored value is {got_bytes} bytes, not the {want_bytes} asked for")]
    WrongSize {
        /// The stored value's length.
        got_bytes: u64,
        /// The length the get asked for.
        want_bytes: u64,
    },
    /// The stored value is not one this store wrote whole (a foreign,
    /// truncated or corrupt value: its header or checksum does not
    /// match); nothing was written.
    #[error("stored value is corrupt, truncated or foreign")]
    Corrupt,
    /// A put of the key by another writer is under way.
    #[error("another put of the key is under way")]
    Busy,
    /// This key's transfer failed (a Mooncake per-key error code).
    #[error("transport failure")]
    Transport,
    /// This key was not done within the call's deadline.
    #[error("timed out")]
    Timeout,
}

/// What a put did with one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    /// The value is stored (and committed: lookups see it).
    Stored,
    /// The key was stored already; its value is left as it was.
    Exists,
}

/// Why a whole call failed: no per-key answer came back.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The store could not be reached, or the connection broke midway.
    #[error("the store could not be reached")]
    Transport,
    /// The call was not answered by its deadline.
    #[error("the call passed its deadline")]
    Timeout,
    /// The store refused the call (protocol error, bad request).
    #[error("the store refused the call")]
    Refused,
}

impl From<CallError> for StoreFault {
    fn from(e: CallError) -> StoreFault {
        match e {
            CallError::Transport => StoreFault::Transport,
            CallError::Timeout => StoreFault::Timeout,
            CallError::Refused => StoreFault::Refused,
        }
    }
}

/// One answer per key of a batch, in the batch's order.
pub type Answers<T> = Result<Vec<Result<T, ItemError>>, CallError>;

/// A store, called on one thread (see the module docs). Every batched
/// method answers one result per key, in the order asked, or fails as a
/// whole; an answer of another length is treated as a failed call.
pub trait StoreBackend: Send + 'static {
    /// A short name for logs and stats (`inproc`, `redis`, `mooncake`).
    fn name(&self) -> &'static str;

    /// The engine's KV memory, once, before any put or get names it: a
    /// backend that moves bytes itself registers it with its transport
    /// (kvferry's server, Mooncake's `register_buffer`); one that copies
    /// through its client needs nothing.
    fn register(&mut self, layout: &RankLayout) -> Result<(), CallError> {
        let _ = layout;
        Ok(())
    }

    /// Per key, whether a committed value exists.
    fn exists(&mut self, keys: &[ChunkKey], deadline: Instant) -> Result<Vec<bool>, CallError>;

    /// Stores each item's value, read from its scatter list. A value is
    /// visible to `exists` and `get` only once all its bytes are in.
    fn put(&mut self, items: &[PutItem], deadline: Instant) -> Answers<PutOutcome>;

    /// Writes each item's value into its scatter list, or answers
    /// [`ItemError::WrongSize`] without writing when the stored value has
    /// another length.
    fn get(&mut self, items: &[GetItem], deadline: Instant) -> Answers<()>;

    /// Removes the keys; a missing one is [`ItemError::NotFound`].
    fn remove(&mut self, keys: &[ChunkKey], deadline: Instant) -> Answers<()>;

    /// Removes every key that starts with `prefix` (a model's keys:
    /// vLLM's `reset_prefix_cache`); how many. A store that cannot list
    /// its keys refuses ([`CallError::Refused`]).
    fn remove_prefix(&mut self, prefix: &str, deadline: Instant) -> Result<u64, CallError> {
        let _ = (prefix, deadline);
        Err(CallError::Refused)
    }

    /// Keys that left the store (evicted or removed) since the last call,
    /// at most `max` (the rest stay for the next call); for `BlockRemoved`
    /// events. A store that cannot tell answers none.
    fn take_removed(&mut self, max: usize) -> Vec<ChunkKey> {
        let _ = max;
        Vec::new()
    }
}

/// The save machine's view of one put answer.
pub(crate) fn put_result(r: &Result<PutOutcome, ItemError>) -> PutResult {
    match r {
        Ok(PutOutcome::Stored) => PutResult::Stored,
        Ok(PutOutcome::Exists) => PutResult::Exists,
        Err(ItemError::Full) => PutResult::Full,
        Err(ItemError::TooLarge) => PutResult::TooLarge,
        Err(_) => PutResult::Failed,
    }
}

/// The load machine's view of one get answer.
pub(crate) fn get_result(r: &Result<(), ItemError>) -> GetResult {
    match r {
        Ok(()) => GetResult::Loaded,
        Err(ItemError::NotFound) => GetResult::NotFound,
        Err(ItemError::WrongSize { got_bytes, .. }) => GetResult::WrongSize {
            got_bytes: *got_bytes,
        },
        Err(ItemError::Corrupt) => GetResult::Failed,
        Err(_) => GetResult::Failed,
    }
}
