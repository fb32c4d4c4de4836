//! What a server counts ([`ServerCounters`]) and the OpenMetrics text of
//! it ([`metrics_text`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvferry_auth::Rejects;
use kvferry_store::internal::space::SpaceStats;

kvferry_metrics::counter_set! {
    /// What a server counts, shared with the metrics endpoint.
    #[derive(Debug, Default)]
    pub struct ServerCounters;
    /// A snapshot of [`ServerCounters`].
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
    pub struct ServerStats;
    /// Gets of a stored value.
    hits: Counter "kvferry_store_hits", "gets of a stored value";
    /// Gets of a key not stored.
    misses: Counter "kvferry_store_misses", "gets of a key not stored";
    /// Values evicted to make room.
    evictions: Counter "kvferry_store_evictions", "values evicted to make room";
    /// Values removed on request.
    removals: Counter "kvferry_store_removals", "values removed on request";
    /// Puts committed.
    commits: Counter "kvferry_store_commits", "puts committed";
    /// Puts refused for want of room.
    full: Counter "kvferry_store_full", "puts refused for want of room";
    /// Bytes of stored values.
    stored_bytes: Gauge "kvferry_store_stored_bytes", "bytes of stored values";
    /// Bytes stored or being written.
    used_bytes: Gauge "kvferry_store_used_bytes", "bytes stored or being written";
    /// Values stored.
    values: Gauge "kvferry_store_values", "values stored";
    /// The arena's size.
    capacity_bytes: Gauge "kvferry_store_capacity_bytes", "bytes of the arena";
    /// Bytes read from engines (puts).
    bytes_in: Counter "kvferry_store_read_bytes", "bytes read from engines";
    /// Bytes written to engines (gets).
    bytes_out: Counter "kvferry_store_written_bytes", "bytes written to engines";
    /// Requests answered.
    requests: Counter "kvferry_store_requests", "requests answered";
    /// Requests refused as a whole (malformed, no hello, unreachable).
    refused: Counter "kvferry_store_refused", "requests refused as a whole";
    /// Engine connections open now.
    connections: Gauge "kvferry_store_connections", "engine connections open";
    /// Batches whose bytes did not move (engine gone, fenced, timeout).
    transfer_failures: Counter "kvferry_store_transfer_failures", "batches whose bytes did not move";
    /// Batches to engines on this host moved through their shared memory.
    shm_batches: Counter "kvferry_store_shm_batches", "batches moved through an engine's shared memory";
}

impl ServerCounters {
    pub(crate) fn publish(&self, s: &SpaceStats) {
        let p = |a: &AtomicU64, v: u64| a.store(v, Ordering::Relaxed);
        p(&self.hits, s.hits);
        p(&self.misses, s.misses);
        p(&self.evictions, s.evictions);
        p(&self.removals, s.removals);
        p(&self.commits, s.commits);
        p(&self.full, s.full);
        p(&self.stored_bytes, s.stored_bytes);
        p(&self.used_bytes, s.used_bytes);
        p(&self.values, s.values);
    }

    pub(crate) fn add(a: &AtomicU64, n: u64) {
        a.fetch_add(n, Ordering::Relaxed);
    }
}

/// The OpenMetrics text of a server's stats and refusals.
pub fn metrics_text(s: &ServerStats, rejects: &Arc<Rejects>) -> String {
    let families = s.families();
    let rejects = Arc::clone(rejects);
    kvferry_metrics::render(move |encoder| {
        kvferry_metrics::encode_families(encoder, &families)?;
        kvferry_metrics::encode_auth_rejects(encoder, &rejects)
    })
}
