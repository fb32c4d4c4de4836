//! The control file an endpoint shares with the peers that copy into its
//! memory: a generation, one lane per peer, and the block fence's bits.
//!
//! With one-sided copies the target never sees a write, so its fence must
//! be where the initiator can ask it, and a close must wait for the copies
//! already past the question. The protocol (a Dekker handshake; every
//! marked access sequentially consistent):
//!
//! * initiator, per chunk: write the slots it will touch into its lane,
//!   make the lane's sequence odd, *then* check the generation and the
//!   slots' open bits; copy only if all hold; make the sequence even.
//! * owner, on close: clear the slots' bits, *then* look at every lane;
//!   a lane that is odd, still at the same sequence and names a closed
//!   slot is waited for until its sequence moves on.
//!
//! Either the initiator sees the cleared bit (and copies nothing) or the
//! owner sees the lane (and waits for the copy): no copy runs after the
//! close returns. Retiring (a region or fence changed) bumps the
//! generation and waits for every odd lane the same way, so a peer's old
//! map of the regions is never used again. `tests/loom_shm_fence.rs`
//! model-checks the handshake; the wait is bounded by
//! [`super::ShmConfig::drain_max`], and a lane whose peer died (its
//! socket hung up: the kernel drops a process's memory before its files)
//! is not waited for.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::mem::{PeerMap, SharedMem};
use super::protocol::{self, Lane, Word};
use super::ShmRefusal;
use crate::fence::slots::FenceKey;

const MAGIC: u64 = u64::from_le_bytes(*b"KVFSHM01");
/// Words before the lanes: magic, generation, lanes, spaces, and up to
/// [`MAX_SPACES`] slot counts.
const HEADER_WORDS: usize = 128;
const LANE_WORDS: usize = 4;
/// Most fence spaces (KV blocks and pools) a control file holds.
pub(crate) const MAX_SPACES: usize = HEADER_WORDS - 4;
/// Most fence slots a control file holds (a 16 MiB bitmap); a larger
/// fence leaves the endpoint on tcp.
pub(crate) const MAX_SLOTS: u64 = 1 << 27;
/// A lane's `space` word when the chunk touches no fenced slot.
const NO_SPACE: u64 = u64::MAX;

/// The words of a control file, wherever it is mapped.
struct Words {
    ptr: *const AtomicU64,
    words: usize,
    lanes: usize,
    /// Bit offset of each space's first slot, and its slot count.
    spaces: Vec<(u64, u64)>,
}

impl Words {
    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.words, "control word {i} out of {}", self.words);
        // SAFETY: in bounds (checked), 8-aligned (page-aligned mapping),
        // and the mapping outlives `self`; shared words are only ever
        // accessed atomically.
        unsafe { &*self.ptr.add(i) }
    }

    fn generation(&self) -> &AtomicU64 {
        self.word(1)
    }

    fn lane(&self, lane: usize, field: usize) -> &AtomicU64 {
        self.word(HEADER_WORDS + lane * LANE_WORDS + field)
    }

    fn lane_words(&self, lane: usize) -> Lane<'_, AtomicU64> {
        Lane {
            seq: self.lane(lane, 0),
            range: [self.lane(lane, 1), self.lane(lane, 2), self.lane(lane, 3)],
        }
    }

    fn bits_start(&self) -> usize {
        HEADER_WORDS + self.lanes * LANE_WORDS
    }

    /// The bit of `slot` in `space`, if both exist.
    fn bit(&self, space: usize, slot: u64) -> Option<(&AtomicU64, u64)> {
        let &(base, count) = self.spaces.get(space)?;
        (slot < count).then(|| {
            let b = base + slot;
            (
                self.word(self.bits_start() + (b / 64) as usize),
                1 << (b % 64),
            )
        })
    }

    fn len_words(lanes: usize, spaces: &[u64]) -> Option<usize> {
        let slots: u64 = spaces.iter().try_fold(0u64, |a, &c| a.checked_add(c))?;
        if slots > MAX_SLOTS || spaces.len() > MAX_SPACES {
            return None;
        }
        Some(HEADER_WORDS + lanes * LANE_WORDS + slots.div_ceil(64) as usize)
    }

    fn layout(spaces: &[u64]) -> Vec<(u64, u64)> {
        let mut base = 0;
        spaces
            .iter()
            .map(|&c| {
                let s = (base, c);
                base += c;
                s
            })
            .collect()
    }
}

fn space_of(key: FenceKey) -> (usize, u64) {
    match key {
        FenceKey::Block(id) => (0, u64::from(id)),
        FenceKey::Item { pool, index } => (pool as usize + 1, u64::from(index)),
    }
}

/// The owner's side of a control file: it sets and clears fence bits,
/// hands lanes to peers and drains them.
pub(crate) struct CtlOwner {
    mem: SharedMem,
    words: Words,
    /// The socket of the peer holding each lane (`None`: free); its hang-up
    /// says the peer is gone.
    peers: Mutex<Vec<Option<OwnedFd>>>,
    drain_max: Duration,
    stats: Mutex<DrainStats>,
}

/// What the drains of one control file waited for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct DrainStats {
    /// Copies a close or retire waited for.
    pub(crate) waited: u64,
    /// Waits cut short because the copying peer was gone.
    pub(crate) peer_gone: u64,
    /// Waits that ran past the bound with the peer alive.
    pub(crate) overruns: u64,
}

impl DrainStats {
    pub(crate) fn add(&mut self, o: DrainStats) {
        self.waited += o.waited;
        self.peer_gone += o.peer_gone;
        self.overruns += o.overruns;
    }
}

impl std::fmt::Debug for CtlOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CtlOwner")
            .field("lanes", &self.words.lanes)
            .field("generation", &self.generation())
            .finish()
    }
}

// SAFETY: the mapping is only touched through atomics and owned here.
unsafe impl Send for CtlOwner {}
// SAFETY: as above.
unsafe impl Sync for CtlOwner {}

impl CtlOwner {
    /// A control file of `lanes` lanes over fence spaces of `spaces` slots
    /// each (none without a fence); `None` when the fence is too large.
    pub(crate) fn new(lanes: usize, spaces: &[u64], drain_max: Duration) -> Option<CtlOwner> {
        let words = Words::len_words(lanes, spaces)?;
        let mem = SharedMem::new("kvferry-shm-ctl", words * 8).ok()?;
        let w = Words {
            ptr: mem.as_ptr() as *const AtomicU64,
            words,
            lanes,
            spaces: Words::layout(spaces),
        };
        w.word(0).store(MAGIC, SeqCst);
        w.word(2).store(lanes as u64, SeqCst);
        w.word(3).store(spaces.len() as u64, SeqCst);
        for (i, &c) in spaces.iter().enumerate() {
            w.word(4 + i).store(c, SeqCst);
        }
        Some(CtlOwner {
            mem,
            words: w,
            peers: Mutex::new((0..lanes).map(|_| None).collect()),
            drain_max,
            stats: Mutex::new(DrainStats::default()),
        })
    }

    pub(crate) fn lanes(&self) -> usize {
        self.words.lanes
    }

    pub(crate) fn mem(&self) -> &SharedMem {
        &self.mem
    }

    pub(crate) fn generation(&self) -> u64 {
        self.words.generation().load(SeqCst)
    }

    pub(crate) fn stats(&self) -> DrainStats {
        *kvferry_reactor::lock(&self.stats)
    }

    /// Marks `key` open for peers.
    pub(crate) fn set_open(&self, key: FenceKey) {
        let (space, slot) = space_of(key);
        if let Some((w, bit)) = self.words.bit(space, slot) {
            w.raise(bit);
        }
    }

    /// Marks `keys` closed, then waits for the peers' copies that checked
    /// them open before.
    pub(crate) fn close(&self, keys: &[FenceKey]) {
        for &key in keys {
            let (space, slot) = space_of(key);
            if let Some((w, bit)) = self.words.bit(space, slot) {
                w.clear(bit);
            }
        }
        if !keys.is_empty() {
            self.drain(|space, first, last| {
                keys.iter().any(|&k| {
                    let (s, slot) = space_of(k);
                    s as u64 == space && (first..=last).contains(&slot)
                })
            });
        }
    }

    /// Ends every peer's map of this file: bumps the generation, then waits
    /// for every copy in progress.
    pub(crate) fn retire(&self) {
        self.words.generation().fetch_add(1, SeqCst);
        self.drain(|_, _, _| true);
    }

    /// Waits for every lane in a copy that `hits` (space, first, last).
    fn drain(&self, hits: impl Fn(u64, u64, u64) -> bool) {
        for lane in 0..self.words.lanes {
            let busy = protocol::busy(&self.words.lane_words(lane), |s, f, l| {
                s == NO_SPACE || hits(s, f, l)
            });
            if let Some(seq) = busy {
                self.wait_lane(lane, seq);
            }
        }
    }

    /// Waits until lane `lane` leaves sequence `seq`, its peer is gone, or
    /// the bound passes.
    fn wait_lane(&self, lane: usize, seq: u64) {
        let start = Instant::now();
        let mut tries = 0u32;
        let outcome = loop {
            if self.words.lane(lane, 0).load(SeqCst) != seq {
                break Outcome::Done;
            }
            tries += 1;
            if tries < 256 {
                std::hint::spin_loop();
                continue;
            }
            if self.peer_gone(lane) {
                break Outcome::Gone;
            }
            if start.elapsed() > self.drain_max {
                break Outcome::Overrun;
            }
            std::thread::yield_now();
        };
        let mut st = kvferry_reactor::lock(&self.stats);
        st.waited += 1;
        match outcome {
            Outcome::Done => {}
            Outcome::Gone => st.peer_gone += 1,
            Outcome::Overrun => {
                st.overruns += 1;
                tracing::error!(
                    lane,
                    bound_ms = self.drain_max.as_millis() as u64,
                    "shm: a peer's copy into fenced memory outlasted the drain bound"
                );
            }
        }
    }

    /// True when lane `lane`'s peer hung up (or never held it).
    fn peer_gone(&self, lane: usize) -> bool {
        let peers = kvferry_reactor::lock(&self.peers);
        peers.get(lane).and_then(Option::as_ref).is_none_or(hung_up)
    }

    /// Gives a free lane (or one whose peer hung up) to the peer on
    /// `conn`; `None` when every lane is held.
    pub(crate) fn take_lane(&self, conn: OwnedFd) -> Option<usize> {
        let mut peers = kvferry_reactor::lock(&self.peers);
        let lane = peers.iter().position(|p| p.as_ref().is_none_or(hung_up))?;
        // A peer that died mid-copy left its lane odd: start it even.
        let seq = self.words.lane(lane, 0);
        seq.store((seq.load(SeqCst) + 1) & !1, SeqCst);
        peers[lane] = Some(conn);
        Some(lane)
    }

    /// Lanes held by live peers.
    pub(crate) fn peers(&self) -> usize {
        let peers = kvferry_reactor::lock(&self.peers);
        peers.iter().flatten().filter(|c| !hung_up(c)).count()
    }
}

enum Outcome {
    Done,
    Gone,
    Overrun,
}

/// True when the peer's end of `conn` is closed.
fn hung_up(conn: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: conn.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd; zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Why a copy through a peer's control file did not run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The peer retired this map: regions or fence changed.
    Stale,
    /// A slot the copy touches is closed.
    Fenced,
}

/// A peer's control file mapped here, with the lane it gave us.
pub(crate) struct CtlView {
    _map: PeerMap,
    words: Words,
    lane: usize,
    generation: u64,
}

impl CtlView {
    /// Maps the control file `fd` and checks its header against `spaces`
    /// and `lanes` as the offer stated them.
    pub(crate) fn new(
        fd: &OwnedFd,
        lanes: usize,
        spaces: &[u64],
        lane: usize,
        generation: u64,
    ) -> Result<CtlView, ShmRefusal> {
        let words = Words::len_words(lanes, spaces).ok_or(ShmRefusal::Malformed("fence size"))?;
        if lane >= lanes {
            return Err(ShmRefusal::Malformed("lane"));
        }
        let map = PeerMap::new(fd, 0, words as u64 * 8)?;
        let w = Words {
            ptr: map.ptr() as *const AtomicU64,
            words,
            lanes,
            spaces: Words::layout(spaces),
        };
        let counts_match = spaces
            .iter()
            .enumerate()
            .all(|(i, &c)| w.word(4 + i).load(SeqCst) == c);
        if w.word(0).load(SeqCst) != MAGIC
            || w.word(2).load(SeqCst) != lanes as u64
            || w.word(3).load(SeqCst) != spaces.len() as u64
            || !counts_match
        {
            return Err(ShmRefusal::Malformed("control file header"));
        }
        debug_assert!(map.len() >= words as u64 * 8);
        Ok(CtlView {
            _map: map,
            words: w,
            lane,
            generation,
        })
    }

    /// Runs `copy` if this map is current and every slot `slots` names
    /// (`(space, first, last)`, none for unfenced bytes) is open, with the
    /// lane held across it.
    pub(crate) fn guarded(
        &self,
        slots: Option<(usize, u64, u64)>,
        copy: impl FnOnce(),
    ) -> Result<(), Stop> {
        let (space, first, last) = slots.map_or((NO_SPACE, 0, 0), |(s, f, l)| (s as u64, f, l));
        let lane = self.words.lane_words(self.lane);
        let mut stop = None;
        let allowed = || {
            if self.words.generation().get() != self.generation {
                stop = Some(Stop::Stale);
            } else if slots.is_some_and(|(s, f, l)| !self.all_open(s, f, l)) {
                stop = Some(Stop::Fenced);
            }
            stop.is_none()
        };
        match protocol::enter(&lane, [space, first, last], allowed) {
            Ok(seq) => {
                copy();
                protocol::leave(&lane, seq);
                Ok(())
            }
            Err(_) => Err(stop.unwrap_or(Stop::Fenced)),
        }
    }

    /// True while the owner has not retired this map.
    pub(crate) fn current(&self) -> bool {
        self.words.generation().load(SeqCst) == self.generation
    }

    fn all_open(&self, space: usize, first: u64, last: u64) -> bool {
        (first..=last).all(|slot| {
            self.words
                .bit(space, slot)
                .is_some_and(|(w, bit)| w.load(SeqCst) & bit != 0)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    /// An owner with 2 lanes over 4 KV blocks, and a view holding lane 0
    /// whose socket's other end is returned.
    fn pair(drain_max: Duration) -> (CtlOwner, CtlView, UnixStream) {
        let owner = CtlOwner::new(2, &[4], drain_max).unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        let lane = owner.take_lane(OwnedFd::from(theirs)).unwrap();
        let fd = owner.mem().fd().try_clone_to_owned().unwrap();
        let view = CtlView::new(&fd, 2, &[4], lane, owner.generation()).unwrap();
        (owner, view, ours)
    }

    fn block(slot: u64) -> Option<(usize, u64, u64)> {
        Some((0, slot, slot))
    }

    #[test]
    fn a_copy_runs_only_while_its_blocks_are_open_and_the_map_current() {
        let (owner, view, _peer) = pair(Duration::from_secs(5));
        let mut ran = 0;
        assert_eq!(view.guarded(block(1), || ran += 1), Err(Stop::Fenced));
        owner.set_open(FenceKey::Block(1));
        assert_eq!(view.guarded(block(1), || ran += 1), Ok(()));
        assert_eq!(
            view.guarded(Some((0, 1, 2)), || ran += 1),
            Err(Stop::Fenced)
        );
        assert_eq!(view.guarded(None, || ran += 1), Ok(()), "unfenced bytes");
        owner.close(&[FenceKey::Block(1)]);
        assert_eq!(view.guarded(block(1), || ran += 1), Err(Stop::Fenced));
        owner.set_open(FenceKey::Block(1));
        owner.retire();
        assert_eq!(view.guarded(block(1), || ran += 1), Err(Stop::Stale));
        assert_eq!(ran, 2);
        assert_eq!(owner.stats().waited, 0, "no copy was in progress");
    }

    #[test]
    fn a_close_waits_for_a_copy_in_progress_on_its_block() {
        // The close runs inside the copy (as a peer's close would run
        // during it): it cannot return before the copy leaves, so it runs
        // to its bound with the peer alive, and says so.
        let bound = Duration::from_millis(30);
        let (owner, view, _peer) = pair(bound);
        owner.set_open(FenceKey::Block(2));
        owner.set_open(FenceKey::Block(3));
        let mut took = Duration::ZERO;
        view.guarded(block(2), || {
            let t = Instant::now();
            owner.close(&[FenceKey::Block(3)]);
            assert!(t.elapsed() < bound, "another block's close does not wait");
            owner.close(&[FenceKey::Block(2)]);
            took = t.elapsed();
        })
        .unwrap();
        assert!(took >= bound, "the close waited for the copy ({took:?})");
        let st = owner.stats();
        assert_eq!((st.waited, st.overruns, st.peer_gone), (1, 1, 0));
    }

    #[test]
    fn a_close_does_not_wait_for_a_peer_that_died_mid_copy() {
        let (owner, view, peer) = pair(Duration::from_secs(30));
        owner.set_open(FenceKey::Block(0));
        view.guarded(block(0), || {
            // The peer's socket closes, as when the kernel reaps it.
            drop(peer);
            let t = Instant::now();
            owner.close(&[FenceKey::Block(0)]);
            assert!(t.elapsed() < Duration::from_secs(5), "no wait for the dead");
        })
        .unwrap();
        let st = owner.stats();
        assert_eq!((st.waited, st.overruns, st.peer_gone), (1, 0, 1));
        // Its lane is free again, and starts even.
        let (a, _b) = UnixStream::pair().unwrap();
        assert_eq!(owner.peers(), 0);
        assert!(owner.take_lane(OwnedFd::from(a)).is_some());
    }
}
