//! `kvferry bench transport ...`: throughput and latency of a transport on
//! loopback, next to single-thread memcpy of the same buffers in the same run.
//!
//! For `tcp` the target and the initiator each run on their own glommio
//! executor, pinned to different cores when the machine has two. The
//! initiator submits one batch at a time (`--batch` descriptors of
//! `--block-bytes` each) for `--seconds`, and times each batch from submit to
//! completion.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use glommio::{LocalExecutorBuilder, Placement};

use clap::{Args, Subcommand, ValueEnum};
use kvferry::transport::LocalTransport;
use kvferry::transport::{Cadence, MooncakeConfig, MooncakeTransport};
use kvferry::transport::{Desc, EndpointAddr, Op, PollPolicy, Session, Transport};
use kvferry::transport::{ShmMode, TcpConfig, TcpTransport};

use crate::baseline::{self, BaselineArg, BaselineRun};
use crate::cli::{usage_error, UsageError};
use crate::pingpong;
use crate::shape::TransportArg;
use crate::sweep::{self, SweepArgs};

/// `kvferry bench ...`.
#[derive(Clone, Debug, Subcommand)]
pub(crate) enum BenchCommand {
    /// Transport throughput and latency on loopback, next to memcpy.
    #[command(allow_negative_numbers = true)]
    Transport(TransportArgs),
    /// Store put and get throughput of fresh keys, every byte verified.
    Store(crate::store_bench::StoreBenchArgs),
    /// The target process of `bench transport --transport shm`.
    #[command(hide = true)]
    TransportPeer(crate::bench_shm::PeerArgs),
    /// Device memory through kvferry (a copy stream, IPC to another
    /// process, staged tcp) against cudaMemcpy and host tcp, verified.
    Device(crate::bench_device::DeviceArgs),
    /// The peer process of `bench device`.
    #[command(hide = true)]
    DevicePeer(crate::bench_device::PeerArgs),
}

/// The options of `kvferry bench transport`.
#[derive(Clone, Debug, Args)]
pub(crate) struct TransportArgs {
    /// Transport to measure.
    #[arg(long, default_value_t = TransportArg::Tcp)]
    transport: TransportArg,
    /// Bytes per descriptor.
    #[arg(long, value_name = "N", default_value_t = 1 << 20,
          value_parser = clap::value_parser!(u64).range(1..))]
    block_bytes: u64,
    /// Descriptors per batch.
    #[arg(long, value_name = "N", default_value_t = 32,
          value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
    /// TCP streams per session (1..=64).
    #[arg(long, value_name = "N", default_value_t = 4)]
    streams: usize,
    /// Measuring time, in (0, 3600].
    #[arg(long, value_name = "S", default_value_t = 3.0)]
    seconds: f64,
    /// Wait policy while a transfer is pending.
    #[arg(long, default_value_t = PollArg::Spin)]
    poll: PollArg,
    /// Push or pull.
    #[arg(long, default_value_t = OpArg::Write)]
    op: OpArg,
    /// Mooncake's protocol with `--transport mooncake` (the library from
    /// `MOONCAKE_TE_LIB`).
    #[arg(long, value_name = "P", default_value = "tcp")]
    mooncake_protocol: String,
    /// With `--transport mooncake`: microseconds between two status polls
    /// of a batch (0: yield to the executor between polls) [default: the
    /// transport's backoff, 20 us doubling to 1 ms].
    #[arg(long, value_name = "US")]
    mooncake_poll_us: Option<u64>,
    /// Do not pin the executors to cores.
    #[arg(long)]
    no_pin: bool,
    /// Every descriptor of a batch moves the same block (one block of
    /// source and destination memory, like iperf3's one `-l` buffer)
    /// instead of a block of its own.
    #[arg(long)]
    reuse_block: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Also measure a reference in the same run and print the ratio.
    #[arg(long, value_name = "KIND")]
    baseline: Option<BaselineArg>,
    #[command(flatten)]
    sweep: SweepArgs,
}

/// `--poll`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PollArg {
    /// Spin up to 1 ms, then park.
    Spin,
    /// Park at once.
    Park,
}

/// `--op`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OpArg {
    /// The initiator writes into the target.
    Write,
    /// The initiator reads from the target.
    Read,
}

impl std::fmt::Display for PollArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PollArg::Spin => "spin",
            PollArg::Park => "park",
        })
    }
}

impl std::fmt::Display for OpArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OpArg::Write => "write",
            OpArg::Read => "read",
        })
    }
}

/// Entry point of `kvferry bench transport`.
pub(crate) fn main(a: &TransportArgs) -> ExitCode {
    let run = if a.sweep.sweep {
        params(a).and_then(|(p, _)| sweep::main(&p, &a.sweep))
    } else {
        transport_main(a)
    };
    match run {
        Ok(code) => code,
        Err(e) => usage_error("kvferry bench transport", &e.0),
    }
}

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
    batches: u64,
    elapsed: Duration,
    /// Per-batch latency.
    pub(crate) latencies: kvferry::Latency,
    /// Every batch's latency, in order, with [`Params::keep_samples`].
    pub(crate) samples: Vec<Duration>,
    /// Source and destination were equal after the run.
    pub(crate) verified: bool,
    /// Single-thread memcpy of the same buffers on the same (pinned) thread.
    pub(crate) memcpy_gbps: f64,
}

fn transport_main(a: &TransportArgs) -> Result<ExitCode, UsageError> {
    let (p, _) = params(a)?;
    // Found before anything is measured, so a missing tool fails at once.
    let iperf3 = match a.baseline {
        Some(BaselineArg::Iperf3) => Some(baseline::Baseline::find_iperf3()?),
        Some(BaselineArg::Pingpong) | None => None,
    };
    let mut m = match measure(&p) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("kvferry bench transport: {e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let reference = match iperf3.map(|b| b.run(&p)).transpose() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvferry bench transport: {e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let pingpong = match a.baseline {
        Some(BaselineArg::Pingpong) => match run_pingpong(&p) {
            Ok(pp) => Some(pp),
            Err(e) => {
                eprintln!("kvferry bench transport: ping-pong baseline: {e}");
                return Ok(ExitCode::FAILURE);
            }
        },
        Some(BaselineArg::Iperf3) | None => None,
    };
    let check_ok = m.verified;
    let memcpy_gbps = m.memcpy_gbps;
    report(
        &p,
        &mut m,
        memcpy_gbps,
        check_ok,
        reference.as_ref(),
        pingpong.as_ref(),
    );
    Ok(if check_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Runs one measurement of `p` over freshly filled buffers.
pub(crate) fn measure(p: &Params) -> Result<Measured, String> {
    let total = buffer_bytes(p);
    // Both buffers live here and outlive the executor threads, which only
    // see their addresses; they are touched again only after the threads
    // are joined. The side the data comes from holds a pattern, the other
    // zeros, so the check after the run means something in both directions.
    let (mut src, mut dst) = buffers(p.op, total);
    let src_addr = src.as_mut_ptr() as u64;
    let dst_addr = dst.as_mut_ptr() as u64;

    let measured = match p.transport.as_str() {
        "tcp" => run_tcp(p, src_addr, dst_addr),
        "shm" => crate::bench_shm::run(p, ShmMode::Require),
        "auto" => crate::bench_shm::run(p, ShmMode::Auto),
        "mooncake" => run_mooncake(p, src_addr, dst_addr),
        _ => run_local(p, src_addr, dst_addr),
    };
    drop((src, dst));
    measured
}

impl Measured {
    /// Payload throughput in GB/s (10^9 bytes per second).
    pub(crate) fn gbps(&self, p: &Params) -> f64 {
        let bytes = self.batches * p.batch * p.block_bytes;
        bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

/// What to measure, from the command line, and the bytes of one batch.
fn params(a: &TransportArgs) -> Result<(Params, u64), UsageError> {
    let (block_bytes, batch, streams, seconds) = (a.block_bytes, a.batch, a.streams, a.seconds);
    if !(1..=64).contains(&streams) {
        return Err(UsageError("--streams: expected 1..=64".into()));
    }
    let total = block_bytes
        .checked_mul(batch)
        .filter(|&t| t <= 8 << 30)
        .ok_or_else(|| UsageError("--block-bytes x --batch must be at most 8 GiB".into()))?;
    if !(seconds > 0.0 && seconds <= 3600.0) {
        return Err(UsageError("--seconds must be in (0, 3600]".into()));
    }
    let poll = match a.poll {
        PollArg::Spin => PollPolicy::default(),
        PollArg::Park => PollPolicy::Park,
    };
    let op = match a.op {
        OpArg::Write => Op::Write,
        OpArg::Read => Op::Read,
    };
    let (json, pin) = (a.json, !a.no_pin);
    let transport = a.transport.to_string();
    let poll_name = a.poll.to_string();
    let p = Params {
        transport,
        block_bytes,
        batch,
        streams,
        seconds,
        poll,
        poll_name,
        op,
        json,
        pin,
        keep_samples: false,
        reuse_block: a.reuse_block,
        mooncake_protocol: a.mooncake_protocol.clone(),
        mooncake_cadence: match a.mooncake_poll_us {
            None => MooncakeConfig::default().cadence,
            Some(0) => Cadence::Yield,
            Some(us) => Cadence::Timer(Duration::from_micros(us)),
        },
    };
    Ok((p, total))
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

/// The ping-pong baseline with the batch shape, time and pinning of `p`.
fn run_pingpong(p: &Params) -> std::io::Result<pingpong::PingPong> {
    let shape = pingpong::Shape {
        block_bytes: p.block_bytes,
        batch: p.batch,
        op: p.op,
    };
    let cores = matches!(placement(p.pin, 0), Placement::Fixed(_)).then_some((0, 1));
    pingpong::measure(shape, p.seconds, cores)
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

fn run_tcp(p: &Params, src_addr: u64, dst_addr: u64) -> Result<Measured, String> {
    let total = buffer_bytes(p) as usize;
    let config = TcpConfig {
        streams: p.streams,
        poll: p.poll,
        ..TcpConfig::default()
    };
    let (addr_tx, addr_rx) = flume::bounded::<Result<SocketAddr, String>>(1);
    let (stop_tx, stop_rx) = flume::bounded::<()>(1);
    let target_config = config.clone();
    let target = LocalExecutorBuilder::new(placement(p.pin, 1))
        .name("bench-target")
        .spawn(move || async move {
            let setup = || -> Result<TcpTransport, String> {
                let t = TcpTransport::bind("127.0.0.1:0".parse().unwrap(), target_config)
                    .map_err(|e| e.to_string())?;
                // SAFETY: `dst` outlives this thread (joined before it is
                // touched again) and only the transport uses it meanwhile.
                unsafe { t.register(dst_addr as usize as *mut u8, total) }
                    .map_err(|e| e.to_string())?;
                Ok(t)
            };
            match setup() {
                Ok(t) => {
                    let _ = addr_tx.send(Ok(t.local_addr()));
                    let _ = stop_rx.recv_async().await;
                    drop(t);
                }
                Err(e) => {
                    let _ = addr_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| format!("starting the target executor: {e}"))?;
    let peer = addr_rx.recv().map_err(|e| e.to_string()).and_then(|r| r)?;
    let p2 = p.clone();
    let initiator = LocalExecutorBuilder::new(placement(p.pin, 0))
        .name("bench-initiator")
        .spawn(move || async move {
            let t = TcpTransport::bind("127.0.0.1:0".parse().unwrap(), config)
                .map_err(|e| e.to_string())?;
            // SAFETY: as for the target's buffer.
            unsafe { t.register(src_addr as usize as *mut u8, total) }
                .map_err(|e| e.to_string())?;
            let session = t
                .open(&EndpointAddr::Tcp(peer))
                .await
                .map_err(|e| e.to_string())?;
            let batch = descs(&p2, src_addr, dst_addr);
            let m = drive(&p2, &session, &batch).await;
            session.close().await;
            // The target is idle now (it waits for the stop signal), so the
            // buffers can be compared and copied on this thread.
            m.map(|m| verify_and_memcpy(&p2, m, src_addr, dst_addr))
        })
        .map_err(|e| format!("starting the initiator executor: {e}"))?;
    let result = initiator
        .join()
        .map_err(|e| format!("initiator executor: {e}"));
    let _ = stop_tx.send(());
    target.join().map_err(|e| format!("target executor: {e}"))?;
    result?
}

fn run_local(p: &Params, src_addr: u64, dst_addr: u64) -> Result<Measured, String> {
    let total = buffer_bytes(p) as usize;
    let p2 = p.clone();
    LocalExecutorBuilder::new(placement(p.pin, 0))
        .name("bench-local")
        .spawn(move || async move {
            let (a, b) = (LocalTransport::default(), LocalTransport::default());
            // SAFETY: both buffers outlive this thread and only the
            // transport touches them meanwhile.
            unsafe { register_pair(&a, &b, (src_addr, dst_addr), total) }?;
            drive_pair(&p2, &a, &b, (src_addr, dst_addr)).await
        })
        .map_err(|e| format!("starting the executor: {e}"))?
        .join()
        .map_err(|e| format!("local executor: {e}"))?
}

/// Two Mooncake engines on one executor (the library from
/// `MOONCAKE_TE_LIB`, protocol `--mooncake-protocol`): the bytes cross the
/// engine's transport (loopback for `tcp`) between them.
fn run_mooncake(p: &Params, src_addr: u64, dst_addr: u64) -> Result<Measured, String> {
    let total = buffer_bytes(p) as usize;
    let p2 = p.clone();
    let cfg = MooncakeConfig {
        protocol: p.mooncake_protocol.clone(),
        max_descs: p.batch as usize,
        cadence: p.mooncake_cadence,
        ..MooncakeConfig::default()
    };
    LocalExecutorBuilder::new(placement(p.pin, 0))
        .name("bench-mooncake")
        .spawn(move || async move {
            let ip = std::net::IpAddr::from([127, 0, 0, 1]);
            let a = MooncakeTransport::new(ip, cfg.clone()).map_err(|e| e.to_string())?;
            let b = MooncakeTransport::new(ip, cfg).map_err(|e| e.to_string())?;
            // SAFETY: both buffers outlive this thread and only the
            // transport touches them meanwhile.
            unsafe { register_pair(&a, &b, (src_addr, dst_addr), total) }?;
            // What `b`'s hello would tell a node.
            a.learn_peer(&b.endpoint_addr(), b.regions());
            drive_pair(&p2, &a, &b, (src_addr, dst_addr)).await
        })
        .map_err(|e| format!("starting the executor: {e}"))?
        .join()
        .map_err(|e| format!("mooncake executor: {e}"))?
}

/// Registers `src` with `a` and `dst` with `b`, `total` bytes each.
///
/// # Safety
///
/// Both buffers must outlive the endpoints, and only they touch them.
unsafe fn register_pair(
    a: &impl Transport,
    b: &impl Transport,
    (src, dst): (u64, u64),
    total: usize,
) -> Result<(), String> {
    // SAFETY: forwarded from the caller.
    unsafe {
        a.register(src as usize as *mut u8, total)
            .map_err(|e| e.to_string())?;
        b.register(dst as usize as *mut u8, total)
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Opens a session from `a` to `b`, drives the batches over it and
/// checks and measures the buffers ([`verify_and_memcpy`]).
async fn drive_pair<T: Transport>(
    p: &Params,
    a: &T,
    b: &T,
    (src, dst): (u64, u64),
) -> Result<Measured, String> {
    let session = a
        .open(&b.endpoint_addr())
        .await
        .map_err(|e| e.to_string())?;
    let batch = descs(p, src, dst);
    let m = drive(p, &session, &batch).await;
    m.map(|m| verify_and_memcpy(p, m, src, dst))
}

/// Checks that the transfers left both buffers equal, then measures memcpy
/// of the same buffers on the calling (executor) thread, so both figures
/// come from the same core in the same run.
fn verify_and_memcpy(p: &Params, mut m: Measured, src_addr: u64, dst_addr: u64) -> Measured {
    let total = buffer_bytes(p) as usize;
    // SAFETY: the buffers are owned by `transport_main`, which does not touch
    // them until this thread is joined, and no transfer is running now.
    let (src, dst) = unsafe {
        (
            std::slice::from_raw_parts(src_addr as usize as *const u8, total),
            std::slice::from_raw_parts_mut(dst_addr as usize as *mut u8, total),
        )
    };
    m.verified = src == &*dst;
    m.memcpy_gbps = measure_memcpy(src, dst, p.block_bytes as usize, p.seconds.min(1.0));
    m
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

fn report(
    p: &Params,
    m: &mut Measured,
    memcpy_gbps: f64,
    check_ok: bool,
    reference: Option<&BaselineRun>,
    pingpong: Option<&pingpong::PingPong>,
) {
    let gbps = m.gbps(p);
    let us = |q: f64| m.latencies.quantile(q).as_secs_f64() * 1e6;
    let (p50_us, p99_us) = (us(0.50), us(0.99));
    let pp_us = pingpong.map(|pp| {
        let us = |q: f64| pp.latencies.quantile(q).as_secs_f64() * 1e6;
        (us(0.50), us(0.99))
    });
    if p.json {
        let mut v = report_json(p, m, memcpy_gbps, check_ok);
        if let Some(r) = reference {
            v["iperf3_gbps"] = r.gbps.into();
            v["iperf3_len"] = r.len.into();
            v["ratio_to_iperf3"] = baseline::ratio(gbps, r.gbps).into();
        }
        if let Some((pp50, pp99)) = pp_us {
            v["pingpong_p50_us"] = pp50.into();
            v["pingpong_p99_us"] = pp99.into();
            v["p50_to_pingpong"] = (p50_us / pp50).into();
            v["p99_to_pingpong"] = (p99_us / pp99).into();
        }
        println!("{v}");
        return;
    }
    print_text(p, m, memcpy_gbps);
    if let Some(r) = reference {
        println!("{}", r.describe(gbps));
    }
    if let (Some((pp50, pp99)), Some(pp)) = (pp_us, pingpong) {
        println!(
            "  pingpong       p50 {pp50:.1} us, p99 {pp99:.1} us ({} round trips)",
            pp.round_trips
        );
        let (r50, r99) = (p50_us / pp50, p99_us / pp99);
        println!("  to pingpong    p50 {r50:.2}x, p99 {r99:.2}x");
    }
    if !check_ok {
        println!("  VERIFY FAILED: destination differs from source");
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Write => "write",
        Op::Read => "read",
    }
}

/// The JSON report of kvferry's own figures.
fn report_json(p: &Params, m: &Measured, memcpy_gbps: f64, check_ok: bool) -> serde_json::Value {
    let secs = m.elapsed.as_secs_f64().max(1e-9);
    let gbps = m.gbps(p);
    let us = |q: f64| m.latencies.quantile(q).as_secs_f64() * 1e6;
    serde_json::json!({
        "transport": p.transport,
        "op": op_name(p.op),
        "poll": p.poll_name,
        "block_bytes": p.block_bytes,
        "batch": p.batch,
        "streams": p.streams,
        "pinned": p.pin,
        "reuse_block": p.reuse_block,
        "seconds": secs,
        "batches": m.batches,
        "gbps": gbps,
        "descs_per_s": (m.batches * p.batch) as f64 / secs,
        "p50_us": us(0.50),
        "p99_us": us(0.99),
        "memcpy_gbps": memcpy_gbps,
        "ratio_to_memcpy": baseline::ratio(gbps, memcpy_gbps),
        "verified": check_ok,
    })
}

/// The text report's first lines: what ran, throughput, latency, memcpy.
fn print_text(p: &Params, m: &Measured, memcpy_gbps: f64) {
    let secs = m.elapsed.as_secs_f64().max(1e-9);
    let gbps = m.gbps(p);
    let descs_per_s = (m.batches * p.batch) as f64 / secs;
    let us = |q: f64| m.latencies.quantile(q).as_secs_f64() * 1e6;
    let (p50_us, p99_us) = (us(0.50), us(0.99));
    let ratio = baseline::ratio(gbps, memcpy_gbps);
    let reuse = if p.reuse_block {
        " (one block reused)"
    } else {
        ""
    };
    println!(
        "transport {} ({}, poll {}), {} x {} B per batch{reuse}, {} streams, {:.1} s",
        p.transport,
        op_name(p.op),
        p.poll_name,
        p.batch,
        p.block_bytes,
        p.streams,
        secs
    );
    println!("  batches        {}", m.batches);
    println!("  throughput     {gbps:.3} GB/s, {descs_per_s:.0} descriptors/s");
    println!("  batch latency  p50 {p50_us:.1} us, p99 {p99_us:.1} us");
    println!("  memcpy         {memcpy_gbps:.3} GB/s (one thread, same buffers)");
    println!("  ratio          {ratio:.3} of memcpy");
}
