//! [`StoreSettings`]: what both halves of an engine's store connector are
//! configured with (JSON from `kvferry.vllm`), and the connector
//! configuration they make.

use std::time::Duration;

use kvferry_machines::store::events::Medium;
use kvferry_machines::store::{GroupSpec, KeyspaceSpec, StoreConfig};
use kvferry_machines::{Backoff, ModelSpec};
use serde::Deserialize;

use crate::config::{ConnectorConfig, ConnectorLimits};
use crate::lookup::{BoardError, LookupBoard};
use crate::scheduler::StoreSchedulerConfig;

/// A group as the settings name it.
#[derive(Clone, Copy, Debug, Deserialize)]
pub struct GroupSetting {
    /// Tokens per block.
    pub block_tokens: u32,
    /// A sliding window's tokens; `None`: full attention.
    #[serde(default)]
    pub window_tokens: Option<u32>,
}

/// What both halves are configured with (JSON from `kvferry.vllm`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSettings {
    /// The store's URL (`kvferry.store` URLs).
    pub store: String,
    /// Where rank 0 answers lookups (`ipc://…` or `tcp://127.0.0.1:…`).
    pub lookup_endpoint: String,
    /// The engine's KV-cache groups, in its order.
    pub groups: Vec<GroupSetting>,
    /// Look prefixes up and load the hits.
    #[serde(default = "yes")]
    pub load: bool,
    /// Save what the prefill computed.
    #[serde(default = "yes")]
    pub save: bool,
    /// Save what the decode computed too.
    #[serde(default)]
    pub save_decode: bool,
    /// The longest one lookup may take (a slower answer is a miss).
    #[serde(default = "default_lookup_timeout_ms")]
    pub lookup_timeout_ms: u64,
    /// After a lookup found the store or the lookup server down, lookups
    /// are misses for this long.
    #[serde(default = "default_down_backoff_ms")]
    pub down_backoff_ms: u64,
    /// The most requests the halves track at once (lookups out, saves,
    /// loads): past it a request goes without the store.
    #[serde(default = "default_max_requests")]
    pub max_requests: usize,
    /// The model's name, part of every key.
    #[serde(default)]
    pub model_name: String,
    /// The KV cache's dtype, part of every key.
    #[serde(default)]
    pub dtype: String,
    /// The engine's TP size.
    #[serde(default = "one")]
    pub tp_size: u32,
    /// This worker's TP rank (rank 0 of stage 0 serves the lookups).
    #[serde(default)]
    pub tp_rank: u32,
    /// The engine's PP size.
    #[serde(default = "one")]
    pub pp_size: u32,
    /// This worker's pipeline stage.
    #[serde(default)]
    pub pp_rank: u32,
    /// One store call's bound; unset: the machines' default.
    #[serde(default)]
    pub op_bound_ms: Option<u64>,
    /// One save's or load's bound; unset: the machines' default.
    #[serde(default)]
    pub request_timeout_ms: Option<u64>,
}

fn yes() -> bool {
    true
}
fn one() -> u32 {
    1
}
fn default_lookup_timeout_ms() -> u64 {
    1000
}
fn default_down_backoff_ms() -> u64 {
    2000
}
fn default_max_requests() -> usize {
    4096
}

impl StoreSettings {
    /// The settings in `json`.
    pub fn parse(json: &str) -> Result<StoreSettings, serde_json::Error> {
        serde_json::from_str(json)
    }

    /// The groups as the scheduler and the keyspace take them.
    pub fn groups(&self) -> Vec<GroupSpec> {
        (self.groups.iter())
            .map(|g| GroupSpec {
                block_tokens: g.block_tokens,
                window_tokens: g.window_tokens,
            })
            .collect()
    }

    /// The connector's configuration for a model of this shape.
    pub fn connector_config(&self, model: ModelSpec) -> ConnectorConfig {
        let mut store = StoreConfig::default();
        if let Some(ms) = self.op_bound_ms {
            store.op_bound = Duration::from_millis(ms);
        }
        if let Some(ms) = self.request_timeout_ms {
            store.request_timeout = Duration::from_millis(ms);
        }
        let limits = ConnectorLimits {
            max_saves: self.max_requests,
            max_loads: self.max_requests,
            ..ConnectorLimits::default()
        };
        ConnectorConfig {
            store,
            keyspace: KeyspaceSpec {
                model_name: self.model_name.clone(),
                model,
                dtype: self.dtype.clone(),
                tp_size: self.tp_size,
                pp_size: self.pp_size,
                groups: self.groups(),
            },
            medium: Medium::Cpu,
            limits,
        }
    }

    /// The scheduler half's configuration.
    pub fn scheduler_config(&self) -> StoreSchedulerConfig {
        let mut cfg = StoreSchedulerConfig::new(self.groups());
        cfg.load = self.load;
        cfg.save = self.save;
        cfg.save_decode = self.save_decode;
        cfg.max_requests = self.max_requests;
        cfg
    }

    /// Starts the scheduler half's lookups off its thread, against rank
    /// 0's lookup server.
    pub fn start_lookups(&self) -> Result<LookupBoard, BoardError> {
        LookupBoard::start(
            &self.lookup_endpoint,
            Duration::from_millis(self.lookup_timeout_ms),
            // A fixed pause (a back-off of factor 1), not a growing one:
            // while the store counts as down every lookup is a miss, so a
            // pause that grew would leave a store that came back unused for
            // longer. `down_backoff_ms` is that one pause.
            Backoff::fixed(Duration::from_millis(self.down_backoff_ms)),
            self.max_requests,
        )
    }

    /// One store call's bound, slack included: how long a drain waits for
    /// a call it cannot cut short.
    pub fn op_bound(&self) -> Duration {
        let bound =
            (self.op_bound_ms).map_or(StoreConfig::default().op_bound, Duration::from_millis);
        bound + Duration::from_millis(100)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"{"store": "inproc", "lookup_endpoint": "ipc:///tmp/l", "groups": [{"block_tokens": 16}]}"#;

    #[test]
    fn unset_keys_take_their_defaults() {
        let s = StoreSettings::parse(MINIMAL).unwrap();
        assert!(s.load && s.save && !s.save_decode);
        let sched = s.scheduler_config();
        assert!(sched.load && sched.save && !sched.save_decode);
        assert_eq!(
            (s.lookup_timeout_ms, s.down_backoff_ms, s.max_requests),
            (1000, 2000, 4096)
        );
        assert_eq!((s.tp_size, s.tp_rank, s.pp_size, s.pp_rank), (1, 0, 1, 0));
        let group = GroupSpec {
            block_tokens: 16,
            window_tokens: None,
        };
        assert_eq!(s.groups(), vec![group]);
        let bound = StoreConfig::default().op_bound + Duration::from_millis(100);
        assert_eq!(s.op_bound(), bound);
    }

    #[test]
    fn an_unknown_key_is_refused() {
        let typo = MINIMAL.replace("\"groups\"", "\"lookup_timeout\": 5, \"groups\"");
        let e = StoreSettings::parse(&typo).unwrap_err();
        assert!(e.to_string().contains("lookup_timeout"), "{e}");
    }

    #[test]
    fn the_connector_is_bounded_and_timed_as_set() {
        let json = MINIMAL.replace(
            "\"groups\"",
            "\"max_requests\": 7, \"op_bound_ms\": 300, \"request_timeout_ms\": 900, \"groups\"",
        );
        let s = StoreSettings::parse(&json).unwrap();
        let model = ModelSpec {
            layout: kvferry_machines::LayoutKind::Hnd,
            total_kv_heads: 2,
            block_tokens: 16,
            head_bytes: 128,
        };
        let c = s.connector_config(model);
        assert_eq!((c.limits.max_saves, c.limits.max_loads), (7, 7));
        assert_eq!(s.scheduler_config().max_requests, 7);
        assert_eq!(c.store.op_bound, Duration::from_millis(300));
        assert_eq!(c.store.request_timeout, Duration::from_millis(900));
        assert_eq!(c.keyspace.groups, s.groups());
        assert_eq!(s.op_bound(), Duration::from_millis(400));
    }
}
