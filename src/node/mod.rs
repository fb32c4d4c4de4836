//! The node: one prefill or decode rank, with its reactor (the machines),
//! its data-plane endpoint and its side channel.
//!
//! ```text
//!  engine threads ──Sender/Receiver/start_load_kv──▶ ReactorHandle ──▶ executor
//!                                                                    (machines,
//!  peers ◀──zmq── bridge thread ◀──frames (flume)── ActionSink ◀──── transport)
//!        ──zmq──▶ bridge thread ──events──▶ ReactorHandle
//! ```
//!
//! * The machines run on one glommio executor (one rank is one device). The
//!   [`ActionSink`](kvferry_reactor::ActionSink) of that executor turns their
//!   actions into side-channel frames and planner-built transport batches.
//! * One bridge thread owns every ZeroMQ socket (a ROUTER on prefill ranks, a
//!   DEALER per prefill peer on decode ranks), decodes frames, routes them to
//!   the machines, answers hellos and heartbeats, resolves prefill ranks for
//!   decode requests and marks silent peers dead.
//! * The messages on a request's critical path skip the bridges once a tcp
//!   data-plane session to the peer is open: the sink packs them into a
//!   NOTIFY frame of that session and the peer's executor hands them to its
//!   machines directly (ZeroMQ stays the fallback; see
//!   [`NodeConfig::data_plane_messages`]). Decode engine threads resolve a
//!   request's prefill ranks from routes the bridge cached.
//! * Engine threads call the node from any thread; nothing they call blocks
//!   on the network, except [`Node::start`] and [`Node::register_kv_caches`].
//!
//! ```no_run
//! use kvferry::node::*;
//! # fn demo(layout: KvLayout, d_layout: KvLayout) -> Result<(), NodeError> {
//! let p = Node::start(NodeConfig::new(Role::Prefill, "p"))?;
//! unsafe { p.register_kv_caches(layout)? };
//! let d = Node::start(NodeConfig::new(Role::Decode, "d"))?;
//! unsafe { d.register_kv_caches(d_layout)? };
//! let target = PrefillTarget::Direct { tp_size: 1, pp_size: 1, side_channels: vec![p.side_channel_addr()] };
//! let rx = d.receiver(TransferId(42), &target)?;
//! rx.request(vec![vec![BlockId(0), BlockId(1)]])?;
//! let tx = p.sender(TransferId(42))?;
//! tx.send(vec![vec![BlockId(5), BlockId(6)]], true)?;
//! let phase = rx.wait(std::time::Duration::from_secs(5));
//! # Ok(()) }
//! ```

mod batch;
mod bridge;
mod command;
mod config;
mod error;
mod handles;
mod registration;
mod settings;
mod sink;
mod tables;
mod waker;

use kvferry_reactor::lock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvferry_machines::duplex::{self, Direction, Duplex};
use kvferry_machines::send;
use kvferry_machines::{check_request_id, PairLayout, RecvMachine};
pub use kvferry_machines::{
    AbortReason, BlockId, BlockLists, Config as Timeouts, FailReason, Mode, Phase, TransferId,
};
pub use kvferry_machines::{
    BatchLimits, LayoutKind, ModelSpec, Pool, PoolKind, PoolRegion, RankLayout, Region, Stage,
};
use kvferry_reactor::{Outcome, Reactor, ShutdownPolicy, SubmitError};

use crate::stats::Counters;
pub use crate::stats::NodeStats;
use crate::transport::FencePool;
pub use batch::{
    FinishedLoads, LoadMeta, LoadRequest, MetaDecodeError, SendRequest, StartFailures,
};
use command::BridgeCmd;
pub use config::{
    Event, EventKind, EventSink, KvLayout, NodeConfig, PrefillTarget, Role, TransportKind,
    DECODE_YIELD_BELOW,
};
pub use error::{DataPlaneError, IdCollision, Misuse, NodeError, PeerUnfit};
pub use handles::{Receiver, Sender};
pub use settings::{
    setting_keys, ConfigError, ModeSetting, NodeSettings, RoleSetting, TransportSetting, ENV_PREFIX,
};
pub(crate) use tables::{EngineHandle, LocalKv, PeerData, Routes, Shared};
use tables::{Peers, Records, TerminalSeq};

/// The node's reactor: one executor whose machines go either way (a
/// node of [`Role::Both`] holds both kinds at once).
type Engine = Reactor<Duplex>;

struct Inner {
    shared: Arc<Shared>,
    handle: EngineHandle,
    engine: Mutex<Option<Engine>>,
    bridge: Mutex<Option<bridge::BridgeThread>>,
    side_channel: String,
    bootstrap_server: Mutex<Option<registration::EmbeddedBootstrap>>,
    metrics_server: Mutex<Option<crate::stats::MetricsServer>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop(Duration::from_millis(200));
    }
}

impl Inner {
    fn stop(&self, grace: Duration) {
        let engine = lock(&self.engine).take();
        if let Some(r) = engine {
            drop(r.shutdown(ShutdownPolicy::Abort { grace }));
        }
        if let Some(b) = lock(&self.bridge).take() {
            b.stop(&self.shared);
        }
        if let Some(s) = lock(&self.bootstrap_server).take() {
            s.stop();
        }
        drop(lock(&self.metrics_server).take());
    }
}

static NEXT_NODE_ID: AtomicU64 = AtomicU64::new(1);

/// One prefill or decode rank. Cheap to clone; every clone is the same node.
/// The node stops when the last clone (and handle) is dropped, or at
/// [`Node::shutdown`].
#[derive(Clone)]
pub struct Node {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("role", &self.inner.shared.role)
            .field("engine_id", &self.inner.shared.config.engine_id)
            .field("tp_rank", &self.inner.shared.config.tp_rank)
            .finish()
    }
}

/// Refuses a configuration the node cannot run with.
fn check_config(config: &NodeConfig) -> Result<(), NodeError> {
    config.timeouts.validate().map_err(Misuse::Timeouts)?;
    if config.reactor.executors.len() != 1 {
        return Err(Misuse::Executors(config.reactor.executors.len()).into());
    }
    if config.tp_size == 0 || config.tp_rank >= config.tp_size {
        return Err(Misuse::TpRank {
            tp_rank: config.tp_rank,
            tp_size: config.tp_size,
        }
        .into());
    }
    if config.pp_size == 0 || config.pp_rank >= config.pp_size {
        return Err(Misuse::PpRank {
            pp_rank: config.pp_rank,
            pp_size: config.pp_size,
        }
        .into());
    }
    if config.max_peers == 0
        || config.max_finished_records == 0
        || config.bridge_queue_capacity == 0
        || config.max_bootstrap_targets == 0
        || config.max_data_sessions == 0
    {
        return Err(Misuse::ZeroBound(
            "max_peers, max_finished_records, bridge_queue_capacity, \
             max_bootstrap_targets and max_data_sessions",
        )
        .into());
    }
    let ms = Duration::from_millis(1);
    in_range(
        "resolve_timeout",
        config.resolve_timeout,
        ms,
        crate::resolve::MAX_RESOLVE_TIMEOUT,
    )?;
    // A probe later than the bootstrap timeout would come after the
    // requests waiting for the peer expired. Unset, probes follow the
    // heartbeat, which is checked as it always was.
    if let Some(probe) = config.probe_interval {
        let probe_max = config.timeouts.bootstrap_timeout.max(ms);
        in_range("probe_interval", probe, ms, probe_max)?;
    }
    Ok(())
}

fn in_range(
    setting: &'static str,
    value: Duration,
    min: Duration,
    max: Duration,
) -> Result<(), NodeError> {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    Err(Misuse::OutOfRange {
        setting,
        value,
        min,
        max,
    }
    .into())
}

/// The address the node binds: `listen`, else its `host`, resolved once
/// here (on the caller's thread, not on the executor, which binds the data
/// plane). Listening on loopback only suits a loopback `host`.
fn bind_ip(config: &NodeConfig) -> Result<std::net::IpAddr, NodeError> {
    let resolve = |host: &str| {
        config.resolver().resolve_host(host).map_err(|source| {
            NodeError::from(DataPlaneError::BadHost {
                host: host.to_string(),
                source,
            })
        })
    };
    let Some(listen) = &config.listen else {
        return resolve(&config.host);
    };
    let ip = resolve(listen)?;
    if ip.is_loopback() && !resolve(&config.host)?.is_loopback() {
        return Err(Misuse::UnreachableHost {
            host: config.host.clone(),
            listen: ip,
        }
        .into());
    }
    Ok(ip)
}

/// The cluster key `config` names, and the rule without one: listen on
/// loopback only, unless `allow_unauthenticated_remote` (said once here).
fn cluster_key(
    config: &NodeConfig,
    bind_ip: std::net::IpAddr,
) -> Result<Option<kvferry_auth::ClusterKey>, NodeError> {
    if let Some(path) = &config.cluster_key_file {
        let previous = config.cluster_key_previous_file.as_deref();
        let key = kvferry_auth::ClusterKey::load(path, previous)?;
        tracing::info!(ids = ?key, "authenticating peers with the cluster key");
        if config.transport == TransportKind::Mooncake {
            tracing::warn!(
                "transport mooncake: Mooncake's engine does not authenticate each transfer; \
                 the bootstrap service and the side channel are authenticated, its data plane \
                 is not (docs/security.md)"
            );
        }
        return Ok(Some(key));
    }
    // The embedded bootstrap service keeps the same rule itself.
    if !bind_ip.is_loopback() {
        let (what, addr) = ("side channel and data plane", bind_ip.to_string());
        if !config.allow_unauthenticated_remote {
            return Err(Misuse::UnauthenticatedRemote { what, addr }.into());
        }
        tracing::warn!(
            what,
            %addr,
            "listening beyond loopback without a cluster key: anyone who reaches the port is trusted"
        );
    }
    Ok(None)
}

/// The state the engine threads, the executor and the bridge share.
fn new_shared(
    config: &NodeConfig,
    bind_ip: std::net::IpAddr,
    key: Option<kvferry_auth::ClusterKey>,
    bridge_tx: flume::Sender<BridgeCmd>,
) -> Result<Arc<Shared>, NodeError> {
    let waker = Arc::new(waker::Waker::new().map_err(|e| NodeError::side_channel("waker", e))?);
    let node_id = NEXT_NODE_ID.fetch_add(1, Ordering::Relaxed);
    let (tracked_tx, tracked_rx) = flume::bounded(config.bridge_queue_capacity);
    Ok(Arc::new(Shared {
        role: config.role,
        node_id,
        config: config.clone(),
        bind_ip,
        key,
        local: OnceLock::new(),
        endpoint: OnceLock::new(),
        peers: Mutex::new(Peers::default()),
        tickets: Mutex::new(HashMap::new()),
        tracked_tx,
        tracked_rx,
        routes: Mutex::new(Routes::default()),
        counters: Arc::new(Counters::default()),
        records: Mutex::new(Records::default()),
        bridge_tx,
        waker,
        // Any nonzero seed; distinct per node.
        fault_dice: AtomicU64::new(0x9E37_79B9_7F4A_7C15 ^ node_id),
        terminal_seq: Mutex::new(TerminalSeq::default()),
        terminal_cv: Condvar::new(),
        any_named: std::sync::atomic::AtomicBool::new(false),
        id_hash: OnceLock::new(),
        receiving: Mutex::new(std::collections::HashSet::new()),
    }))
}

/// Starts the executor of `config.role` and waits until its transport
/// endpoint is bound; the engine and the handle engine threads use.
fn start_engine(
    shared: &Arc<Shared>,
    config: &NodeConfig,
) -> Result<(Engine, EngineHandle), NodeError> {
    let (ready_tx, ready_rx) = flume::bounded::<Result<String, DataPlaneError>>(1);
    let s = shared.clone();
    let engine = Reactor::<Duplex>::start(config.reactor.clone(), move |ctx| {
        sink::Sink::new(s.clone(), ctx.poster, ready_tx.clone())
    })?;
    let handle = engine.handle();
    let endpoint = ready_rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| NodeError::Timeout("transport endpoint"))??;
    let _ = shared.endpoint.set(endpoint);
    Ok((engine, handle))
}

/// The HTTP servers `config` asks for: the embedded bootstrap service (a
/// prefill rank only) and the metrics endpoint.
fn start_servers(
    shared: &Shared,
    config: &NodeConfig,
) -> Result<
    (
        Option<registration::EmbeddedBootstrap>,
        Option<crate::stats::MetricsServer>,
    ),
    NodeError,
> {
    let counters = shared.counters.clone();
    let source: crate::bootstrap::MetricsSource = Arc::new(move || crate::stats::render(&counters));
    let bootstrap_server =
        match (&config.role, &config.serve_bootstrap) {
            (Role::Prefill | Role::Both, Some(addr)) => Some(
                registration::EmbeddedBootstrap::start(addr, source.clone(), shared)?,
            ),
            _ => None,
        };
    let metrics_server = match &config.metrics_listen {
        Some(addr) => {
            let auth = shared.key.clone().filter(|_| config.authenticate_metrics);
            let auth = auth.map(|key| kvferry_metrics::http::ScrapeAuth {
                key,
                rejects: shared.counters.auth.clone(),
                surface: kvferry_auth::Surface::Bootstrap,
            });
            Some(crate::stats::MetricsServer::start_with(addr, source, auth)?)
        }
        None => None,
    };
    Ok((bootstrap_server, metrics_server))
}

impl Node {
    /// Starts the executor (with its transport endpoint), the side channel
    /// and, on a prefill rank, the embedded bootstrap service and the
    /// registration at the bootstrap service.
    pub fn start(config: NodeConfig) -> Result<Node, NodeError> {
        check_config(&config)?;
        let bind_ip = bind_ip(&config)?;
        let key = cluster_key(&config, bind_ip)?;
        let (bridge_tx, bridge_rx) = flume::bounded(config.bridge_queue_capacity);
        let shared = new_shared(&config, bind_ip, key, bridge_tx)?;
        let (engine, handle) = start_engine(&shared, &config)?;
        let (bootstrap_server, metrics_server) = start_servers(&shared, &config)?;
        let (bridge, side_channel) =
            bridge::BridgeThread::start(shared.clone(), handle.clone(), bridge_rx)?;
        let node = Node {
            inner: Arc::new(Inner {
                shared,
                handle,
                engine: Mutex::new(Some(engine)),
                bridge: Mutex::new(Some(bridge)),
                side_channel,
                bootstrap_server: Mutex::new(bootstrap_server),
                metrics_server: Mutex::new(metrics_server),
            }),
        };
        if config.role.sends() {
            if let Some(addr) = node.bootstrap_addr() {
                let key = node.inner.shared.key.clone();
                registration::register_in_background(addr, &config, key, node.side_channel_addr());
            }
        }
        Ok(node)
    }

    /// The bootstrap service this node registers at (or serves).
    pub fn bootstrap_addr(&self) -> Option<String> {
        let c = &self.inner.shared.config;
        if let Some(b) = &c.bootstrap {
            return Some(b.clone());
        }
        lock(&self.inner.bootstrap_server)
            .as_ref()
            .map(|s| s.addr())
    }

    /// This node's role.
    pub fn role(&self) -> Role {
        self.inner.shared.role
    }

    /// The side-channel address peers connect to (`tcp://host:port`, with
    /// the configured host when it is a name; decode ranks have none and
    /// return an empty string).
    pub fn side_channel_addr(&self) -> String {
        self.inner.side_channel.clone()
    }

    /// The data-plane endpoint (`tcp://..` or `local://..`).
    pub fn endpoint(&self) -> String {
        self.inner
            .shared
            .endpoint
            .get()
            .cloned()
            .unwrap_or_default()
    }

    /// Registers the engine's KV cache with the data plane and makes it the
    /// layout this rank announces to peers. Call once, before requests.
    ///
    /// # Safety
    ///
    /// Every region must point at `num_blocks × block_len` bytes, and every
    /// buffer of a pool at `items × item_len` bytes, that stay
    /// allocated until the node is shut down (or dropped), and that peers
    /// may write (decode, push mode) or read (prefill) whenever the protocol
    /// lets them: the engine must not hold Rust references into them while a
    /// transfer on the blocks may be in flight.
    pub unsafe fn register_kv_caches(&self, layout: KvLayout) -> Result<(), NodeError> {
        let s = &self.inner.shared;
        if s.local.get().is_some() {
            return Err(Misuse::RegisteredTwice.into());
        }
        let rank = RankLayout {
            tp_size: s.config.tp_size,
            tp_rank: s.config.tp_rank,
            num_blocks: layout.num_blocks,
            regions: layout.regions.clone(),
            stage: Stage {
                pp_size: s.config.pp_size,
                pp_rank: s.config.pp_rank,
                first_region: layout.first_region,
            },
            pools: layout.pools.clone(),
        };
        // Checked now so a bad layout is the caller's error, not every
        // peer's: a pair with itself exercises the same validation.
        PairLayout::new(
            &layout.model,
            &rank,
            &RankLayout {
                tp_size: 1,
                tp_rank: 0,
                ..rank.clone()
            },
        )
        .or_else(|_| PairLayout::new(&layout.model, &rank, &rank))
        .map_err(Misuse::Layout)?;
        for r in &rank.regions {
            layout
                .num_blocks
                .checked_mul(r.block_len)
                .ok_or(Misuse::RegionOverflow)?;
        }
        let kv = sink::KvMemory {
            regions: rank.regions.iter().map(|r| (r.base, r.block_len)).collect(),
            num_blocks: layout.num_blocks,
            pools: (rank.pools.iter())
                .map(|p| FencePool {
                    buffers: p.regions.iter().map(|r| (r.base, r.item_len)).collect(),
                    items: p.items,
                })
                .collect(),
            fenced: !(s.config.timeouts.unsafe_disable_fence
                || s.config.timeouts.unsafe_ignore_in_flight),
            device: s.config.device.clone(),
        };
        let node_id = s.node_id;
        self.on_data_plane("memory registration", move || {
            sink::register_regions(node_id, &kv)
        })?;
        let _ = s.local.set(LocalKv {
            model: layout.model,
            layout: rank,
        });
        Ok(())
    }

    /// Orders this node's device copies after the engine's work: records
    /// an event on the engine's stream `stream` (a `CUstream`; 0 for the
    /// legacy default stream) and makes every device copy that reads local
    /// blocks from now on wait for it, on the device. Call it before
    /// handing over blocks the engine's kernels just wrote (the vLLM
    /// connector does, for every step that finished requests). Returns
    /// once the data plane holds the event; a no-op without a device.
    pub fn engine_handoff(&self, stream: u64) -> Result<(), NodeError> {
        let s = &self.inner.shared;
        let Some(device) = &s.config.device else {
            return Ok(());
        };
        let event = device.record_engine_event(stream).map_err(|source| {
            DataPlaneError::Transport(crate::transport::TransportError::Device {
                during: "recording an event on the engine's stream",
                source,
            })
        })?;
        let node_id = s.node_id;
        self.on_data_plane("engine hand-off", move || {
            sink::wait_engine(node_id, &event)
        })
    }

    /// Runs `work` on the executor that owns the node's endpoint and
    /// waits for it (at most 10 s, else `Timeout(what)`).
    fn on_data_plane(
        &self,
        what: &'static str,
        work: impl FnOnce() -> Result<(), DataPlaneError> + Send + 'static,
    ) -> Result<(), NodeError> {
        let (tx, rx) = flume::bounded(1);
        self.inner
            .handle
            .spawn_on(0, move || async move {
                let _ = tx.send(work());
            })
            .map_err(NodeError::from)?;
        // Waits for the executor: inside a `Node::batch` the ring of the
        // spawn just queued would otherwise wait for the batch's end.
        kvferry_reactor::release_held();
        rx.recv_timeout(Duration::from_secs(10))
            .map_err(|_| NodeError::Timeout(what))??;
        Ok(())
    }

    /// Refuses a call of `direction` on a node whose role lacks it, or
    /// before `register_kv_caches`.
    fn require(&self, direction: Direction) -> Result<(), NodeError> {
        let role = self.inner.shared.role;
        match direction {
            Direction::Send if !role.sends() => return Err(Misuse::WrongRole(Role::Prefill).into()),
            Direction::Recv if !role.receives() => {
                return Err(Misuse::WrongRole(Role::Decode).into())
            }
            Direction::Send | Direction::Recv => {}
        }
        if self.inner.shared.local.get().is_none() {
            return Err(Misuse::NotRegistered.into());
        }
        Ok(())
    }

    /// Runs `f` and wakes each executor that `f` queued work for once, when
    /// `f` returns, instead of once per call: for an engine step that
    /// starts several requests, or a `sender` and its `send` issued
    /// together. Without it a woken executor on a busy core may run between
    /// two calls, take the first, park, and be woken again for the second.
    /// Work queued inside `f` only starts when `f` returns, so `f` must not
    /// wait for a transfer by other means than the node's own calls: its
    /// waits ([`Sender::wait`]), polls ([`Node::phase`], the handles'
    /// `poll`, [`Node::get_finished`], all reading through the reactor
    /// handle, which wakes what is held first) and `register_kv_caches`.
    /// Batches nest, on any number of nodes.
    pub fn batch<R>(f: impl FnOnce() -> R) -> R {
        kvferry_reactor::batch(f)
    }

    /// Prefill: the handle for `tid` (created now, or found if the
    /// decode side's request arrived first).
    pub fn sender(&self, tid: TransferId) -> Result<Sender, NodeError> {
        self.require(Direction::Send)?;
        let h = &self.inner.handle;
        let s = &self.inner.shared;
        if s.finished_phase(tid).is_some() {
            // The transfer already ended here: typically decode aborted (or
            // failed) before the engine had its KV. A new machine would wait
            // out its bootstrap timeout for a `Pull` that never comes; the
            // handle reports the recorded outcome at once instead, and the
            // engine frees its blocks. Transfer ids are never reused.
            return Ok(Sender {
                node: self.clone(),
                tid,
                request_id: s.name_of(tid),
            });
        }
        // Found if the decode side's first message got here first.
        s.create_sender(h, tid)?;
        Ok(Sender {
            node: self.clone(),
            tid,
            request_id: s.name_of(tid),
        })
    }

    /// The transfer id of string request id `request_id` (1 to
    /// [`REQUEST_ID_MAX_BYTES`](kvferry_machines::REQUEST_ID_MAX_BYTES)
    /// bytes): [`TransferId::of_request_id`], which every node computes alike.
    pub fn transfer_id_of(&self, request_id: &str) -> Result<TransferId, NodeError> {
        check_request_id(request_id).map_err(Misuse::RequestId)?;
        Ok(self.inner.shared.transfer_id_of(request_id))
    }

    /// Prefill: [`Node::sender`] for a transfer named by string request id.
    /// Fails with [`NodeError::IdCollision`] when this node holds the same
    /// transfer id for another request id; a decode rank's `Pull` naming
    /// another string is refused and fails only that decode request.
    pub fn sender_named(&self, request_id: &str) -> Result<Sender, NodeError> {
        self.require(Direction::Send)?;
        let tid = self.transfer_id_of(request_id)?;
        self.sender_as(tid, Some(request_id))
    }

    /// [`Node::sender`], tying `request_id` (if any) to `tid` first.
    fn sender_as(&self, tid: TransferId, request_id: Option<&str>) -> Result<Sender, NodeError> {
        let Some(id) = request_id else {
            return self.sender(tid);
        };
        check_request_id(id).map_err(Misuse::RequestId)?;
        let s = &self.inner.shared;
        let fresh = s.claim_name(tid, id)?;
        let sender = self.sender(tid);
        if sender.is_err() && fresh {
            s.release_name(tid);
        }
        sender
    }

    /// Decode: [`Node::receiver`] for a transfer named by string request
    /// id. The id travels in every `Pull`, and the prefill rank refuses it
    /// if it holds the transfer id for another string (the request then
    /// fails `Aborted(IdCollision)`). Fails with [`NodeError::IdCollision`]
    /// when this node holds the transfer id for another request id.
    pub fn receiver_named(
        &self,
        request_id: &str,
        prefill: &PrefillTarget,
    ) -> Result<Receiver, NodeError> {
        self.require(Direction::Recv)?;
        let tid = self.transfer_id_of(request_id)?;
        self.inner.shared.check_name(tid, request_id)?;
        Ok(Receiver {
            node: self.clone(),
            tid,
            request_id: Some(Arc::from(request_id)),
            target: prefill.clone(),
        })
    }

    /// Replaces the hash from request ids to transfer ids for this node,
    /// before its first named transfer; false if one was set already.
    /// Tests give two nodes one hash that maps different strings to one
    /// transfer id, to force collisions.
    #[doc(hidden)]
    pub fn set_request_id_hash(&self, hash: fn(&str) -> TransferId) -> bool {
        self.inner.shared.id_hash.set(hash).is_ok()
    }

    /// Decode: the handle for `tid`, fed by the prefill engine at
    /// `prefill`. Nothing is sent until [`Receiver::request`].
    pub fn receiver(
        &self,
        tid: TransferId,
        prefill: &PrefillTarget,
    ) -> Result<Receiver, NodeError> {
        self.require(Direction::Recv)?;
        Ok(Receiver {
            node: self.clone(),
            tid,
            request_id: None,
            target: prefill.clone(),
        })
    }

    fn request(
        &self,
        rx: &Receiver,
        dst_blocks: BlockLists,
        prefix_blocks: Vec<u32>,
    ) -> Result<(), NodeError> {
        // The machine and its first event: one wake-up.
        Node::batch(|| {
            let id = rx.request_id.as_deref();
            self.request_as(rx.tid, id, &rx.target, dst_blocks, prefix_blocks)
        })
    }

    /// Starts the load of `tid`, tying `request_id` (if any) to it before
    /// the machine exists, so its `Pull` names the string.
    fn request_as(
        &self,
        tid: TransferId,
        request_id: Option<&str>,
        target: &PrefillTarget,
        dst_blocks: BlockLists,
        prefix_blocks: Vec<u32>,
    ) -> Result<(), NodeError> {
        let s = &self.inner.shared;
        let fresh = match request_id {
            Some(id) => {
                check_request_id(id).map_err(Misuse::RequestId)?;
                s.claim_name(tid, id)?
            }
            None => false,
        };
        let r = self.request_now(tid, target, dst_blocks, prefix_blocks);
        if r.is_err() && fresh {
            s.release_name(tid);
        }
        r
    }

    fn request_now(
        &self,
        tid: TransferId,
        target: &PrefillTarget,
        dst_blocks: BlockLists,
        prefix_blocks: Vec<u32>,
    ) -> Result<(), NodeError> {
        self.open_recv(tid, dst_blocks, prefix_blocks)?;
        let h = &self.inner.handle;
        let s = &self.inner.shared;
        // Prefill ranks this node talks to already: no trip through the
        // bridge (about two thread hand-offs off every request).
        if let Some(resolved) = s.cached_route(tid, target) {
            return match h.send_event(tid, duplex::Event::Recv(resolved)) {
                Ok(()) => Ok(()),
                Err(r) => {
                    let _ = h.abort(tid, AbortReason::Engine);
                    Err(NodeError::from(r.error))
                }
            };
        }
        self.resolve_in_bridge(tid, target, false)
    }

    /// Creates the receive machine of `tid`, in `Bootstrapping`.
    fn open_recv(
        &self,
        tid: TransferId,
        dst_blocks: BlockLists,
        prefix_blocks: Vec<u32>,
    ) -> Result<(), NodeError> {
        self.require(Direction::Recv)?;
        let s = &self.inner.shared;
        let m = RecvMachine::new(
            Instant::now(),
            &s.config.timeouts,
            tid,
            s.config.mode,
            dst_blocks,
            prefix_blocks,
        )
        .map_err(Misuse::Request)?;
        // Marked before the machine exists, so a `Pull` for the same id
        // from a decode peer never finds it unmarked (`Role::Both`).
        let was_receiving = s.is_receiving(tid);
        s.set_receiving(tid, true);
        if let Err(r) = self.inner.handle.create(0, tid, Duplex::Recv(m)) {
            // Refused: the mark stays only for the receive that had it.
            if !was_receiving {
                s.set_receiving(tid, false);
            }
            return Err(NodeError::from(r.error));
        }
        Ok(())
    }

    /// Has the bridge find the prefill ranks of `tid`'s machine (and, when
    /// it was `aborted` before it asked, only tell them).
    fn resolve_in_bridge(
        &self,
        tid: TransferId,
        target: &PrefillTarget,
        aborted: bool,
    ) -> Result<(), NodeError> {
        if !self.inner.shared.to_bridge(BridgeCmd::Resolve {
            tid,
            target: target.clone(),
            aborted,
        }) {
            // Without resolution the machine would wait out its bootstrap
            // timeout; fail it now instead.
            let _ = self.inner.handle.abort(tid, AbortReason::Engine);
            return Err(NodeError::Busy(SubmitError::MailboxFull { executor: 0 }));
        }
        Ok(())
    }

    /// Aborts a receive that never asked for its KV: the prefill ranks
    /// hold the KV for it until told, so it is opened with no destination
    /// blocks (nothing can land), aborted, and the bridge finds the ranks
    /// and tells them (`abort_unpulled`), bounded by the bootstrap timeout.
    fn abort_unrequested(&self, rx: &Receiver) -> Result<(), NodeError> {
        Node::batch(|| {
            self.open_recv(rx.tid, Vec::new(), Vec::new())?;
            self.abort(rx.tid)?;
            self.resolve_in_bridge(rx.tid, &rx.target, true)
        })
    }

    fn send_chunk(
        &self,
        tid: TransferId,
        blocks: BlockLists,
        is_last: bool,
    ) -> Result<(), NodeError> {
        self.require(Direction::Send)?;
        let event = send::Event::ChunkReady {
            src_blocks: blocks,
            is_last,
        };
        match self
            .inner
            .handle
            .send_event(tid, duplex::Event::Send(event))
        {
            Ok(()) => Ok(()),
            // Ended already (see `sender`): nothing to send, the handle's
            // phase tells the outcome.
            Err(r)
                if r.error == SubmitError::UnknownTransfer(tid)
                    && self.inner.shared.finished_phase(tid).is_some() =>
            {
                Ok(())
            }
            Err(r) => Err(NodeError::from(r.error)),
        }
    }

    /// Latest phase of a transfer: live from the executor, or the final
    /// phase once it finished (kept for a bounded number of transfers).
    pub fn phase(&self, tid: TransferId) -> Option<Phase> {
        if let Some(p) = self.inner.handle.poll(tid) {
            return Some(p);
        }
        self.collect();
        let done = {
            let r = lock(&self.inner.shared.records);
            r.done.get(&tid).copied()
        };
        // A transfer may leave the board between the two looks.
        done.or_else(|| self.inner.handle.poll(tid))
    }

    /// Aborts a transfer (either role). Unknown transfers are a misuse.
    pub fn abort(&self, tid: TransferId) -> Result<(), NodeError> {
        self.inner
            .handle
            .abort(tid, AbortReason::Engine)
            .map_err(NodeError::from)
    }

    /// Collects the executor's completions so its board stays small. Final
    /// phases were recorded when they happened; only transfers that never
    /// reported one (refused at creation, dropped at shutdown) are recorded here.
    fn collect(&self) {
        for c in self.inner.handle.get_finished(4096) {
            match c.outcome {
                Outcome::Finished { .. } => {}
                // `Rejected`, `Dropped` and any later outcome: no terminal
                // phase was reported for it.
                _ => {
                    let s = &self.inner.shared;
                    let direction = s.direction_of(c.transfer_id);
                    s.set_receiving(c.transfer_id, false);
                    let phase = Phase::Failed(FailReason::Aborted(AbortReason::Shutdown));
                    s.record(c.transfer_id, direction, phase, None);
                }
            }
        }
    }

    /// Counters.
    pub fn stats(&self) -> NodeStats {
        self.inner.shared.counters.snapshot()
    }

    /// The node's metrics as `/metrics` serves them (OpenMetrics text):
    /// the counters of [`Node::stats`] and the latency histogram.
    pub fn metrics_text(&self) -> String {
        crate::stats::render(&self.inner.shared.counters)
    }

    /// Latency of the requests that succeeded, first report to terminal.
    pub fn latency(&self) -> crate::stats::Latency {
        self.inner.shared.counters.latency()
    }

    /// Peers and requests refused on `surface` for failing authentication
    /// (`kvferry_auth_rejected_total`).
    pub fn auth_rejected(&self, surface: kvferry_auth::Surface) -> u64 {
        self.inner.shared.counters.auth.get(surface)
    }

    /// Requests and connections turned away on `surface` for exceeding
    /// their address's budget (`kvferry_rate_limited_total`).
    pub fn rate_limited(&self, surface: kvferry_auth::Surface) -> u64 {
        self.inner.shared.counters.auth.limited(surface)
    }

    /// Where `/metrics` and `/health` are served (`NodeConfig::metrics_listen`).
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        let m = lock(&self.inner.metrics_server);
        m.as_ref().map(|m| m.local_addr())
    }

    /// Side-channel peers currently marked dead.
    pub fn dead_peers(&self) -> usize {
        bridge::dead_peers(&self.inner.shared)
    }

    /// Stops the node: aborts live requests, gives them `grace` to tell
    /// their peers, then closes the side channel and the transport.
    pub fn shutdown(&self, grace: Duration) {
        self.inner.stop(grace);
    }
}
