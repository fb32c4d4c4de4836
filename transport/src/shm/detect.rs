//! Finds whether registered memory is already shareable: mapped shared
//! from a `memfd` this process holds open (an engine that allocated its
//! KV cache that way, a [`super::SharedMem`]), so any registration of it
//! can be offered to peers without a separate API.

use std::io::{BufRead, BufReader};
use std::os::fd::{FromRawFd, OwnedFd};

/// One line of `/proc/self/maps`.
#[derive(Debug, PartialEq, Eq)]
struct Mapping {
    start: u64,
    end: u64,
    shared: bool,
    offset: u64,
    dev: (u32, u32),
    inode: u64,
    memfd: bool,
}

fn parse(line: &str) -> Option<Mapping> {
    let mut it = line.split_ascii_whitespace();
    let (start, end) = it.next()?.split_once('-')?;
    let perms = it.next()?;
    let offset = u64::from_str_radix(it.next()?, 16).ok()?;
    let (major, minor) = it.next()?.split_once(':')?;
    let inode = it.next()?.parse().ok()?;
    let path = it.next().unwrap_or("");
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        shared: perms.as_bytes().get(3) == Some(&b's'),
        offset,
        dev: (
            u32::from_str_radix(major, 16).ok()?,
            u32::from_str_radix(minor, 16).ok()?,
        ),
        inode,
        memfd: path.starts_with("/memfd:"),
    })
}

/// A piece of registered memory that is shared: `len` bytes at `addr`,
/// the bytes of `fd` from `offset`.
#[derive(Debug)]
pub(crate) struct Piece {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) fd: OwnedFd,
    pub(crate) offset: u64,
}

/// The pieces of `[addr, addr + len)` mapped shared from a `memfd` this
/// process holds open: maximal runs of one file at consecutive offsets,
/// clipped to the range (an engine's tensor whose page-aligned interior
/// was put on a `memfd` by [`super::share_pages`] has one, its edges
/// stay private).
pub(crate) fn shared_pieces(addr: u64, len: u64) -> Vec<Piece> {
    let Some(end) = addr.checked_add(len) else {
        return Vec::new();
    };
    let Ok(maps) = std::fs::File::open("/proc/self/maps") else {
        return Vec::new();
    };
    let mut runs: Vec<Run> = Vec::new();
    for line in BufReader::new(maps).lines().map_while(Result::ok) {
        let Some(m) = parse(&line) else { continue };
        if m.end <= addr || !(m.shared && m.memfd) {
            continue;
        }
        if m.start >= end {
            break;
        }
        let (start, stop) = (m.start.max(addr), m.end.min(end));
        let offset = m.offset + (start - m.start);
        let file = (m.dev, m.inode);
        match runs.last_mut() {
            Some(r)
                if r.end == start && r.file == file && r.offset + (start - r.start) == offset =>
            {
                r.end = stop
            }
            _ => runs.push(Run {
                start,
                end: stop,
                offset,
                file,
            }),
        }
    }
    runs.into_iter()
        .filter_map(|r| {
            let fd = open_fd(r.file.0, r.file.1)?;
            Some(Piece {
                addr: r.start,
                len: r.end - r.start,
                fd,
                offset: r.offset,
            })
        })
        .collect()
}

/// A run of one file at consecutive offsets, clipped to the range asked.
struct Run {
    start: u64,
    end: u64,
    /// The file's offset at `start`.
    offset: u64,
    /// Device and inode.
    file: ((u32, u32), u64),
}

/// A duplicate of an open descriptor of this process on file (dev, inode).
fn open_fd(dev: (u32, u32), inode: u64) -> Option<OwnedFd> {
    for entry in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: fstat into a local buffer; a descriptor closed meanwhile
        // just fails.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            continue;
        }
        let same = st.st_ino == inode
            && libc::major(st.st_dev) == dev.0
            && libc::minor(st.st_dev) == dev.1;
        if same {
            // SAFETY: duplicating a descriptor we just checked.
            let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
            return (dup >= 0).then(|| unsafe { OwnedFd::from_raw_fd(dup) });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::SharedMem;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_shared_memfd_is_found_and_private_memory_is_not() {
        let mem = SharedMem::new("kvferry-detect", 3 * 4096).unwrap();
        let base = mem.as_ptr() as u64;
        let pieces = shared_pieces(base + 4096, 8192);
        assert_eq!(pieces.len(), 1);
        let Piece {
            fd,
            offset,
            addr,
            len,
        } = pieces.into_iter().next().unwrap();
        assert_eq!((offset, addr, len), (4096, base + 4096, 8192));
        let mut a: libc::stat = unsafe { std::mem::zeroed() };
        let mut b: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat into local buffers.
        unsafe {
            libc::fstat(fd.as_raw_fd(), &mut a);
            libc::fstat(mem.fd().as_raw_fd(), &mut b);
        }
        assert_eq!(a.st_ino, b.st_ino, "the same file");
        // Other tests' files may sit beside it: find ours, clipped to it.
        let clipped = shared_pieces(base - 4096, 5 * 4096);
        assert!(
            clipped
                .iter()
                .any(|p| (p.addr, p.len, p.offset) == (base, 3 * 4096, 0)),
            "clipped to the file: {clipped:?}"
        );
        let private = vec![0u8; 1 << 20];
        assert!(shared_pieces(private.as_ptr() as u64, 4096).is_empty());
    }

    #[test]
    fn maps_lines_parse() {
        let m = parse("7f00a000-7f00c000 rw-s 00002000 00:01 1234   /memfd:kv (deleted)").unwrap();
        assert_eq!(
            (m.start, m.end, m.offset, m.inode),
            (0x7f00a000, 0x7f00c000, 0x2000, 1234)
        );
        assert!(m.shared && m.memfd);
        let m = parse("7f00a000-7f00c000 rw-p 00000000 00:00 0").unwrap();
        assert!(!m.shared && !m.memfd);
    }
}
