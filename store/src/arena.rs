//! The bytes of a RAM store: one zeroed, page-aligned allocation of
//! `capacity_bytes`, whose extents a [`Space`](crate::space::Space) hands
//! out. One type for both RAM stores: the store server's arena (registered
//! with its data plane, which moves the bytes) and the in-process store's
//! (copied in and out under the space's reservations and pins).
//!
//! The arena is only bytes: which extent holds what, what is evicted when
//! it is full and when a put is refused is the space's alone.
//!
//! Its one failure rule: an arena of the size asked for, or a typed
//! [`AllocError`]; never a smaller one, and never an abort of the process
//! (what a failed allocation does in the standard library). The caller
//! says what a failure means: the store server does not start, and the
//! in-process store's constructor returns it.
//!
//! The bytes are a private anonymous mapping, not the allocator's: an
//! over-aligned zeroed allocation is zeroed by writing every page, which
//! would make a store hold its whole capacity from its start (1 GiB for an
//! in-process store's default) however little it stores. Mapped, a page
//! is the kernel's shared zero page until written; the store server
//! touches them all at start on purpose ([`Arena::prefault`]).

use std::ptr::NonNull;

/// The arena's alignment, and the stride its pages are faulted in at.
pub const PAGE_BYTES: usize = 4096;

/// Why an arena could not be had: its size is not addressable or the
/// allocator refused it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("allocating {bytes} bytes of store memory failed")]
pub struct AllocError {
    /// The size asked for.
    pub bytes: u64,
}

/// See the module docs. Who may touch which extent is the space's to say:
/// it hands each extent to one writer (a reservation) or to readers (a
/// pin), never both, so the bytes are read and written without a lock.
pub struct Arena {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the arena is plain bytes; who may touch which extent is decided
// by its space, under its owner's lock (see `Arena`).
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena").field("len", &self.len).finish()
    }
}

impl Arena {
    /// `bytes` zeroed bytes, page-aligned; their pages are the kernel's
    /// until written (see [`Arena::prefault`]). An arena of no bytes
    /// allocates nothing.
    pub fn new(bytes: u64) -> Result<Arena, AllocError> {
        let alloc = || AllocError { bytes };
        let len = usize::try_from(bytes).map_err(|_| alloc())?;
        if len == 0 {
            return Ok(Arena {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        isize::try_from(len).map_err(|_| alloc())?;
        // SAFETY: a new private anonymous mapping, placed by the kernel;
        // nothing else refers to it.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(alloc());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(alloc)?;
        Ok(Arena { ptr, len })
    }

    /// Touches every page of the arena once, so a store holds its capacity
    /// from the start and its first puts do not stall on page faults.
    pub fn prefault(&mut self) {
        for off in (0..self.len).step_by(PAGE_BYTES) {
            // SAFETY: inside the allocation; a volatile write of the zero
            // already there (`&mut self`: nobody reads or writes it now),
            // so the page is really mapped.
            unsafe { self.ptr.as_ptr().add(off).write_volatile(0) };
        }
    }

    /// The first byte, for registering the arena with a transport.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The first byte's address: an extent at `off` is at `base() + off`.
    pub fn base(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an arena of no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The extent `[off, off + len)`.
    ///
    /// # Safety
    ///
    /// The space gave the extent to the caller alone (a reservation it
    /// holds), inside the arena.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn extent_mut(&self, off: u64, len: u64) -> &mut [u8] {
        debug_assert!(off + len <= self.len as u64);
        // SAFETY: in bounds and unshared, by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off as usize), len as usize) }
    }

    /// The extent `[off, off + len)`.
    ///
    /// # Safety
    ///
    /// The space keeps the extent from writers while the slice lives (a
    /// pin the caller holds, or its lock), inside the arena.
    pub unsafe fn extent(&self, off: u64, len: u64) -> &[u8] {
        debug_assert!(off + len <= self.len as u64);
        // SAFETY: in bounds and not written, by the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off as usize), len as usize) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: mapped in `new` with this length; whoever may still
            // touch it (the server's transport) is dropped first.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::KeyAnswer;
    use crate::space::Space;

    #[test]
    fn an_arena_is_zeroed_page_aligned_and_of_the_size_asked() {
        let mut a = Arena::new(3 * PAGE_BYTES as u64 + 5).unwrap();
        a.prefault();
        assert_eq!(a.len(), 3 * PAGE_BYTES + 5);
        assert_eq!(a.base() % PAGE_BYTES as u64, 0);
        // SAFETY: the whole arena, nobody else holds it.
        assert!(unsafe { a.extent(0, a.len() as u64) }
            .iter()
            .all(|&b| b == 0));
        let empty = Arena::new(0).unwrap();
        assert!(empty.is_empty());
    }

    #[test]
    fn a_size_that_cannot_be_had_is_an_error_never_a_smaller_arena() {
        for bytes in [u64::MAX, isize::MAX as u64] {
            assert_eq!(Arena::new(bytes).err(), Some(AllocError { bytes }));
        }
    }

    /// The arena and its space together, as both stores use them: a full
    /// arena evicts the least recently used value nobody reads, or, with
    /// eviction off, refuses; the bytes of values kept stay as written.
    #[test]
    fn a_full_arena_evicts_the_least_recently_used_value_or_refuses() {
        let arena = Arena::new(24).unwrap();
        let put = |space: &mut Space, key: &str, byte: u8| {
            let off = space.reserve(key, 8)?;
            // SAFETY: the reservation is this put's alone.
            unsafe { arena.extent_mut(off, 8) }.fill(byte);
            space.commit(key);
            Ok::<u64, KeyAnswer>(off)
        };
        let value = |space: &Space, key: &str| {
            let (off, len) = space.committed_extent(key)?;
            // SAFETY: nothing writes while the space is borrowed.
            Some(unsafe { arena.extent(off, len) }.to_vec())
        };
        let mut evicting = Space::new(24, 16);
        for (i, k) in ["a", "b", "c"].into_iter().enumerate() {
            put(&mut evicting, k, i as u8 + 1).unwrap();
        }
        evicting.pin("a", 8).unwrap();
        evicting.unpin("a");
        let d = put(&mut evicting, "d", 4).unwrap();
        assert_eq!(value(&evicting, "b"), None, "b was the least recently used");
        assert_eq!(value(&evicting, "d"), Some(vec![4; 8]));
        assert_eq!(value(&evicting, "a"), Some(vec![1; 8]));
        assert_eq!(d, 8, "d in b's room");
        let mut refusing = Space::new(24, 16).without_eviction();
        for k in ["a", "b", "c"] {
            put(&mut refusing, k, 9).unwrap();
        }
        assert_eq!(put(&mut refusing, "d", 4), Err(KeyAnswer::Full));
        assert_eq!(refusing.stats().full, 1);
        assert_eq!(value(&refusing, "a"), Some(vec![9; 8]));
        assert_eq!(refusing.reserve("e", 25), Err(KeyAnswer::TooLarge));
    }

    /// Pages of `a` in memory now.
    fn resident_pages(a: &Arena) -> usize {
        let mut pages = vec![0u8; a.len().div_ceil(PAGE_BYTES)];
        // SAFETY: the arena's own mapping, one status byte per page.
        let r = unsafe { libc::mincore(a.as_ptr().cast(), a.len(), pages.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore");
        pages.iter().filter(|p| **p & 1 == 1).count()
    }

    #[test]
    fn an_arena_holds_no_memory_until_its_pages_are_written() {
        let mut a = Arena::new(64 << 20).unwrap();
        assert_eq!(resident_pages(&a), 0);
        // SAFETY: no one else touches this arena.
        let first = unsafe { a.extent_mut(0, 1) };
        first[0] = 7;
        assert!(
            resident_pages(&a) * PAGE_BYTES <= 2 << 20,
            "one page (or huge page) written"
        );
        a.prefault();
        assert_eq!(resident_pages(&a), (64 << 20) / PAGE_BYTES);
    }
}
