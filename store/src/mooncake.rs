//! The `mooncake://MASTER_HOST:PORT` backend: Mooncake Store through its C
//! API (`store_c.h`, loaded at run time by `mooncake-sys` from
//! `MOONCAKE_STORE_LIB` or the search path; docs/design.md, "Backends").
//!
//! * Setup: `mooncake_store_setup` with `P2PHANDSHAKE` metadata (no
//!   metadata service), the master's address, the transfer protocol
//!   (`?protocol=rdma`, default `tcp`), and the segment this client lends
//!   the store (`?segment_mb=N`).
//! * Values are the block's bytes. Mooncake's batch calls take one
//!   contiguous buffer per key, and a key's value is scattered over the
//!   engine's regions (one piece per layer), so every value goes through a
//!   staging buffer registered with the client (`staging_bytes`, bounded):
//!   gathered from the blocks before a put, scattered into them after a
//!   get whose length is the one asked for. The store's bytes never land
//!   in a block unchecked, and only kvferry's own copy touches engine
//!   memory, before the call's deadline.
//! * Per-key codes: `OBJECT_ALREADY_EXISTS` is [`PutOutcome::Exists`],
//!   `NO_AVAILABLE_HANDLE` [`ItemError::Full`] (the pressure path),
//!   `OBJECT_NOT_FOUND` [`ItemError::NotFound`], `CHECKSUM_MISMATCH`
//!   [`ItemError::Corrupt`], any other failure [`ItemError::Transport`]; a
//!   value longer than the staging buffer is [`ItemError::TooLarge`].
//! * The C calls block and take no deadline: a batch is cut into staging
//!   rounds, and the keys of rounds that would start past the deadline
//!   answer [`ItemError::Timeout`]. Mooncake evicts on its own; evicted
//!   keys are misses at the next lookup (no `BlockRemoved` events).

use std::ffi::c_int;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvferry_machines::store::ChunkKey;
use mooncake_sys::ffi::{store_code, ReplicateConfig};
use mooncake_sys::store::{Store, StoreConfig};
use mooncake_sys::StoreLib;

use super::backend::{Answers, CallError, GetItem, ItemError, PutItem, PutOutcome, StoreBackend};

/// How a [`MooncakeStore`] is set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MooncakeStoreConfig {
    /// `host:port` of `mooncake_master`.
    pub master: String,
    /// This client's address (its transfer engine's host).
    pub local_host: String,
    /// The transfer protocol (`tcp`, `rdma`).
    pub protocol: String,
    /// RDMA device names (empty for tcp).
    pub device: String,
    /// Bytes this client lends the store's global segment.
    pub segment_bytes: u64,
    /// Bytes of the staging buffer; a value larger is `TooLarge`.
    pub staging_bytes: usize,
    /// Replicas per value.
    pub replicas: usize,
    /// The library's path; `None`: `MOONCAKE_STORE_LIB`, then the search path.
    pub library: Option<PathBuf>,
}

/// Why a `mooncake://` URL or setup failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MooncakeStoreError {
    /// Not `mooncake://HOST:PORT[?protocol=P&segment_mb=N&device=D]`.
    #[error("bad mooncake store URL {0:?}")]
    BadUrl(String),
    /// The library failed to load or set up.
    #[error(transparent)]
    Library(#[from] mooncake_sys::Error),
}

impl MooncakeStoreConfig {
    /// The settings of `url`, the rest at their defaults.
    pub fn from_url(url: &str) -> Result<MooncakeStoreConfig, MooncakeStoreError> {
        let bad = || MooncakeStoreError::BadUrl(url.to_string());
        let rest = url.strip_prefix("mooncake://").ok_or_else(bad)?;
        let (master, query) = rest.split_once('?').unwrap_or((rest, ""));
        if master
            .rsplit_once(':')
            .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
        {
            return Err(bad());
        }
        let mut cfg = MooncakeStoreConfig {
            master: master.to_string(),
            ..MooncakeStoreConfig::default()
        };
        for kv in query.split('&').filter(|kv| !kv.is_empty()) {
            match kv.split_once('=').ok_or_else(bad)? {
                ("protocol", p) => cfg.protocol = p.to_string(),
                ("device", d) => cfg.device = d.to_string(),
                ("segment_mb", n) => cfg.segment_bytes = n.parse::<u64>().map_err(|_| bad())? << 20,
                _ => return Err(bad()),
            }
        }
        Ok(cfg)
    }
}

impl Default for MooncakeStoreConfig {
    fn default() -> Self {
        MooncakeStoreConfig {
            master: String::new(),
            local_host: "127.0.0.1".into(),
            protocol: "tcp".into(),
            device: String::new(),
            segment_bytes: 512 << 20,
            staging_bytes: 64 << 20,
            replicas: 1,
            library: None,
        }
    }
}

/// A Mooncake Store client as a [`StoreBackend`].
pub struct MooncakeStore {
    store: Store,
    /// Gathered values on their way in and out; registered with the store.
    staging: Vec<u8>,
    replicas: usize,
    /// Batch calls into the library so far.
    calls: u64,
}

impl MooncakeStore {
    /// Loads the library, sets the client up against the master and
    /// registers the staging buffer.
    pub fn connect(cfg: &MooncakeStoreConfig) -> Result<MooncakeStore, MooncakeStoreError> {
        let lib = match &cfg.library {
            Some(p) => StoreLib::open(p)?,
            None => StoreLib::load()?,
        };
        let sc = StoreConfig {
            local_hostname: cfg.local_host.clone(),
            metadata_server: "P2PHANDSHAKE".into(),
            global_segment_size: cfg.segment_bytes,
            local_buffer_size: cfg.staging_bytes as u64,
            protocol: cfg.protocol.clone(),
            device_name: cfg.device.clone(),
            master_server_addr: cfg.master.clone(),
        };
        let mut store = Store::new(Arc::new(lib), &sc)?;
        let mut staging = vec![0u8; cfg.staging_bytes.max(1)];
        // SAFETY: `staging` is never reallocated and lives as long as the
        // store: both are fields of the backend, and the store (which
        // unregisters it when it drops) is dropped first.
        unsafe { store.register_buffer(staging.as_mut_ptr(), staging.len())? };
        Ok(MooncakeStore {
            store,
            staging,
            replicas: cfg.replicas.max(1),
            calls: 0,
        })
    }

    /// Cuts `lens` into rounds that each fit the staging buffer: the index
    /// ranges of the items per round. An item larger than the buffer is a
    /// round of its own (answered `TooLarge`).
    fn rounds(&self, lens: impl Iterator<Item = u64>) -> Vec<std::ops::Range<usize>> {
        let cap = self.staging.len() as u64;
        let mut out = Vec::new();
        let (mut start, mut used, mut end) = (0usize, 0u64, 0usize);
        for (i, len) in lens.enumerate() {
            end = i + 1;
            if i > start && used.saturating_add(len) > cap {
                out.push(start..i);
                (start, used) = (i, 0);
            }
            used = used.saturating_add(len);
        }
        if end > start {
            out.push(start..end);
        }
        out
    }
}

impl MooncakeStore {
    /// Why a staging round is answered without a call: the deadline
    /// passed, or its first value (a round of its own when it is larger
    /// than the staging buffer, see `rounds`) does not fit.
    fn refused(&self, first_len: u64, deadline: Instant) -> Option<ItemError> {
        if Instant::now() >= deadline {
            Some(ItemError::Timeout)
        } else if first_len > self.staging.len() as u64 {
            Some(ItemError::TooLarge)
        } else {
            None
        }
    }

    /// The C requests of a round: each key with its staging slice.
    fn requests<'k>(
        &mut self,
        keys: impl Iterator<Item = &'k ChunkKey>,
        slices: &[(usize, usize)],
    ) -> Vec<(&'k str, *mut u8, usize)> {
        let base = self.staging.as_mut_ptr();
        (keys.zip(slices))
            // SAFETY: `layout` placed every slice inside the staging buffer.
            .map(|(k, &(at, n))| (k.as_str(), unsafe { base.add(at) }, n))
            .collect()
    }
}

/// The staging slices of a round: `(offset, len)` per item.
fn layout(lens: impl Iterator<Item = u64>) -> Vec<(usize, usize)> {
    let mut at = 0usize;
    lens.map(|l| {
        let s = (at, l as usize);
        at += l as usize;
        s
    })
    .collect()
}

fn put_answer(code: c_int) -> Result<PutOutcome, ItemError> {
    match i64::from(code) {
        0 => Ok(PutOutcome::Stored),
        store_code::OBJECT_ALREADY_EXISTS => Ok(PutOutcome::Exists),
        store_code::NO_AVAILABLE_HANDLE => Err(ItemError::Full),
        _ => Err(ItemError::Transport),
    }
}

fn get_answer(got: i64, want: u64) -> Result<(), ItemError> {
    match got {
        n if n >= 0 && n as u64 == want => Ok(()),
        n if n >= 0 => Err(ItemError::WrongSize {
            got_bytes: n as u64,
            want_bytes: want,
        }),
        store_code::OBJECT_NOT_FOUND => Err(ItemError::NotFound),
        store_code::CHECKSUM_MISMATCH => Err(ItemError::Corrupt),
        _ => Err(ItemError::Transport),
    }
}

impl StoreBackend for MooncakeStore {
    fn name(&self) -> &'static str {
        "mooncake"
    }

    fn exists(&mut self, keys: &[ChunkKey], deadline: Instant) -> Result<Vec<bool>, CallError> {
        if Instant::now() >= deadline {
            return Err(CallError::Timeout);
        }
        let ks: Vec<&str> = keys.iter().map(ChunkKey::as_str).collect();
        self.calls += 1;
        let answers = self
            .store
            .batch_exists(&ks)
            .map_err(|_| CallError::Transport)?;
        Ok(answers.into_iter().map(|a| a == 1).collect())
    }

    fn put(&mut self, items: &[PutItem], deadline: Instant) -> Answers<PutOutcome> {
        let mut out = Vec::with_capacity(items.len());
        for round in self.rounds(items.iter().map(|i| i.from.len())) {
            let its = &items[round];
            if let Some(e) = self.refused(its[0].from.len(), deadline) {
                out.extend(its.iter().map(|_| Err(e)));
                continue;
            }
            let slices = layout(its.iter().map(|i| i.from.len()));
            for (it, &(at, n)) in its.iter().zip(&slices) {
                it.from.read_into(&mut self.staging[at..at + n]);
            }
            let batch = self.requests(its.iter().map(|i| &i.key), &slices);
            let rc = self.replicate();
            // SAFETY: the buffers lie in registered memory and stay valid
            // during the call.
            self.calls += 1;
            let codes = unsafe { self.store.batch_put_from(&batch, &rc) };
            match codes {
                Ok(c) => out.extend(c.into_iter().map(put_answer)),
                Err(_) => out.extend(its.iter().map(|_| Err(ItemError::Transport))),
            }
        }
        Ok(out)
    }

    fn get(&mut self, items: &[GetItem], deadline: Instant) -> Answers<()> {
        let mut out = Vec::with_capacity(items.len());
        for round in self.rounds(items.iter().map(|i| i.into.len())) {
            let its = &items[round];
            if let Some(e) = self.refused(its[0].into.len(), deadline) {
                out.extend(its.iter().map(|_| Err(e)));
                continue;
            }
            let slices = layout(its.iter().map(|i| i.into.len()));
            let batch = self.requests(its.iter().map(|i| &i.key), &slices);
            // SAFETY: as in `put`; the library writes at most each slice.
            self.calls += 1;
            let got = match unsafe { self.store.batch_get_into(&batch) } {
                Ok(g) => g,
                Err(_) => {
                    out.extend(its.iter().map(|_| Err(ItemError::Transport)));
                    continue;
                }
            };
            let late = Instant::now() >= deadline;
            for ((it, &(at, n)), g) in its.iter().zip(&slices).zip(got) {
                let answer = get_answer(g, it.into.len());
                if answer.is_ok() && late {
                    // Past the deadline the blocks may be someone else's.
                    out.push(Err(ItemError::Timeout));
                    continue;
                }
                if answer.is_ok() {
                    it.into.write_from(&self.staging[at..at + n]);
                }
                out.push(answer);
            }
        }
        Ok(out)
    }

    fn remove(&mut self, keys: &[ChunkKey], deadline: Instant) -> Answers<()> {
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            if Instant::now() >= deadline {
                out.push(Err(ItemError::Timeout));
                continue;
            }
            out.push(match self.store.remove(k.as_str()) {
                Ok(()) => Ok(()),
                Err(mooncake_sys::Error::Call { code, .. })
                    if code == store_code::OBJECT_NOT_FOUND =>
                {
                    Err(ItemError::NotFound)
                }
                Err(_) => Err(ItemError::Transport),
            });
        }
        Ok(out)
    }
}

impl MooncakeStore {
    /// Batch calls made into the library (each one request to the store
    /// for existence; puts and gets also move the values).
    pub fn round_trips(&self) -> u64 {
        self.calls
    }

    /// Where the store keeps each value: `replicas` copies, no pins.
    fn replicate(&self) -> ReplicateConfig {
        ReplicateConfig {
            replica_num: self.replicas,
            with_soft_pin: 0,
            with_hard_pin: 0,
            preferred_segments: std::ptr::null(),
            preferred_segments_count: 0,
        }
    }
}
