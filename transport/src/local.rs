//! The `local` transport: both endpoints in one process, bytes moved with
//! `memcpy` between registered regions.
//!
//! Endpoints find each other through a process-wide directory keyed by
//! endpoint id (one entry per live endpoint, removed on drop). Registries are
//! thread-safe, so a session may connect endpoints on different executors.

use kvferry_reactor::lock;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::registry::{self, Registry};
use super::{
    Desc, EndpointAddr, MisuseError, Op, RegionId, RegionInfo, Session, Transport, TransportError,
};

/// Live local endpoints by id. Bounded by the number of endpoints alive.
static DIRECTORY: Mutex<BTreeMap<u64, Weak<Registry>>> = Mutex::new(BTreeMap::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Copies between yields, so a huge batch does not starve the executor.
const YIELD_EVERY_BYTES: u64 = 64 << 20;

/// An in-process endpoint.
pub struct LocalTransport {
    id: u64,
    registry: Arc<Registry>,
}

impl Default for LocalTransport {
    fn default() -> Self {
        Self::new(registry::DEFAULT_MAX_REGIONS)
    }
}

impl LocalTransport {
    /// A new endpoint holding at most `max_regions` registrations.
    pub fn new(max_regions: usize) -> LocalTransport {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let registry = Registry::new(max_regions);
        lock(&DIRECTORY).insert(id, Arc::downgrade(&registry));
        LocalTransport { id, registry }
    }

    /// Opens a session to another local endpoint.
    pub fn open_local(&self, peer_id: u64) -> Result<LocalSession, TransportError> {
        let peer = lock(&DIRECTORY)
            .get(&peer_id)
            .and_then(Weak::upgrade)
            .ok_or_else(|| {
                MisuseError::UnreachableEndpoint(EndpointAddr::Local(peer_id).to_string())
            })?;
        Ok(LocalSession {
            local: Arc::clone(&self.registry),
            peer: Some(peer),
        })
    }
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        lock(&DIRECTORY).remove(&self.id);
    }
}

/// A session between two local endpoints.
pub struct LocalSession {
    local: Arc<Registry>,
    /// `None` once closed.
    peer: Option<Arc<Registry>>,
}

impl Session for LocalSession {
    async fn transfer(&self, op: Op, descs: &[Desc]) -> Result<(), TransportError> {
        let Some(peer) = &self.peer else {
            return Err(MisuseError::SessionClosed.into());
        };
        // Both sides are validated and pinned before the first byte moves.
        let _local = self
            .local
            .pin(descs.iter().map(|d| (d.local_addr, d.len_bytes)))
            .map_err(|(index, fault)| MisuseError::LocalDescriptor { index, fault })?;
        let _remote = peer
            .pin(descs.iter().map(|d| (d.remote_addr, d.len_bytes)))
            .map_err(|(index, fault)| MisuseError::RemoteDescriptor { index, fault })?;
        let mut since_yield = 0u64;
        for d in descs {
            let (src, dst) = match op {
                Op::Write => (d.local_addr, d.remote_addr),
                Op::Read => (d.remote_addr, d.local_addr),
            };
            // SAFETY: both ranges lie inside registered regions (checked and
            // pinned above), which the registrants promised are valid for
            // reads and writes. `copy` tolerates overlap (a session from an
            // endpoint to itself).
            unsafe {
                std::ptr::copy(
                    src as usize as *const u8,
                    dst as usize as *mut u8,
                    d.len_bytes as usize,
                );
            }
            since_yield += d.len_bytes;
            if since_yield >= YIELD_EVERY_BYTES {
                since_yield = 0;
                futures_lite::future::yield_now().await;
            }
        }
        Ok(())
    }

    async fn close(mut self) {
        self.peer = None;
    }
}

impl Transport for LocalTransport {
    type Session = LocalSession;

    unsafe fn register(&self, addr: *mut u8, len_bytes: usize) -> Result<RegionId, TransportError> {
        Ok(self.registry.insert(addr as u64, len_bytes as u64)?)
    }

    fn unregister(&self, id: RegionId) -> Result<(), TransportError> {
        Ok(self.registry.remove(id)?)
    }

    fn regions(&self) -> Vec<RegionInfo> {
        self.registry.regions()
    }

    fn endpoint_addr(&self) -> EndpointAddr {
        EndpointAddr::Local(self.id)
    }

    async fn open(&self, peer: &EndpointAddr) -> Result<LocalSession, TransportError> {
        match peer {
            EndpointAddr::Local(id) => self.open_local(*id),
            EndpointAddr::Tcp(_) | EndpointAddr::Mooncake(_) => {
                Err(MisuseError::UnreachableEndpoint(peer.to_string()).into())
            }
        }
    }
}
