//! A store named by its URL: the one place that turns `inproc`,
//! `kvferry://`, `redis://`, `redis+cluster://` and `mooncake://` into a
//! backend, for the CLI and the engines' connectors alike.
//!
//! `inproc` is a store of this handle's own; `inproc://NAME` is the store
//! of that name in this process, made on first use and shared by every
//! handle opened with it (the ranks or engines of one process). Named
//! stores live as long as the process: as many as the names used.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use kvferry_machines::store::ChunkKey;
use kvferry_machines::RankLayout;
use kvferry_reactor::lock;

use crate::arena::AllocError;
use crate::backend::{Answers, CallError, GetItem, PutItem, PutOutcome, StoreBackend};
use crate::inproc::{InprocConfig, InprocStore};
use crate::mooncake::{MooncakeStore, MooncakeStoreConfig, MooncakeStoreError};
use crate::redis::{ClusterConfig, RedisClusterStore, RedisConfig, RedisError, RedisStore};
use crate::remote::{RemoteConfig, RemoteError, RemoteStore};

/// The store URLs [`AnyStore::open`] takes.
pub const STORE_URLS: &str = "inproc[://NAME], kvferry://HOST:PORT, \
     redis://[user:password@]HOST:PORT, redis+cluster://[user:password@]HOST:PORT[,HOST:PORT...], \
     mooncake://MASTER_HOST:PORT[?protocol=P&segment_mb=N]";

/// Why a URL gave no store.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// No store has this scheme.
    #[error("{0:?}: the stores are {STORE_URLS}")]
    Scheme(String),
    /// A `redis://` or `redis+cluster://` URL that does not parse.
    #[error(transparent)]
    RedisUrl(RedisError),
    /// A `mooncake://` URL that does not parse.
    #[error(transparent)]
    MooncakeUrl(MooncakeStoreError),
    /// The `kvferry://` server's address does not resolve or route.
    #[error(transparent)]
    Remote(RemoteError),
    /// Mooncake's client could not start.
    #[error(transparent)]
    Mooncake(MooncakeStoreError),
    /// The cluster key's file (`KVFERRY_CLUSTER_KEY_FILE`) could not be used.
    #[error(transparent)]
    Key(#[from] kvferry_auth::KeyError),
    /// The in-process store's room cannot be had.
    #[error("in-process store: {0}")]
    Inproc(#[from] AllocError),
}

impl OpenError {
    /// The URL itself is wrong (not the store behind it).
    pub fn is_bad_url(&self) -> bool {
        matches!(
            self,
            OpenError::Scheme(_) | OpenError::RedisUrl(_) | OpenError::MooncakeUrl(_)
        )
    }
}

enum Backend {
    Inproc(InprocStore),
    Remote(RemoteStore),
    Redis(RedisStore),
    RedisCluster(RedisClusterStore),
    Mooncake(MooncakeStore),
}

/// A store opened from its URL. See the module docs.
pub struct AnyStore {
    url: String,
    backend: Backend,
}

impl std::fmt::Debug for AnyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnyStore").field("url", &self.url).finish()
    }
}

/// The named in-process stores of this process.
fn named_inproc(name: &str) -> Result<InprocStore, AllocError> {
    static NAMED: OnceLock<Mutex<HashMap<String, InprocStore>>> = OnceLock::new();
    let mut named = lock(NAMED.get_or_init(Mutex::default));
    if let Some(store) = named.get(name) {
        return Ok(store.clone());
    }
    let store = InprocStore::new(InprocConfig::default())?;
    named.insert(name.to_owned(), store.clone());
    Ok(store)
}

impl AnyStore {
    /// Opens the store `url` names ([`STORE_URLS`]); the in-process store
    /// gets `inproc`'s defaults.
    pub fn open(url: &str) -> Result<AnyStore, OpenError> {
        AnyStore::open_with(url, InprocConfig::default())
    }

    /// [`AnyStore::open`], a plain `inproc` store made with `inproc`.
    pub fn open_with(url: &str, inproc: InprocConfig) -> Result<AnyStore, OpenError> {
        let backend = if url == "inproc" {
            Backend::Inproc(InprocStore::new(inproc)?)
        } else if let Some(name) = url.strip_prefix("inproc://") {
            Backend::Inproc(named_inproc(name)?)
        } else if url.starts_with("kvferry://") {
            let mut cfg = RemoteConfig::from_url(url);
            // The cluster key, as every kvferry process finds it: with one,
            // the server must prove it and so must this engine.
            cfg.tcp.key = kvferry_auth::ClusterKey::from_env()?;
            let remote = RemoteStore::connect(cfg);
            Backend::Remote(remote.map_err(OpenError::Remote)?)
        } else if url.starts_with("redis://") {
            let cfg = RedisConfig::from_url(url).map_err(OpenError::RedisUrl)?;
            Backend::Redis(RedisStore::new(cfg))
        } else if url.starts_with("redis+cluster://") {
            let cfg = ClusterConfig::from_url(url).map_err(OpenError::RedisUrl)?;
            Backend::RedisCluster(RedisClusterStore::new(cfg))
        } else if url.starts_with("mooncake://") {
            let cfg = MooncakeStoreConfig::from_url(url).map_err(OpenError::MooncakeUrl)?;
            Backend::Mooncake(MooncakeStore::connect(&cfg).map_err(OpenError::Mooncake)?)
        } else {
            return Err(OpenError::Scheme(url.to_owned()));
        };
        Ok(AnyStore {
            url: url.to_owned(),
            backend,
        })
    }

    /// Another handle on the same store (a rank-0 lookup server's): the
    /// same in-process store, or a new client of the same URL.
    pub fn second_handle(&self) -> Result<AnyStore, OpenError> {
        match &self.backend {
            Backend::Inproc(s) => Ok(AnyStore {
                url: self.url.clone(),
                backend: Backend::Inproc(s.clone()),
            }),
            _ => AnyStore::open(&self.url),
        }
    }

    /// The URL it was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Round trips to the store so far (0 for the in-process store).
    pub fn round_trips(&self) -> u64 {
        match &self.backend {
            Backend::Inproc(_) => 0,
            Backend::Remote(s) => s.round_trips(),
            Backend::Redis(s) => s.round_trips(),
            Backend::RedisCluster(s) => s.round_trips(),
            Backend::Mooncake(s) => s.round_trips(),
        }
    }

    fn inner(&mut self) -> &mut dyn StoreBackend {
        match &mut self.backend {
            Backend::Inproc(s) => s,
            Backend::Remote(s) => s,
            Backend::Redis(s) => s,
            Backend::RedisCluster(s) => s,
            Backend::Mooncake(s) => s,
        }
    }
}

impl StoreBackend for AnyStore {
    fn name(&self) -> &'static str {
        match &self.backend {
            Backend::Inproc(s) => s.name(),
            Backend::Remote(s) => s.name(),
            Backend::Redis(s) => s.name(),
            Backend::RedisCluster(s) => s.name(),
            Backend::Mooncake(s) => s.name(),
        }
    }

    fn register(&mut self, layout: &RankLayout) -> Result<(), CallError> {
        self.inner().register(layout)
    }

    fn exists(&mut self, keys: &[ChunkKey], deadline: Instant) -> Result<Vec<bool>, CallError> {
        self.inner().exists(keys, deadline)
    }

    fn put(&mut self, items: &[PutItem], deadline: Instant) -> Answers<PutOutcome> {
        self.inner().put(items, deadline)
    }

    fn get(&mut self, items: &[GetItem], deadline: Instant) -> Answers<()> {
        self.inner().get(items, deadline)
    }

    fn remove(&mut self, keys: &[ChunkKey], deadline: Instant) -> Answers<()> {
        self.inner().remove(keys, deadline)
    }

    fn remove_prefix(&mut self, prefix: &str, deadline: Instant) -> Result<u64, CallError> {
        self.inner().remove_prefix(prefix, deadline)
    }

    fn take_removed(&mut self, max: usize) -> Vec<ChunkKey> {
        self.inner().take_removed(max)
    }
}
