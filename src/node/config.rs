//! What a node is configured with: its role, its peers' whereabouts, its
//! bounds and its tuning, and the layout of the memory it registers.

use std::time::Duration;

use kvferry_machines::wire;
use kvferry_machines::{
    BatchLimits, Config as Timeouts, Mode, ModelSpec, Phase, Pool, Region, TransferId,
};
use kvferry_reactor::ReactorConfig;

/// Which side of disaggregated serving this node is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Runs prefill and sends KV.
    Prefill,
    /// Runs decode and receives KV.
    Decode,
    /// Sends and receives KV (vLLM's `kv_role = "kv_both"`): one side
    /// channel and one data plane serve both directions, and each request
    /// keeps the direction it was opened with (a [`Sender`](super::Sender)
    /// or a [`Receiver`](super::Receiver)).
    Both,
}

impl Role {
    /// True for the roles that send KV (open [`Sender`](super::Sender)s).
    pub fn sends(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// True for the roles that receive KV (open [`Receiver`](super::Receiver)s).
    pub fn receives(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

/// Which data plane moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Same process, memcpy.
    Local,
    /// TCP sockets (glommio) only, across processes and hosts.
    Tcp,
    /// tcp, and shared memory with every peer on this host that shares the
    /// memory a batch writes to or reads from (`kvferry_transport::shm`):
    /// one copy instead of two through the kernel.
    Auto,
    /// Shared memory only: peers on this host whose KV memory is shared
    /// (a sealed `memfd`); a peer that cannot share fails.
    Shm,
    /// Mooncake's Transfer Engine (RDMA, NVLink, TCP), loaded at run time;
    /// set up by [`NodeConfig::mooncake`].
    Mooncake,
}

/// Where a decode rank finds the prefill ranks of a request.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum PrefillTarget {
    /// Ask a bootstrap service for the ranks of engine `engine_id` at data
    /// parallel rank `dp_rank` (vLLM: `remote_engine_id` and
    /// `remote_dp_rank`).
    Bootstrap {
        /// `host:port` of the bootstrap service.
        addr: String,
        /// The prefill engine.
        engine_id: String,
        /// Its data-parallel rank, as it registered; `None`: the engine's
        /// one rank, whichever it is (vLLM names each DP engine apart,
        /// `<id>_dp<k>`, and routers send that id without a rank).
        dp_rank: Option<u32>,
    },
    /// The side-channel addresses of every prefill rank.
    Direct {
        /// Prefill TP size.
        tp_size: u32,
        /// Prefill PP size (1 without pipeline parallelism).
        pp_size: u32,
        /// `tcp://host:port` per prefill rank, stage by stage: the rank of
        /// TP rank `t` in stage `s` is at `s · tp_size + t`.
        side_channels: Vec<String>,
    },
}

/// Everything a node needs to start.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Prefill or decode.
    pub role: Role,
    /// This engine's id (what the bootstrap service lists).
    pub engine_id: String,
    /// Data-parallel rank of the engine.
    pub dp_rank: u32,
    /// Data-parallel ranks of the deployment: a bootstrap service this
    /// node serves answers `/query` once that many ranks have registered
    /// (each with `tp_size × pp_size` workers).
    pub dp_size: u32,
    /// Tensor-parallel size of the engine.
    pub tp_size: u32,
    /// This node's TP rank.
    pub tp_rank: u32,
    /// Pipeline-parallel size of the engine (1: none). A prefill engine
    /// with stages feeds a decode engine with the same PP size (stage to
    /// stage) or none (every stage to each decode rank).
    pub pp_size: u32,
    /// This node's pipeline stage; it registers the regions of its
    /// layers ([`KvLayout::first_region`]).
    pub pp_rank: u32,
    /// Push (P writes) or pull (D reads); both sides must agree.
    pub mode: Mode,
    /// Data plane.
    pub transport: TransportKind,
    /// Host to bind the side channel and the TCP transport on: an IP
    /// address or a name. A name is resolved once at [`Node::start`](super::Node::start)
    /// (within `resolve_timeout`) for binding, and advertised as it is
    /// (in the hello and the bootstrap registration), so peers resolve it
    /// themselves and find the node again after a restart moved it.
    pub host: String,
    /// Where the side channel and the TCP transport listen, when it is not
    /// the advertised `host` (`0.0.0.0`, an interface's address; `None`:
    /// `host` itself). A node that advertises a non-loopback `host` while
    /// listening on loopback refuses to start
    /// ([`Misuse::UnreachableHost`](super::Misuse::UnreachableHost)).
    pub listen: Option<String>,
    /// Side-channel port of a prefill rank; 0 picks a free one.
    pub side_channel_port: u16,
    /// Port the tcp data plane listens on; 0 picks a free one.
    pub data_plane_port: u16,
    /// TCP connections per data-plane session (large batches are spread
    /// over them); 0 keeps the transport's default.
    pub tcp_streams: usize,
    /// Prefill: the bootstrap service to register at (`host:port`).
    pub bootstrap: Option<String>,
    /// Prefill: serve the bootstrap service embedded on this address
    /// (vLLM serves it from rank 0 on port 8998). It also serves this
    /// node's `/metrics`.
    pub serve_bootstrap: Option<String>,
    /// The file holding the cluster key (its raw bytes, 32 or more;
    /// `KVFERRY_CLUSTER_KEY_FILE` in the settings). With a key every
    /// surface authenticates its peers (bootstrap requests, side channel,
    /// data plane; docs/security.md); without one the node listens on
    /// loopback only, unless `allow_unauthenticated_remote`.
    pub cluster_key_file: Option<std::path::PathBuf>,
    /// The previous cluster key's file, accepted beside the current one
    /// during a rotation.
    pub cluster_key_previous_file: Option<std::path::PathBuf>,
    /// Listen beyond loopback without a cluster key: anyone who reaches
    /// the node's ports is trusted (`--insecure`). Logged at start.
    pub allow_unauthenticated_remote: bool,
    /// With a cluster key, serve `/metrics` (on `metrics_listen` and the
    /// embedded bootstrap service) only to requests signed with it;
    /// otherwise (the default) to anyone, as Prometheus scrapes.
    pub authenticate_metrics: bool,
    /// With a cluster key, tag every tcp data frame's payload too
    /// (`TcpConfig::payload_mac`): bytes changed in flight fail their
    /// request instead of landing unnoticed. Off by default (its cost:
    /// docs/performance.md, "Authentication").
    pub payload_mac: bool,
    /// Serve this node's `/metrics` and `/health` on this address
    /// (`host:port`, port 0 picks a free one; see [`Node::metrics_addr`](super::Node::metrics_addr)).
    pub metrics_listen: Option<String>,
    /// Timeouts and bounds of the machines; `heartbeat_interval` and
    /// `heartbeat_misses` also drive peer liveness.
    pub timeouts: Timeouts,
    /// Longest wait for one host-name lookup (this node's `host`, the
    /// bootstrap service, a peer's side channel or data-plane endpoint);
    /// past it the attempt fails with a typed timeout and the next
    /// connection attempt or probe looks the name up again. At most
    /// [`MAX_RESOLVE_TIMEOUT`](crate::resolve::MAX_RESOLVE_TIMEOUT).
    pub resolve_timeout: Duration,
    /// How host names are looked up; `None`, the system's resolver
    /// (/etc/hosts, then DNS). A test moves a name with it.
    pub lookup: Option<crate::resolve::HostLookup>,
    /// How often decode says hello again to a prefill peer that is dead
    /// or has not answered yet (and looks its name up again); `None`:
    /// every `timeouts.heartbeat_interval`. Between 1 ms and
    /// `timeouts.bootstrap_timeout`.
    pub probe_interval: Option<Duration>,
    /// The reactor (exactly one executor: one rank is one device).
    pub reactor: ReactorConfig,
    /// Side-channel frame bounds.
    pub frame_limits: wire::Limits,
    /// Planner batch bounds.
    pub batch_limits: BatchLimits,
    /// Most peers the side channel tracks (ROUTER identities on prefill,
    /// DEALER connections on decode). When full, the slot of a dead peer
    /// that no transfer refers to is reused; otherwise a newcomer's hello is
    /// rejected (`bad_frames`) and a decode request that needs a new prefill
    /// connection fails at once.
    pub max_peers: usize,
    /// Most finished transfers remembered for [`Node::phase`](super::Node::phase) and
    /// [`Node::get_finished`](super::Node::get_finished); past it the oldest records are forgotten
    /// (every machine already ended). An engine that does not call
    /// `get_finished` for that long loses the oldest notifications; each
    /// loss is logged and counted in `NodeStats::limit_hits`.
    pub max_finished_records: usize,
    /// Most block ids kept for [`Node::block_ids_with_load_errors`](super::Node::block_ids_with_load_errors); past it
    /// further ids are dropped and counted in `NodeStats::limit_hits`.
    pub max_load_error_blocks: usize,
    /// Commands queued from the executor and engine threads to the bridge
    /// thread. When full a frame is dropped and counted in `dropped_frames`
    /// (the machines' timeouts cover a lost message) and a decode request is
    /// refused with [`NodeError::Busy`](super::NodeError::Busy).
    pub bridge_queue_capacity: usize,
    /// Decode: most bootstrap targets (service, engine id) whose directory
    /// is cached. When full, an entry that is not being queried is evicted;
    /// if every entry is being queried the request fails at once.
    pub max_bootstrap_targets: usize,
    /// Most data-plane sessions (one per peer endpoint) kept open. When full,
    /// an idle session is closed; if none is idle the transfer fails with
    /// a transport error naming the limit.
    pub max_data_sessions: usize,
    /// How the TCP data plane waits for its sockets. Parking (the default)
    /// leaves the cores to the side-channel threads and the engine: with
    /// spinning, a small request over loopback took 1.75 ms at p50 on
    /// 2 cores against 1.0 ms parked, because the spinning executors starved
    /// the ZeroMQ threads on the same cores. Spin only with cores to spare.
    pub tcp_poll: crate::transport::PollPolicy,
    /// The Mooncake engine's settings, used with [`TransportKind::Mooncake`].
    /// Its `linger` must be shorter than `timeouts.transfer_bound`.
    pub mooncake: crate::transport::MooncakeConfig,
    /// The device the KV cache lives on, when it is device memory
    /// ([`crate::transport::open_cuda`] for `cuda:N`): each registered
    /// range the device recognises is registered as device memory, and
    /// moved by the transport's device path (tcp: staged through pinned
    /// buffers; Mooncake: registered at the device's location). `None`:
    /// host memory only.
    pub device: Option<std::sync::Arc<dyn crate::transport::Device>>,
    /// Send the messages on a request's critical path (push: decode's
    /// `Pull` and lease ticket, prefill's `Status`; pull: decode's `Pull`
    /// and `Done`, prefill's `Ready`)
    /// over the tcp data-plane session to that peer instead of ZeroMQ once
    /// a session is open, and take such messages from peers. On loopback
    /// this cuts a small request's latency by about a third (five thread
    /// hand-offs per message: executor, bridge, two libzmq I/O threads,
    /// bridge, executor). Off: everything goes over ZeroMQ, and peers that
    /// try are refused and fall back to it.
    pub data_plane_messages: bool,
    /// Fault injection, for tests and `kvferry demo --drop-control-ppm`:
    /// this share (parts per million) of the control messages the machines
    /// emit is dropped instead of sent, whatever channel would carry it
    /// (side channel, data-plane notification, a write's status trailer),
    /// so that resending can be seen to recover them. 0 in production.
    pub drop_control_ppm: u32,
    /// Where the node reports events as they happen, for a program that
    /// blocks on a channel instead of polling; `None` for an engine that
    /// polls (the handles' `poll`/`wait`, or [`Node::get_finished`]).
    ///
    /// [`Node::get_finished`]: super::Node::get_finished
    pub events: Option<EventSink>,
}

impl NodeConfig {
    /// This config with the cluster key's files named by
    /// `KVFERRY_CLUSTER_KEY_FILE` and `KVFERRY_CLUSTER_KEY_PREVIOUS_FILE`
    /// and with `payload_mac` from `KVFERRY_PAYLOAD_MAC` (`1` or `true`),
    /// when set: what every `kvferry` command does.
    pub fn with_auth_from_env(mut self) -> NodeConfig {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        if let Some(f) = var(kvferry_auth::KEY_FILE_ENV) {
            self.cluster_key_file = Some(f.into());
        }
        if let Some(f) = var(kvferry_auth::PREVIOUS_KEY_FILE_ENV) {
            self.cluster_key_previous_file = Some(f.into());
        }
        if let Some(v) = var("KVFERRY_PAYLOAD_MAC") {
            self.payload_mac = v == "1" || v == "true";
        }
        self
    }
}

/// A channel a node sends its [`Event`]s to. Several nodes may share one
/// channel (each with its own `tag`) without a forwarding thread, which
/// would add a thread hand-off to every event. A full channel drops the
/// event: the handles and `get_finished` still report it.
#[derive(Clone, Debug)]
pub struct EventSink {
    /// Copied into every event of this node (a rank, say).
    pub tag: u32,
    /// Where the events go.
    pub tx: flume::Sender<Event>,
}

/// What a node reports to its [`EventSink`], sent from the executor or
/// the bridge when it happens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// The sink's tag.
    pub tag: u32,
    /// The transfer.
    pub transfer_id: TransferId,
    /// What happened to it.
    pub kind: EventKind,
}

impl Event {
    /// The terminal phase this event reports, if it is a
    /// [`EventKind::Finished`].
    pub fn finished(&self) -> Option<Phase> {
        match self.kind {
            EventKind::Finished(p) => Some(p),
            EventKind::Requested { .. } => None,
        }
    }
}

/// The kinds of [`Event`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// The transfer reached this terminal phase (either role).
    Finished(Phase),
    /// Prefill: a decode rank asked for a transfer the engine has not
    /// started (no [`Node::sender`](super::Node::sender) yet). An engine
    /// learns of its requests from its own router and ignores these; a
    /// prefill with no router (`kvferry prefill`, a benchmark) answers them.
    Requested {
        /// Per group, how many blocks the request has on the prefill side
        /// (the decode rank's prefix hit plus its destination blocks).
        blocks_per_group: Vec<u32>,
    },
}

/// A decode node's [`ReactorConfig::yield_after_ends_below`]: the engine
/// hears first of requests that end while few are in flight (measured with
/// the demo: one at a time 0.12 → 0.095 ms at p50 on one core; 256 in flight
/// unchanged, where a yield per turn cost 12 % of the throughput).
pub const DECODE_YIELD_BELOW: usize = 8;

impl NodeConfig {
    /// How often the bridge probes a dead or silent peer
    /// ([`NodeConfig::probe_interval`], else the heartbeat interval).
    pub fn probe_every(&self) -> Duration {
        self.probe_interval
            .unwrap_or(self.timeouts.heartbeat_interval)
    }

    /// The resolver every lookup of the node uses: `lookup` (or the
    /// system's) bounded by `resolve_timeout`.
    pub fn resolver(&self) -> crate::resolve::Resolver {
        crate::resolve::Resolver::configured(self.resolve_timeout, self.lookup.as_ref())
    }

    /// Defaults for one rank (TP 1, push mode, TCP on loopback, ephemeral ports).
    pub fn new(role: Role, engine_id: impl Into<String>) -> NodeConfig {
        let reactor = ReactorConfig {
            mailbox_capacity: 65_536,
            max_machines_per_executor: 65_536,
            // A decode engine waits for its requests to end (the KV is
            // there); a prefill engine only gets its blocks back.
            yield_after_ends_below: match role {
                Role::Decode | Role::Both => DECODE_YIELD_BELOW,
                Role::Prefill => 0,
            },
            ..ReactorConfig::default()
        };
        NodeConfig {
            role,
            engine_id: engine_id.into(),
            dp_rank: 0,
            tp_size: 1,
            tp_rank: 0,
            dp_size: 1,
            pp_size: 1,
            pp_rank: 0,
            mode: Mode::Push,
            transport: TransportKind::Auto,
            host: "127.0.0.1".into(),
            listen: None,
            side_channel_port: 0,
            data_plane_port: 0,
            tcp_streams: 0,
            bootstrap: None,
            serve_bootstrap: None,
            metrics_listen: None,
            cluster_key_file: None,
            cluster_key_previous_file: None,
            allow_unauthenticated_remote: false,
            authenticate_metrics: false,
            payload_mac: false,
            timeouts: Timeouts::default(),
            resolve_timeout: crate::resolve::DEFAULT_RESOLVE_TIMEOUT,
            probe_interval: None,
            lookup: None,
            reactor,
            frame_limits: wire::Limits::default(),
            batch_limits: BatchLimits::default(),
            max_peers: 4096,
            // As many as the executor holds live: enough for handles polled
            // soon after the end, and small (the soak saw 1 << 20 records
            // cost about 100 MiB of growth before it levelled off).
            max_finished_records: 65_536,
            max_load_error_blocks: 1 << 22,
            bridge_queue_capacity: 65_536,
            max_bootstrap_targets: 256,
            max_data_sessions: 4096,
            tcp_poll: crate::transport::PollPolicy::Park,
            mooncake: crate::transport::MooncakeConfig::default(),
            device: None,
            data_plane_messages: true,
            drop_control_ppm: 0,
            events: None,
        }
    }
}

/// The engine's KV cache as registered with the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Model facts (layout kind, total KV heads, block tokens, head bytes).
    pub model: ModelSpec,
    /// Blocks per region.
    pub num_blocks: u64,
    /// One region per layer and K/V (per layer for MLA), in the model's
    /// order on P and D; a pipeline stage registers its layers' only.
    pub regions: Vec<Region>,
    /// Index, in the model's region order, of the first region registered
    /// (0 without pipeline parallelism; with it, the regions of the layers
    /// before this stage's first).
    pub first_region: u32,
    /// Aux and state buffers that move beside the KV (SGLang's aux data,
    /// Mamba/SWA/DSA state), indexed per request: a request's block lists
    /// end with one index list per pool, in this order. Both sides declare
    /// the same pools. Empty for a KV-only engine.
    pub pools: Vec<Pool>,
}
