//! Timeouts and bounds of one machine.

use std::time::Duration;

use super::InputError;

/// Timeouts (docs/design.md §2 table) and bounds of one machine.
///
/// Both sides of a transfer should run with the same `lease`; a granter
/// may grant less (P caps grants at its hold limit), never more than the
/// toucher accepts (the toucher clips a grant to its own `lease`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Peer info not received (P: D's `Pull`; D: the P ranks from the bootstrap service).
    pub bootstrap_timeout: Duration,
    /// D: no progress (data or status) since the request was sent or since the last progress.
    pub waiting_timeout: Duration,
    /// P: KV ready but D silent this long: give the blocks back. Renewed by any message of D.
    pub claim_timeout: Duration,
    /// Length of one lease grant. Renewed every `heartbeat_interval`, so it must exceed it.
    pub lease: Duration,
    /// P: hard cap on holding blocks for one transfer, counted from the machine's creation.
    pub hold_limit: Duration,
    /// The transport contract: a write or read posted at `t` touches no memory after
    /// `t + transfer_bound` (the driver reports it failed by then at the latest).
    pub transfer_bound: Duration,
    /// Extra margin of the fence for clock-rate drift between nodes.
    pub fence_margin: Duration,
    /// How often a toucher renews its lease (the per-transfer heartbeat).
    pub heartbeat_interval: Duration,
    /// Heartbeats a peer may miss before the driver declares it dead (used by the driver).
    pub heartbeat_misses: u32,
    /// Most peers one machine deals with (fan-out / fan-in).
    pub max_peers: usize,
    /// Most chunks in one transfer.
    pub max_chunks: usize,
    /// Most writes (P, push) or reads (D, pull) in flight per machine.
    pub max_in_flight: usize,
    /// Most KV-cache groups in a block list.
    pub max_groups: usize,
    /// Most blocks per group in one block list.
    pub max_blocks_per_group: usize,
    /// Most lease requests remembered per peer (older ones are forgotten).
    pub max_lease_requests: usize,
    /// How long a rank waits for the answer its peer owes it before it
    /// sends again what asked for it (D: the `Pull`; pull-mode P: the last
    /// `Ready`, which a D rank that is done answers with `Done`). The wait
    /// doubles after each resend, up to `heartbeat_interval`.
    pub resend_after: Duration,
    /// Most resends to one peer while it stays silent; hearing from it
    /// starts the count again. Zero turns resending off.
    pub max_resends: u32,
    /// UNSAFE, for the simulator's self-test only (`tests/sim.rs`): a
    /// granter that ends a transfer reuses its blocks at once, without
    /// waiting for the toucher to return its lease or for the lease plus the
    /// fence to run out. Always `false` outside that test.
    #[doc(hidden)]
    pub unsafe_disable_fence: bool,
    /// UNSAFE, for the simulator's self-test only (`tests/sim.rs`): a
    /// toucher that ends a transfer forgets the writes or reads it still has
    /// in flight. Always `false` outside that test.
    #[doc(hidden)]
    pub unsafe_ignore_in_flight: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            bootstrap_timeout: Duration::from_secs(300),
            waiting_timeout: Duration::from_secs(300),
            claim_timeout: Duration::from_secs(30),
            lease: Duration::from_secs(10),
            hold_limit: Duration::from_secs(480),
            transfer_bound: Duration::from_secs(10),
            fence_margin: Duration::from_secs(2),
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_misses: 2,
            max_peers: 64,
            max_chunks: 4096,
            max_in_flight: 256,
            max_groups: 16,
            max_blocks_per_group: 1 << 20,
            max_lease_requests: 4,
            resend_after: Duration::from_millis(200),
            max_resends: 8,
            unsafe_disable_fence: false,
            unsafe_ignore_in_flight: false,
        }
    }
}

impl Config {
    /// Checks the settings once, when the node starts (machines trust a
    /// config they are given). A lease no longer than the heartbeat interval
    /// would lapse between renewals and stall every transfer; a zero bound
    /// would refuse every request.
    pub fn validate(&self) -> Result<(), InputError> {
        if self.lease <= self.heartbeat_interval {
            return Err(InputError::Misuse(
                "lease must be longer than heartbeat_interval",
            ));
        }
        if self.max_peers == 0
            || self.max_chunks == 0
            || self.max_in_flight == 0
            || self.max_groups == 0
            || self.max_blocks_per_group == 0
            || self.max_lease_requests == 0
        {
            return Err(InputError::Misuse("every max_* bound must be at least 1"));
        }
        if self.max_resends > 0 && self.resend_after.is_zero() {
            return Err(InputError::Misuse(
                "resend_after must be positive when max_resends is not zero",
            ));
        }
        if self.max_chunks > u32::MAX as usize || self.max_blocks_per_group > u32::MAX as usize {
            return Err(InputError::Misuse("chunk and block bounds must fit in u32"));
        }
        Ok(())
    }

    /// How long a granter waits after a lease ran out before it reuses its
    /// blocks: every transfer started under the lease has ended by then.
    pub fn fence(&self) -> Duration {
        self.fence_margin + self.transfer_bound
    }
}
