//! The settings of a TCP endpoint ([`TcpConfig`], with its device staging,
//! [`StagingConfig`]), their defaults and their check. A leaf: the endpoint
//! (`mod.rs`), the connections it serves (`target`), its sessions and the
//! handshake (`auth`) all read them, and they name none of those.

use std::sync::Arc;
use std::time::Duration;

use crate::device::Device;
use crate::registry;
use crate::shm::ShmConfig;
use crate::wire;
use crate::{MisuseError, PollPolicy};

/// Settings of a TCP endpoint (both its target and its initiator side).
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Connections per session; large batches are spread over them.
    pub streams: usize,
    /// Most payload bytes per frame (at most [`wire::MAX_FRAME_BYTES`]);
    /// longer descriptors are split.
    pub frame_max_bytes: u64,
    /// Most descriptors per frame (at most [`wire::MAX_FRAME_DESCS`]).
    pub frame_max_descs: u32,
    /// Most unacknowledged payload bytes per session, shared evenly by the
    /// streams a batch uses; must be at least `streams * frame_max_bytes`.
    pub inflight_max_bytes: u64,
    /// Most descriptors in one batch.
    pub max_batch_descs: usize,
    /// How both sides wait for sockets.
    pub poll: PollPolicy,
    /// Bound on one batch, from submission to completion (and on one
    /// notification).
    pub batch_timeout: Duration,
    /// Bound on establishing one connection.
    pub connect_timeout: Duration,
    /// Most connections the target side serves at once.
    pub max_connections: usize,
    /// Most registered regions.
    pub max_regions: usize,
    /// Shared memory with peers on this host.
    pub shm: ShmConfig,
    /// The device behind the regions registered with
    /// [`TcpTransport::register_device`](super::TcpTransport::register_device); `None` for host memory only.
    pub device: Option<Arc<dyn Device>>,
    /// The cluster key: with one, every connection, both ways, is
    /// authenticated and its headers sealed (see `wire.rs`'s
    /// "Authenticated connections"); peers without it are refused.
    pub key: Option<kvferry_auth::ClusterKey>,
    /// Where refused peers are counted (`surface="data_plane"`).
    pub rejects: Arc<kvferry_auth::Rejects>,
    /// With a key, also tag every data frame's payload (its bulk bytes,
    /// which a header's tag covers only through where they go and how
    /// many), so bytes changed in flight are detected: the frame fails and
    /// the connection closes (the bytes landed; the request fails). On for
    /// a connection when either side asks. Off by default: each byte is
    /// read once more on both sides (docs/performance.md,
    /// "Authentication"). Not with device memory at the target.
    pub payload_mac: bool,
    /// How device bytes pass through pinned host buffers on their way to
    /// and from sockets.
    pub staging: StagingConfig,
}

/// The staging of device bytes over sockets: a pipeline through a bounded
/// pool of pinned host buffers, device-to-host copies overlapped with
/// sends and host-to-device copies with receives.
#[derive(Clone, Debug)]
pub struct StagingConfig {
    /// Pinned buffers per endpoint, allocated on first use: the bound on
    /// staged bytes in flight (`buffers * buffer_bytes`, 64 MiB by
    /// default). At least 2, so that a copy and a send overlap.
    pub buffers: usize,
    /// Bytes per buffer: the most one staged copy moves.
    pub buffer_bytes: usize,
    /// Longest a fence close, or a cancelled batch's staging buffer, waits
    /// for a device copy in flight.
    pub drain_max: Duration,
}

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig {
            buffers: 16,
            buffer_bytes: 4 << 20,
            drain_max: Duration::from_secs(1),
        }
    }
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            streams: 2,
            frame_max_bytes: 512 << 10,
            frame_max_descs: 1024,
            inflight_max_bytes: 64 << 20,
            max_batch_descs: 1 << 20,
            poll: PollPolicy::default(),
            batch_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            max_connections: 1024,
            max_regions: registry::DEFAULT_MAX_REGIONS,
            shm: ShmConfig::default(),
            device: None,
            key: None,
            rejects: Arc::default(),
            payload_mac: false,
            staging: StagingConfig::default(),
        }
    }
}

impl TcpConfig {
    /// Checks the ranges documented on the fields.
    pub fn validate(&self) -> Result<(), MisuseError> {
        let bad = |s: String| Err(MisuseError::BadConfig(s));
        if !(1..=64).contains(&self.streams) {
            return bad(format!("streams must be 1..=64, not {}", self.streams));
        }
        if !(1..=wire::MAX_FRAME_BYTES).contains(&self.frame_max_bytes) {
            return bad(format!(
                "frame_max_bytes must be 1..={}",
                wire::MAX_FRAME_BYTES
            ));
        }
        if !(1..=wire::MAX_FRAME_DESCS).contains(&self.frame_max_descs) {
            return bad(format!(
                "frame_max_descs must be 1..={}",
                wire::MAX_FRAME_DESCS
            ));
        }
        if self.inflight_max_bytes < self.frame_max_bytes.saturating_mul(self.streams as u64) {
            return bad("inflight_max_bytes must be at least streams * frame_max_bytes".into());
        }
        if self.batch_timeout.is_zero() || self.connect_timeout.is_zero() {
            return bad("timeouts must be positive".into());
        }
        if self.max_regions as u64 > u64::from(wire::MAX_REGIONS) {
            return bad(format!("max_regions must be at most {}", wire::MAX_REGIONS));
        }
        if self.shm.lanes == 0 || self.shm.lanes > 4096 || self.shm.handshake_timeout.is_zero() {
            return bad("shm lanes must be 1..=4096 and its timeout positive".into());
        }
        if self.staging.buffers < 2 || self.staging.buffer_bytes < 4096 {
            return bad("staging needs 2 or more buffers of 4096 bytes or more".into());
        }
        if self.max_batch_descs == 0 || self.max_connections == 0 || self.max_regions == 0 {
            return bad("limits must be positive".into());
        }
        Ok(())
    }
}
