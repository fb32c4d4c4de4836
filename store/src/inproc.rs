//! The in-process store: bounded RAM inside the engine's process, for
//! one-process setups and tests.
//!
//! * Capacity in bytes and in entries; a value larger than the capacity is
//!   [`ItemError::TooLarge`].
//! * With eviction on, the least recently used committed values make room
//!   (a get or put counts as a use); with it off, or when only puts under
//!   way hold the space, a put is [`ItemError::Full`]: the pressure path.
//! * A put first reserves its room as a pending entry, copies the bytes
//!   without holding the lock, then commits: `exists` and `get` see a value
//!   only once all its bytes are in, and a second writer of a pending key
//!   is [`ItemError::Busy`].
//! * A get of a value of another length than its scatter list writes
//!   nothing ([`ItemError::WrongSize`]).
//! * Keys that leave (evicted or removed) queue for
//!   [`StoreBackend::take_removed`], bounded by `max_removed`; overflow is
//!   counted.
//!
//! Handles are cheap clones sharing one store, so several connectors (the
//! ranks of one process) share it, each on its own backend thread.

use kvferry_reactor::sync::lock;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvferry_machines::store::ChunkKey;

use super::backend::{Answers, CallError, GetItem, ItemError, PutItem, PutOutcome, StoreBackend};

/// Bounds of an [`InprocStore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InprocConfig {
    /// Most bytes of values held (committed and pending).
    pub capacity_bytes: u64,
    /// Most values held.
    pub max_entries: usize,
    /// Evict least recently used values to make room; `false`: a full
    /// store refuses puts.
    pub evict: bool,
    /// Most removed keys queued for `take_removed`.
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
    /// Removed keys dropped because the queue was full.
    pub removed_dropped: u64,
    /// Bytes held now (committed and pending).
    pub used_bytes: u64,
    /// Values held now (committed and pending).
    pub entries: u64,
}

enum Entry {
    /// Room reserved; the bytes are being copied in.
    Pending { bytes: u64 },
    /// Visible to lookups and gets.
    Committed { value: Arc<[u8]>, tick: u64 },
}

impl Entry {
    fn bytes(&self) -> u64 {
        match self {
            Entry::Pending { bytes } => *bytes,
            Entry::Committed { value, .. } => value.len() as u64,
        }
    }
}

struct Inner {
    cfg: InprocConfig,
    entries: HashMap<ChunkKey, Entry>,
    /// Committed keys by last use, oldest first.
    lru: BTreeMap<u64, ChunkKey>,
    tick: u64,
    removed: VecDeque<ChunkKey>,
    stats: InprocStats,
}

/// A handle on an in-process store. See the module docs.
#[derive(Clone)]
pub struct InprocStore {
    inner: Arc<Mutex<Inner>>,
}

impl std::fmt::Debug for InprocStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InprocStore")
            .field("stats", &self.stats())
            .finish()
    }
}

impl InprocStore {
    /// An empty store.
    pub fn new(cfg: InprocConfig) -> InprocStore {
        InprocStore {
            inner: Arc::new(Mutex::new(Inner {
                cfg,
                entries: HashMap::new(),
                lru: BTreeMap::new(),
                tick: 0,
                removed: VecDeque::new(),
                stats: InprocStats::default(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere while holding the lock leaves consistent maps:
        // every update below is completed before the guard drops.
        lock(&self.inner)
    }

    /// The counters so far.
    pub fn stats(&self) -> InprocStats {
        self.lock().stats
    }

    /// Stores `value` under `key` as a put would, from a buffer (tools and
    /// tests: a value of another length, a store filled beforehand).
    pub fn insert(&self, key: ChunkKey, value: &[u8]) -> Result<PutOutcome, ItemError> {
        let mut inner = self.lock();
        if let Some(outcome) = inner.reserve(&key, value.len() as u64)? {
            return Ok(outcome);
        }
        inner.commit(key, Arc::from(value));
        Ok(PutOutcome::Stored)
    }

    /// The committed value of `key`, if any (tools and tests).
    pub fn value(&self, key: &ChunkKey) -> Option<Vec<u8>> {
        match self.lock().entries.get(key) {
            Some(Entry::Committed { value, .. }) => Some(value.to_vec()),
            _ => None,
        }
    }

    fn put_one(&self, item: &PutItem) -> Result<PutOutcome, ItemError> {
        let bytes = item.from.len();
        if let Some(outcome) = self.lock().reserve(&item.key, bytes)? {
            return Ok(outcome);
        }
        // The room is ours; copy without holding the lock.
        let mut value = vec![0u8; bytes as usize];
        item.from.read_into(&mut value);
        self.lock().commit(item.key.clone(), Arc::from(value));
        Ok(PutOutcome::Stored)
    }

    fn get_one(&self, item: &GetItem) -> Result<(), ItemError> {
        let value = {
            let mut inner = self.lock();
            match inner.touch(&item.key) {
                Some(v) => v,
                None => {
                    inner.stats.misses += 1;
                    return Err(ItemError::NotFound);
                }
            }
        };
        let want_bytes = item.into.len();
        if value.len() as u64 != want_bytes {
            return Err(ItemError::WrongSize {
                got_bytes: value.len() as u64,
                want_bytes,
            });
        }
        item.into.write_from(&value);
        self.lock().stats.hits += 1;
        Ok(())
    }
}

impl Inner {
    /// Reserves room for a put of `key`: `Some(Exists)` when it is stored
    /// already, `None` when a pending entry now holds the room.
    fn reserve(&mut self, key: &ChunkKey, bytes: u64) -> Result<Option<PutOutcome>, ItemError> {
        match self.entries.get(key) {
            Some(Entry::Committed { .. }) => return Ok(Some(PutOutcome::Exists)),
            Some(Entry::Pending { .. }) => return Err(ItemError::Busy),
            None => {}
        }
        if bytes > self.cfg.capacity_bytes {
            return Err(ItemError::TooLarge);
        }
        while self.stats.used_bytes + bytes > self.cfg.capacity_bytes
            || self.entries.len() >= self.cfg.max_entries
        {
            if !self.cfg.evict || !self.evict_oldest() {
                self.stats.full += 1;
                return Err(ItemError::Full);
            }
        }
        self.entries.insert(key.clone(), Entry::Pending { bytes });
        self.stats.used_bytes += bytes;
        self.stats.entries = self.entries.len() as u64;
        Ok(None)
    }

    /// Makes a reserved key's value visible.
    fn commit(&mut self, key: ChunkKey, value: Arc<[u8]>) {
        self.tick += 1;
        self.lru.insert(self.tick, key.clone());
        self.entries.insert(
            key,
            Entry::Committed {
                value,
                tick: self.tick,
            },
        );
        self.stats.stored += 1;
    }

    /// The committed value of `key`, now the most recently used.
    fn touch(&mut self, key: &ChunkKey) -> Option<Arc<[u8]>> {
        let next = self.tick + 1;
        let Some(Entry::Committed { value, tick }) = self.entries.get_mut(key) else {
            return None;
        };
        let old = std::mem::replace(tick, next);
        let value = value.clone();
        self.tick = next;
        self.lru.remove(&old);
        self.lru.insert(next, key.clone());
        Some(value)
    }

    /// Evicts the least recently used committed value; false if none.
    fn evict_oldest(&mut self) -> bool {
        let Some((_, key)) = self.lru.pop_first() else {
            return false;
        };
        self.drop_entry(&key);
        self.stats.evictions += 1;
        true
    }

    /// Forgets `key`'s entry and queues it as removed.
    fn drop_entry(&mut self, key: &ChunkKey) {
        if let Some(e) = self.entries.remove(key) {
            self.stats.used_bytes -= e.bytes();
            self.stats.entries = self.entries.len() as u64;
            if let Entry::Committed { tick, .. } = e {
                self.lru.remove(&tick);
            }
        }
        if self.removed.len() < self.cfg.max_removed {
            self.removed.push_back(key.clone());
        } else {
            self.stats.removed_dropped += 1;
        }
    }

    fn remove_one(&mut self, key: &ChunkKey) -> Result<(), ItemError> {
        match self.entries.get(key) {
            Some(Entry::Committed { .. }) => {
                self.drop_entry(key);
                Ok(())
            }
            Some(Entry::Pending { .. }) => Err(ItemError::Busy),
            None => Err(ItemError::NotFound),
        }
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
        inner.stats.exists_calls += 1;
        Ok((keys.iter())
            .map(|k| matches!(inner.entries.get(k), Some(Entry::Committed { .. })))
            .collect())
    }

    fn put(&mut self, items: &[PutItem], deadline: Instant) -> Answers<PutOutcome> {
        {
            let mut inner = self.lock();
            inner.stats.put_calls += 1;
            inner.stats.put_keys += items.len() as u64;
        }
        each(items, deadline, |it| self.put_one(it))
    }

    fn get(&mut self, items: &[GetItem], deadline: Instant) -> Answers<()> {
        self.lock().stats.get_calls += 1;
        each(items, deadline, |it| self.get_one(it))
    }

    fn remove(&mut self, keys: &[ChunkKey], _deadline: Instant) -> Answers<()> {
        let mut inner = self.lock();
        inner.stats.remove_calls += 1;
        Ok(keys.iter().map(|k| inner.remove_one(k)).collect())
    }

    fn take_removed(&mut self, max: usize) -> Vec<ChunkKey> {
        let mut inner = self.lock();
        let n = max.min(inner.removed.len());
        inner.removed.drain(..n).collect()
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
        let spec = kvferry_machines::store::KeyspaceSpec {
            model_name: "m".into(),
            model: kvferry_machines::layout::ModelSpec {
                layout: kvferry_machines::layout::LayoutKind::Hnd,
                total_kv_heads: 1,
                block_tokens: 1,
                head_bytes: 1,
            },
            dtype: "bf16".into(),
            tp_size: 1,
            pp_size: 1,
            groups: vec![kvferry_machines::store::GroupSpec {
                block_tokens: 1,
                window_tokens: None,
            }],
        };
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
    }

    #[test]
    fn a_reserved_put_is_invisible_until_committed() {
        let mut s = store(64, true);
        s.lock().reserve(&key(1), 8).unwrap();
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
        s.lock().commit(key(1), Arc::from(&[7u8; 8][..]));
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
        });
        small.insert(key(1), &[0; 1]).unwrap();
        assert_eq!(small.insert(key(2), &[0; 1]), Err(ItemError::Full));
    }
}
