//! The bootstrap service: where prefill ranks announce their side-channel
//! addresses and decode ranks look them up, as in vLLM's Mooncake bootstrap
//! server (same routes, same JSON shapes, so operators can `curl` it).
//!
//! * `POST /register` `{"engine_id", "dp_rank", "tp_rank", "pp_rank", "addr"}`
//! * `GET /query[?engine_id=ID]` →
//!   `{"<dp_rank>": {"engine_id": .., "worker_addr": {"<tp_rank>": {"<pp_rank>": addr}}}}`
//! * `GET /health` → `ok`
//! * `GET /metrics` → the embedding node's metrics ([`MetricsSource`]), when it has one.
//!
//! With a cluster key ([`ServerAuth`]), `/register` and `/query` (and
//! `/metrics` unless left open) must carry a signature
//! ([`kvferry_auth::request`]), and so must a request for any other path
//! or method (signed, it hears 404, or 405 naming the methods the path
//! takes); anything else gets 401 without a reason and counts in
//! `kvferry_auth_rejected_total{surface="bootstrap"}`. `GET /health` stays
//! open.
//!
//! The server ([`BootstrapServer`]) runs on plain threads of kvferry's one
//! HTTP server (`kvferry-http`); the client ([`BootstrapClient`]) is a few
//! lines of HTTP/1.1 over `std::net::TcpStream`, so neither pulls in an
//! async runtime.

mod client;
mod server;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use client::{BootstrapClient, ClientError, RetryPolicy};

pub use kvferry_metrics::http::{MetricsSource, ServerError, METRICS_CONTENT_TYPE};
pub use server::{
    BootstrapServer, ExpectedRanks, ServerAuth, ServerConfig, ServerLimits, LOCAL_ONLY,
};

/// Default port of the bootstrap service (the one vLLM uses).
pub const DEFAULT_PORT: u16 = 8998;

/// Body of `POST /register`: one worker (rank) and its side-channel address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterRequest {
    /// The engine the worker belongs to.
    pub engine_id: String,
    /// Its data-parallel rank.
    pub dp_rank: u32,
    /// Its tensor-parallel rank.
    pub tp_rank: u32,
    /// Its pipeline-parallel rank.
    pub pp_rank: u32,
    /// Side-channel endpoint, e.g. `tcp://10.0.0.5:41235`.
    pub addr: String,
}

/// Body of a successful `POST /register`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterResponse {
    /// `"ok"`.
    pub status: String,
    /// True when this (dp, tp, pp) slot was registered before and its address
    /// was replaced (a restarted rank).
    pub replaced: bool,
}

/// One data-parallel rank of an engine in `GET /query`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineEntry {
    /// The engine.
    pub engine_id: String,
    /// tp_rank → pp_rank → side-channel address.
    pub worker_addr: BTreeMap<u32, BTreeMap<u32, String>>,
}

impl EngineEntry {
    /// TP size as the registered ranks show it (vLLM counts the entries).
    pub fn tp_size(&self) -> usize {
        self.worker_addr.len()
    }

    /// PP size as the registered ranks show it: the stages of TP rank 0.
    pub fn pp_size(&self) -> usize {
        self.worker_addr.get(&0).map_or(0, BTreeMap::len)
    }

    /// Side-channel address of one worker.
    pub fn addr(&self, tp_rank: u32, pp_rank: u32) -> Option<&str> {
        self.worker_addr
            .get(&tp_rank)
            .and_then(|pp| pp.get(&pp_rank))
            .map(String::as_str)
    }
}

/// Body of `GET /query`: dp_rank → engine entry.
pub type QueryResponse = BTreeMap<u32, EngineEntry>;

/// Limits on what `/register` accepts; they bound the registry's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegistryLimits {
    /// Workers (dp, tp, pp slots) across all engines.
    pub max_workers: usize,
    /// Bytes of `engine_id` and of `addr`.
    pub max_string_bytes: usize,
    /// Exclusive bound on every rank; catches garbage like `4294967295`.
    pub max_rank: u32,
}

impl Default for RegistryLimits {
    fn default() -> Self {
        RegistryLimits {
            max_workers: 65_536,
            max_string_bytes: 512,
            max_rank: 1 << 16,
        }
    }
}

impl RegistryLimits {
    /// Refuses a request whose strings or ranks exceed these limits.
    fn check(&self, req: &RegisterRequest) -> Result<(), RegisterError> {
        self.check_str("engine_id", &req.engine_id)?;
        self.check_str("addr", &req.addr)?;
        for (what, rank) in [
            ("dp_rank", req.dp_rank),
            ("tp_rank", req.tp_rank),
            ("pp_rank", req.pp_rank),
        ] {
            if rank >= self.max_rank {
                return Err(RegisterError::Invalid(format!(
                    "{what} {rank} is out of range (limit {})",
                    self.max_rank
                )));
            }
        }
        Ok(())
    }

    /// Refuses an empty, oversized or control-character string `what`.
    fn check_str(&self, what: &str, s: &str) -> Result<(), RegisterError> {
        if s.is_empty() {
            return Err(RegisterError::Invalid(format!("{what} is empty")));
        }
        if s.len() > self.max_string_bytes {
            return Err(RegisterError::Invalid(format!(
                "{what} is {} bytes, limit is {}",
                s.len(),
                self.max_string_bytes
            )));
        }
        if s.chars().any(char::is_control) {
            return Err(RegisterError::Invalid(format!(
                "{what} contains control characters"
            )));
        }
        Ok(())
    }
}

/// Why a registration was refused.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// The request itself is invalid (HTTP 400).
    #[error("invalid registration: {0}")]
    Invalid(String),
    /// The dp rank already belongs to another engine (HTTP 409).
    #[error("dp_rank {dp_rank} is registered by engine {existing:?}, not {requested:?}")]
    EngineMismatch {
        /// The contested rank.
        dp_rank: u32,
        /// The engine that holds it.
        existing: String,
        /// The engine that asked for it.
        requested: String,
    },
    /// The registry holds `max_workers` workers already (HTTP 503).
    #[error("registry full ({max_workers} workers)")]
    Full {
        /// The registry's bound.
        max_workers: usize,
    },
}

/// The registry behind the service, independent of HTTP.
#[derive(Debug, Default)]
pub struct Registry {
    limits: RegistryLimits,
    engines: BTreeMap<u32, EngineEntry>,
    workers: usize,
}

impl Registry {
    /// An empty registry under `limits`.
    pub fn new(limits: RegistryLimits) -> Registry {
        Registry {
            limits,
            engines: BTreeMap::new(),
            workers: 0,
        }
    }

    /// Adds or replaces one worker. Re-registering the same slot replaces its
    /// address, so a restarted rank is found again by decode ranks (vLLM
    /// rejects it, which leaves a restarted prefill rank unreachable).
    pub fn register(&mut self, req: RegisterRequest) -> Result<RegisterResponse, RegisterError> {
        self.limits.check(&req)?;

        if let Some(entry) = self.engines.get(&req.dp_rank) {
            if entry.engine_id != req.engine_id {
                return Err(RegisterError::EngineMismatch {
                    dp_rank: req.dp_rank,
                    existing: entry.engine_id.clone(),
                    requested: req.engine_id,
                });
            }
            let slot = self
                .engines
                .get_mut(&req.dp_rank)
                .and_then(|e| e.worker_addr.get_mut(&req.tp_rank))
                .and_then(|pp| pp.get_mut(&req.pp_rank));
            if let Some(addr) = slot {
                *addr = req.addr;
                return Ok(RegisterResponse {
                    status: "ok".into(),
                    replaced: true,
                });
            }
        }
        if self.workers >= self.limits.max_workers {
            return Err(RegisterError::Full {
                max_workers: self.limits.max_workers,
            });
        }
        let entry = self
            .engines
            .entry(req.dp_rank)
            .or_insert_with(|| EngineEntry {
                engine_id: req.engine_id.clone(),
                worker_addr: BTreeMap::new(),
            });
        entry
            .worker_addr
            .entry(req.tp_rank)
            .or_default()
            .insert(req.pp_rank, req.addr);
        self.workers += 1;
        Ok(RegisterResponse {
            status: "ok".into(),
            replaced: false,
        })
    }

    /// Every engine, or only the dp ranks of `engine_id`.
    pub fn query(&self, engine_id: Option<&str>) -> QueryResponse {
        self.engines
            .iter()
            .filter(|(_, e)| engine_id.is_none_or(|id| e.engine_id == id))
            .map(|(dp, e)| (*dp, e.clone()))
            .collect()
    }

    /// What the registry still lacks of `expect` (which dp ranks, how many
    /// workers), or `None` once every expected rank has registered.
    pub fn missing(&self, expect: ExpectedRanks) -> Option<String> {
        let complete = |dp: u32| {
            self.engines.get(&dp).map_or(0, |e| {
                e.worker_addr.values().map(BTreeMap::len).sum::<usize>()
            }) >= expect.workers
        };
        let waiting: Vec<u32> = (0..expect.dp_size).filter(|&dp| !complete(dp)).collect();
        if waiting.is_empty() {
            return None;
        }
        Some(format!(
            "waiting for ranks: dp ranks {waiting:?} have fewer than {} of their workers registered",
            expect.workers
        ))
    }

    /// Workers registered.
    pub fn len(&self) -> usize {
        self.workers
    }

    /// True when no worker is registered.
    pub fn is_empty(&self) -> bool {
        self.workers == 0
    }
}
