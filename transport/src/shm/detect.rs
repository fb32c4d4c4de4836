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

/// The file and offset behind `[addr, addr + len)` when one shared
/// `memfd` mapping (or contiguous pieces of one, at matching offsets)
/// covers it and this process holds the file open; a duplicate of that
/// descriptor.
pub(crate) fn shared_backing(addr: u64, len: u64) -> Option<(OwnedFd, u64)> {
    let end = addr.checked_add(len)?;
    let maps = std::fs::File::open("/proc/self/maps").ok()?;
    let mut first: Option<Mapping> = None;
    let mut covered = addr;
    for line in BufReader::new(maps).lines() {
        let m = parse(&line.ok()?)?;
        if m.end <= covered {
            continue;
        }
        if m.start > covered {
            return None;
        }
        let piece_ok = m.shared
            && m.memfd
            && first.as_ref().is_none_or(|f| {
                (f.dev, f.inode) == (m.dev, m.inode) && m.offset == f.offset + (m.start - f.start)
            });
        if !piece_ok {
            return None;
        }
        covered = m.end;
        first.get_or_insert(m);
        if covered >= end {
            break;
        }
    }
    let f = first.filter(|_| covered >= end)?;
    let fd = open_fd(f.dev, f.inode)?;
    Some((fd, f.offset + (addr - f.start)))
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
        let (fd, off) = shared_backing(base + 4096, 8192).expect("found");
        assert_eq!(off, 4096);
        let mut a: libc::stat = unsafe { std::mem::zeroed() };
        let mut b: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat into local buffers.
        unsafe {
            libc::fstat(fd.as_raw_fd(), &mut a);
            libc::fstat(mem.fd().as_raw_fd(), &mut b);
        }
        assert_eq!(a.st_ino, b.st_ino, "the same file");
        assert!(shared_backing(base, 4 * 4096).is_none(), "past the mapping");
        let private = vec![0u8; 1 << 20];
        assert!(shared_backing(private.as_ptr() as u64, 4096).is_none());
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
