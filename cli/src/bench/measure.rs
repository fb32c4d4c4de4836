//! What a transport bench measures and how: its parameters, the buffers
//! and their pattern, pinning, the timed loop of batches, memcpy of the
//! same buffers; what every bench of `kvferry bench` shares.

use std::time::{Duration, Instant};

use glommio::Placement;
use kvferry::transport::{Cadence, Desc, Op, PollPolicy, Session};

/// What to measure.
#[derive(Clone, Debug)]
pub(crate) struct Params {
    pub(crate) transport: String,
    pub(crate) block_bytes: u64,
    pub(crate) batch: u64,
    pub(crate) streams: usize,
    pub(crate) seconds: f64,
    pub(crate) poll: PollPolicy,
    pub(crate) poll_name: String,
    pub(crate) op: Op,
    pub(crate) json: bool,
    pub(crate) pin: bool,
    /// Keep every batch's latency in [`Measured::samples`].
    pub(crate) keep_samples: bool,
    /// Every descriptor moves block 0.
    pub(crate) reuse_block: bool,
    /// Mooncake's protocol, for `--transport mooncake`.
    pub(crate) mooncake_protocol: String,
    /// How `--transport mooncake` polls a batch.
    pub(crate) mooncake_cadence: Cadence,
}

/// What was measured.
#[derive(Debug, Default)]
pub(crate) struct Measured {
    /// Batches timed.
    pub(crate) batches: u64,
    /// From the first timed batch's submit to the last one's completion.
    pub(crate) elapsed: Duration,
    /// Per-batch latency.
    pub(crate) latencies: kvferry::Latency,
    /// Every batch's latency, in order, with [`Params::keep_samples`].
    pub(crate) samples: Vec<Duration>,
    /// Source and destination were equal after the run.
    pub(crate) verified: bool,
    /// Single-thread memcpy of the same buffers on the same (pinned) thread.
    pub(crate) memcpy_gbps: f64,
}

impl Measured {
    /// Payload throughput in GB/s (10^9 bytes per second).
    pub(crate) fn gbps(&self, p: &Params) -> f64 {
        let bytes = self.batches * p.batch * p.block_bytes;
        bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

/// Bytes of each of the source and destination buffers.
pub(crate) fn buffer_bytes(p: &Params) -> u64 {
    if p.reuse_block {
        p.block_bytes
    } else {
        p.block_bytes * p.batch
    }
}

/// Source and destination of `total` bytes: the side `op` reads from
/// holds a pattern, the other zeros.
pub(crate) fn buffers(op: Op, total: u64) -> (Vec<u8>, Vec<u8>) {
    let mut src = vec![0u8; total as usize];
    let mut dst = vec![0u8; total as usize];
    let from = match op {
        Op::Write => &mut src,
        Op::Read => &mut dst,
    };
    fill_pattern(from);
    (src, dst)
}

/// The bytes the side a bench reads from holds.
pub(crate) fn fill_pattern(bytes: &mut [u8]) {
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[7];
    }
}

pub(crate) fn placement(pin: bool, core: usize) -> Placement {
    if pins(pin) {
        Placement::Fixed(core)
    } else {
        Placement::Unbound
    }
}

/// Whether `pin` pins: the initiator to core 0 and the target to core 1,
/// which takes two cores.
pub(crate) fn pins(pin: bool) -> bool {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    pin && cores >= 2
}

pub(crate) fn descs(p: &Params, local: u64, remote: u64) -> Vec<Desc> {
    // With `reuse_block` every descriptor names block 0.
    let blocks = if p.reuse_block { 1 } else { p.batch };
    (0..p.batch)
        .map(|i| i % blocks)
        .map(|i| Desc {
            local_addr: local + i * p.block_bytes,
            remote_addr: remote + i * p.block_bytes,
            len_bytes: p.block_bytes,
        })
        .collect()
}

/// Submits batches back to back for the configured time.
pub(crate) async fn drive(
    p: &Params,
    session: &impl Session,
    batch: &[Desc],
) -> Result<Measured, String> {
    // Warm up: connections, page faults, caches.
    let warm_until = Instant::now() + Duration::from_millis(200);
    while Instant::now() < warm_until {
        session
            .transfer(p.op, batch)
            .await
            .map_err(|e| e.to_string())?;
    }
    let mut m = Measured::default();
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(p.seconds);
    loop {
        let t0 = Instant::now();
        session
            .transfer(p.op, batch)
            .await
            .map_err(|e| e.to_string())?;
        let t1 = Instant::now();
        m.batches += 1;
        m.latencies.record(t1 - t0);
        if p.keep_samples {
            m.samples.push(t1 - t0);
        }
        if t1 >= until {
            m.elapsed = t1 - start;
            return Ok(m);
        }
    }
}

/// Single-thread memcpy of `src` into `dst`, block by block, in GB/s:
/// `dst` is one `src`-sized window or several, filled in turn (a store's
/// memory receives a batch where older values are not; one window over
/// and over measures the cache where the batch fits it).
pub(crate) fn measure_memcpy(src: &[u8], dst: &mut [u8], block: usize, seconds: f64) -> f64 {
    let windows = (dst.len() / src.len().max(1)).max(1);
    let start = Instant::now();
    let mut bytes = 0u64;
    let mut rounds = 0;
    while rounds < 3 * windows || start.elapsed().as_secs_f64() < seconds {
        let window = &mut dst[(rounds % windows) * src.len()..][..src.len()];
        for (s, d) in src.chunks(block).zip(window.chunks_mut(block)) {
            d.copy_from_slice(s);
        }
        std::hint::black_box(&mut *window);
        bytes += src.len() as u64;
        rounds += 1;
    }
    bytes as f64 / start.elapsed().as_secs_f64() / 1e9
}
