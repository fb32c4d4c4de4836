//! The `mooncake` transport: Mooncake's Transfer Engine moves the bytes
//! (its `tcp`, `rdma`, `nvlink`, ... transports), kvferry keeps the control
//! plane, leases, fences and deadlines (docs/design.md, "The Mooncake
//! transport").
//!
//! * One engine per endpoint, made and used on the endpoint's executor
//!   (`mooncake_sys::Engine` is neither `Send` nor `Sync`), loaded at run
//!   time from `MOONCAKE_TE_LIB` or the search path.
//! * The endpoint's address is the engine's segment name under
//!   `P2PHANDSHAKE`, `mooncake://IP:PORT`; it rides kvferry's `Hello`.
//! * Bounds: every local range is checked (and its region pinned) against
//!   this endpoint's registry before a request is submitted, every remote
//!   range against the peer's KV regions as its `Hello` announced them
//!   ([`MooncakeTransport::learn_peer`]). Mooncake's one-sided writes and
//!   reads never pass through the target's CPU, so the target cannot check
//!   again: the initiator's check is the only one.
//! * Completion: the executor polls `getTransferStatus` (yielding between
//!   polls, or on a timer: [`Cadence`]); it never blocks on the library.
//! * Deadlines: the C API cannot cancel. A batch must finish by
//!   `deadline - linger` to succeed; past that it has failed, but its
//!   future resolves only once the library reports every task finished, or
//!   at `deadline` (the machines' transfer bound, after which they trust no
//!   memory is touched) at the latest, so the blocks under it stay fenced
//!   while the library may still touch them. A batch still unfinished at
//!   `deadline` breaks that contract: it is counted
//!   ([`MooncakeTransport::overdue_batches`]), logged, and its id is kept
//!   and freed once the library finishes it. The library's own timeouts
//!   (`MC_SLICE_TIMEOUT`, `MC_TCP_STATUS_TIMEOUT_SEC`) should be set below
//!   `linger` so that cannot happen.
//! * Dropping a batch's future does not stop the library:
//!   [`Transport::stops_on_drop`] is false, so the node waits for every
//!   batch of a transfer instead of dropping the rest on the first failure.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvferry_machines::Backoff;
use mooncake_sys::ffi::{TransferRequest, OPCODE_READ, OPCODE_WRITE};
use mooncake_sys::{Batch, Engine, EngineConfig, Registration, Segment, TaskState, TeLib};

use super::registry::{self, Registry};
use super::{
    Desc, EndpointAddr, MisuseError, Op, RegionId, RegionInfo, Session, Transport, TransportError,
};

/// How the executor waits between two status polls of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cadence {
    /// Yield to the executor's other tasks, then poll again: the lowest
    /// latency, but a busy executor while batches are out, which takes
    /// CPU from the engine's own threads where cores are few (docs/performance.md).
    Yield,
    /// Sleep this long between polls.
    Timer(Duration),
    /// Sleep `first` after the first poll, twice as long after each next
    /// one, at most `max` ([`Backoff::doubling`]): a small batch is seen
    /// done within tens of microseconds, a large one costs a poll per `max`.
    Backoff {
        /// The first pause.
        first: Duration,
        /// The longest pause.
        max: Duration,
    },
}

impl Cadence {
    /// The pause after `polls` unfinished polls of a batch.
    fn pause(self, polls: u32) -> Option<Duration> {
        match self {
            Cadence::Yield => None,
            Cadence::Timer(t) => Some(t),
            Cadence::Backoff { first, max } => Some(Backoff::doubling(first, max).delay(polls)),
        }
    }
}

/// How a [`MooncakeTransport`] is set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MooncakeConfig {
    /// Mooncake's transport: `tcp`, `rdma`, `nvlink`, `nvlink_intra`,
    /// `efa`, ... (`tcp` is installed by name; the others by the engine's
    /// topology discovery, which `MC_CUSTOM_TOPO_JSON` can narrow).
    pub protocol: String,
    /// The metadata service; `P2PHANDSHAKE` needs none.
    pub metadata: String,
    /// Where registered memory lives, passed to `registerLocalMemory`:
    /// `cpu:0`, `cuda:0` (GPU memory, moved with GPUDirect RDMA where the
    /// hardware has it), or `*` for the engine to find out.
    pub location: String,
    /// The library's path; `None`: `MOONCAKE_TE_LIB`, then the search path.
    pub library: Option<PathBuf>,
    /// Most descriptors in one batch.
    pub max_descs: usize,
    /// The part of a batch's time reserved for the library to let go of
    /// its memory after the batch failed (see the module docs).
    pub linger: Duration,
    /// How completions are polled.
    pub cadence: Cadence,
}

impl Default for MooncakeConfig {
    fn default() -> Self {
        MooncakeConfig {
            protocol: "tcp".into(),
            metadata: "P2PHANDSHAKE".into(),
            location: "cpu:0".into(),
            library: None,
            max_descs: 1 << 16,
            linger: Duration::from_secs(2),
            cadence: Cadence::Backoff {
                first: Duration::from_micros(20),
                max: Duration::from_millis(1),
            },
        }
    }
}

/// The library, opened once per process and shared by every endpoint.
fn library(path: Option<&PathBuf>) -> Result<Arc<TeLib>, TransportError> {
    static LOADED: OnceLock<Result<Arc<TeLib>, mooncake_sys::Error>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        match path {
            Some(p) => TeLib::open(p),
            None => TeLib::load(),
        }
        .map(Arc::new)
    });
    loaded.clone().map_err(|source| TransportError::Library {
        during: "loading the Mooncake transfer engine",
        source,
    })
}

fn lib_err(during: &'static str) -> impl FnOnce(mooncake_sys::Error) -> TransportError {
    move |source| TransportError::Library { during, source }
}

/// State shared by the endpoint and its sessions.
struct Shared {
    engine: Engine,
    registry: Arc<Registry>,
    /// The KV regions of each peer, from its `Hello`, sorted by address.
    peers: RefCell<HashMap<SocketAddr, Vec<RegionInfo>>>,
    /// Requests of the batch being submitted: reused, so the submit path
    /// allocates nothing per descriptor once warm.
    scratch: RefCell<Vec<TransferRequest>>,
    overdue: Cell<u64>,
    cfg: MooncakeConfig,
}

/// A Mooncake Transfer Engine endpoint.
pub struct MooncakeTransport {
    shared: Rc<Shared>,
    /// Each region's registration with the engine; the regions of one
    /// [`MooncakeTransport::register_batch`] share theirs.
    registrations: RefCell<HashMap<RegionId, Rc<Registration>>>,
    addr: SocketAddr,
}

impl MooncakeTransport {
    /// Loads the library (once per process), creates an engine reachable
    /// at `ip` and installs `cfg.protocol`.
    pub fn new(ip: std::net::IpAddr, cfg: MooncakeConfig) -> Result<Self, TransportError> {
        let lib = library(cfg.library.as_ref())?;
        let ec = EngineConfig {
            metadata: cfg.metadata.clone(),
            ..EngineConfig::p2p(&ip.to_string(), &cfg.protocol)
        };
        let engine = Engine::new(lib, &ec).map_err(lib_err("creating the engine"))?;
        let name = engine.local_addr().map_err(lib_err("naming the engine"))?;
        let addr: SocketAddr = name.parse().map_err(|_| TransportError::Library {
            during: "naming the engine",
            source: mooncake_sys::Error::BadText {
                call: "getLocalIpAndPort",
            },
        })?;
        Ok(MooncakeTransport {
            shared: Rc::new(Shared {
                engine,
                registry: Registry::new(registry::DEFAULT_MAX_REGIONS),
                peers: RefCell::new(HashMap::new()),
                scratch: RefCell::new(Vec::new()),
                overdue: Cell::new(0),
                cfg,
            }),
            registrations: RefCell::new(HashMap::new()),
            addr,
        })
    }

    /// Records the memory `peer` registered (its KV regions, as its
    /// `Hello` announced them): remote ranges are checked against these.
    pub fn learn_peer(&self, peer: &EndpointAddr, mut regions: Vec<RegionInfo>) {
        let EndpointAddr::Mooncake(addr) = peer else {
            return;
        };
        regions.sort_by_key(|r| r.addr);
        self.shared.peers.borrow_mut().insert(*addr, regions);
    }

    /// Forgets every peer's memory (the caller bounds what it taught: a
    /// peer not taught again has all its ranges refused).
    pub fn forget_peers(&self) {
        self.shared.peers.borrow_mut().clear();
    }

    /// Registers every `(addr, len)` like [`Transport::register`], with one
    /// `registerLocalMemoryBatch` call; all or none. The engine lets go of
    /// them together, once the last of them is unregistered, so they must
    /// stay valid until then (the node unregisters its KV as a whole).
    ///
    /// # Safety
    ///
    /// As [`Transport::register`], for every region, until the last of
    /// them is unregistered.
    pub unsafe fn register_batch(
        &self,
        regions: &[(*mut u8, usize)],
    ) -> Result<Vec<RegionId>, TransportError> {
        let loc = self.shared.cfg.location.clone();
        // SAFETY: the caller's promise.
        unsafe { self.register_batch_at(regions, &loc) }
    }

    /// Registers `regions` like [`MooncakeTransport::register_batch`], at
    /// `location` (`cuda:0` for device memory: the engine moves it with
    /// GPUDirect RDMA or NVLink where the hardware has them).
    ///
    /// # Safety
    ///
    /// As for [`Transport::register`], for memory at `location`.
    pub unsafe fn register_batch_at(
        &self,
        regions: &[(*mut u8, usize)],
        loc: &str,
    ) -> Result<Vec<RegionId>, TransportError> {
        let mut ids = Vec::with_capacity(regions.len());
        for &(addr, len) in regions {
            match self.shared.registry.insert(addr as u64, len as u64) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    self.forget(&ids);
                    return Err(e.into());
                }
            }
        }
        // SAFETY: the caller's promise, as for `register`.
        match unsafe { self.shared.engine.register_batch(regions, loc) } {
            Ok(r) => {
                let r = Rc::new(r);
                let mut regs = self.registrations.borrow_mut();
                regs.extend(ids.iter().map(|&id| (id, r.clone())));
                Ok(ids)
            }
            Err(source) => {
                self.forget(&ids);
                Err(TransportError::Library {
                    during: "registering memory",
                    source,
                })
            }
        }
    }

    fn forget(&self, ids: &[RegionId]) {
        for &id in ids {
            let _ = self.shared.registry.remove(id);
        }
    }

    /// Batches still unfinished at their deadline (see the module docs).
    pub fn overdue_batches(&self) -> u64 {
        self.shared.overdue.get()
    }

    /// Batches dropped unfinished that the engine still holds.
    pub fn lingering_batches(&self) -> usize {
        self.shared.engine.reap()
    }
}

impl Transport for MooncakeTransport {
    type Session = MooncakeSession;

    unsafe fn register(&self, addr: *mut u8, len_bytes: usize) -> Result<RegionId, TransportError> {
        let id = self.shared.registry.insert(addr as u64, len_bytes as u64)?;
        let loc = &self.shared.cfg.location;
        // SAFETY: the caller's promise (valid, shareable memory until
        // `unregister`) is what the engine needs.
        match unsafe { self.shared.engine.register(addr, len_bytes, loc) } {
            Ok(r) => {
                self.registrations.borrow_mut().insert(id, Rc::new(r));
                Ok(id)
            }
            Err(source) => {
                self.shared.registry.remove(id)?;
                Err(TransportError::Library {
                    during: "registering memory",
                    source,
                })
            }
        }
    }

    fn unregister(&self, id: RegionId) -> Result<(), TransportError> {
        // The registry refuses while a batch pins the region.
        self.shared.registry.remove(id)?;
        self.registrations.borrow_mut().remove(&id);
        Ok(())
    }

    fn regions(&self) -> Vec<RegionInfo> {
        self.shared.registry.regions()
    }

    fn endpoint_addr(&self) -> EndpointAddr {
        EndpointAddr::Mooncake(self.addr)
    }

    async fn open(&self, peer: &EndpointAddr) -> Result<MooncakeSession, TransportError> {
        let EndpointAddr::Mooncake(addr) = peer else {
            return Err(MisuseError::UnreachableEndpoint(peer.to_string()).into());
        };
        let segment = (self.shared.engine)
            .open_segment(&addr.to_string())
            .map_err(lib_err("opening the peer's segment"))?;
        Ok(MooncakeSession {
            shared: self.shared.clone(),
            segment: Some(Rc::new(segment)),
            peer: *addr,
        })
    }

    fn stops_on_drop(&self) -> bool {
        false
    }
}

/// A session to one peer's segment.
pub struct MooncakeSession {
    shared: Rc<Shared>,
    /// `None` once closed.
    segment: Option<Rc<Segment>>,
    peer: SocketAddr,
}

impl MooncakeSession {
    /// Checks both sides of every descriptor; pins the local regions.
    fn check(&self, descs: &[Desc]) -> Result<registry::Pins, TransportError> {
        let max = self.shared.cfg.max_descs;
        if descs.len() > max {
            return Err(MisuseError::BatchTooLarge {
                descs: descs.len(),
                max_descs: max,
            }
            .into());
        }
        let pins = (self.shared.registry)
            .pin(descs.iter().map(|d| (d.local_addr, d.len_bytes)))
            .map_err(|(index, fault)| MisuseError::LocalDescriptor { index, fault })?;
        let peers = self.shared.peers.borrow();
        let regions = peers.get(&self.peer).map_or(&[][..], |r| &r[..]);
        registry::check_remote(regions, descs.iter().map(|d| (d.remote_addr, d.len_bytes)))
            .map_err(|(index, fault)| MisuseError::RemoteDescriptor { index, fault })?;
        Ok(pins)
    }

    /// Allocates a batch for `descs` and submits them.
    fn submit(&self, segment: &Segment, op: Op, descs: &[Desc]) -> Result<Batch, TransportError> {
        let opcode = match op {
            Op::Write => OPCODE_WRITE,
            Op::Read => OPCODE_READ,
        };
        let mut batch = (self.shared.engine)
            .batch(descs.len())
            .map_err(lib_err("allocating a batch"))?;
        let mut reqs = self.shared.scratch.borrow_mut();
        reqs.clear();
        reqs.extend(descs.iter().map(|d| TransferRequest {
            opcode,
            source: mooncake_sys::engine::source_ptr(d.local_addr),
            target_id: segment.id(),
            target_offset: d.remote_addr,
            length: d.len_bytes,
        }));
        // SAFETY: `check` found every local range in a region registered
        // with this engine (and pinned it until the batch ends) and every
        // remote range in the peer's registered KV; `wait` keeps the batch
        // (and so the caller's blocks, fenced) until its tasks finish.
        unsafe { batch.submit(&reqs) }.map_err(lib_err("submitting a batch"))?;
        Ok(batch)
    }

    /// Polls `batch` until every task finished, or `deadline`; success
    /// only if every task completed with all its bytes by `fail_at`.
    async fn wait(
        &self,
        batch: Batch,
        descs: &[Desc],
        fail_at: Instant,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        // The time the batch had to succeed in.
        let window = fail_at.saturating_duration_since(Instant::now());
        let after_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        let timeout = || TransportError::Timeout { after_ms };
        let mut next = 0;
        let mut polls = 0u32;
        let mut failed: Option<TransportError> = None;
        loop {
            while next < descs.len() {
                match batch.status(next).map_err(lib_err("polling a batch"))? {
                    TaskState::Completed { bytes } if bytes == descs[next].len_bytes => {}
                    TaskState::Completed { .. } => failed = failed.or(Some(short_task())),
                    TaskState::Failed(status) => failed = failed.or(Some(failed_task(status))),
                    TaskState::Waiting | TaskState::Pending | TaskState::Unknown(_) => break,
                }
                next += 1;
            }
            let now = Instant::now();
            if next == descs.len() {
                return match failed {
                    None if now <= fail_at => Ok(()),
                    None => Err(timeout()),
                    Some(e) => Err(e),
                };
            }
            if now >= deadline {
                self.overdue(descs.len() - next);
                return Err(timeout());
            }
            match self.shared.cfg.cadence.pause(polls) {
                None => futures_lite::future::yield_now().await,
                Some(t) => drop(glommio::timer::Timer::new(t).await),
            }
            polls = polls.saturating_add(1);
        }
    }

    fn overdue(&self, unfinished: usize) {
        let s = &self.shared;
        s.overdue.set(s.overdue.get() + 1);
        tracing::error!(
            peer = %self.peer,
            unfinished,
            "a Mooncake batch is unfinished at the transfer bound: its memory may still be touched"
        );
    }
}

fn short_task() -> TransportError {
    TransportError::Peer(super::PeerError::Protocol(
        "a Mooncake task completed with fewer bytes than asked".into(),
    ))
}

fn failed_task(status: i32) -> TransportError {
    TransportError::Library {
        during: "a Mooncake task",
        source: mooncake_sys::Error::Call {
            call: "getTransferStatus",
            code: i64::from(status),
        },
    }
}

impl Session for MooncakeSession {
    /// Without a caller's deadline (the node always gives one): `linger`
    /// to succeed, and `linger` more for the library to let go.
    async fn transfer(&self, op: Op, descs: &[Desc]) -> Result<(), TransportError> {
        let bound = self.shared.cfg.linger.saturating_mul(2);
        self.transfer_until(op, descs, None, Instant::now() + bound)
            .await
            .map(drop)
    }

    async fn transfer_until(
        &self,
        op: Op,
        descs: &[Desc],
        _trailer: Option<&[u8]>,
        deadline: Instant,
    ) -> Result<bool, TransportError> {
        let Some(segment) = &self.segment else {
            return Err(MisuseError::SessionClosed.into());
        };
        if descs.is_empty() {
            return Ok(false);
        }
        self.shared.engine.reap();
        let _pins = self.check(descs)?;
        let batch = self.submit(segment, op, descs)?;
        let fail_at = deadline
            .checked_sub(self.shared.cfg.linger)
            .unwrap_or(deadline)
            .max(Instant::now());
        // No trailer: Mooncake's notifications may arrive before the data
        // they follow, so the caller sends the status its own way.
        self.wait(batch, descs, fail_at, deadline)
            .await
            .map(|()| false)
    }

    async fn close(mut self) {
        self.segment = None;
    }
}
