//! Pages of an engine's host KV pool in a store, for SGLang's HiCache
//! ([`PageStore`], under `kvferry.sglang_hicache`): one store value per
//! page, keyed by the engine's own page hashes, over any store URL.
//!
//! SGLang computes the keys and calls page batches from its prefetch and
//! backup threads, so this sits below the vLLM-shaped `StoreConnector`:
//! each call is synchronous, bounded by a deadline, and runs with the GIL
//! released. A page's value is the page's bytes in every region, region by
//! region; every page is checked against the registered pool
//! ([`RegisteredMemory::scatter`]) before a byte moves.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvferry::machines::store::ChunkKey;
use kvferry::machines::{RankLayout, Region, Stage};
use kvferry::reactor::lock;
use kvferry::BlockId;
use kvferry_store::{
    AnyStore, CallError, GetItem, PutItem, RegisteredMemory, Scatter, StoreBackend,
};
use pyo3::prelude::*;

use crate::args::same_process;
use crate::errors::{misuse, timeout_err, TransportError};

/// A store of pages (see the module docs).
#[pyclass(module = "kvferry._native", frozen)]
pub(crate) struct PageStore {
    state: Mutex<State>,
    timeout: Duration,
    pid: u32,
}

struct State {
    store: AnyStore,
    /// The host pool, once registered.
    memory: Option<RegisteredMemory>,
}

#[pymethods]
impl PageStore {
    /// Opens the store at `url` (`kvferry.STORE_URLS`); each call waits at
    /// most `timeout_ms`.
    #[new]
    #[pyo3(signature = (url, timeout_ms=5000))]
    fn new(py: Python<'_>, url: String, timeout_ms: u64) -> PyResult<PageStore> {
        if timeout_ms == 0 {
            return Err(misuse("timeout_ms must be positive"));
        }
        let store = crate::store::open_store(py, &url)?;
        Ok(PageStore {
            state: Mutex::new(State {
                store,
                memory: None,
            }),
            timeout: Duration::from_millis(timeout_ms),
            pid: std::process::id(),
        })
    }

    /// Registers the pool: `pages` pages in each region, given as (address
    /// of page 0, bytes per page); a page's value is its bytes in every
    /// region, in this order. Once, before any put or get.
    fn register(&self, py: Python<'_>, regions: Vec<(u64, u64)>, pages: u64) -> PyResult<()> {
        same_process(self.pid)?;
        let layout = RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks: pages,
            regions: (regions.iter())
                .map(|&(base, len)| Region {
                    base,
                    block_len: len,
                    kv_block_len: len,
                })
                .collect(),
            stage: Stage::SINGLE,
            pools: Vec::new(),
        };
        let memory = RegisteredMemory::new(layout).map_err(|e| misuse(format!("pool: {e}")))?;
        let mut s = lock(&self.state);
        if s.memory.is_some() {
            return Err(misuse("the pool is registered already"));
        }
        let store = &mut s.store;
        py.detach(|| store.register(memory.layout()))
            .map_err(|e| call_error("register", e))?;
        s.memory = Some(memory);
        Ok(())
    }

    /// Per key, whether the store holds it: one round trip.
    fn exists(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<bool>> {
        same_process(self.pid)?;
        let keys = chunk_keys(keys)?;
        let deadline = Instant::now() + self.timeout;
        let mut s = lock(&self.state);
        let store = &mut s.store;
        py.detach(|| store.exists(&keys, deadline))
            .map_err(|e| call_error("exists", e))
    }

    /// Stores page `pages[i]` under `keys[i]`; per key, whether the store
    /// holds it afterwards (stored now, or already).
    fn put(&self, py: Python<'_>, keys: Vec<String>, pages: Vec<u64>) -> PyResult<Vec<bool>> {
        let item = |key, from| PutItem { key, from };
        self.batch(py, "put", keys, &pages, item, |store, items, deadline| {
            store
                .put(items, deadline)
                .map(|a| a.iter().map(Result::is_ok).collect())
        })
    }

    /// Writes the value of `keys[i]` into page `pages[i]`; per key,
    /// whether it did (a missing key, or a value of another size, writes
    /// nothing).
    fn get(&self, py: Python<'_>, keys: Vec<String>, pages: Vec<u64>) -> PyResult<Vec<bool>> {
        let item = |key, into| GetItem { key, into };
        self.batch(py, "get", keys, &pages, item, |store, items, deadline| {
            store
                .get(items, deadline)
                .map(|a| a.iter().map(Result::is_ok).collect())
        })
    }

    /// Removes every key that starts with `prefix`; how many.
    fn remove_prefix(&self, py: Python<'_>, prefix: String) -> PyResult<u64> {
        same_process(self.pid)?;
        let deadline = Instant::now() + self.timeout;
        let mut s = lock(&self.state);
        let store = &mut s.store;
        py.detach(|| store.remove_prefix(&prefix, deadline))
            .map_err(|e| call_error("remove_prefix", e))
    }

    /// The store's URL scheme name (`inproc`, `kvferry`, `redis`, ...).
    #[getter]
    fn backend(&self) -> &'static str {
        lock(&self.state).store.name()
    }
}

impl PageStore {
    /// One put or get of pages: `keys[i]` with page `pages[i]`'s scatter
    /// list as an `item`, handed to `call` with the GIL released; per key,
    /// whether it moved.
    fn batch<I: Sync>(
        &self,
        py: Python<'_>,
        what: &str,
        keys: Vec<String>,
        pages: &[u64],
        item: impl Fn(ChunkKey, Scatter) -> I,
        call: impl FnOnce(&mut AnyStore, &[I], Instant) -> Result<Vec<bool>, CallError> + Send,
    ) -> PyResult<Vec<bool>> {
        same_process(self.pid)?;
        let mut s = lock(&self.state);
        let scatters = scatters(&s.memory, pages, keys.len())?;
        let items: Vec<I> = (chunk_keys(keys)?.into_iter().zip(scatters))
            .map(|(key, scatter)| item(key, scatter))
            .collect();
        let deadline = Instant::now() + self.timeout;
        let store = &mut s.store;
        py.detach(|| call(store, &items, deadline))
            .map_err(|e| call_error(what, e))
    }
}

fn chunk_keys(keys: Vec<String>) -> PyResult<Vec<ChunkKey>> {
    keys.into_iter()
        .map(|k| ChunkKey::from_stored(k).map_err(|e| misuse(format!("key: {e}"))))
        .collect()
}

/// Each page's scatter list, checked against the pool; as many pages as
/// keys.
fn scatters(
    memory: &Option<RegisteredMemory>,
    pages: &[u64],
    keys: usize,
) -> PyResult<Vec<Scatter>> {
    let memory = memory
        .as_ref()
        .ok_or_else(|| misuse("register the pool before a put or get"))?;
    if pages.len() != keys {
        return Err(misuse(format!("{keys} keys for {} pages", pages.len())));
    }
    pages
        .iter()
        .map(|&p| {
            let block = u32::try_from(p).map_err(|_| misuse(format!("page {p}")))?;
            (memory.scatter(BlockId(block))).map_err(|e| misuse(format!("page {p}: {e}")))
        })
        .collect()
}

/// A call that got no answer: the store's fault, a typed error the Python
/// side turns into misses.
fn call_error(what: &str, e: CallError) -> PyErr {
    match e {
        CallError::Timeout => timeout_err(format!("store {what}: {e}")),
        _ => TransportError::new_err(format!("store {what}: {e}")),
    }
}
