//! [`NodeSettings`]: the serde schema of a node's configuration, read from
//! a JSON or TOML file, from `KVFERRY_*` environment variables, or from an
//! engine's own configuration (vLLM's `kv_connector_extra_config` is this
//! JSON object).
//!
//! Each key is declared once, in [`node_settings!`]'s invocation below:
//! its name, type, documentation (what it means, then a `Replaces:`
//! paragraph naming its equivalent in the connectors kvferry replaces),
//! and the [`NodeConfig`] field it sets through which mapping
//! ([`codec`]). The struct, the environment variables, `build`, `of` and
//! docs/config.md's table of keys ([`NodeSettings::markdown_table`]) all
//! come from that declaration.

mod codec;
mod env;
mod error;
mod table;

use serde::{Deserialize, Serialize};

use super::{NodeConfig, Role, TransportKind};
use env::{EnvKind, Kind};
pub use error::ConfigError;
use kvferry_machines::Mode;

/// One key of the schema, as declared.
struct Setting {
    /// The key (and, in capitals after [`ENV_PREFIX`], its variable).
    key: &'static str,
    /// The [`NodeConfig`] field it sets, as written in the declaration.
    field: &'static str,
    /// How its variable reads.
    kind: Kind,
    /// Its doc comment's lines.
    doc: &'static str,
}

/// Declares the schema: for each key its doc comment, name, type, and
/// `mapping(field.path)`: the [`codec`] module that maps it onto that
/// [`NodeConfig`] field.
macro_rules! node_settings {
    ($(
        $(#[doc = $doc:literal])+
        $key:ident: $ty:ty = $codec:ident($($path:ident).+);
    )+) => {
        /// Every knob of a [`NodeConfig`] that is plain data, each optional:
        /// what is absent keeps [`NodeConfig::new`]'s default. Durations are
        /// in milliseconds (microseconds for the spin), as engines'
        /// environment variables give them. Unknown keys are refused, so a
        /// typo is an error, not a silently ignored setting.
        #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct NodeSettings {
            $($(#[doc = $doc])+ pub $key: Option<$ty>,)+
        }

        /// Every key, in the order docs/config.md lists them.
        const SETTINGS: &[Setting] = &[$(Setting {
            key: stringify!($key),
            field: stringify!($($path).+),
            kind: <$ty as EnvKind>::KIND,
            doc: concat!($($doc, "\n"),+),
        }),+];

        impl NodeSettings {
            /// Writes every key that is set into `c`.
            fn apply(&self, c: &mut NodeConfig) -> Result<(), ConfigError> {
                $(if let Some(v) = &self.$key {
                    codec::$codec::put(&mut c.$($path).+, v)?;
                })+
                Ok(())
            }

            /// Every key of `c`'s plain data, set: what a node built from
            /// settings runs with, defaults and the environment included
            /// (the inverse of [`NodeSettings::build`] on the schema's keys).
            pub fn of(c: &NodeConfig) -> NodeSettings {
                NodeSettings {
                    $($key: codec::$codec::get(&c.$($path).+),)+
                }
            }
        }
    };
}

node_settings! {
    /// Which side this node is: `prefill`, `decode` or `both` (`kv_both`
    /// is vLLM's name for it). Required.
    ///
    /// Replaces: vLLM `kv_role` (`kv_producer`, `kv_consumer`, `kv_both`);
    /// SGLang `--disaggregation-mode`.
    role: RoleSetting = convert(role);
    /// This engine's id, what the bootstrap service lists. Required.
    ///
    /// Replaces: vLLM `kv_transfer_config.engine_id`; SGLang's bootstrap
    /// room's engine.
    engine_id: String = plain(engine_id);
    /// The engine's data-parallel rank. The vLLM connectors take it from
    /// vLLM's `data_parallel_index` (the local rank with local engines
    /// only).
    ///
    /// Replaces: vLLM `data_parallel_index`; SGLang `attn_dp_rank`.
    dp_rank: u32 = plain(dp_rank);
    /// The deployment's data-parallel ranks: a bootstrap service this node
    /// serves answers `/query` (every engine) once that many have
    /// registered. The vLLM connectors take vLLM's `data_parallel_size`.
    ///
    /// Replaces: vLLM `data_parallel_size`.
    dp_size: u32 = plain(dp_size);
    /// The engine's tensor-parallel size.
    ///
    /// Replaces: vLLM `tensor_parallel_size`; SGLang `--tp-size`.
    tp_size: u32 = plain(tp_size);
    /// This worker's tensor-parallel rank.
    ///
    /// Replaces: the worker's TP rank.
    tp_rank: u32 = plain(tp_rank);
    /// The engine's pipeline-parallel size (1: none). A prefill engine
    /// with stages feeds a decode engine with the same size (stage to
    /// stage) or none (every stage to each decode rank).
    ///
    /// Replaces: vLLM `pipeline_parallel_size`; SGLang `--pp-size`.
    pp_size: u32 = plain(pp_size);
    /// This worker's pipeline stage.
    ///
    /// Replaces: the worker's PP rank (vLLM `get_pp_group().rank_in_group`).
    pp_rank: u32 = plain(pp_rank);
    /// `push` (prefill writes) or `pull` (decode reads); both sides must
    /// agree.
    ///
    /// Replaces: vLLM's and SGLang's connectors push; vLLM-Ascend's pulls.
    mode: ModeSetting = convert(mode);
    /// The data plane: `auto` (tcp, and one copy through a peer's shared
    /// memory when it is on this host, same user, its KV shared), `tcp`
    /// (sockets only), `shm` (shared memory only), `local` (this process),
    /// `mooncake` (Mooncake's Transfer Engine; docs/mooncake.md).
    ///
    /// Replaces: Mooncake's connectors always use Mooncake's engine.
    transport: TransportSetting = convert(transport);
    /// Mooncake's protocol with `transport` `mooncake`: `tcp`, `rdma`,
    /// `nvlink`, `nvlink_intra`, `efa`, ...
    ///
    /// Replaces: Mooncake `mooncake_protocol` in `kv_connector_extra_config`.
    mooncake_protocol: String = plain(mooncake.protocol);
    /// Where the KV lives for Mooncake's registration: `cpu:0`, `cuda:0`,
    /// `*` (the engine finds out).
    ///
    /// Replaces: Mooncake's location of the registered tensors.
    mooncake_location: String = plain(mooncake.location);
    /// How long a failed Mooncake batch waits for the library to let go
    /// of its memory; shorter than `transfer_bound_ms`.
    ///
    /// Replaces: none.
    mooncake_linger_ms: u64 = ms(mooncake.linger);
    /// Where the KV cache is: `cpu`, or `cuda:N` (CUDA device N; the
    /// driver is loaded when the config is built, and a missing one fails
    /// it). Ranges the device recognises are registered as device memory:
    /// tcp stages them through pinned host buffers, Mooncake registers
    /// them at `cuda:N`, `local` refuses them. The vLLM connectors and the
    /// SGLang backend set it from the engine's device.
    ///
    /// Replaces: Mooncake's `mooncake_location`, the tensors' device.
    device: String = device(device);
    /// The address advertised to peers (and bound unless `listen` is
    /// set): an IP address or a name, advertised as given, so peers look
    /// it up themselves. The engine adapters, when it is not set and the
    /// node has a cluster key (or `allow_unauthenticated_remote`), take
    /// what the engine's own connectors find (vLLM: `VLLM_HOST_IP`, else
    /// the outbound route's source; SGLang: `get_local_ip_auto`).
    ///
    /// Replaces: vLLM `get_ip()` and `VLLM_HOST_IP`; SGLang `--host`.
    host: String = plain(host);
    /// Where the side channel and the tcp data plane listen when not on
    /// `host` (`0.0.0.0`, an interface's address). A non-loopback `host`
    /// with a loopback `listen` refuses to start.
    ///
    /// Replaces: none (the Mooncake connectors bind what they advertise).
    listen: String = opt(listen);
    /// The side channel's port; 0 picks a free one. Through the engine
    /// adapters a set port is a base, every rank of the engines on a host
    /// listening at base + its index: vLLM `(local DP rank × pp_size +
    /// pp_rank) × tp_size + tp_rank`; SGLang the same with the system DP
    /// rank.
    ///
    /// Replaces: vLLM Mooncake's side-channel port
    /// (`VLLM_MOONCAKE_BOOTSTRAP_PORT + dp_index × tp`); vLLM-Ascend
    /// `kv_port + dp_rank × tp × pp + device`.
    side_channel_port: u16 = plain(side_channel_port);
    /// The tcp data plane's port; 0 picks a free one. A base through the
    /// engine adapters, as `side_channel_port`.
    ///
    /// Replaces: Mooncake Transfer Engine's RPC port (`get_rpc_port()`).
    data_plane_port: u16 = plain(data_plane_port);
    /// TCP connections per data-plane session (large batches are spread
    /// over them); 0 keeps the transport's default.
    ///
    /// Replaces: Mooncake `num_workers` (sender threads).
    tcp_streams: usize = plain(tcp_streams);
    /// Prefill: the bootstrap service to register at (`host:port`). The
    /// vLLM connector, when it is not set: the DP master's address (this
    /// host's when that is loopback) at `VLLM_MOONCAKE_BOOTSTRAP_PORT`.
    ///
    /// Replaces: vLLM `get_mooncake_bootstrap_addr`,
    /// `bootstrap_server_address`; SGLang `--disaggregation-bootstrap-port`.
    bootstrap: String = opt(bootstrap);
    /// Prefill: serve the bootstrap service (and this node's `/metrics`)
    /// on this address. The vLLM connector, when it is not set:
    /// `0.0.0.0:8998` on TP rank 0 of DP rank 0, PP rank 0.
    ///
    /// Replaces: vLLM's rank 0 serving on `0.0.0.0:8998`; SGLang's
    /// bootstrap server.
    serve_bootstrap: String = opt(serve_bootstrap);
    /// Serve this node's `/metrics` and `/health` on this address
    /// (`host:port`; port 0 picks a free one).
    ///
    /// Replaces: none (Mooncake logs its stats).
    metrics_listen: String = opt(metrics_listen);
    /// The file holding the cluster key (32 bytes or more; also
    /// `KVFERRY_CLUSTER_KEY_FILE`). With it every surface authenticates
    /// its peers (docs/security.md); without it the node serves its own
    /// host only.
    ///
    /// Replaces: none (the connectors kvferry replaces authenticate
    /// nothing).
    cluster_key_file: String = path(cluster_key_file);
    /// The previous cluster key's file, accepted beside the current one
    /// during a rotation.
    ///
    /// Replaces: none.
    cluster_key_previous_file: String = path(cluster_key_previous_file);
    /// Without a key, serve peers on other hosts too: anyone who reaches
    /// the ports is trusted (the node may listen beyond loopback; the
    /// bootstrap service answers them).
    ///
    /// Replaces: none (vLLM and SGLang listen on every interface,
    /// unauthenticated).
    allow_unauthenticated_remote: bool = plain(allow_unauthenticated_remote);
    /// With a cluster key, serve `/metrics` only to requests signed with
    /// it (otherwise to anyone, as Prometheus scrapes).
    ///
    /// Replaces: none.
    authenticate_metrics: bool = plain(authenticate_metrics);
    /// With a cluster key, tag every tcp data frame's payload too, so
    /// bytes changed in flight fail their request (its cost:
    /// docs/performance.md, "Authentication").
    ///
    /// Replaces: none.
    payload_mac: bool = plain(payload_mac);
    /// How long a transfer waits for its peer's information (prefill:
    /// the decode's request for the KV; decode: the prefill ranks from the
    /// bootstrap service); a prefill frees a request nobody pulled after
    /// it.
    ///
    /// Replaces: SGLang `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`; vLLM
    /// `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`.
    bootstrap_timeout_ms: u64 = ms(timeouts.bootstrap_timeout);
    /// Decode: how long a request may go without progress (data or
    /// status) since it was sent or since its last progress.
    ///
    /// Replaces: `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`; vLLM's receive
    /// timeout (abort timeout + 60 s).
    waiting_timeout_ms: u64 = ms(timeouts.waiting_timeout);
    /// A prefill whose KV is ready gives it back once its decode has been
    /// silent this long (renewed by any of its messages).
    ///
    /// Replaces: none.
    claim_timeout_ms: u64 = ms(timeouts.claim_timeout);
    /// The length of one grant to touch the granter's blocks (the fence,
    /// docs/design.md); renewed every `heartbeat_interval_ms`, so longer
    /// than it.
    ///
    /// Replaces: none.
    lease_ms: u64 = ms(timeouts.lease);
    /// Prefill: the most it holds one transfer's blocks, counted from the
    /// transfer's start, whatever happens.
    ///
    /// Replaces: vLLM's abort timeout as a hard cap.
    hold_limit_ms: u64 = ms(timeouts.hold_limit);
    /// The transport's contract: a write or read posted at t touches no
    /// memory after t plus this (it is reported failed by then at the
    /// latest).
    ///
    /// Replaces: `ASCEND_TRANSFER_TIMEOUT`; Mooncake's transfer timeout.
    transfer_bound_ms: u64 = ms(timeouts.transfer_bound);
    /// The fence's extra margin for clock-rate drift between nodes.
    ///
    /// Replaces: none.
    fence_margin_ms: u64 = ms(timeouts.fence_margin);
    /// How often a toucher renews its lease (the per-transfer heartbeat);
    /// also how often decode probes a dead prefill rank unless
    /// `probe_interval_ms` is set.
    ///
    /// Replaces: `SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL`.
    heartbeat_interval_ms: u64 = ms(timeouts.heartbeat_interval);
    /// Heartbeats missed before a peer is dead.
    ///
    /// Replaces: `SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`.
    heartbeat_misses: u32 = plain(timeouts.heartbeat_misses);
    /// How long a rank waits for the answer its peer owes it before it
    /// sends again what asked for it; the wait doubles after each resend,
    /// up to `heartbeat_interval_ms`.
    ///
    /// Replaces: none (the references never resend a lost message).
    resend_after_ms: u64 = ms(timeouts.resend_after);
    /// The most resends to one peer while it stays silent (hearing from
    /// it starts the count again); 0 turns resending off.
    ///
    /// Replaces: none.
    max_resends: u32 = plain(timeouts.max_resends);
    /// How often decode says hello again to a prefill peer that is dead
    /// or has not answered (and looks its name up again), between 1 ms and
    /// `bootstrap_timeout_ms`; unset: every `heartbeat_interval_ms`.
    ///
    /// Replaces: `SGLANG_FAILED_SESSION_PROBE_INTERVAL_S` (with
    /// `SGLANG_ENABLE_FAILED_SESSION_PROBE`).
    probe_interval_ms: u64 = opt_ms(probe_interval);
    /// The longest wait for one host-name lookup (1 ms to 60 s), on a
    /// helper thread, never on an executor; past it the attempt fails with
    /// a typed timeout and the next one looks the name up again.
    ///
    /// Replaces: none (the references hand names to ZeroMQ and `socket`,
    /// which look them up with no bound).
    resolve_timeout_ms: u64 = ms(resolve_timeout);
    /// The most peers the side channel tracks; when full, a dead peer's
    /// slot no transfer refers to is reused, else a newcomer is refused.
    ///
    /// Replaces: none (unbounded in the references).
    max_peers: usize = plain(max_peers);
    /// The most finished transfers remembered for the engine to collect;
    /// past it the oldest are forgotten, each loss logged and counted.
    ///
    /// Replaces: none (unbounded in the references).
    max_finished_records: usize = plain(max_finished_records);
    /// The most block ids kept for the engine's list of blocks whose load
    /// failed; past it further ids are dropped and counted.
    ///
    /// Replaces: vLLM `get_block_ids_with_load_errors` (unbounded).
    max_load_error_blocks: usize = plain(max_load_error_blocks);
    /// Commands queued to the bridge thread; when full a frame is dropped
    /// and counted, and a decode request is refused as busy.
    ///
    /// Replaces: `SGLANG_DISAGGREGATION_QUEUE_SIZE`.
    bridge_queue_capacity: usize = plain(bridge_queue_capacity);
    /// Decode: the most bootstrap targets (service, engine id) whose
    /// directory is cached; when full one not being queried is evicted.
    ///
    /// Replaces: none (unbounded in the references).
    max_bootstrap_targets: usize = plain(max_bootstrap_targets);
    /// The most data-plane sessions (one per peer endpoint) kept open;
    /// when full an idle one is closed, else the transfer fails.
    ///
    /// Replaces: Mooncake's per-segment handles.
    max_data_sessions: usize = plain(max_data_sessions);
    /// How the tcp data plane waits for its sockets: 0 parks; more spins
    /// that many microseconds before parking. Spin only with cores to
    /// spare: spinning executors starve the engine's threads on theirs.
    ///
    /// Replaces: none (the references block in their transfer threads).
    tcp_spin_us: u64 = spin_us(tcp_poll);
    /// Send the messages on a request's critical path over the tcp
    /// data-plane session to that peer, once one is open, instead of over
    /// ZeroMQ (about a third of a small request's latency on loopback).
    ///
    /// Replaces: none (the references send every control message over
    /// ZeroMQ).
    data_plane_messages: bool = plain(data_plane_messages);
}

/// [`Role`] as a setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoleSetting {
    /// [`Role::Prefill`].
    Prefill,
    /// [`Role::Decode`].
    Decode,
    /// [`Role::Both`]; `kv_both` is vLLM's name for it.
    #[serde(alias = "kv_both")]
    Both,
}

/// [`Mode`] as a setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModeSetting {
    /// [`Mode::Push`].
    Push,
    /// [`Mode::Pull`].
    Pull,
}

/// [`TransportKind`] as a setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransportSetting {
    /// [`TransportKind::Tcp`].
    Tcp,
    /// [`TransportKind::Auto`].
    Auto,
    /// [`TransportKind::Shm`].
    Shm,
    /// [`TransportKind::Local`].
    Local,
    /// [`TransportKind::Mooncake`].
    Mooncake,
}

/// `$setting` and `$value` name the same variants, mapped both ways.
macro_rules! same_variants {
    ($setting:ident <=> $value:ident: $($variant:ident),+) => {
        impl From<$value> for $setting {
            fn from(v: $value) -> Self {
                match v {
                    $($value::$variant => $setting::$variant,)+
                }
            }
        }

        impl From<$setting> for $value {
            fn from(s: $setting) -> Self {
                match s {
                    $($setting::$variant => $value::$variant,)+
                }
            }
        }

        impl EnvKind for $setting {
            const KIND: Kind = Kind::Text;
        }
    };
}

same_variants!(RoleSetting <=> Role: Prefill, Decode, Both);
same_variants!(ModeSetting <=> Mode: Push, Pull);
same_variants!(TransportSetting <=> TransportKind: Tcp, Auto, Shm, Local, Mooncake);

/// The prefix of the environment variables [`NodeSettings::from_env`]
/// reads: `KVFERRY_` and the key in capitals (`KVFERRY_LEASE_MS`).
pub const ENV_PREFIX: &str = "KVFERRY_";

impl NodeSettings {
    /// Settings from a JSON object.
    pub fn from_json(text: &str) -> Result<NodeSettings, ConfigError> {
        Ok(serde_json::from_str(text)?)
    }

    /// Settings from a TOML document.
    pub fn from_toml(text: &str) -> Result<NodeSettings, ConfigError> {
        Ok(toml::from_str(text)?)
    }

    /// Settings from a `.json` or `.toml` file.
    pub fn from_file(path: &str) -> Result<NodeSettings, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_string(),
            source,
        })?;
        if path.ends_with(".json") {
            Self::from_json(&text)
        } else if path.ends_with(".toml") {
            Self::from_toml(&text)
        } else {
            Err(ConfigError::UnknownFormat {
                path: path.to_string(),
            })
        }
    }

    /// Settings from the `KVFERRY_<KEY>` variables of `vars` (the process
    /// environment for [`NodeSettings::from_env`]). Each value is read as
    /// its key's type (strings as they are); variables of other names are
    /// left alone, since other kvferry tools use the prefix too.
    pub fn from_vars(
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<NodeSettings, ConfigError> {
        let mut object = serde_json::Map::new();
        for (var, value) in vars {
            let Some(key) = var.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            let key = key.to_ascii_lowercase();
            let Some(kind) = SETTINGS.iter().find(|s| s.key == key).map(|s| s.kind) else {
                continue;
            };
            let v = kind.parse(&value).ok_or_else(|| ConfigError::Env {
                var: var.clone(),
                why: format!("{value:?} is not {}", kind.name()),
            })?;
            object.insert(key, v);
        }
        Ok(serde_json::from_value(serde_json::Value::Object(object))?)
    }

    /// Settings from the process environment (see [`NodeSettings::from_vars`]).
    pub fn from_env() -> Result<NodeSettings, ConfigError> {
        Self::from_vars(std::env::vars())
    }

    /// These settings with every key `over` sets replaced by its value
    /// (a file, then the environment over it, say).
    pub fn overridden_by(self, over: NodeSettings) -> NodeSettings {
        let (Ok(serde_json::Value::Object(mut base)), Ok(serde_json::Value::Object(top))) =
            (serde_json::to_value(&self), serde_json::to_value(&over))
        else {
            unreachable!("settings serialize as a JSON object");
        };
        base.extend(top.into_iter().filter(|(_, v)| !v.is_null()));
        serde_json::from_value(serde_json::Value::Object(base))
            .expect("a merge of two settings is settings")
    }

    /// A node config: [`NodeConfig::new`] for the role and engine id, with
    /// every other key that is set applied.
    pub fn build(&self) -> Result<NodeConfig, ConfigError> {
        let role = self.role.ok_or(ConfigError::Missing("role"))?;
        let engine_id = self
            .engine_id
            .clone()
            .ok_or(ConfigError::Missing("engine_id"))?;
        let mut c = NodeConfig::new(role.into(), engine_id);
        self.apply(&mut c)?;
        Ok(c)
    }
}

/// The schema's keys, in the order `docs/config.md` lists them.
pub fn setting_keys() -> impl Iterator<Item = &'static str> {
    SETTINGS.iter().map(|s| s.key)
}
