//! The request shape, cluster and timeout options that `demo`, the soak,
//! `prefill` and `decode` share, the rank options of `prefill` and
//! `decode`, and the cluster a demo-style run starts.
//!
//! Shape options are optional on the command line: the demo and the soak
//! fill what is not given from different defaults ([`DemoOptions::default`]
//! and the soak's small request), so the defaults live in one place and
//! the help text is written from them.

use std::fmt::Display;
use std::time::Duration;

use clap::{Args, ValueEnum};
use kvferry::machines::Mode;
use kvferry::machines::{LayoutKind, ModelSpec};
use kvferry::node::{NodeConfig, Role, TransportKind};
use kvferry::transport::MooncakeConfig;
use kvferry_testkit::demo_timeouts;
use kvferry_testkit::synth::ClusterSpec;

/// KV cache layout (`--layout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LayoutArg {
    /// Heads, then tokens, then bytes within a block.
    Hnd,
    /// Tokens, then heads, then bytes within a block.
    Nhd,
    /// One latent per token, the same on every rank.
    Mla,
}

/// Who moves the KV (`--mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Prefill writes into decode's blocks.
    Push,
    /// Decode reads from prefill's blocks.
    Pull,
}

/// Data plane (`--transport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    /// TCP streams, and shared memory with peers on this host that share
    /// their KV memory.
    Auto,
    /// TCP streams only, also between processes.
    Tcp,
    /// Shared memory only: peers on this host.
    Shm,
    /// memcpy within one process.
    Local,
    /// Mooncake's Transfer Engine (`MOONCAKE_TE_LIB`), its protocol by
    /// `--mooncake-protocol`.
    Mooncake,
}

/// The name a value has on the command line.
fn value_name(v: impl ValueEnum) -> String {
    v.to_possible_value()
        .map_or_else(String::new, |p| p.get_name().to_string())
}

impl Display for LayoutArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&value_name(*self))
    }
}

impl Display for ModeArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&value_name(*self))
    }
}

impl Display for TransportArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&value_name(*self))
    }
}

impl From<LayoutArg> for LayoutKind {
    fn from(v: LayoutArg) -> LayoutKind {
        match v {
            LayoutArg::Hnd => LayoutKind::Hnd,
            LayoutArg::Nhd => LayoutKind::Nhd,
            LayoutArg::Mla => LayoutKind::Mla,
        }
    }
}

impl From<LayoutKind> for LayoutArg {
    fn from(v: LayoutKind) -> LayoutArg {
        match v {
            LayoutKind::Hnd => LayoutArg::Hnd,
            LayoutKind::Nhd => LayoutArg::Nhd,
            LayoutKind::Mla => LayoutArg::Mla,
        }
    }
}

impl From<ModeArg> for Mode {
    fn from(v: ModeArg) -> Mode {
        match v {
            ModeArg::Push => Mode::Push,
            ModeArg::Pull => Mode::Pull,
        }
    }
}

impl From<Mode> for ModeArg {
    fn from(v: Mode) -> ModeArg {
        match v {
            Mode::Push => ModeArg::Push,
            Mode::Pull => ModeArg::Pull,
        }
    }
}

impl From<TransportArg> for TransportKind {
    fn from(v: TransportArg) -> TransportKind {
        match v {
            TransportArg::Tcp => TransportKind::Tcp,
            TransportArg::Auto => TransportKind::Auto,
            TransportArg::Shm => TransportKind::Shm,
            TransportArg::Local => TransportKind::Local,
            TransportArg::Mooncake => TransportKind::Mooncake,
        }
    }
}

impl From<TransportKind> for TransportArg {
    fn from(v: TransportKind) -> TransportArg {
        match v {
            TransportKind::Tcp => TransportArg::Tcp,
            TransportKind::Auto => TransportArg::Auto,
            TransportKind::Shm => TransportArg::Shm,
            TransportKind::Local => TransportArg::Local,
            TransportKind::Mooncake => TransportArg::Mooncake,
        }
    }
}

/// `text` followed by the default of the field `f` picks from
/// [`DemoOptions::default`], as clap prints a default.
pub(crate) fn with_default<T: Display>(text: &str, f: impl Fn(&DemoOptions) -> T) -> String {
    format!("{text} [default: {}]", f(&DemoOptions::default()))
}

/// The model, the node's mode and transport, and the deadlines: the options
/// of every command that runs a node.
#[derive(Clone, Debug, Default, Args)]
pub(crate) struct ModelArgs {
    #[arg(long, value_name = "L", value_parser = clap::value_parser!(u32).range(1..),
          help = with_default("Layers", |o| o.layers))]
    layers: Option<u32>,
    #[arg(long, value_name = "T", value_parser = clap::value_parser!(u32).range(1..),
          help = with_default("Tokens per block", |o| o.block_tokens))]
    block_tokens: Option<u32>,
    #[arg(long, value_name = "H", value_parser = clap::value_parser!(u32).range(1..),
          help = with_default("KV heads of the model (1 for mla)", |o| o.heads))]
    heads: Option<u32>,
    #[arg(long, value_name = "X", value_parser = clap::value_parser!(u64).range(1..),
          help = with_default("Bytes per head per token", |o| o.head_bytes))]
    head_bytes: Option<u64>,
    #[arg(long, help = with_default("KV layout", |o| LayoutArg::from(o.layout)))]
    layout: Option<LayoutArg>,
    #[arg(long, help = with_default("Who moves the KV", |o| ModeArg::from(o.mode)))]
    mode: Option<ModeArg>,
    #[arg(long, help = with_default("Data plane", |o| TransportArg::from(o.transport)))]
    transport: Option<TransportArg>,
    #[arg(long, value_name = "P",
          help = with_default("Mooncake's protocol with --transport mooncake (tcp, rdma, nvlink, nvlink_intra, efa, ...)",
                              |o| o.mooncake_protocol.clone()))]
    mooncake_protocol: Option<String>,
    #[arg(long, value_name = "MS",
          help = with_default("Per-request deadline (bootstrap, waiting, claim)", |o| o.timeout_ms))]
    timeout_ms: Option<u64>,
}

impl ModelArgs {
    /// `d` with the options given here in place of its fields.
    pub(crate) fn apply(&self, d: DemoOptions) -> DemoOptions {
        DemoOptions {
            layers: self.layers.unwrap_or(d.layers),
            block_tokens: self.block_tokens.unwrap_or(d.block_tokens),
            heads: self.heads.unwrap_or(d.heads),
            head_bytes: self.head_bytes.unwrap_or(d.head_bytes),
            layout: self.layout.map_or(d.layout, LayoutKind::from),
            mode: self.mode.map_or(d.mode, Mode::from),
            transport: self.transport.map_or(d.transport, TransportKind::from),
            mooncake_protocol: (self.mooncake_protocol.clone()).unwrap_or(d.mooncake_protocol),
            timeout_ms: self.timeout_ms.unwrap_or(d.timeout_ms),
            ..d
        }
    }
}

/// The options shared by the demo and the soak: request shape, cluster and
/// timeouts.
#[derive(Clone, Debug, Default, Args)]
pub(crate) struct ShapeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, value_name = "C", value_parser = clap::value_parser!(u64).range(1..),
          help = with_default(&format!("Requests in flight ({} with --store)",
                                       crate::store_demo::StoreDemo::default().concurrency),
                              |o| o.concurrency))]
    concurrency: Option<u64>,
    #[arg(long, value_name = "B", value_parser = clap::value_parser!(u32).range(1..),
          help = with_default("KV blocks per request", |o| o.blocks_per_request))]
    blocks_per_request: Option<u32>,
    #[arg(long, value_name = "P", value_parser = clap::value_parser!(u32).range(1..),
          help = with_default("Prefill TP size", |o| o.prefill_tp))]
    prefill_tp: Option<u32>,
    #[arg(long, value_name = "D", value_parser = clap::value_parser!(u32).range(1..),
          help = with_default("Decode TP size", |o| o.decode_tp))]
    decode_tp: Option<u32>,
    #[arg(long, value_name = "US",
          help = with_default("Executors spin this long before parking (0: park at once)", |o| o.spin_us))]
    spin_us: Option<u64>,
    /// Every side-channel message over ZeroMQ, none over the tcp data plane.
    #[arg(long)]
    zmq_only: bool,
}

impl ShapeArgs {
    /// `--concurrency`, if given.
    pub(crate) fn concurrency(&self) -> Option<u64> {
        self.concurrency
    }

    /// `d` with the options given here in place of its fields.
    pub(crate) fn apply(&self, d: DemoOptions) -> DemoOptions {
        let d = self.model.apply(d);
        DemoOptions {
            concurrency: self.concurrency.unwrap_or(d.concurrency),
            blocks_per_request: self.blocks_per_request.unwrap_or(d.blocks_per_request),
            prefill_tp: self.prefill_tp.unwrap_or(d.prefill_tp),
            decode_tp: self.decode_tp.unwrap_or(d.decode_tp),
            spin_us: self.spin_us.unwrap_or(d.spin_us),
            zmq_only: self.zmq_only || d.zmq_only,
            ..d
        }
    }
}

/// Where a rank finds the bootstrap service and which TP rank it is: the
/// options `prefill` and `decode` share.
#[derive(Clone, Debug, Args)]
pub(crate) struct RankArgs {
    /// Address of the bootstrap service (HOST:PORT; the host may be a
    /// name, looked up again at every attempt).
    #[arg(long, value_name = "ADDR")]
    pub bootstrap: String,
    /// TP size of this engine.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub tp_size: u32,
    /// This rank's index in its TP group.
    #[arg(long, value_name = "R", default_value_t = 0)]
    pub tp_rank: u32,
    /// This engine's data-parallel rank (what it registers under).
    #[arg(long, value_name = "R", default_value_t = 0)]
    pub dp_rank: u32,
    /// Pipeline-parallel size of this engine: each stage holds its share
    /// of the layers (prefill with stages feeds decode with none or as many).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub pp_size: u32,
    /// This rank's pipeline stage.
    #[arg(long, value_name = "R", default_value_t = 0)]
    pub pp_rank: u32,
    /// Host other ranks reach this one at, an IP address or a name (bound
    /// at its address, advertised as given) [default: the node's, 127.0.0.1].
    #[arg(long, value_name = "HOST")]
    pub host: Option<String>,
    /// Where the side channel and the data plane listen (0.0.0.0: every
    /// interface) [default: the host's address].
    #[arg(long, value_name = "IP")]
    pub listen: Option<String>,
    /// Serve this rank's `/metrics` and `/health` here (HOST:PORT).
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<String>,
    /// Listen beyond loopback without a cluster key
    /// (KVFERRY_CLUSTER_KEY_FILE): anyone who reaches the ports is trusted.
    #[arg(long)]
    pub insecure: bool,
}

impl RankArgs {
    /// A node config of `role` for this rank, with the model options' mode,
    /// transport and deadlines.
    pub(crate) fn node_config(&self, role: Role, engine_id: String, o: &DemoOptions) -> NodeConfig {
        let mut c = NodeConfig::new(role, engine_id);
        c.tp_size = self.tp_size;
        c.tp_rank = self.tp_rank;
        c.dp_rank = self.dp_rank;
        c.pp_size = self.pp_size;
        c.pp_rank = self.pp_rank;
        c.mode = o.mode;
        c.transport = o.transport;
        c.mooncake = o.mooncake();
        c.timeouts = demo_timeouts(o.timeout_ms);
        if let Some(h) = &self.host {
            c.host = h.clone();
        }
        c.listen = self.listen.clone();
        c.metrics_listen = self.metrics_listen.clone();
        c.allow_unauthenticated_remote = self.insecure;
        c.with_auth_from_env()
    }
}

/// The settings of a demo-style run.
#[derive(Clone, Debug)]
pub(crate) struct DemoOptions {
    /// Requests to run (the demo; the soak runs for a time instead).
    pub requests: u64,
    /// Requests in flight at once.
    pub concurrency: u64,
    /// Layers of the model.
    pub layers: u32,
    /// KV blocks per request.
    pub blocks_per_request: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// KV heads of the model (1 is used for MLA).
    pub heads: u32,
    /// Bytes per head per token.
    pub head_bytes: u64,
    /// Prefill TP size.
    pub prefill_tp: u32,
    /// Decode TP size.
    pub decode_tp: u32,
    /// KV layout.
    pub layout: LayoutKind,
    /// Who moves the KV.
    pub mode: Mode,
    /// Data plane.
    pub transport: TransportKind,
    /// Mooncake's protocol, with [`TransportKind::Mooncake`].
    pub mooncake_protocol: String,
    /// Per-request deadline (bootstrap, waiting, claim).
    pub timeout_ms: u64,
    /// Executors spin this long before parking (0: park at once).
    pub spin_us: u64,
    /// Every side-channel message over ZeroMQ (`data_plane_messages` off).
    pub zmq_only: bool,
    /// KV-cache groups per request (the demo), each of
    /// `blocks_per_request` blocks.
    pub groups: u32,
    /// Sliding window in tokens of every group but the first (0: full
    /// attention): those groups move only the window's blocks.
    pub window_tokens: u64,
    /// Fault injection: parts per million of the control messages every
    /// node drops (`NodeConfig::drop_control_ppm`).
    pub drop_control_ppm: u32,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            requests: 2000,
            concurrency: 64,
            layers: 4,
            blocks_per_request: 4,
            block_tokens: 16,
            heads: 8,
            head_bytes: 128,
            prefill_tp: 1,
            decode_tp: 1,
            layout: LayoutKind::Hnd,
            mode: Mode::Push,
            transport: TransportKind::Auto,
            mooncake_protocol: "tcp".into(),
            timeout_ms: 10_000,
            spin_us: 0,
            zmq_only: false,
            groups: 1,
            window_tokens: 0,
            drop_control_ppm: 0,
        }
    }
}

impl DemoOptions {
    /// The Mooncake engine's settings of these options.
    pub(crate) fn mooncake(&self) -> MooncakeConfig {
        MooncakeConfig {
            protocol: self.mooncake_protocol.clone(),
            ..MooncakeConfig::default()
        }
    }

    /// The model of these options.
    pub(crate) fn model(&self) -> ModelSpec {
        ModelSpec {
            layout: self.layout,
            total_kv_heads: match self.layout {
                LayoutKind::Mla => 1,
                LayoutKind::Hnd | LayoutKind::Nhd => self.heads,
            },
            block_tokens: self.block_tokens,
            head_bytes: self.head_bytes,
        }
    }
}

/// The cluster of a demo-style run with `slots` request slots of
/// `blocks_per_request` blocks on every rank.
pub(crate) fn cluster_spec(o: &DemoOptions, slots: u64) -> Result<ClusterSpec, String> {
    let blocks = slots
        .checked_mul(u64::from(o.blocks_per_request) * u64::from(o.groups.max(1)))
        .filter(|&b| b <= u64::from(u32::MAX))
        .ok_or("concurrency × blocks-per-request is too large")?;
    Ok(ClusterSpec {
        mooncake: o.mooncake(),
        model: o.model(),
        layers: o.layers,
        prefill_blocks: blocks,
        decode_blocks: blocks,
        prefill_tp: o.prefill_tp,
        decode_tp: o.decode_tp,
        prefill_pp: 1,
        decode_pp: 1,
        mode: o.mode,
        transport: o.transport,
        timeouts: demo_timeouts(o.timeout_ms),
        bootstrap: Some("127.0.0.1:0".into()),
        spin: (o.spin_us > 0).then(|| Duration::from_micros(o.spin_us)),
        data_plane_messages: !o.zmq_only,
        drop_control_ppm: o.drop_control_ppm,
    })
}

/// Per group, the blocks of request slot `slot` (the same ids on both
/// sides): `groups` runs of `per_group` blocks.
pub(crate) fn slot_blocks(per_group: u32, groups: usize, slot: u64) -> Vec<Vec<u32>> {
    let (b, groups) = (u64::from(per_group), groups as u64);
    (0..groups)
        .map(|g| {
            (0..b)
                .map(|i| ((slot * groups + g) * b + i) as u32)
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tests that run CLI ranks beside their own nodes (`e2e_kill`) give
    /// those nodes the test kit's medium model: it must stay the default.
    #[test]
    fn the_default_model_is_the_test_kits_medium_one() {
        assert_eq!(
            DemoOptions::default().model(),
            kvferry_testkit::model::medium()
        );
    }
}
