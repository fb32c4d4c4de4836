//! The in-process store: bounded RAM inside the engine's process, for
//! one-process setups and tests.
//!
//! The store server's RAM, in the engine's process: a [`Space`] keeps the
//! index of one arena of `capacity_bytes`, so both stores share its rules.
//!
//! * Capacity in bytes and in entries; a value larger than the capacity is
//!   [`ItemError::TooLarge`].
//! * With eviction on, the least recently used committed values nobody is
//!   reading make room (a get or put counts as a use); with it off, or
//!   when only puts under way and reads hold the space, a put is
//!   [`ItemError::Full`]: the pressure path.
//! * A put first reserves its extent, copies the bytes into it without
//!   holding the lock, then commits: `exists` and `get` see a value only
//!   once all its bytes are in, and a second writer of a pending key is
//!   [`ItemError::Busy`]. A get pins the value while it copies it out.
//! * A get of a value of another length than its scatter list writes
//!   nothing ([`ItemError::WrongSize`]).
//! * Keys that leave (evicted or removed) go to the space's removed log,
//!   bounded by `max_removed`; each handle reads it from where it last
//!   stopped ([`StoreBackend::take_removed`]), and what fell out of the
//!   log before it read it is counted.
//!
//! Handles are cheap clones sharing one store, so several connectors (the
//! ranks of one process) share it, each on its own backend thread.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvferry_machines::store::ChunkKey;
use kvferry_reactor::lock;

use super::arena::{AllocError, Arena};
use super::backend::{Answers, CallError, GetItem, ItemError, PutItem, PutOutcome, StoreBackend};
use super::proto::KeyAnswer;
use super::space::Space;

/// Bounds of an [`InprocStore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InprocConfig {
    /// Most bytes of values held (committed and pending): the arena's
    /// size, allocated zeroed (pages are the kernel's until written).
    pub capacity_bytes: u64,
    /// Most values held.
    pub max_entries: usize,
    /// Evict least recently used values to make room; `false`: a full
    /// store refuses puts.
    pub evict: bool,
    /// Most removed keys the log keeps for `take_removed`.
    pub max_removed: usize,
}

impl Default for InprocConfig {
    fn default() -> Self {
        InprocConfig {
            capacity_bytes: 1 << 30,
            max_entries: 1 << 20,
            evict: true,
            max_removed: 1 << 16,
        }
    }
}

/// Counters of an [`InprocStore`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InprocStats {
    /// `exists` calls.
    pub exists_calls: u64,
    /// `put` calls.
    pub put_calls: u64,
    /// `get` calls.
    pub get_calls: u64,
    /// `remove` calls.
    pub remove_calls: u64,
    /// Keys asked to be put.
    pub put_keys: u64,
    /// Values stored by puts.
    pub stored: u64,
    /// Puts refused for want of room.
    pub full: u64,
    /// Gets that found their value (of the right length).
    pub hits: u64,
    /// Gets that found nothing.
    pub misses: u64,
    /// Values evicted to make room.
    pub evictions: u64,
    /// Removed keys that fell out of the log before a handle read them.
    pub removed_dropped: u64,
    /// Bytes held now (committed and pending).
    pub used_bytes: u64,
    /// Values held now (committed and pending).
    pub entries: u64,
}

/// The index and the call counters, under one lock.
struct Inner {
    space: Space,
    calls: InprocStats,
}

struct Shared {
    inner: Mutex<Inner>,
    /// The values' bytes: the space hands each extent to one put (while
    /// reserved) or to readers (while pinned), never both, so the copies
    /// run without the lock.
    arena: Arena,
}

/// A handle on an in-process store. See the module docs.
#[derive(Clone)]
pub struct InprocStore {
    shared: Arc<Shared>,
    /// This handle's place in the removed log.
    removed_at: u64,
}

impl std::fmt::Debug for InprocStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InprocStore")
            .field("stats", &self.stats())
            .finish()
    }
}

impl InprocStore {
    /// An empty store, or why its arena of `capacity_bytes` cannot be had
    /// (not addressable, or refused by the allocator): a store never holds
    /// less room than its configuration says.
    pub fn new(cfg: InprocConfig) -> Result<InprocStore, AllocError> {
        let mut space = Space::new(cfg.capacity_bytes, cfg.max_entries);
        space = space.with_removed_log(cfg.max_removed);
        if !cfg.evict {
            space = space.without_eviction();
        }
        let inner = Inner {
            space,
            calls: InprocStats::default(),
        };
        Ok(InprocStore {
            shared: Arc::new(Shared {
                inner: Mutex::new(inner),
                arena: Arena::new(cfg.capacity_bytes)?,
            }),
            removed_at: 0,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere while holding the lock leaves a consistent
        // index: every update of the space completes before it returns.
        lock(&self.shared.inner)
    }

    /// The counters so far.
    pub fn stats(&self) -> InprocStats {
        let inner = self.lock();
        let s = inner.space.stats();
        InprocStats {
            stored: s.commits,
            full: s.full,
            hits: s.hits,
            misses: s.misses,
            evictions: s.evictions,
            used_bytes: s.used_bytes,
            entries: inner.space.len() as u64,
            ..inner.calls
        }
    }

    /// Stores `value` under `key` as a put would, from a buffer (tools and
    /// tests: a value of another length, a store filled beforehand).
    pub fn insert(&self, key: ChunkKey, value: &[u8]) -> Result<PutOutcome, ItemError> {
        self.put_with(&key, value.len() as u64, |room| room.copy_from_slice(value))
    }

    /// The committed value of `key`, if any (tools and tests).
    pub fn value(&self, key: &ChunkKey) -> Option<Vec<u8>> {
        let inner = self.lock();
        let (off, len) = inner.space.committed_extent(key.as_str())?;
        // SAFETY: the lock keeps the extent from being reused while read.
        Some(unsafe { self.shared.arena.extent(off, len) }.to_vec())
    }

    /// Reserves `len` bytes for `key`, fills them with `fill` outside the
    /// lock, and commits.
    fn put_with(
        &self,
        key: &ChunkKey,
        len: u64,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<PutOutcome, ItemError> {
        let off = match self.lock().space.reserve(key.as_str(), len) {
            Ok(off) => off,
            Err(KeyAnswer::Exists) => return Ok(PutOutcome::Exists),
            Err(answer) => return Err(item_error(answer, len)),
        };
        // SAFETY: the reservation is this put's alone until it commits.
        fill(unsafe { self.shared.arena.extent_mut(off, len) });
        self.lock().space.commit(key.as_str());
        Ok(PutOutcome::Stored)
    }

    fn put_one(&self, item: &PutItem) -> Result<PutOutcome, ItemError> {
        self.put_with(&item.key, item.from.len(), |room| item.from.read_into(room))
    }

    fn get_one(&self, item: &GetItem) -> Result<(), ItemError> {
        let want = item.into.len();
        let off = (self.lock().space.pin(item.key.as_str(), want))
            .map_err(|answer| item_error(answer, want))?;
        // SAFETY: the pin keeps writers and eviction off the extent.
        item.into
            .write_from(unsafe { self.shared.arena.extent(off, want) });
        self.lock().space.unpin(item.key.as_str());
        Ok(())
    }
}

/// The space's answer for one key as a backend's per-key error.
fn item_error(answer: KeyAnswer, want_bytes: u64) -> ItemError {
    match answer {
        KeyAnswer::Busy => ItemError::Busy,
        KeyAnswer::Full => ItemError::Full,
        KeyAnswer::TooLarge => ItemError::TooLarge,
        KeyAnswer::WrongSize { got_bytes } => ItemError::WrongSize {
            got_bytes,
            want_bytes,
        },
        _ => ItemError::NotFound,
    }
}

/// Runs `one` on each item while the deadline allows; the items after it
/// are [`ItemError::Timeout`] and their memory is not touched.
fn each<I, T>(
    items: &[I],
    deadline: Instant,
    mut one: impl FnMut(&I) -> Result<T, ItemError>,
) -> Answers<T> {
    Ok(items
        .iter()
        .map(|it| {
            if Instant::now() >= deadline {
                Err(ItemError::Timeout)
            } else {
                one(it)
            }
        })
        .collect())
}

impl StoreBackend for InprocStore {
    fn name(&self) -> &'static str {
        "inproc"
    }

    fn exists(&mut self, keys: &[ChunkKey], _deadline: Instant) -> Result<Vec<bool>, CallError> {
        let mut inner = self.lock();
        inner.calls.exists_calls += 1;
        Ok((keys.iter())
            .map(|k| inner.space.exists(k.as_str()))
            .collect())
    }

    fn put(&mut self, items: &[PutItem], deadline: Instant) -> Answers<PutOutcome> {
        {
            let mut inner = self.lock();
            inner.calls.put_calls += 1;
            inner.calls.put_keys += items.len() as u64;
        }
        each(items, deadline, |it| self.put_one(it))
    }

    fn get(&mut self, items: &[GetItem], deadline: Instant) -> Answers<()> {
        self.lock().calls.get_calls += 1;
        each(items, deadline, |it| self.get_one(it))
    }

    fn remove(&mut self, keys: &[ChunkKey], _deadline: Instant) -> Answers<()> {
        let mut inner = self.lock();
        inner.calls.remove_calls += 1;
        Ok((keys.iter())
            .map(|k| match inner.space.remove(k.as_str()) {
                KeyAnswer::Done => Ok(()),
                answer => Err(item_error(answer, 0)),
            })
            .collect())
    }

    fn remove_prefix(&mut self, prefix: &str, _deadline: Instant) -> Result<u64, CallError> {
        Ok(self.lock().space.remove_prefix(prefix))
    }

    fn take_removed(&mut self, max: usize) -> Vec<ChunkKey> {
        let (keys, _, next) = {
            let mut inner = lock(&self.shared.inner);
            let read = inner.space.removed_since(self.removed_at, max);
            inner.calls.removed_dropped += read.1;
            read
        };
        self.removed_at = next;
        // Every key in the log was a `ChunkKey`'s text.
        keys.into_iter()
            .filter_map(|k| ChunkKey::from_stored(k).ok())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Scatter, Segment};
    use kvferry_machines::store::BlockHash;
    use std::time::Duration;

    fn key(i: u64) -> ChunkKey {
        // Any keyspace will do: the store treats keys as opaque.
        let spec = kvferry_testkit::model::keyspace("m", kvferry_testkit::model::flat(1));
        let ks = kvferry_machines::store::Keyspace::new(&spec).unwrap();
        let scope = ks.scope(None, &[]).unwrap();
        ks.key(&ks.shards()[0], &scope, 0, &BlockHash::from_u64(i))
            .unwrap()
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    fn store(capacity_bytes: u64, evict: bool) -> InprocStore {
        InprocStore::new(InprocConfig {
            capacity_bytes,
            evict,
            ..InprocConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn a_reserved_put_is_invisible_until_committed() {
        let mut s = store(64, true);
        let off = s.lock().space.reserve(key(1).as_str(), 8).unwrap();
        assert_eq!(s.exists(&[key(1)], far()).unwrap(), vec![false]);
        assert_eq!(s.insert(key(1), &[0; 8]), Err(ItemError::Busy));
        let mut buf = [0u8; 8];
        // SAFETY: `buf` outlives the call and nothing else touches it.
        let into = unsafe {
            Scatter::from_raw(vec![Segment {
                addr: buf.as_mut_ptr() as u64,
                len: 8,
            }])
        };
        let item = GetItem { key: key(1), into };
        let got = s.get(std::slice::from_ref(&item), far()).unwrap();
        assert_eq!(got, vec![Err(ItemError::NotFound)]);
        // SAFETY: the reservation above is this test's alone.
        unsafe { s.shared.arena.extent_mut(off, 8) }.fill(7);
        s.lock().space.commit(key(1).as_str());
        assert_eq!(s.exists(&[key(1)], far()).unwrap(), vec![true]);
        assert_eq!(s.get(&[item], far()).unwrap(), vec![Ok(())]);
        assert_eq!(buf, [7; 8]);
    }

    #[test]
    fn the_least_recently_used_value_goes_first() {
        let mut s = store(24, true);
        for i in 1..=3 {
            s.insert(key(i), &[i as u8; 8]).unwrap();
        }
        let mut buf = [0u8; 8];
        // SAFETY: as above.
        let into = unsafe {
            Scatter::from_raw(vec![Segment {
                addr: buf.as_mut_ptr() as u64,
                len: 8,
            }])
        };
        assert_eq!(
            s.get(&[GetItem { key: key(1), into }], far()).unwrap(),
            vec![Ok(())]
        );
        s.insert(key(4), &[4; 8]).unwrap();
        let held = s.exists(&[key(1), key(2), key(3), key(4)], far()).unwrap();
        assert_eq!(held, vec![true, false, true, true]);
        assert_eq!(s.take_removed(16), vec![key(2)]);
        assert_eq!(s.stats().evictions, 1);
        assert_eq!(s.stats().used_bytes, 24);
    }

    #[test]
    fn full_and_too_large_are_told_apart() {
        let s = store(16, false);
        assert_eq!(s.insert(key(1), &[0; 17]), Err(ItemError::TooLarge));
        s.insert(key(1), &[0; 12]).unwrap();
        assert_eq!(s.insert(key(2), &[0; 8]), Err(ItemError::Full));
        assert_eq!(s.insert(key(1), &[0; 8]), Ok(PutOutcome::Exists));
        assert_eq!(s.stats().full, 1);
        let small = InprocStore::new(InprocConfig {
            max_entries: 1,
            evict: false,
            ..InprocConfig::default()
        })
        .unwrap();
        small.insert(key(1), &[0; 1]).unwrap();
        assert_eq!(small.insert(key(2), &[0; 1]), Err(ItemError::Full));
    }

    #[test]
    fn a_store_whose_room_cannot_be_had_is_an_error_not_a_smaller_store() {
        let too_big = InprocConfig {
            capacity_bytes: u64::MAX,
            ..InprocConfig::default()
        };
        let e = InprocStore::new(too_big).err();
        assert_eq!(e, Some(AllocError { bytes: u64::MAX }));
    }
}
