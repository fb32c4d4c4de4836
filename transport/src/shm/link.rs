//! The initiator's side: the handshake over the target's Unix socket, and
//! the link that copies through the target's shared memory.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::Duration;

use super::ctl::{CtlView, Stop};
use super::hello::{peer_cred, recv_offer, Answer, Offer, OfferDevice};
use super::host::HostId;
use super::mem::PeerMap;
use super::{ShmRefusal, SHM_CHUNK_BYTES};
use crate::device::{CopyTracker, Device, Dir, IpcOpened};
use crate::fence::slots::{slots_in, FenceRegion};
use crate::fence::BlockFence;
use crate::RegionInfo;

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
