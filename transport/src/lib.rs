#![warn(missing_docs)]
//! Data plane: moves bytes between registered memory regions of two endpoints.
//!
//! A [`Transport`] is one endpoint, owned by one glommio executor (thread per
//! core): a node creates one endpoint per executor and keeps it there. The
//! endpoint registers the memory that peers may touch, opens [`Session`]s to
//! peer endpoints, and serves the sessions that peers open to it.
//!
//! A session moves a batch of [`Desc`]riptors `(local_addr, remote_addr,
//! len_bytes)` in one direction ([`Op::Write`] pushes local bytes into the
//! peer, [`Op::Read`] pulls peer bytes into local memory) and resolves when
//! every byte has landed, or fails as a whole with a [`TransportError`].
//!
//! Every descriptor is checked against the registered regions on both ends
//! before any byte moves: the initiator checks its own side (and the peer's
//! advertised regions), the target checks its own side again on every frame.
//! A peer can therefore never make an endpoint read or write memory it did
//! not register, whatever it sends.
//!
//! ```no_run
//! # use kvferry_transport::*;
//! # async fn demo(peer: EndpointAddr) -> Result<(), TransportError> {
//! let ep = TcpTransport::bind("127.0.0.1:0".parse().unwrap(), TcpConfig::default())?;
//! let mut buf = vec![0u8; 1 << 20];
//! // SAFETY: `buf` outlives the registration; it is unregistered below.
//! let region = unsafe { ep.register(buf.as_mut_ptr(), buf.len())? };
//! let session = ep.open(&peer).await?;
//! let descs = [Desc { local_addr: buf.as_ptr() as u64, remote_addr: 0x1000, len_bytes: 4096 }];
//! session.transfer(Op::Write, &descs).await?;
//! session.close().await;
//! ep.unregister(region)?;
//! # Ok(()) }
//! ```

mod any;
mod device;
mod fdio;
mod fence;
mod local;
mod mooncake;
mod registry;
mod resolve;
mod shm;
mod tcp;
mod turns;
mod wire;

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::{Duration, Instant};

pub use any::{AnySession, AnyTransport};
#[cfg(feature = "cuda")]
pub use device::CudaDevice;
pub use device::{
    open_cuda, CopyStream, Device, DeviceAlloc, DeviceError, Dir, EngineEvent, HostDevice,
    IpcExport, IpcOpened, Lease, Mark, Pinned, PoolStats, StagingPool, IPC_HANDLE_LEN,
};
pub use fence::{BlockFence, FenceKey, FencePool};
pub use local::{LocalSession, LocalTransport};
pub use mooncake::{Cadence, MooncakeConfig, MooncakeSession, MooncakeTransport};
pub use registry::{Pins, RangeFault, RegionId, RegionInfo, Registry, DEFAULT_MAX_REGIONS};
pub use resolve::{advertised, is_own_address, HostPort, ResolveError, Resolver};
pub use shm::{
    share_pages, shm_copied_bytes, SharedMem, ShmConfig, ShmMode, ShmRefusal, ShmStats,
    SHM_CHUNK_BYTES,
};
pub use tcp::{
    NotifyHandler, StagingConfig, StagingStats, TcpConfig, TcpSession, TcpThreadStats, TcpTransport,
};

/// The wire format and the resolver's knobs, for the node, the CLI's
/// benchmarks and the tests; not an embedder's API.
pub mod internal {
    /// Name resolution: limits and the lookup hook tests replace.
    pub mod resolve {
        pub use crate::resolve::*;
    }
    /// The bounds check a peer's advertised regions go through.
    pub mod registry {
        pub use crate::registry::*;
    }
    /// The shared-memory hello's decoders with the properties the fuzz
    /// target checks, and seeds for it.
    pub mod shm_hello {
        pub use crate::shm::hello::{check_answer, check_offer, seeds};
    }
    /// The fence handshake of shared-memory copies (model-checked).
    pub mod shm_protocol {
        pub use crate::shm::protocol::*;
    }
    /// The tcp transport's frames.
    pub mod wire {
        pub use crate::wire::*;
    }
}

/// Direction of a batch, seen from the initiator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Op {
    /// Push: copy `local_addr` into the peer's `remote_addr`.
    Write,
    /// Pull: copy the peer's `remote_addr` into `local_addr`.
    Read,
}

/// One contiguous copy. Addresses are plain integers because remote addresses
/// are only meaningful inside the peer's process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Desc {
    /// Address in the initiator's registered memory.
    pub local_addr: u64,
    /// Address in the target's registered memory.
    pub remote_addr: u64,
    /// Number of bytes; zero is rejected as a malformed descriptor.
    pub len_bytes: u64,
}

/// How an endpoint waits for a socket while a transfer is pending: the
/// executors' type, so one setting means the same everywhere.
pub use kvferry_reactor::PollPolicy;

/// Where a peer endpoint listens: a resolved address. Its text form
/// (`tcp://127.0.0.1:7000`, `local://3`) is what nodes exchange in their
/// hello message; a hello may also name a tcp endpoint by host name
/// (`tcp://prefill-0.prefill.svc:5600`), which [`EndpointAddr::resolve`]
/// turns into this, off the executors. [`FromStr`] takes IP literals only:
/// it runs where no lookup may block (the executor reading a data-plane
/// notification's sender).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndpointAddr {
    /// A [`tcp::TcpTransport`] listening on this socket address.
    Tcp(SocketAddr),
    /// A [`local::LocalTransport`] in this process, by its id.
    Local(u64),
    /// A [`mooncake::MooncakeTransport`]: its engine's segment name under
    /// `P2PHANDSHAKE` (`IP:PORT`).
    Mooncake(SocketAddr),
}

impl fmt::Display for EndpointAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndpointAddr::Tcp(addr) => write!(f, "tcp://{addr}"),
            EndpointAddr::Local(id) => write!(f, "local://{id}"),
            EndpointAddr::Mooncake(addr) => write!(f, "mooncake://{addr}"),
        }
    }
}

impl FromStr for EndpointAddr {
    type Err = MisuseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || MisuseError::BadEndpointAddr(s.to_string());
        if let Some(rest) = s.strip_prefix("tcp://") {
            rest.parse().map(EndpointAddr::Tcp).map_err(|_| bad())
        } else if let Some(rest) = s.strip_prefix("local://") {
            rest.parse().map(EndpointAddr::Local).map_err(|_| bad())
        } else if let Some(rest) = s.strip_prefix("mooncake://") {
            rest.parse().map(EndpointAddr::Mooncake).map_err(|_| bad())
        } else {
            Err(bad())
        }
    }
}

impl EndpointAddr {
    /// `text` as an endpoint, a `tcp://` host name looked up by `resolver`
    /// (a bounded wait: never call it on an executor).
    pub fn resolve(text: &str, resolver: &Resolver) -> Result<EndpointAddr, EndpointError> {
        let Some(rest) = text.strip_prefix("tcp://") else {
            return Ok(text.parse()?);
        };
        resolver
            .resolve_str(rest)
            .map(EndpointAddr::Tcp)
            .map_err(|source| EndpointError::Resolve {
                addr: text.to_string(),
                source,
            })
    }
}

/// Why [`EndpointAddr::resolve`] found no endpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// Neither `tcp://host:port` nor `local://id`.
    #[error(transparent)]
    Malformed(#[from] MisuseError),
    /// A `tcp://` address whose host is malformed or does not resolve.
    #[error("endpoint {addr:?}: {source}")]
    Resolve {
        /// The endpoint as given.
        addr: String,
        /// Why.
        #[source]
        source: ResolveError,
    },
}

impl serde::Serialize for EndpointAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for EndpointAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Why a transport call failed. The variants separate blame: the caller
/// ([`TransportError::Misuse`]), the peer ([`TransportError::Peer`]), the
/// network or OS ([`TransportError::Io`], [`TransportError::Disconnected`])
/// and time ([`TransportError::Timeout`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The caller asked for something invalid; nothing moved.
    #[error("misuse: {0}")]
    Misuse(#[from] MisuseError),
    /// The peer refused a frame or broke the protocol.
    #[error("peer: {0}")]
    Peer(#[from] PeerError),
    /// The connection closed or reset before the batch completed.
    #[error("connection to peer lost during {during}")]
    Disconnected {
        /// What the endpoint was doing when the connection went away.
        during: &'static str,
    },
    /// A socket call failed.
    #[error("i/o error during {during}: {source}")]
    Io {
        /// What the endpoint was doing.
        during: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The request the memory belongs to ended here (its blocks were handed
    /// back to the engine) while the batch was moving; the rest of it was
    /// not moved.
    #[error("memory fenced during {during}: its request ended")]
    Fenced {
        /// What the endpoint was doing.
        during: &'static str,
    },
    /// A call into a data-plane library (Mooncake's transfer engine)
    /// failed, or the library reported a task failed.
    #[error("{during}: {source}")]
    Library {
        /// What the endpoint was doing.
        during: &'static str,
        /// The library's error.
        #[source]
        source: mooncake_sys::Error,
    },
    /// A device call failed (device memory staged or copied).
    #[error("{during}: {source}")]
    Device {
        /// What the endpoint was doing.
        during: &'static str,
        /// The device's error.
        #[source]
        source: DeviceError,
    },
    /// The batch did not complete within the configured bound.
    #[error("batch did not complete within {after_ms} ms")]
    Timeout {
        /// The configured bound.
        after_ms: u64,
    },
}

impl TransportError {
    pub(crate) fn device(during: &'static str) -> impl Fn(DeviceError) -> TransportError {
        move |source| TransportError::Device { during, source }
    }

    pub(crate) fn io(during: &'static str, source: std::io::Error) -> Self {
        TransportError::Io { during, source }
    }
}

/// Errors the caller caused. Nothing moved when one of these is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MisuseError {
    /// A descriptor's local side is not inside a local registered region.
    #[error("descriptor {index}: local range {fault}")]
    LocalDescriptor {
        /// Index in the batch.
        index: usize,
        /// What is wrong with it.
        fault: RangeFault,
    },
    /// A descriptor's remote side is not inside a region the peer registered.
    #[error("descriptor {index}: remote range {fault}")]
    RemoteDescriptor {
        /// Index in the batch.
        index: usize,
        /// What is wrong with it.
        fault: RangeFault,
    },
    /// A batch with more descriptors than the configured maximum.
    #[error("batch of {descs} descriptors exceeds the maximum of {max_descs}")]
    BatchTooLarge {
        /// Descriptors in the batch.
        descs: usize,
        /// The configured maximum.
        max_descs: usize,
    },
    /// Registering an empty region, or one whose end overflows.
    #[error("region at {addr:#x} of {len_bytes} bytes is empty or wraps around")]
    BadRegion {
        /// Start of the region.
        addr: u64,
        /// Its length.
        len_bytes: u64,
    },
    /// Registering a region that overlaps one already registered.
    #[error("region at {addr:#x} of {len_bytes} bytes overlaps a registered region")]
    RegionOverlap {
        /// Start of the region.
        addr: u64,
        /// Its length.
        len_bytes: u64,
    },
    /// More regions than the registry holds.
    #[error("at most {max_regions} regions can be registered")]
    TooManyRegions {
        /// The limit.
        max_regions: usize,
    },
    /// Unregistering an id that is not registered.
    #[error("region {0:?} is not registered")]
    UnknownRegion(RegionId),
    /// Unregistering a region a transfer is still using.
    #[error("region {id:?} is used by {pins} in-flight descriptor runs")]
    RegionBusy {
        /// The region.
        id: RegionId,
        /// How many pins hold it.
        pins: u64,
    },
    /// An endpoint address that does not parse.
    #[error(
        "bad endpoint address {0:?} (expected tcp://IP:PORT, mooncake://IP:PORT or local://ID)"
    )]
    BadEndpointAddr(String),
    /// Opening a session to an address of another transport kind, or to a
    /// local endpoint that no longer exists.
    #[error("no reachable endpoint {0} for this transport")]
    UnreachableEndpoint(String),
    /// A configuration value out of range.
    #[error("bad configuration: {0}")]
    BadConfig(String),
    /// Using a session after `close`.
    #[error("session is closed")]
    SessionClosed,
}

/// Errors the peer caused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerError {
    /// The target refused a frame; `index` is the descriptor of the batch it
    /// blamed where that applies.
    #[error("target rejected the batch ({reason}) at descriptor {index}")]
    Rejected {
        /// Why.
        reason: wire::RejectReason,
        /// Descriptor index in the batch (0 when not descriptor-specific).
        index: usize,
    },
    /// The peer sent something that is not a valid response.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// Shared memory was required and the peer cannot share it.
    #[error("shared memory refused: {0}")]
    ShmRefused(#[from] ShmRefusal),
    /// The peer did not authenticate with the cluster key, or has none
    /// while this endpoint has one.
    #[error("peer not authenticated: {0}")]
    Unauthenticated(&'static str),
}

/// One endpoint of a transport, living on one executor.
///
/// Futures returned by these methods are `!Send`: they run on the executor
/// that owns the endpoint.
// The trait is only used with concrete, executor-local types (glommio
// futures are !Send by design), so the missing `Send` bound that this lint
// warns about is intended.
#[allow(async_fn_in_trait)]
pub trait Transport {
    /// A connection to one peer endpoint.
    type Session: Session;

    /// Registers `len_bytes` of host memory at `addr` so that local batches
    /// may use it and peers may read or write it. Regions must not overlap.
    ///
    /// # Safety
    ///
    /// Until [`Transport::unregister`] succeeds for the returned id (or the
    /// endpoint is dropped), the memory must stay allocated and valid for
    /// reads and writes of `len_bytes`, and nothing else may hold a Rust
    /// reference (`&`/`&mut`) to it while a transfer may touch it: peers
    /// write into it at any time they are allowed to by the caller's protocol.
    unsafe fn register(&self, addr: *mut u8, len_bytes: usize) -> Result<RegionId, TransportError>;

    /// Removes a registration. Fails with [`MisuseError::RegionBusy`] while a
    /// batch (local or from a peer) is using the region, so the memory can be
    /// freed as soon as this returns `Ok`.
    fn unregister(&self, id: RegionId) -> Result<(), TransportError>;

    /// The regions registered now, to advertise to peers.
    fn regions(&self) -> Vec<RegionInfo>;

    /// The address peers use to open sessions to this endpoint.
    fn endpoint_addr(&self) -> EndpointAddr;

    /// Opens a session to `peer`. Connections are made lazily and re-made
    /// after a failure, so a session survives a peer restart.
    async fn open(&self, peer: &EndpointAddr) -> Result<Self::Session, TransportError>;

    /// Whether callers gain from coalescing small batches to one peer into
    /// one: true where every batch costs a round trip to the peer (tcp),
    /// false where a batch is a copy in this process (the default).
    fn coalesce_small_batches(&self) -> bool {
        false
    }

    /// Whether its sessions carry notifications
    /// ([`Session::notify_peer`]); false by default.
    fn carries_notifications(&self) -> bool {
        false
    }

    /// Whether dropping a batch's future stops every operation on its
    /// memory at once (true for tcp and local). False where a library
    /// moves the bytes and cannot be cancelled (Mooncake): callers then
    /// wait for every batch instead of dropping the others when one fails.
    fn stops_on_drop(&self) -> bool {
        true
    }
}

/// A session from this endpoint to one peer endpoint.
#[allow(async_fn_in_trait)]
pub trait Session {
    /// Moves every descriptor of `descs` in direction `op` and resolves when
    /// all bytes have landed. Fails as a whole; on a misuse error nothing
    /// moved. Several batches may be in flight on one session at once.
    async fn transfer(&self, op: Op, descs: &[Desc]) -> Result<(), TransportError>;

    /// Moves `descs` like [`Session::transfer`], bounded by `deadline`
    /// instead of the transport's own batch bound, so that the caller's
    /// deadline is the batch's only timer: at `deadline` the batch fails
    /// with [`TransportError::Timeout`], and dropping it stops every
    /// operation on its memory at once.
    ///
    /// A `trailer` (writes only) asks for a write whose completion also
    /// delivers a notification behind the bytes: the transport hands it to
    /// the peer's notification handler once every byte landed, where it can
    /// make the delivery depend on that (tcp, for a batch that fits one
    /// stream). `Ok(true)` says the handler took it; `Ok(false)` that it
    /// was not delivered and the caller delivers it its own way. The
    /// default delivers no trailer and races [`Session::transfer`] against
    /// one timer.
    async fn transfer_until(
        &self,
        op: Op,
        descs: &[Desc],
        trailer: Option<&[u8]>,
        deadline: Instant,
    ) -> Result<bool, TransportError> {
        let _ = trailer;
        let bound = deadline.saturating_duration_since(Instant::now());
        within(bound, async {
            self.transfer(op, descs).await.map(|()| false)
        })
        .await
    }

    /// Hands `payload` to the peer's notification handler, apart from any
    /// batch: `Ok(true)` once the handler took it, `Ok(false)` when this
    /// transport carries no notifications and the caller delivers the
    /// message its own way. The default carries none.
    async fn notify_peer(&self, payload: &[u8]) -> Result<bool, TransportError> {
        let _ = payload;
        Ok(false)
    }

    /// Closes the session's connections. In-flight batches on other clones
    /// fail with [`MisuseError::SessionClosed`] on their next use.
    async fn close(self);
}

/// Runs `work` for at most `bound`, then fails it with
/// [`TransportError::Timeout`]; dropping it stops every socket operation or
/// copy on its memory at once.
pub async fn within<T>(
    bound: Duration,
    work: impl Future<Output = Result<T, TransportError>>,
) -> Result<T, TransportError> {
    let deadline = async {
        glommio::timer::Timer::new(bound).await;
        let after_ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
        Err(TransportError::Timeout { after_ms })
    };
    futures_lite::future::or(work, deadline).await
}
