//! The initiator's side: the handshake over the target's Unix socket, and
//! the link that copies through the target's shared memory.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::Duration;

use super::ctl::{CtlView, Stop};
use super::host::{HostId, HOST_ID_LEN};
use super::mem::PeerMap;
use super::target::ANSWER_LEN;
use super::{ShmRefusal, SHM_CHUNK_BYTES};
use crate::device::{CopyTracker, Device, Dir, IpcOpened, IPC_HANDLE_LEN};
use crate::fence::{slots_in, BlockFence, FenceRegion, Space};
use crate::RegionInfo;

pub(crate) const TOKEN_LEN: usize = 16;
const OFFER_MAGIC: u64 = u64::from_le_bytes(*b"KVFSHMOF");
/// Most region files one offer passes (`SCM_MAX_FD` is 253, one is the
/// control file).
pub(crate) const MAX_OFFER_REGIONS: usize = 252;
/// Most fenced regions an offer lists.
const MAX_OFFER_FENCE: usize = 1 << 16;

pub(crate) fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    let mut got = 0;
    while got < N {
        // SAFETY: writes at most `N - got` bytes into `b[got..]`.
        let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), N - got, 0) };
        if n > 0 {
            got += n as usize;
        } else if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            // No randomness at all: fall back to the clock, still unique
            // enough for a socket name (a token is also checked by user).
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos()
                .to_le_bytes();
            for (i, x) in b.iter_mut().enumerate() {
                *x ^= t[i % t.len()];
            }
            break;
        }
    }
    b
}

pub(crate) fn random_token() -> [u8; TOKEN_LEN] {
    random_bytes()
}

pub(crate) fn random_u64() -> u64 {
    u64::from_le_bytes(random_bytes())
}

/// The kernel's record of who holds the other end of `conn`.
pub(crate) fn peer_cred(conn: &UnixStream) -> Result<libc::ucred, ShmRefusal> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` describe a buffer of the right size.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc < 0 {
        return Err(ShmRefusal::io(io::Error::last_os_error()));
    }
    Ok(cred)
}

/// One shared region as an offer lists it (its file is passed beside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OfferRegion {
    pub(crate) info: RegionInfo,
    pub(crate) offset: u64,
}

/// One device region as an offer lists it: the range, its offset in its
/// allocation, and the allocation's IPC handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OfferDevice {
    pub(crate) info: RegionInfo,
    pub(crate) offset: u64,
    pub(crate) handle: [u8; IPC_HANDLE_LEN],
}

/// What a target hands a peer: its map of shared memory and fence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Offer {
    pub(crate) generation: u64,
    pub(crate) lane: usize,
    pub(crate) lanes: usize,
    pub(crate) counts: Vec<u64>,
    pub(crate) fence: Vec<FenceRegion>,
    pub(crate) regions: Vec<OfferRegion>,
    /// Device regions (the GPU hello); an offer without the list (an
    /// older target) has none.
    pub(crate) devices: Vec<OfferDevice>,
}

impl Offer {
    /// Little-endian words: length, magic, generation, lane, lanes, the
    /// counts, the fenced regions (base, stride, count, space), the shared
    /// regions (addr, len, offset), then the device regions (addr, len,
    /// offset, the handle's 64 bytes as 8 words).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = vec![0, OFFER_MAGIC, self.generation];
        w.extend([self.lane as u64, self.lanes as u64]);
        w.push(self.counts.len() as u64);
        w.extend(&self.counts);
        w.push(self.fence.len() as u64);
        for r in &self.fence {
            w.extend([r.base, r.stride, r.count, r.space.index() as u64]);
        }
        w.push(self.regions.len() as u64);
        for r in &self.regions {
            w.extend([r.info.addr, r.info.len_bytes, r.offset]);
        }
        w.push(self.devices.len() as u64);
        for d in &self.devices {
            w.extend([d.info.addr, d.info.len_bytes, d.offset]);
            w.extend(
                d.handle
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())),
            );
        }
        w[0] = (w.len() * 8) as u64;
        w.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Offer, ShmRefusal> {
        let bad = ShmRefusal::Malformed;
        let mut words = b
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()));
        let mut next = || words.next().ok_or(bad("short offer"));
        let len = next()?;
        if !b.len().is_multiple_of(8) || len != b.len() as u64 || next()? != OFFER_MAGIC {
            return Err(bad("offer header"));
        }
        let generation = next()?;
        let lane = next()? as usize;
        let lanes = next()? as usize;
        let n = next()? as usize;
        if n > super::ctl::MAX_SPACES {
            return Err(bad("spaces"));
        }
        let counts = (0..n).map(|_| next()).collect::<Result<Vec<_>, _>>()?;
        let n = next()? as usize;
        if n > MAX_OFFER_FENCE {
            return Err(bad("fenced regions"));
        }
        let mut fence = Vec::with_capacity(n);
        for _ in 0..n {
            let (base, stride, count) = (next()?, next()?, next()?);
            let space = Space::from_index(next()?).ok_or(bad("space"))?;
            if space.index() >= counts.len() || stride == 0 || count == 0 {
                return Err(bad("fenced region"));
            }
            fence.push(FenceRegion {
                base,
                stride,
                count,
                space,
            });
        }
        if fence.windows(2).any(|w| w[0].base > w[1].base) {
            return Err(bad("fenced regions out of order"));
        }
        let n = next()? as usize;
        if n > MAX_OFFER_REGIONS {
            return Err(bad("regions"));
        }
        let mut regions = Vec::with_capacity(n);
        for _ in 0..n {
            let (addr, len_bytes, offset) = (next()?, next()?, next()?);
            regions.push(OfferRegion {
                info: RegionInfo { addr, len_bytes },
                offset,
            });
        }
        let n = next().unwrap_or(0) as usize;
        if n > MAX_OFFER_REGIONS {
            return Err(bad("device regions"));
        }
        let mut devices = Vec::with_capacity(n);
        for _ in 0..n {
            let (addr, len_bytes, offset) = (next()?, next()?, next()?);
            let mut handle = [0u8; IPC_HANDLE_LEN];
            for c in handle.chunks_exact_mut(8) {
                c.copy_from_slice(&next()?.to_le_bytes());
            }
            devices.push(OfferDevice {
                info: RegionInfo { addr, len_bytes },
                offset,
                handle,
            });
        }
        Ok(Offer {
            generation,
            lane,
            lanes,
            counts,
            fence,
            regions,
            devices,
        })
    }
}

/// Sends `offer` with `fds` (the control file, then one per region).
pub(crate) fn send_offer(
    conn: &UnixStream,
    offer: &Offer,
    fds: &[RawFd],
) -> Result<(), ShmRefusal> {
    if fds.len() != offer.regions.len() + 1 || offer.regions.len() > MAX_OFFER_REGIONS {
        return Err(ShmRefusal::Malformed("too many regions to share"));
    }
    let bytes = offer.encode();
    let mut cbuf = vec![0u8; cmsg_space(fds.len())];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut _,
        iov_len: bytes.len(),
    };
    let msg = msghdr(&mut iov, &mut cbuf);
    // SAFETY: the control buffer has room for one header and the fds.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
    }
    // SAFETY: `msg` describes valid buffers.
    let n = unsafe { libc::sendmsg(conn.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(ShmRefusal::io(io::Error::last_os_error()));
    }
    // The rest, if the socket took only part (the files came with the first byte).
    (&*conn)
        .write_all(&bytes[n as usize..])
        .map_err(ShmRefusal::io)
}

/// A message of one buffer and a control buffer; both must outlive its use.
fn msghdr(iov: &mut libc::iovec, control: &mut [u8]) -> libc::msghdr {
    // SAFETY: a zeroed msghdr is valid (no buffers).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    msg
}

fn cmsg_space(fds: usize) -> usize {
    // SAFETY: pure arithmetic.
    unsafe { libc::CMSG_SPACE((fds * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// Receives an offer and its files.
fn recv_offer(conn: &UnixStream) -> Result<(Offer, Vec<OwnedFd>), ShmRefusal> {
    let mut buf = vec![0u8; 64 << 10];
    let mut cbuf = vec![0u8; cmsg_space(MAX_OFFER_REGIONS + 1)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut msg = msghdr(&mut iov, &mut cbuf);
    // SAFETY: `msg` describes valid buffers.
    let n = unsafe { libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n <= 0 {
        let e = if n == 0 {
            io::Error::from(io::ErrorKind::UnexpectedEof)
        } else {
            io::Error::last_os_error()
        };
        return Err(ShmRefusal::io(e));
    }
    let fds = take_fds(&msg);
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(ShmRefusal::Malformed("too many files"));
    }
    let mut got = n as usize;
    let want = if got >= 8 {
        u64::from_le_bytes(buf[..8].try_into().unwrap_or_default())
    } else {
        0
    };
    if !(8..=(64 << 20)).contains(&want) {
        return Err(ShmRefusal::Malformed("offer length"));
    }
    let want = want as usize;
    buf.resize(want.max(got), 0);
    while got < want {
        let k = io::Read::read(&mut &*conn, &mut buf[got..want]).map_err(ShmRefusal::io)?;
        if k == 0 {
            return Err(ShmRefusal::Malformed("short offer"));
        }
        got += k;
    }
    buf.truncate(got);
    Ok((Offer::decode(&buf)?, fds))
}

/// Takes ownership of the files in `msg`'s control messages.
fn take_fds(msg: &libc::msghdr) -> Vec<OwnedFd> {
    let mut out = Vec::new();
    // SAFETY: walking the control buffer the kernel filled, by its macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let n = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..n {
                    out.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    out
}

/// A target's answer to the shm hello, decoded.
pub(crate) struct Answer {
    pub(crate) host: HostId,
    pub(crate) token: [u8; TOKEN_LEN],
    pub(crate) name: String,
}

impl Answer {
    pub(crate) fn decode(b: &[u8]) -> Option<Answer> {
        if b.len() != ANSWER_LEN {
            return None;
        }
        let host = HostId::decode(&b[..HOST_ID_LEN])?;
        let token = b[HOST_ID_LEN..HOST_ID_LEN + TOKEN_LEN].try_into().ok()?;
        let name = &b[HOST_ID_LEN + TOKEN_LEN..];
        let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
        let name = std::str::from_utf8(&name[..end]).ok()?.to_string();
        Some(Answer { host, token, name })
    }
}

/// A mapped region of the target.
struct Mapped {
    info: RegionInfo,
    map: PeerMap,
}

/// A device region of the target, its allocation opened here.
struct OpenedDevice {
    info: RegionInfo,
    /// Where `info.addr` is in this process.
    here: u64,
    _opened: IpcOpened,
}

/// The initiator's link to one target: its regions mapped here (shared
/// host memory) or opened (device memory, by IPC handle), its control
/// file, and the socket whose hang-up frees our lane there.
pub(crate) struct ShmLink {
    regions: Vec<Mapped>,
    devices: Vec<OpenedDevice>,
    ctl: CtlView,
    fence: Vec<FenceRegion>,
    _conn: UnixStream,
}

// SAFETY: the mappings are plain memory owned by the link; it is built on
// a helper thread and then used by one executor only.
unsafe impl Send for ShmLink {}

/// Why a batch did not go through the link.
#[derive(Debug)]
pub(crate) enum CopyFail {
    /// A target range outside the link's regions: tcp may move it.
    Uncovered,
    /// The target changed its regions or fence: handshake again.
    Stale,
    /// A block of this side or the target's is fenced.
    Fenced,
    /// The deadline passed between chunks.
    Timeout,
    /// A device copy failed.
    Device(crate::DeviceError),
}

impl ShmLink {
    /// Connects to the target that sent `answer` (it said hello as
    /// `expected_pid`) and maps what it offers. Blocking: run off the
    /// executors.
    /// With `device`, the target's device regions are opened too.
    pub(crate) fn establish(
        answer: &Answer,
        me: &HostId,
        timeout: Duration,
        device: Option<&dyn Device>,
    ) -> Result<ShmLink, ShmRefusal> {
        if !me.shares_with(&answer.host) {
            return Err(if me.uid != answer.host.uid {
                ShmRefusal::NotSameUser
            } else {
                ShmRefusal::NotSameHost
            });
        }
        let addr = SocketAddr::from_abstract_name(&answer.name).map_err(ShmRefusal::io)?;
        let conn = UnixStream::connect_addr(&addr).map_err(ShmRefusal::io)?;
        conn.set_read_timeout(Some(timeout))
            .map_err(ShmRefusal::io)?;
        conn.set_write_timeout(Some(timeout))
            .map_err(ShmRefusal::io)?;
        let cred = peer_cred(&conn)?;
        if cred.uid != me.uid {
            return Err(ShmRefusal::NotSameUser);
        }
        if cred.pid as u32 != answer.host.pid {
            return Err(ShmRefusal::WrongProcess);
        }
        (&conn).write_all(&answer.token).map_err(ShmRefusal::io)?;
        let (offer, fds) = recv_offer(&conn)?;
        let devices = open_devices(&offer.devices, device)?;
        ShmLink::map(offer, fds, conn, devices)
    }

    fn map(
        offer: Offer,
        fds: Vec<OwnedFd>,
        conn: UnixStream,
        devices: Vec<OpenedDevice>,
    ) -> Result<ShmLink, ShmRefusal> {
        if fds.len() != offer.regions.len() + 1 {
            return Err(ShmRefusal::Malformed("file count"));
        }
        let ctl = CtlView::new(
            &fds[0],
            offer.lanes,
            &offer.counts,
            offer.lane,
            offer.generation,
        )?;
        let mut regions = offer
            .regions
            .iter()
            .zip(&fds[1..])
            .map(|(r, fd)| {
                Ok(Mapped {
                    info: r.info,
                    map: PeerMap::new(fd, r.offset, r.info.len_bytes)?,
                })
            })
            .collect::<Result<Vec<_>, ShmRefusal>>()?;
        regions.sort_by_key(|m| m.info.addr);
        let overlap = regions.windows(2).any(|w| {
            w[0].info
                .addr
                .checked_add(w[0].info.len_bytes)
                .is_none_or(|end| end > w[1].info.addr)
        });
        if overlap {
            return Err(ShmRefusal::Malformed("overlapping regions"));
        }
        Ok(ShmLink {
            regions,
            devices,
            ctl,
            fence: offer.fence,
            _conn: conn,
        })
    }

    /// Where `[addr, addr + len)` of the target is mapped here.
    fn translate(&self, addr: u64, len: u64) -> Option<*mut u8> {
        let end = addr.checked_add(len)?;
        let i = self.regions.partition_point(|m| m.info.addr <= addr);
        let m = &self.regions[i.checked_sub(1)?];
        (len > 0 && end <= m.info.addr + m.info.len_bytes).then(|| {
            // SAFETY: inside the mapping (checked above).
            unsafe { m.map.ptr().add((addr - m.info.addr) as usize) }
        })
    }

    /// Where `[addr, addr + len)` of the target's device memory is here.
    fn translate_device(&self, addr: u64, len: u64) -> Option<u64> {
        let end = addr.checked_add(len)?;
        let i = self.devices.partition_point(|m| m.info.addr <= addr);
        let m = &self.devices[i.checked_sub(1)?];
        (len > 0 && end <= m.info.addr + m.info.len_bytes).then(|| m.here + (addr - m.info.addr))
    }

    /// True if the link reaches none of the target's memory (it offers
    /// only device regions and this side has no device to open them).
    pub(crate) fn is_empty(&self) -> bool {
        self.regions.is_empty() && self.devices.is_empty()
    }

    /// True while the target has not changed what it shares since.
    pub(crate) fn current(&self) -> bool {
        self.ctl.current()
    }

    /// True if the link moves `d`: its target range in the target's shared
    /// host memory and its local range host memory (a `memcpy`), or its
    /// target range in the target's device memory opened here (a copy on
    /// this endpoint's device).
    pub(crate) fn covers(&self, d: &crate::Desc, local_device: bool) -> bool {
        match self.translate_device(d.remote_addr, d.len_bytes) {
            Some(_) => true,
            None => !local_device && self.translate(d.remote_addr, d.len_bytes).is_some(),
        }
    }

    /// Whether the target range `[remote, remote + len)` is device memory.
    pub(crate) fn is_device(&self, remote: u64, len: u64) -> bool {
        self.translate_device(remote, len).is_some()
    }

    /// Copies one piece between this side's `local` (device memory when
    /// `local_device`) and the target's device memory at `remote`, on
    /// `copies`' streams, under both fences: the lane stays published
    /// until the copy ended, so a close there waits for it as for a
    /// `memcpy`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn copy_device(
        &self,
        write: bool,
        local: u64,
        remote: u64,
        len: u64,
        local_device: bool,
        fence: Option<&BlockFence>,
        copies: &CopyTracker,
    ) -> Result<(), CopyFail> {
        let there = self
            .translate_device(remote, len)
            .ok_or(CopyFail::Uncovered)?;
        if fence.is_some_and(|f| !f.allows(local, len)) {
            return Err(CopyFail::Fenced);
        }
        let dir = match (write, local_device) {
            (_, true) => Dir::DeviceToDevice,
            (true, false) => Dir::ToDevice,
            (false, false) => Dir::ToHost,
        };
        let (dst, src) = if write {
            (there, local)
        } else {
            (local, there)
        };
        let slots = slots_in(&self.fence, remote, len).map(|(r, f, l)| (r.space.index(), f, l));
        let mut copied = Ok(());
        self.ctl
            .guarded(slots, || {
                // SAFETY: `local` lies in this endpoint's registered memory
                // (pinned by the caller), `there` in an allocation opened
                // from the target's handle; both fences allow them now and
                // the lane holds the target's close off until the copy ends.
                copied = unsafe { copies.copy_now(dir, dst, src, len) };
            })
            .map_err(|s| match s {
                Stop::Stale => CopyFail::Stale,
                Stop::Fenced => CopyFail::Fenced,
            })?;
        copied.map_err(CopyFail::Device)?;
        super::count_copied(len);
        Ok(())
    }

    /// Copies one chunk: `local` (this side, registered and checked by the
    /// caller) and the target's `remote`, under both fences.
    pub(crate) fn copy_chunk(
        &self,
        write: bool,
        local: u64,
        remote: u64,
        len: u64,
        fence: Option<&BlockFence>,
    ) -> Result<(), CopyFail> {
        debug_assert!(len <= SHM_CHUNK_BYTES);
        let there = self.translate(remote, len).ok_or(CopyFail::Uncovered)?;
        if fence.is_some_and(|f| !f.allows(local, len)) {
            return Err(CopyFail::Fenced);
        }
        let slots = slots_in(&self.fence, remote, len).map(|(r, f, l)| (r.space.index(), f, l));
        let here = local as usize as *mut u8;
        self.ctl
            .guarded(slots, || {
                let (src, dst) = if write { (here, there) } else { (there, here) };
                // SAFETY: `here` lies in this endpoint's registered memory
                // (pinned by the caller), `there` inside a live mapping of
                // the target's sealed file; the fences allow both now.
                unsafe { std::ptr::copy(src, dst, len as usize) };
            })
            .map_err(|s| match s {
                Stop::Stale => CopyFail::Stale,
                Stop::Fenced => CopyFail::Fenced,
            })?;
        super::count_copied(len);
        Ok(())
    }
}

/// Opens the offered device regions with `device`; without one, or where a
/// handle does not open (another host's, memory without a legacy IPC
/// handle), none: those regions move over tcp, staged.
fn open_devices(
    offered: &[OfferDevice],
    device: Option<&dyn Device>,
) -> Result<Vec<OpenedDevice>, ShmRefusal> {
    let Some(device) = device else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for d in offered {
        match device.open_ipc(&d.handle) {
            Ok(opened) => out.push(OpenedDevice {
                info: d.info,
                here: opened.base() + d.offset,
                _opened: opened,
            }),
            Err(e) => tracing::debug!(error = %e, "shm: a device region did not open; tcp"),
        }
    }
    out.sort_by_key(|m| m.info.addr);
    let overlap = out.windows(2).any(|w| {
        w[0].info
            .addr
            .checked_add(w[0].info.len_bytes)
            .is_none_or(|end| end > w[1].info.addr)
    });
    if overlap {
        return Err(ShmRefusal::Malformed("overlapping device regions"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn offer(regions: usize, fenced: usize) -> Offer {
        Offer {
            generation: 7,
            lane: 3,
            lanes: 64,
            counts: vec![1024, 16],
            fence: (0..fenced as u64)
                .map(|i| FenceRegion {
                    base: 0x1000 + i * 0x10_0000,
                    stride: 4096,
                    count: 16,
                    space: if i % 2 == 0 {
                        Space::Kv
                    } else {
                        Space::Pool(0)
                    },
                })
                .collect(),
            regions: (0..regions as u64)
                .map(|i| OfferRegion {
                    info: RegionInfo {
                        addr: 0x7000_0000 + i * 0x100_0000,
                        len_bytes: 0x8000,
                    },
                    offset: i * 4096,
                })
                .collect(),
            devices: (0..regions as u64)
                .map(|i| OfferDevice {
                    info: RegionInfo {
                        addr: 0x9000_0000 + i * 0x100_0000,
                        len_bytes: 0x4000,
                    },
                    offset: i * 512,
                    handle: [i as u8 ^ 0x5a; IPC_HANDLE_LEN],
                })
                .collect(),
        }
    }

    #[test]
    fn an_offer_round_trips_and_a_cut_or_bent_one_is_refused() {
        let o = offer(3, 4);
        let b = o.encode();
        assert_eq!(Offer::decode(&b), Ok(o));
        assert!(Offer::decode(&b[..b.len() - 8]).is_err(), "cut");
        let mut bent = b.clone();
        bent[8] ^= 1;
        assert!(Offer::decode(&bent).is_err(), "magic");
        let mut many = offer(0, 0);
        many.counts = vec![1; super::super::ctl::MAX_SPACES + 1];
        assert!(Offer::decode(&many.encode()).is_err(), "too many spaces");
        let mut space = offer(0, 1);
        space.fence[0].space = Space::Pool(5);
        assert!(
            Offer::decode(&space.encode()).is_err(),
            "a pool the counts lack"
        );
    }

    proptest! {
        /// Whatever a peer sends, decoding returns, and what it accepts
        /// holds only what the bounds allow.
        #[test]
        fn decoding_any_bytes_returns_within_bounds(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(o) = Offer::decode(&bytes) {
                prop_assert!(o.regions.len() <= MAX_OFFER_REGIONS);
                prop_assert!(o.fence.len() <= MAX_OFFER_FENCE);
                prop_assert!(o.fence.iter().all(|r| r.space.index() < o.counts.len()));
            }
        }

        /// Decoding a valid offer with one word changed never panics.
        #[test]
        fn a_valid_offer_with_a_word_changed_decodes_or_is_refused(at in 0usize..64, word in any::<u64>()) {
            let mut b = offer(2, 2).encode();
            let i = (at % (b.len() / 8)) * 8;
            b[i..i + 8].copy_from_slice(&word.to_le_bytes());
            let _ = Offer::decode(&b);
        }
    }
}
