//! [`NodeSettings`]: the serde schema of a node's configuration, read from
//! a JSON or TOML file, from `KVFERRY_*` environment variables, or from an
//! engine's own configuration (vLLM's `kv_connector_extra_config` is this
//! JSON object). `docs/config.md` lists every key next to its equivalent
//! in the connectors kvferry replaces.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{NodeConfig, Role, TransportKind};
use crate::transport::PollPolicy;
use kvferry_machines::Mode;

/// Every knob of a [`NodeConfig`] that is plain data, each optional: what
/// is absent keeps [`NodeConfig::new`]'s default. Durations are in
/// milliseconds (microseconds for the spin), as engines' environment
/// variables give them. Unknown keys are refused, so a typo is an error,
/// not a silently ignored setting.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSettings {
    /// `"prefill"`, `"decode"` or `"both"` (alias `"kv_both"`); required to build a config.
    pub role: Option<RoleSetting>,
    /// This engine's id (required to build a config).
    pub engine_id: Option<String>,
    /// [`NodeConfig::dp_rank`].
    pub dp_rank: Option<u32>,
    /// [`NodeConfig::dp_size`].
    pub dp_size: Option<u32>,
    /// [`NodeConfig::tp_size`].
    pub tp_size: Option<u32>,
    /// [`NodeConfig::tp_rank`].
    pub tp_rank: Option<u32>,
    /// [`NodeConfig::pp_size`].
    pub pp_size: Option<u32>,
    /// [`NodeConfig::pp_rank`].
    pub pp_rank: Option<u32>,
    /// `"push"` or `"pull"`.
    pub mode: Option<ModeSetting>,
    /// `"tcp"`, `"local"` or `"mooncake"`.
    pub transport: Option<TransportSetting>,
    /// Mooncake's protocol with `"transport": "mooncake"` (`MooncakeConfig::protocol`).
    pub mooncake_protocol: Option<String>,
    /// Where the KV lives for Mooncake's registration (`MooncakeConfig::location`:
    /// `cpu:0`, `cuda:0`, `*`).
    pub mooncake_location: Option<String>,
    /// `MooncakeConfig::linger`.
    pub mooncake_linger_ms: Option<u64>,
    /// [`NodeConfig::device`]: `"cuda:N"` for a KV cache on CUDA device
    /// N (the driver is loaded when the config is built), `"cpu"` for host
    /// memory (the default).
    pub device: Option<String>,
    /// [`NodeConfig::host`].
    pub host: Option<String>,
    /// [`NodeConfig::listen`].
    pub listen: Option<String>,
    /// [`NodeConfig::side_channel_port`].
    pub side_channel_port: Option<u16>,
    /// [`NodeConfig::data_plane_port`].
    pub data_plane_port: Option<u16>,
    /// [`NodeConfig::tcp_streams`].
    pub tcp_streams: Option<usize>,
    /// [`NodeConfig::bootstrap`].
    pub bootstrap: Option<String>,
    /// [`NodeConfig::serve_bootstrap`].
    pub serve_bootstrap: Option<String>,
    /// [`NodeConfig::metrics_listen`].
    pub metrics_listen: Option<String>,
    /// [`NodeConfig::cluster_key_file`] (`KVFERRY_CLUSTER_KEY_FILE`).
    pub cluster_key_file: Option<String>,
    /// [`NodeConfig::cluster_key_previous_file`].
    pub cluster_key_previous_file: Option<String>,
    /// [`NodeConfig::allow_unauthenticated_remote`].
    pub allow_unauthenticated_remote: Option<bool>,
    /// [`NodeConfig::authenticate_metrics`].
    pub authenticate_metrics: Option<bool>,
    /// [`NodeConfig::payload_mac`].
    pub payload_mac: Option<bool>,
    /// `Timeouts::bootstrap_timeout`.
    pub bootstrap_timeout_ms: Option<u64>,
    /// `Timeouts::waiting_timeout`.
    pub waiting_timeout_ms: Option<u64>,
    /// `Timeouts::claim_timeout`.
    pub claim_timeout_ms: Option<u64>,
    /// `Timeouts::lease`.
    pub lease_ms: Option<u64>,
    /// `Timeouts::hold_limit`.
    pub hold_limit_ms: Option<u64>,
    /// `Timeouts::transfer_bound`.
    pub transfer_bound_ms: Option<u64>,
    /// `Timeouts::fence_margin`.
    pub fence_margin_ms: Option<u64>,
    /// `Timeouts::heartbeat_interval`; also how often decode probes a dead
    /// prefill rank unless `probe_interval_ms` is set.
    pub heartbeat_interval_ms: Option<u64>,
    /// `Timeouts::heartbeat_misses`.
    pub heartbeat_misses: Option<u32>,
    /// `Timeouts::resend_after`.
    pub resend_after_ms: Option<u64>,
    /// `Timeouts::max_resends` (0 turns resending off).
    pub max_resends: Option<u32>,
    /// [`NodeConfig::probe_interval`].
    pub probe_interval_ms: Option<u64>,
    /// [`NodeConfig::resolve_timeout`].
    pub resolve_timeout_ms: Option<u64>,
    /// [`NodeConfig::max_peers`].
    pub max_peers: Option<usize>,
    /// [`NodeConfig::max_finished_records`].
    pub max_finished_records: Option<usize>,
    /// [`NodeConfig::max_load_error_blocks`].
    pub max_load_error_blocks: Option<usize>,
    /// [`NodeConfig::bridge_queue_capacity`].
    pub bridge_queue_capacity: Option<usize>,
    /// [`NodeConfig::max_bootstrap_targets`].
    pub max_bootstrap_targets: Option<usize>,
    /// [`NodeConfig::max_data_sessions`].
    pub max_data_sessions: Option<usize>,
    /// [`NodeConfig::tcp_poll`]: 0 parks, more spins that many
    /// microseconds before parking.
    pub tcp_spin_us: Option<u64>,
    /// [`NodeConfig::data_plane_messages`].
    pub data_plane_messages: Option<bool>,
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

/// Why settings could not be read or built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file's name ends neither in `.json` nor in `.toml`.
    #[error("{path}: settings files end in .json or .toml")]
    UnknownFormat {
        /// The file.
        path: String,
    },
    /// JSON that does not fit the schema.
    #[error("JSON settings: {0}")]
    Json(#[from] serde_json::Error),
    /// TOML that does not fit the schema.
    #[error("TOML settings: {0}")]
    Toml(#[from] toml::de::Error),
    /// An environment variable whose value does not fit its key.
    #[error("{var}: {why}")]
    Env {
        /// The variable.
        var: String,
        /// What is wrong with its value.
        why: String,
    },
    /// A key a config cannot be built without.
    #[error("setting {0} is required")]
    Missing(&'static str),
    /// A `device` that is not `cpu` or `cuda:N`.
    #[error("device {0:?}: expected \"cpu\" or \"cuda:N\"")]
    BadDevice(String),
    /// The device asked for cannot be opened here.
    #[error(transparent)]
    Device(#[from] crate::transport::DeviceError),
}

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
            let Some(kind) = key_kind(&key) else {
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
        let role = match self.role.ok_or(ConfigError::Missing("role"))? {
            RoleSetting::Prefill => Role::Prefill,
            RoleSetting::Decode => Role::Decode,
            RoleSetting::Both => Role::Both,
        };
        let engine_id = self
            .engine_id
            .clone()
            .ok_or(ConfigError::Missing("engine_id"))?;
        let mut c = NodeConfig::new(role, engine_id);
        self.apply_placement(&mut c);
        self.apply_timeouts(&mut c);
        self.apply_bounds(&mut c);
        c.device = match self.device.as_deref().map(parse_device).transpose()? {
            Some(Some(ordinal)) => Some(crate::transport::open_cuda(ordinal)?),
            Some(None) | None => None,
        };
        Ok(c)
    }

    /// Every key of `c`'s plain data, set: what a node built from
    /// settings runs with, defaults and the environment included (the
    /// inverse of [`NodeSettings::build`] on the schema's keys).
    pub fn of(c: &NodeConfig) -> NodeSettings {
        let mut s = NodeSettings::placement_of(c);
        s.timeouts_of(c);
        s.bounds_of(c);
        s
    }

    fn placement_of(c: &NodeConfig) -> NodeSettings {
        NodeSettings {
            role: Some(match c.role {
                Role::Prefill => RoleSetting::Prefill,
                Role::Decode => RoleSetting::Decode,
                Role::Both => RoleSetting::Both,
            }),
            engine_id: Some(c.engine_id.clone()),
            dp_rank: Some(c.dp_rank),
            dp_size: Some(c.dp_size),
            tp_size: Some(c.tp_size),
            tp_rank: Some(c.tp_rank),
            pp_size: Some(c.pp_size),
            pp_rank: Some(c.pp_rank),
            mode: Some(match c.mode {
                Mode::Push => ModeSetting::Push,
                Mode::Pull => ModeSetting::Pull,
            }),
            transport: Some(match c.transport {
                TransportKind::Tcp => TransportSetting::Tcp,
                TransportKind::Auto => TransportSetting::Auto,
                TransportKind::Shm => TransportSetting::Shm,
                TransportKind::Local => TransportSetting::Local,
                TransportKind::Mooncake => TransportSetting::Mooncake,
            }),
            mooncake_protocol: Some(c.mooncake.protocol.clone()),
            mooncake_location: Some(c.mooncake.location.clone()),
            mooncake_linger_ms: Some(millis(c.mooncake.linger)),
            device: Some(c.device.as_ref().map_or_else(|| "cpu".into(), |d| d.name())),
            host: Some(c.host.clone()),
            listen: c.listen.clone(),
            side_channel_port: Some(c.side_channel_port),
            data_plane_port: Some(c.data_plane_port),
            tcp_streams: Some(c.tcp_streams),
            bootstrap: c.bootstrap.clone(),
            serve_bootstrap: c.serve_bootstrap.clone(),
            metrics_listen: c.metrics_listen.clone(),
            cluster_key_file: c.cluster_key_file.as_ref().map(|p| p.display().to_string()),
            cluster_key_previous_file: c
                .cluster_key_previous_file
                .as_ref()
                .map(|p| p.display().to_string()),
            allow_unauthenticated_remote: Some(c.allow_unauthenticated_remote),
            authenticate_metrics: Some(c.authenticate_metrics),
            payload_mac: Some(c.payload_mac),
            ..NodeSettings::default()
        }
    }

    fn timeouts_of(&mut self, c: &NodeConfig) {
        let t = &c.timeouts;
        self.bootstrap_timeout_ms = Some(millis(t.bootstrap_timeout));
        self.waiting_timeout_ms = Some(millis(t.waiting_timeout));
        self.claim_timeout_ms = Some(millis(t.claim_timeout));
        self.lease_ms = Some(millis(t.lease));
        self.hold_limit_ms = Some(millis(t.hold_limit));
        self.transfer_bound_ms = Some(millis(t.transfer_bound));
        self.fence_margin_ms = Some(millis(t.fence_margin));
        self.heartbeat_interval_ms = Some(millis(t.heartbeat_interval));
        self.heartbeat_misses = Some(t.heartbeat_misses);
        self.resend_after_ms = Some(millis(t.resend_after));
        self.max_resends = Some(t.max_resends);
        self.probe_interval_ms = c.probe_interval.map(millis);
        self.resolve_timeout_ms = Some(millis(c.resolve_timeout));
    }

    fn bounds_of(&mut self, c: &NodeConfig) {
        self.max_peers = Some(c.max_peers);
        self.max_finished_records = Some(c.max_finished_records);
        self.max_load_error_blocks = Some(c.max_load_error_blocks);
        self.bridge_queue_capacity = Some(c.bridge_queue_capacity);
        self.max_bootstrap_targets = Some(c.max_bootstrap_targets);
        self.max_data_sessions = Some(c.max_data_sessions);
        self.data_plane_messages = Some(c.data_plane_messages);
        self.tcp_spin_us = Some(match c.tcp_poll {
            PollPolicy::Park => 0,
            PollPolicy::Spin { spin } => u64::try_from(spin.as_micros()).unwrap_or(u64::MAX),
        });
    }

    fn apply_placement(&self, c: &mut NodeConfig) {
        set(&mut c.dp_rank, self.dp_rank);
        set(&mut c.dp_size, self.dp_size);
        set(&mut c.tp_size, self.tp_size);
        set(&mut c.tp_rank, self.tp_rank);
        set(&mut c.pp_size, self.pp_size);
        set(&mut c.pp_rank, self.pp_rank);
        if let Some(m) = self.mode {
            c.mode = match m {
                ModeSetting::Push => Mode::Push,
                ModeSetting::Pull => Mode::Pull,
            };
        }
        if let Some(t) = self.transport {
            c.transport = match t {
                TransportSetting::Tcp => TransportKind::Tcp,
                TransportSetting::Auto => TransportKind::Auto,
                TransportSetting::Shm => TransportKind::Shm,
                TransportSetting::Local => TransportKind::Local,
                TransportSetting::Mooncake => TransportKind::Mooncake,
            };
        }
        set(&mut c.mooncake.protocol, self.mooncake_protocol.clone());
        set(&mut c.mooncake.location, self.mooncake_location.clone());
        if let Some(ms) = self.mooncake_linger_ms {
            c.mooncake.linger = Duration::from_millis(ms);
        }
        set(&mut c.host, self.host.clone());
        if self.listen.is_some() {
            c.listen = self.listen.clone();
        }
        set(&mut c.side_channel_port, self.side_channel_port);
        set(&mut c.data_plane_port, self.data_plane_port);
        set(&mut c.tcp_streams, self.tcp_streams);
        if self.bootstrap.is_some() {
            c.bootstrap = self.bootstrap.clone();
        }
        if self.serve_bootstrap.is_some() {
            c.serve_bootstrap = self.serve_bootstrap.clone();
        }
        if self.metrics_listen.is_some() {
            c.metrics_listen = self.metrics_listen.clone();
        }
        if let Some(f) = &self.cluster_key_file {
            c.cluster_key_file = Some(f.into());
        }
        if let Some(f) = &self.cluster_key_previous_file {
            c.cluster_key_previous_file = Some(f.into());
        }
        set(
            &mut c.allow_unauthenticated_remote,
            self.allow_unauthenticated_remote,
        );
        set(&mut c.authenticate_metrics, self.authenticate_metrics);
        set(&mut c.payload_mac, self.payload_mac);
    }

    fn apply_timeouts(&self, c: &mut NodeConfig) {
        let t = &mut c.timeouts;
        set_ms(&mut t.bootstrap_timeout, self.bootstrap_timeout_ms);
        set_ms(&mut t.waiting_timeout, self.waiting_timeout_ms);
        set_ms(&mut t.claim_timeout, self.claim_timeout_ms);
        set_ms(&mut t.lease, self.lease_ms);
        set_ms(&mut t.hold_limit, self.hold_limit_ms);
        set_ms(&mut t.transfer_bound, self.transfer_bound_ms);
        set_ms(&mut t.fence_margin, self.fence_margin_ms);
        set_ms(&mut t.heartbeat_interval, self.heartbeat_interval_ms);
        set(&mut t.heartbeat_misses, self.heartbeat_misses);
        set_ms(&mut t.resend_after, self.resend_after_ms);
        set(&mut t.max_resends, self.max_resends);
        if let Some(ms) = self.probe_interval_ms {
            c.probe_interval = Some(Duration::from_millis(ms));
        }
        set_ms(&mut c.resolve_timeout, self.resolve_timeout_ms);
    }

    fn apply_bounds(&self, c: &mut NodeConfig) {
        set(&mut c.max_peers, self.max_peers);
        set(&mut c.max_finished_records, self.max_finished_records);
        set(&mut c.max_load_error_blocks, self.max_load_error_blocks);
        set(&mut c.bridge_queue_capacity, self.bridge_queue_capacity);
        set(&mut c.max_bootstrap_targets, self.max_bootstrap_targets);
        set(&mut c.max_data_sessions, self.max_data_sessions);
        set(&mut c.data_plane_messages, self.data_plane_messages);
        if let Some(us) = self.tcp_spin_us {
            c.tcp_poll = match us {
                0 => PollPolicy::Park,
                us => PollPolicy::Spin {
                    spin: Duration::from_micros(us),
                },
            };
        }
    }
}

fn set<T>(field: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *field = v;
    }
}

/// `d` in whole milliseconds, as the settings give durations.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn set_ms(field: &mut Duration, ms: Option<u64>) {
    set(field, ms.map(Duration::from_millis));
}

/// How an environment variable's text becomes a key's JSON value.
#[derive(Clone, Copy)]
enum Kind {
    Text,
    Number,
    Flag,
}

impl Kind {
    fn parse(self, text: &str) -> Option<serde_json::Value> {
        match self {
            Kind::Text => Some(serde_json::Value::String(text.to_string())),
            Kind::Number => text.trim().parse::<u64>().ok().map(Into::into),
            Kind::Flag => match text.trim() {
                "1" | "true" => Some(true.into()),
                "0" | "false" => Some(false.into()),
                _ => None,
            },
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Text => "text",
            Kind::Number => "a non-negative integer",
            Kind::Flag => "true/false or 1/0",
        }
    }
}

/// Every key of the schema and how its environment variable reads.
const KEYS: &[(&str, Kind)] = &[
    ("role", Kind::Text),
    ("engine_id", Kind::Text),
    ("dp_rank", Kind::Number),
    ("dp_size", Kind::Number),
    ("tp_size", Kind::Number),
    ("tp_rank", Kind::Number),
    ("pp_size", Kind::Number),
    ("pp_rank", Kind::Number),
    ("mode", Kind::Text),
    ("transport", Kind::Text),
    ("mooncake_protocol", Kind::Text),
    ("mooncake_location", Kind::Text),
    ("mooncake_linger_ms", Kind::Number),
    ("device", Kind::Text),
    ("host", Kind::Text),
    ("listen", Kind::Text),
    ("side_channel_port", Kind::Number),
    ("data_plane_port", Kind::Number),
    ("tcp_streams", Kind::Number),
    ("bootstrap", Kind::Text),
    ("serve_bootstrap", Kind::Text),
    ("metrics_listen", Kind::Text),
    ("cluster_key_file", Kind::Text),
    ("cluster_key_previous_file", Kind::Text),
    ("allow_unauthenticated_remote", Kind::Flag),
    ("authenticate_metrics", Kind::Flag),
    ("payload_mac", Kind::Flag),
    ("bootstrap_timeout_ms", Kind::Number),
    ("waiting_timeout_ms", Kind::Number),
    ("claim_timeout_ms", Kind::Number),
    ("lease_ms", Kind::Number),
    ("hold_limit_ms", Kind::Number),
    ("transfer_bound_ms", Kind::Number),
    ("fence_margin_ms", Kind::Number),
    ("heartbeat_interval_ms", Kind::Number),
    ("heartbeat_misses", Kind::Number),
    ("resend_after_ms", Kind::Number),
    ("max_resends", Kind::Number),
    ("probe_interval_ms", Kind::Number),
    ("resolve_timeout_ms", Kind::Number),
    ("max_peers", Kind::Number),
    ("max_finished_records", Kind::Number),
    ("max_load_error_blocks", Kind::Number),
    ("bridge_queue_capacity", Kind::Number),
    ("max_bootstrap_targets", Kind::Number),
    ("max_data_sessions", Kind::Number),
    ("tcp_spin_us", Kind::Number),
    ("data_plane_messages", Kind::Flag),
];

/// `cpu` is `None`, `cuda:N` is `Some(N)`.
fn parse_device(text: &str) -> Result<Option<u32>, ConfigError> {
    let bad = || ConfigError::BadDevice(text.to_string());
    match text.trim() {
        "cpu" => Ok(None),
        t => match t.strip_prefix("cuda:") {
            Some(n) => n.parse().map(Some).map_err(|_| bad()),
            None => Err(bad()),
        },
    }
}

fn key_kind(key: &str) -> Option<Kind> {
    KEYS.iter().find(|(k, _)| *k == key).map(|&(_, kind)| kind)
}

/// The schema's keys, in the order `docs/config.md` lists them.
pub fn setting_keys() -> impl Iterator<Item = &'static str> {
    KEYS.iter().map(|&(k, _)| k)
}
