//! The `tcp` transport: glommio (io_uring) sockets, several streams per peer.
//!
//! Each [`TcpTransport`] is both a target (it listens, and serves the frames
//! peers send against its own registered memory) and an initiator (its
//! [`TcpSession`]s push and pull batches). The frame format is in
//! [`super::wire`].
//!
//! A batch is cut into frames of at most [`TcpConfig::frame_max_bytes`] and
//! [`TcpConfig::frame_max_descs`]; frames are dealt round-robin to the
//! session's streams and pipelined: on each stream one half sends frames
//! while the other half reads the in-order responses, and the sender stops
//! when the stream's share of [`TcpConfig::inflight_max_bytes`] is unacked.
//! Payload bytes go between the socket and registered memory with
//! `recvmsg`/`sendmsg` over one iovec per descriptor: no staging copy.
//!
//! The target side (the served connections) is in `target` and `inbuf`,
//! the initiator side (sessions, and the plan that cuts a batch into
//! frames) in `session` and `plan`. What both sides read is in leaves that
//! name neither: the settings (`config`), the endpoint's fence and device
//! (`shared`) and how failures read as errors (`fail`).

mod auth;
mod config;
mod fail;
mod inbuf;
mod plan;
mod session;
mod shared;
mod target;

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::os::fd::{AsFd, IntoRawFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;

use glommio::net::TcpListener;
use glommio::Task;
use slab::Slab;

use super::device::{EngineEvent, PoolStats};
use super::fence::BlockFence;
use super::registry::Registry;
use super::shm::{ShmMode, ShmStats, ShmTarget};
use super::{EndpointAddr, MisuseError, RegionId, RegionInfo, Transport, TransportError};

pub use config::{StagingConfig, TcpConfig};
pub use session::TcpSession;
use shared::DeviceSide;
pub use target::NotifyHandler;
use target::Target;

/// Counters of an endpoint's device staging
/// ([`TcpTransport::staging_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagingStats {
    /// The pinned buffer pool.
    pub pool: PoolStats,
    /// Device copies enqueued and not yet seen finished.
    pub copies_in_flight: usize,
    /// Fence closes that waited for a device copy on a block they closed.
    pub drain_waits: u64,
    /// Those that gave up waiting after `drain_max`.
    pub drain_overruns: u64,
}

/// Counters of the tcp transport on one executor thread
/// ([`TcpTransport::thread_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpThreadStats {
    /// Times a reader parked on a socket of this executor had its bytes
    /// and was still not woken for them while a task spinning on another
    /// socket made 64 more tries: a batch that waits for a spin to run out.
    /// Under [`PollPolicy::Park`](crate::PollPolicy::Park) nothing spins,
    /// so it stays 0.
    pub spin_stalls: u64,
}

/// A TCP endpoint. Create it inside the glommio executor that will own it.
pub struct TcpTransport {
    target: Rc<Target>,
    local_addr: SocketAddr,
    listener_fd: RawFd,
    acceptor: Option<Task<()>>,
}

impl TcpTransport {
    /// Listens on `addr` (port 0 picks a free port) and starts serving peers
    /// on the current glommio executor.
    ///
    /// # Panics
    ///
    /// Outside a glommio executor.
    pub fn bind(addr: SocketAddr, mut config: TcpConfig) -> Result<TcpTransport, TransportError> {
        config.validate()?;
        config.poll = config.poll.for_this_process();
        // std's listener sets SO_REUSEADDR but not SO_REUSEPORT (glommio's
        // own bind sets the latter), so a restarted endpoint can rebind the
        // port but two live endpoints can never share it.
        let std_listener =
            std::net::TcpListener::bind(addr).map_err(|e| TransportError::io("bind", e))?;
        let local_addr = std_listener
            .local_addr()
            .map_err(|e| TransportError::io("bind", e))?;
        let listener_fd = std_listener.into_raw_fd();
        // SAFETY: `listener_fd` is a bound, listening socket we own; the
        // glommio listener takes ownership of it.
        let listener = unsafe { <TcpListener as std::os::fd::FromRawFd>::from_raw_fd(listener_fd) };
        let shm = (config.shm.mode != ShmMode::Off)
            .then(|| ShmTarget::start(&config.shm))
            .and_then(|r| {
                r.map_err(|e| tracing::warn!(error = %e, "shm: not available; tcp only"))
                    .ok()
            });
        let device = match &config.device {
            Some(d) => Some(DeviceSide::new(Arc::clone(d), &config.staging)?),
            None => None,
        };
        let target = Rc::new(Target {
            device,
            registry: Registry::new(config.max_regions),
            fence: Rc::new(RefCell::new(None)),
            config,
            notify: RefCell::new(None),
            conns: RefCell::new(Slab::new()),
            shutting_down: Cell::new(false),
            shm,
        });
        let acceptor = glommio::spawn_local(target::accept_loop(Rc::clone(&target), listener));
        Ok(TcpTransport {
            target,
            local_addr,
            listener_fd,
            acceptor: Some(acceptor),
        })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Puts registered memory under `fence`: from now on both ends of this
    /// endpoint (the served connections and every session it opened or
    /// opens) touch KV blocks only while the fence has them open.
    pub fn set_fence(&self, fence: Option<Rc<BlockFence>>) {
        let old = std::mem::replace(&mut *self.target.fence.borrow_mut(), fence.clone());
        if let Some(shm) = &self.target.shm {
            shm.set_fence(old.as_deref(), fence.as_deref());
        }
        if let Some(dev) = &self.target.device {
            if let Some(old) = &old {
                old.detach_copies(&dev.copies);
            }
            if let Some(new) = &fence {
                new.attach_copies(Rc::clone(&dev.copies));
            }
        }
    }

    /// Registers `len_bytes` of device memory at `addr`, on the device of
    /// [`TcpConfig::device`]: the driver checks that the range lies in one
    /// of its allocations, then local batches may use it and peers read
    /// or write it, their bytes staged through pinned host buffers
    /// ([`StagingConfig`]). The bounds checks and the block fence apply as
    /// to host memory.
    ///
    /// # Safety
    ///
    /// As for [`Transport::register`], for device memory: it must stay
    /// allocated until the region is unregistered.
    pub unsafe fn register_device(
        &self,
        addr: u64,
        len_bytes: usize,
    ) -> Result<RegionId, TransportError> {
        let during = "registering device memory";
        let Some(dev) = &self.target.device else {
            let detail = "this endpoint has no device (TcpConfig::device)".to_string();
            return Err(TransportError::device(during)(
                super::DeviceError::NoDriver { detail },
            ));
        };
        let device = &dev.copies.device;
        device
            .check_range(addr, len_bytes as u64)
            .map_err(TransportError::device(during))?;
        let id = self.target.registry.insert_device(addr, len_bytes as u64)?;
        // Peers on this host open it by IPC handle and copy device to
        // device; where it cannot be exported, they stage over tcp.
        if let Some(shm) = &self.target.shm {
            let info = RegionInfo {
                addr,
                len_bytes: len_bytes as u64,
            };
            let offered = device
                .export_ipc(addr, len_bytes as u64)
                .map_err(|e| e.to_string())
                .and_then(|export| {
                    shm.add_device_region(id.0, info, export)
                        .map_err(|e| e.to_string())
                });
            if let Err(e) = offered {
                tracing::debug!(error = %e, "device region not offered by IPC; peers stage it");
            }
        }
        Ok(id)
    }

    /// Makes the device copies that read local blocks from now on wait
    /// for `event`, recorded on the engine's stream when it handed them
    /// over: a send never reads what the engine's kernels still write.
    pub fn wait_engine(&self, event: &EngineEvent) -> Result<(), TransportError> {
        let Some(dev) = &self.target.device else {
            return Ok(());
        };
        dev.copies
            .wait_engine(event)
            .map_err(TransportError::device("waiting for the engine's stream"))
    }

    /// The counters of device staging (zero without a device).
    pub fn staging_stats(&self) -> StagingStats {
        let Some(d) = &self.target.device else {
            return StagingStats::default();
        };
        let (drain_waits, drain_overruns) = d.copies.drain_counts();
        StagingStats {
            pool: d.pool.stats(),
            copies_in_flight: d.copies.in_flight(),
            drain_waits,
            drain_overruns,
        }
    }

    /// Registers `len_bytes` at `addr` like [`Transport::register`], and
    /// shares them with peers on this host: they are the bytes of `fd`
    /// from `offset` (a sealed `memfd`, such as a [`crate::SharedMem`]),
    /// which peers map and copy into or out of directly. Without shared
    /// memory on this endpoint ([`ShmMode::Off`]) it is a plain
    /// registration.
    ///
    /// # Safety
    ///
    /// As for [`Transport::register`]; and `addr` must map `fd` at
    /// `offset` shared (`MAP_SHARED`) for all `len_bytes`, so that what
    /// peers write into the file is what this process reads there.
    pub unsafe fn register_shared(
        &self,
        addr: *mut u8,
        len_bytes: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
    ) -> Result<RegionId, TransportError> {
        let id = self.target.registry.insert(addr as u64, len_bytes as u64)?;
        if let Some(shm) = &self.target.shm {
            let info = RegionInfo {
                addr: addr as u64,
                len_bytes: len_bytes as u64,
            };
            if let Err(refusal) = shm.add_region((id.0, 0), info, fd, offset) {
                let _ = self.target.registry.remove(id);
                return Err(MisuseError::BadConfig(format!("shared region: {refusal}")).into());
            }
        }
        Ok(id)
    }

    /// The counters of the shared-memory path (zero without it).
    pub fn shm_stats(&self) -> ShmStats {
        self.target
            .shm
            .as_ref()
            .map_or_else(ShmStats::default, ShmTarget::stats)
    }

    /// Sets where NOTIFY frames from peers go (see [`TcpSession::notify`]).
    pub fn set_notify_handler(&self, handler: Option<NotifyHandler>) {
        *self.target.notify.borrow_mut() = handler;
    }

    /// The block fence set by [`TcpTransport::set_fence`].
    pub fn fence(&self) -> Option<Rc<BlockFence>> {
        self.target.fence.borrow().clone()
    }

    /// The endpoint's configuration.
    pub fn config(&self) -> &TcpConfig {
        &self.target.config
    }

    /// Connections being served now.
    pub fn connections(&self) -> usize {
        self.target.conns.borrow().len()
    }

    /// The transport's counters on the executor thread this endpoint runs
    /// on (every endpoint of that thread shares them: a task that spins on
    /// a socket holds back every task of its executor).
    pub fn thread_stats(&self) -> TcpThreadStats {
        TcpThreadStats {
            spin_stalls: super::fdio::spin_stalls(),
        }
    }

    /// Stops serving: the listener stops accepting and every served
    /// connection is shut down at once, so peers see the close immediately
    /// and the port can be bound again. Also done on drop.
    pub fn shutdown(&mut self) {
        if self.target.shutting_down.replace(true) {
            return;
        }
        // SAFETY: shutting down sockets we own; the fds stay open until their
        // owners (acceptor, connection tasks) drop them, so they are not
        // reused underneath us.
        unsafe {
            libc::shutdown(self.listener_fd, libc::SHUT_RDWR);
            for (_, &fd) in self.target.conns.borrow().iter() {
                libc::shutdown(fd, libc::SHUT_RDWR);
            }
        }
        // Dropping the task cancels the acceptor and closes the listener.
        self.acceptor.take();
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Transport for TcpTransport {
    type Session = TcpSession;

    /// The parts of the range mapped shared from a sealed `memfd` this
    /// process holds open are shared with peers on this host, as by
    /// [`TcpTransport::register_shared`]; batches touching the rest move
    /// over tcp.
    unsafe fn register(&self, addr: *mut u8, len_bytes: usize) -> Result<RegionId, TransportError> {
        let pieces = match &self.target.shm {
            Some(_) => crate::shm::shared_pieces(addr as u64, len_bytes as u64),
            None => Vec::new(),
        };
        let id = self.target.registry.insert(addr as u64, len_bytes as u64)?;
        if let Some(shm) = &self.target.shm {
            for (k, p) in pieces.iter().enumerate() {
                let info = RegionInfo {
                    addr: p.addr,
                    len_bytes: p.len,
                };
                if let Err(refusal) = shm.add_region((id.0, k as u32), info, p.fd.as_fd(), p.offset)
                {
                    tracing::info!(%refusal, "shm: a memfd region stays unshared");
                }
            }
        }
        Ok(id)
    }

    fn unregister(&self, id: RegionId) -> Result<(), TransportError> {
        // Peers stop copying into it first: its map retires, every copy in
        // progress ends, then the region goes.
        if let Some(shm) = &self.target.shm {
            shm.remove_region(id.0);
        }
        Ok(self.target.registry.remove(id)?)
    }

    fn regions(&self) -> Vec<RegionInfo> {
        self.target.registry.regions()
    }

    fn endpoint_addr(&self) -> EndpointAddr {
        EndpointAddr::Tcp(self.local_addr)
    }

    /// Every batch costs a round trip to the peer.
    fn coalesce_small_batches(&self) -> bool {
        true
    }

    fn carries_notifications(&self) -> bool {
        true
    }

    async fn open(&self, peer: &EndpointAddr) -> Result<TcpSession, TransportError> {
        match peer {
            EndpointAddr::Tcp(addr) => self.open_tcp(*addr).await,
            EndpointAddr::Local(_) | EndpointAddr::Mooncake(_) => {
                Err(MisuseError::UnreachableEndpoint(peer.to_string()).into())
            }
        }
    }
}
