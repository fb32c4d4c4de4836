//! The store's RAM, IO-free: an arena of `capacity_bytes` cut into
//! extents, the index of keys, least-recently-used eviction and the log of
//! removed keys. One type serves both RAM stores: the store server's
//! arena (`kvferry store serve`) and the in-process store
//! ([`crate::inproc`]); each owns the arena's bytes (an
//! [`Arena`](crate::arena::Arena)) and asks the space where a value lives.
//! What a full arena does is the space's rule: evict the least recently
//! used values nobody reads or writes, or, [`Space::without_eviction`],
//! refuse the put ([`KeyAnswer::Full`]).
//!
//! A value lives in one contiguous extent of the arena (the server's data
//! plane moves it with one descriptor per engine segment). A put first
//! *reserves* its extent (the key is `Writing`: invisible to `exists` and
//! `get`, a second put of it is `Busy`), the bytes land, then it is
//! *committed* or *aborted*; so a reader never sees a half-written value.
//! A get *pins* a committed value while its bytes move out; eviction and
//! removal skip pinned and reserved extents, so no byte under a transfer
//! is ever reused.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use crate::proto::KeyAnswer;

/// Most removed keys the log keeps for readers that have not been told
/// of them yet, unless [`Space::with_removed_log`] says otherwise.
pub const REMOVED_LOG_MAX: usize = 1 << 16;

/// Free extents, found by address (to merge neighbours) and by size (best
/// fit).
#[derive(Debug, Default)]
struct Extents {
    by_addr: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
}

impl Extents {
    fn insert(&mut self, mut off: u64, mut len: u64) {
        if let Some((&prev, &plen)) = self.by_addr.range(..off).next_back() {
            if prev + plen == off {
                self.take(prev, plen);
                off = prev;
                len += plen;
            }
        }
        if let Some(&nlen) = self.by_addr.get(&(off + len)) {
            self.take(off + len, nlen);
            len += nlen;
        }
        self.by_addr.insert(off, len);
        self.by_size.insert((len, off));
    }

    fn take(&mut self, off: u64, len: u64) {
        self.by_addr.remove(&off);
        self.by_size.remove(&(len, off));
    }

    /// The smallest extent of at least `len` bytes, cut to `len`.
    fn alloc(&mut self, len: u64) -> Option<u64> {
        let &(flen, off) = self.by_size.range((len, 0)..).next()?;
        self.take(off, flen);
        if flen > len {
            self.by_addr.insert(off + len, flen - len);
            self.by_size.insert((flen - len, off + len));
        }
        Some(off)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Writing,
    Committed,
}

#[derive(Debug)]
struct Entry {
    off: u64,
    len: u64,
    state: State,
    /// Gets moving its bytes out now.
    readers: u32,
    /// Its place in the LRU order while it may be evicted (committed,
    /// nobody reading); `None` otherwise.
    tick: Option<u64>,
}

/// Counters of a [`Space`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpaceStats {
    /// Gets of a committed value of the right size.
    pub hits: u64,
    /// Gets of a key not committed.
    pub misses: u64,
    /// Values evicted to make room.
    pub evictions: u64,
    /// Values removed on request.
    pub removals: u64,
    /// Puts committed.
    pub commits: u64,
    /// Puts refused for want of room.
    pub full: u64,
    /// Bytes of committed values.
    pub stored_bytes: u64,
    /// Bytes reserved or committed.
    pub used_bytes: u64,
    /// Committed values.
    pub values: u64,
}

/// See the module docs.
#[derive(Debug)]
pub struct Space {
    capacity: u64,
    /// Most values (reserved or committed) at once: the index's bound,
    /// whatever their sizes.
    max_values: usize,
    free: Extents,
    entries: HashMap<Arc<str>, Entry>,
    /// The entries that may be evicted, by tick, least recently used
    /// first: eviction takes the first, never scanning past entries in
    /// use.
    lru: BTreeMap<u64, Arc<str>>,
    next_tick: u64,
    removed: VecDeque<Arc<str>>,
    /// Sequence number of `removed[0]`.
    removed_first: u64,
    /// Most keys `removed` holds.
    removed_max: usize,
    /// Whether making room may evict.
    evict: bool,
    stats: SpaceStats,
}

impl Space {
    /// An empty space of `capacity` bytes holding at most `max_values`.
    pub fn new(capacity: u64, max_values: usize) -> Space {
        let mut free = Extents::default();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Space {
            capacity,
            max_values,
            free,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 0,
            removed: VecDeque::new(),
            removed_first: 0,
            removed_max: REMOVED_LOG_MAX,
            evict: true,
            stats: SpaceStats::default(),
        }
    }

    /// The same space, refusing puts that need room ([`KeyAnswer::Full`])
    /// instead of evicting: the engine's pressure path.
    pub fn without_eviction(mut self) -> Space {
        self.evict = false;
        self
    }

    /// The same space, its removed log holding at most `max` keys.
    pub fn with_removed_log(mut self, max: usize) -> Space {
        self.removed_max = max;
        self
    }

    /// Values held, reserved or committed.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no value is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Where the committed value of `key` lives: `(offset, length)`. The
    /// extent stays the value's only while the caller keeps the space from
    /// changing (tools and tests read it under their lock).
    pub fn committed_extent(&self, key: &str) -> Option<(u64, u64)> {
        let e = self.entries.get(key)?;
        (e.state == State::Committed).then_some((e.off, e.len))
    }

    /// The arena's size.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The counters.
    pub fn stats(&self) -> SpaceStats {
        self.stats
    }

    /// Whether `key` has a committed value.
    pub fn exists(&self, key: &str) -> bool {
        self.entries
            .get(key)
            .is_some_and(|e| e.state == State::Committed)
    }

    /// Reserves `len` bytes for a put of `key`, evicting the least
    /// recently used values not in use until they fit; the offset.
    pub fn reserve(&mut self, key: &str, len: u64) -> Result<u64, KeyAnswer> {
        match self.entries.get(key).map(|e| e.state) {
            Some(State::Committed) => return Err(KeyAnswer::Exists),
            Some(State::Writing) => return Err(KeyAnswer::Busy),
            None => {}
        }
        if len > self.capacity || len == 0 {
            return Err(KeyAnswer::TooLarge);
        }
        while self.entries.len() >= self.max_values {
            if !self.evict_one() {
                self.stats.full += 1;
                return Err(KeyAnswer::Full);
            }
        }
        let off = loop {
            if let Some(off) = self.free.alloc(len) {
                break off;
            }
            if !self.evict_one() {
                self.stats.full += 1;
                return Err(KeyAnswer::Full);
            }
        };
        let entry = Entry {
            off,
            len,
            state: State::Writing,
            readers: 0,
            tick: None,
        };
        self.entries.insert(key.into(), entry);
        self.stats.used_bytes += len;
        Ok(off)
    }

    /// Makes a reserved value visible: all its bytes landed.
    pub fn commit(&mut self, key: &str) {
        let Some((key, e)) = self.entries.get_key_value(key) else {
            return;
        };
        if e.state != State::Writing {
            return;
        }
        let (key, len) = (Arc::clone(key), e.len);
        let tick = self.tick(&key);
        let e = self.entries.get_mut(&key).expect("looked up above");
        e.state = State::Committed;
        e.tick = Some(tick);
        self.stats.commits += 1;
        self.stats.values += 1;
        self.stats.stored_bytes += len;
    }

    /// Gives a reservation's bytes back: its put failed.
    pub fn abort(&mut self, key: &str) {
        if self
            .entries
            .get(key)
            .is_some_and(|e| e.state == State::Writing)
        {
            self.drop_entry(key);
        }
    }

    /// Pins a committed value of `want` bytes for a get; its offset.
    pub fn pin(&mut self, key: &str, want: u64) -> Result<u64, KeyAnswer> {
        let Some(e) = self
            .entries
            .get(key)
            .filter(|e| e.state == State::Committed)
        else {
            self.stats.misses += 1;
            return Err(KeyAnswer::NotFound);
        };
        if e.len != want {
            return Err(KeyAnswer::WrongSize { got_bytes: e.len });
        }
        // Read now: out of the eviction order until the last reader is
        // done (`unpin` puts it back as the most recently used).
        if let Some(t) = e.tick {
            self.lru.remove(&t);
        }
        let e = self.entries.get_mut(key).expect("looked up above");
        e.tick = None;
        e.readers += 1;
        self.stats.hits += 1;
        Ok(e.off)
    }

    /// Releases a pin of [`Space::pin`].
    pub fn unpin(&mut self, key: &str) {
        let Some((key, e)) = self.entries.get_key_value(key) else {
            return;
        };
        let (key, readers) = (Arc::clone(key), e.readers);
        if readers != 1 {
            let e = self.entries.get_mut(&key).expect("looked up above");
            e.readers = readers.saturating_sub(1);
            return;
        }
        let tick = self.tick(&key);
        let e = self.entries.get_mut(&key).expect("looked up above");
        e.readers = 0;
        e.tick = Some(tick);
    }

    /// Removes a committed value not in use.
    pub fn remove(&mut self, key: &str) -> KeyAnswer {
        match self.entries.get(key) {
            Some(e) if e.state == State::Committed && e.readers == 0 => {
                self.drop_entry(key);
                self.stats.removals += 1;
                KeyAnswer::Done
            }
            Some(_) => KeyAnswer::Busy,
            None => KeyAnswer::NotFound,
        }
    }

    /// Removes every committed value whose key starts with `prefix` and
    /// that nobody reads; the count. Values being written or read stay.
    pub fn remove_prefix(&mut self, prefix: &str) -> u64 {
        let gone: Vec<Arc<str>> = (self.entries.iter())
            .filter(|(k, e)| k.starts_with(prefix) && e.state == State::Committed && e.readers == 0)
            .map(|(k, _)| Arc::clone(k))
            .collect();
        for k in &gone {
            self.drop_entry(k);
        }
        self.stats.removals += gone.len() as u64;
        gone.len() as u64
    }

    /// The sequence number the next removed key gets: a connection's
    /// starting point in the log.
    pub fn removed_end(&self) -> u64 {
        self.removed_first + self.removed.len() as u64
    }

    /// Keys removed from sequence number `from` on, at most `max`; the
    /// count that fell out of the log before, and the next `from`.
    pub fn removed_since(&self, from: u64, max: usize) -> (Vec<String>, u64, u64) {
        let lost = self.removed_first.saturating_sub(from);
        let start = from.max(self.removed_first);
        let skip = (start - self.removed_first) as usize;
        let keys: Vec<String> = (self.removed.iter().skip(skip).take(max))
            .map(|k| k.to_string())
            .collect();
        let next = start + keys.len() as u64;
        (keys, lost, next)
    }

    fn tick(&mut self, key: &Arc<str>) -> u64 {
        let t = self.next_tick;
        self.next_tick += 1;
        self.lru.insert(t, Arc::clone(key));
        t
    }

    /// Evicts the least recently used committed value nobody reads.
    fn evict_one(&mut self) -> bool {
        if !self.evict {
            return false;
        }
        let Some((_, key)) = self.lru.pop_first() else {
            return false;
        };
        self.drop_entry(&key);
        self.stats.evictions += 1;
        true
    }

    fn drop_entry(&mut self, key: &str) {
        let Some((key, e)) = self.entries.remove_entry(key) else {
            return;
        };
        if let Some(t) = e.tick {
            self.lru.remove(&t);
        }
        self.free.insert(e.off, e.len);
        self.stats.used_bytes -= e.len;
        if e.state == State::Committed {
            self.stats.stored_bytes -= e.len;
            self.stats.values -= 1;
            if self.removed_max == 0 {
                self.removed_first += 1;
                return;
            }
            if self.removed.len() == self.removed_max {
                self.removed.pop_front();
                self.removed_first += 1;
            }
            self.removed.push_back(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_reserved_value_is_invisible_until_committed() {
        let mut s = Space::new(100, 1000);
        assert_eq!(s.reserve("a", 10), Ok(0));
        assert!(!s.exists("a"));
        assert_eq!(s.pin("a", 10), Err(KeyAnswer::NotFound));
        assert_eq!(s.reserve("a", 10), Err(KeyAnswer::Busy));
        s.commit("a");
        assert!(s.exists("a"));
        assert_eq!(s.reserve("a", 10), Err(KeyAnswer::Exists));
        assert_eq!(s.pin("a", 11), Err(KeyAnswer::WrongSize { got_bytes: 10 }));
        assert_eq!(s.pin("a", 10), Ok(0));
    }

    #[test]
    fn eviction_takes_the_least_recently_used_value_nobody_reads() {
        let mut s = Space::new(30, 1000);
        for k in ["a", "b", "c"] {
            s.reserve(k, 10).unwrap();
            s.commit(k);
        }
        // `a` is read now (pinned), `b` was used after `c`.
        s.pin("a", 10).unwrap();
        s.pin("b", 10).unwrap();
        s.unpin("b");
        s.reserve("d", 10).unwrap();
        assert!(!s.exists("c") && s.exists("a") && s.exists("b"));
        assert_eq!(s.removed_since(0, 10), (vec!["c".to_string()], 0, 1));
        s.reserve("e", 10).unwrap();
        assert!(!s.exists("b"), "b was the oldest not in use");
        // Only `a` (pinned) and reservations are left: no room.
        assert_eq!(s.reserve("f", 10), Err(KeyAnswer::Full));
        assert_eq!(s.reserve("g", 31), Err(KeyAnswer::TooLarge));
    }

    #[test]
    fn the_removed_log_is_bounded_and_counts_what_fell_out() {
        let mut s = Space::new(1, 1000);
        for i in 0..REMOVED_LOG_MAX + 3 {
            let k = format!("k{i}");
            s.reserve(&k, 1).unwrap();
            s.commit(&k);
            assert_eq!(s.remove(&k), KeyAnswer::Done);
        }
        let (keys, lost, next) = s.removed_since(0, 2);
        assert_eq!((keys, lost), (vec!["k3".to_string(), "k4".to_string()], 3));
        assert_eq!(next, 5);
        assert_eq!(s.removed_end(), REMOVED_LOG_MAX as u64 + 3);
    }

    #[test]
    fn the_index_is_bounded_by_max_values() {
        let mut s = Space::new(100, 2);
        for k in ["a", "b"] {
            s.reserve(k, 1).unwrap();
        }
        assert_eq!(
            s.reserve("c", 1),
            Err(KeyAnswer::Full),
            "both still writing"
        );
        s.commit("a");
        assert_eq!(
            s.reserve("c", 1),
            Ok(0),
            "in the room of a, the oldest committed"
        );
        assert!(!s.exists("a"));
        assert_eq!(s.stats().evictions, 1);
    }

    #[derive(Clone, Debug)]
    enum Step {
        Put(u8, u64),
        Commit(u8),
        Abort(u8),
        Pin(u8),
        Unpin(u8),
        Remove(u8),
    }

    fn step() -> impl Strategy<Value = Step> {
        let k = 0u8..12;
        prop_oneof![
            (k.clone(), 1u64..40).prop_map(|(k, l)| Step::Put(k, l)),
            k.clone().prop_map(Step::Commit),
            k.clone().prop_map(Step::Abort),
            k.clone().prop_map(Step::Pin),
            k.clone().prop_map(Step::Unpin),
            k.prop_map(Step::Remove),
        ]
    }

    proptest! {
        /// Extents never share a byte, stay inside the arena, and free
        /// plus used bytes are the capacity; pinned values are never
        /// evicted or removed.
        #[test]
        fn extents_never_overlap_and_pins_hold(steps in proptest::collection::vec(step(), 1..200)) {
            let mut s = Space::new(100, 1000);
            let mut lens = HashMap::new();
            let mut pins: HashMap<u8, u32> = HashMap::new();
            for st in steps {
                match st {
                    Step::Put(k, l) => if s.reserve(&k.to_string(), l).is_ok() { lens.insert(k, l); },
                    Step::Commit(k) => s.commit(&k.to_string()),
                    Step::Abort(k) => s.abort(&k.to_string()),
                    Step::Pin(k) => if let Some(&l) = lens.get(&k) {
                        if s.pin(&k.to_string(), l).is_ok() { *pins.entry(k).or_default() += 1; }
                    },
                    Step::Unpin(k) => if let Some(n) = pins.get_mut(&k).filter(|n| **n > 0) {
                        *n -= 1;
                        s.unpin(&k.to_string());
                    },
                    Step::Remove(k) => { let _ = s.remove(&k.to_string()); },
                }
                for (k, n) in &pins {
                    prop_assert!(*n == 0 || s.exists(&k.to_string()), "pinned {k} left");
                }
                let mut spans: Vec<(u64, u64)> = s.entries.values().map(|e| (e.off, e.len)).collect();
                spans.extend(s.free.by_addr.iter().map(|(&o, &l)| (o, l)));
                spans.sort_unstable();
                let mut at = 0;
                for (o, l) in spans {
                    prop_assert_eq!(o, at, "extents tile the arena");
                    at = o + l;
                }
                prop_assert_eq!(at, 100);
            }
        }
    }
}
