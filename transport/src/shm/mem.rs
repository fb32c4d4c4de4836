//! Shared memory: regions backed by a sealed `memfd` (what a target
//! shares), and a peer's region mapped here (what an initiator copies to).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use super::ShmRefusal;

/// Seals every shared file carries: its size is fixed for good, so a peer
/// that mapped it can never take a `SIGBUS` from a shrink.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Host memory in a sealed `memfd`, mapped read-write and shared: register
/// it with [`crate::TcpTransport::register_shared`] and peers on this host
/// copy into and out of it directly.
#[derive(Debug)]
pub struct SharedMem {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain memory owned by this value; the pointer is
// only an address, and who may touch the bytes when is the registrant's
// business (as for any registered region).
unsafe impl Send for SharedMem {}
// SAFETY: as above; `&SharedMem` hands out only the address and the fd.
unsafe impl Sync for SharedMem {}

impl SharedMem {
    /// `len` zeroed bytes in a new `memfd` named `name` (seen in
    /// `/proc/PID/maps`), size-sealed.
    pub fn new(name: &str, len: usize) -> io::Result<SharedMem> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty region"));
        }
        let cname = std::ffi::CString::new(name.replace('\0', "_"))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: a valid C string; the flags are memfd's own.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new fd nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        File::from(fd.try_clone()?).set_len(len as u64)?;
        // SAFETY: fcntl on an fd we own.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let ptr = map(fd.as_fd(), 0, len)?;
        Ok(SharedMem { ptr, len, fd })
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never: an empty region cannot be made.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The `memfd` behind it.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of `len` bytes; the owner of a
        // registration promised nothing uses it past unregistering.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// `len` bytes of `fd` from `offset` (a multiple of the page size), mapped
/// read-write and shared.
fn map(fd: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<*mut u8> {
    // SAFETY: a fresh mapping chosen by the kernel; nothing is overwritten.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// A peer's shared file mapped here: `len` bytes from `offset`.
#[derive(Debug)]
pub(crate) struct PeerMap {
    base: *mut u8,
    map_len: usize,
    /// Where the asked-for bytes start in the mapping.
    delta: usize,
    len: u64,
}

impl PeerMap {
    /// Maps `len` bytes of the peer's `fd` from `offset`, after checking
    /// that the file is size-sealed and holds them: a peer can neither
    /// shrink it under our copies nor make us map past its end.
    pub(crate) fn new(fd: &OwnedFd, offset: u64, len: u64) -> Result<PeerMap, ShmRefusal> {
        // SAFETY: fcntl on an fd we own.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(ShmRefusal::NotSealed);
        }
        let size = File::from(fd.try_clone().map_err(ShmRefusal::io)?)
            .metadata()
            .map_err(ShmRefusal::io)?
            .len();
        let end = offset.checked_add(len);
        if len == 0 || end.is_none_or(|end| end > size) {
            return Err(ShmRefusal::SizeMismatch {
                offset,
                len,
                file_len: size,
            });
        }
        let page = page_size();
        let aligned = offset - offset % page;
        let delta = (offset - aligned) as usize;
        let map_len = usize::try_from(len)
            .ok()
            .and_then(|l| l.checked_add(delta))
            .ok_or(ShmRefusal::SizeMismatch {
                offset,
                len,
                file_len: size,
            })?;
        let base = map(fd.as_fd(), aligned, map_len).map_err(ShmRefusal::io)?;
        Ok(PeerMap {
            base,
            map_len,
            delta,
            len,
        })
    }

    /// The mapped bytes' start here.
    pub(crate) fn ptr(&self) -> *mut u8 {
        // SAFETY: `delta` is inside the mapping.
        unsafe { self.base.add(self.delta) }
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }
}

impl Drop for PeerMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; copies through it run on the
        // thread that owns the link and never outlive it.
        unsafe { libc::munmap(self.base.cast(), self.map_len) };
    }
}

/// Moves the whole pages of `[addr, addr + len)` onto a new sealed
/// `memfd`, in place: the same addresses keep the same bytes, now in a
/// file peers on this host can map, so an engine's KV tensors (allocated
/// by the engine, which gives a connector no say in how) become shareable
/// without moving. The partial pages at the edges stay private. Returns
/// the file, or `None` when the range holds no whole page; keep it open
/// while the memory is registered (registration finds the file by its
/// open descriptor), then close it: the mapping holds the memory.
///
/// # Safety
///
/// The range must be memory this process owns, mapped read-write, and
/// nothing may read or write it during the call (its pages are copied,
/// then replaced). It must then stay allocated for the life of the
/// process (or be unmapped whole): freed to an allocator, its pages, now a
/// shared file's, would hold whatever the allocator puts there next, and a
/// `fork` would share them with the child instead of copying them.
pub unsafe fn share_pages(addr: *mut u8, len: usize) -> io::Result<Option<OwnedFd>> {
    let page = page_size();
    let (a, e) = (addr as u64, (addr as u64).saturating_add(len as u64));
    let start = a.div_ceil(page).saturating_mul(page);
    let end = e / page * page;
    if end <= start {
        return Ok(None);
    }
    let n = (end - start) as usize;
    let staging = SharedMem::new("kvferry-kv", n)?;
    // SAFETY: both ranges are `n` bytes: ours by the caller's promise, the
    // fresh mapping by construction; they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(start as usize as *const u8, staging.as_ptr(), n) };
    let fd = staging.fd.try_clone()?;
    drop(staging);
    // SAFETY: replaces exactly the whole pages of the caller's range, whose
    // bytes the file now holds.
    let p = unsafe {
        libc::mmap(
            start as usize as *mut libc::c_void,
            n,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(Some(fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_move_onto_a_file_in_place_and_keep_their_bytes() {
        let len = 5 * 4096 + 100;
        // Its own mapping (not the heap's), unmapped at the end.
        // SAFETY: a fresh anonymous mapping.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                6 * 4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        // SAFETY: inside the mapping, used only by this test.
        let v = unsafe { std::slice::from_raw_parts_mut(base.cast::<u8>(), len) };
        v.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i * 7 % 251) as u8);
        let before = v.to_vec();
        // Unaligned on purpose: the edges stay private.
        let addr = v.as_mut_ptr().wrapping_add(17);
        // SAFETY: our mapping, untouched during the call.
        let fd = unsafe { share_pages(addr, len - 17) }
            .unwrap()
            .expect("whole pages");
        assert_eq!(*v, *before, "every byte kept");
        v[len / 2] = 0xAB;
        let pieces = super::super::shared_pieces(v.as_ptr() as u64, len as u64);
        assert_eq!(pieces.len(), 1, "{pieces:?}");
        let p = &pieces[0];
        assert_eq!(
            (p.addr, p.len),
            (base as u64 + 4096, 4 * 4096),
            "the whole pages"
        );
        // The file holds what the memory holds, both ways.
        let map = PeerMap::new(&fd, p.offset, p.len).unwrap();
        let at = (v.as_ptr() as u64 + (len / 2) as u64 - p.addr) as usize;
        // SAFETY: inside the mapping.
        assert_eq!(unsafe { *map.ptr().add(at) }, 0xAB);
        // SAFETY: as above.
        unsafe { *map.ptr().add(at) = 0xCD };
        assert_eq!(v[len / 2], 0xCD);
        drop(map);
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(base, 6 * 4096) };
    }
}
