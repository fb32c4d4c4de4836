//! `kvferry bench device`: device memory through kvferry against the
//! device's own copies, in one run, every byte verified.
//!
//! * `copy`: one device's memory to itself through a kvferry copy stream
//!   (enqueue, mark, wait), against a synchronous `cudaMemcpy` device to
//!   device of the same bytes;
//! * `ipc`: into a second process's device memory, opened by IPC handle
//!   (`auto` on one host), against the same `cudaMemcpy`;
//! * `staged`: into the second process's device memory over tcp, staged
//!   through pinned buffers at both ends, against tcp between the two
//!   processes' host memory.
//!
//! The peer process is `kvferry bench device-peer` (hidden). With
//! `--device host` the host stand-in plays the device: the run checks the
//! plumbing (a stand-in's handles do not open in another process, so `ipc`
//! goes staged), not a device's speed.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use glommio::LocalExecutorBuilder;
use kvferry::transport::{
    open_cuda, Desc, Device, DeviceAlloc, Dir, EndpointAddr, HostDevice, Op, Session, ShmConfig,
    ShmMode, TcpConfig, TcpTransport, Transport,
};

use super::measure::fill_pattern;
use super::shm::{blocking_lines, digest, PeerProcess};

/// The options of `kvferry bench device`.
#[derive(Clone, Debug, Args)]
pub(crate) struct DeviceArgs {
    /// `cuda:N`, or `host` for the host stand-in.
    #[arg(long, default_value = "cuda:0")]
    device: String,
    /// Bytes per batch (a KV cache's worth of blocks).
    #[arg(long, value_name = "N", default_value_t = 256 << 20)]
    bytes: u64,
    /// Bytes per descriptor (one layer's run of blocks).
    #[arg(long, value_name = "N", default_value_t = 2 << 20)]
    block_bytes: u64,
    /// Timed batches per measurement; the median is reported.
    #[arg(long, value_name = "N", default_value_t = 5)]
    rounds: usize,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// The options of the hidden `kvferry bench device-peer`.
#[derive(Clone, Debug, Args)]
pub(crate) struct PeerArgs {
    #[arg(long)]
    device: String,
    #[arg(long)]
    bytes: u64,
    /// Offer the device memory to peers on this host (IPC).
    #[arg(long)]
    ipc: bool,
}

fn open(device: &str) -> Result<Arc<dyn Device>, String> {
    if device == "host" {
        return Ok(HostDevice::new(0, Duration::ZERO));
    }
    let ordinal = device
        .strip_prefix("cuda:")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("--device {device:?}: expected cuda:N or host"))?;
    open_cuda(ordinal).map_err(|e| e.to_string())
}

fn config(device: &Arc<dyn Device>, ipc: bool) -> TcpConfig {
    TcpConfig {
        shm: ShmConfig {
            mode: if ipc { ShmMode::Auto } else { ShmMode::Off },
            ..ShmConfig::default()
        },
        device: Some(Arc::clone(device)),
        streams: 4,
        ..TcpConfig::default()
    }
}

/// The digest of `len` bytes of device memory at `addr`.
fn device_digest(dev: &Arc<dyn Device>, addr: u64, len: usize) -> Result<u64, String> {
    let mut host = vec![0u8; len];
    // SAFETY: read while no batch runs.
    unsafe { dev.memcpy_sync(Dir::ToHost, host.as_mut_ptr() as u64, addr, len) }
        .map_err(|e| e.to_string())?;
    Ok(digest(&host))
}

/// The peer: device memory and host memory of `bytes` each, registered
/// with one endpoint; prints `ENDPOINT DEVICE_ADDR HOST_ADDR`, then
/// answers `device` or `host` lines with that memory's digest.
pub(crate) fn peer_main(a: &PeerArgs) -> ExitCode {
    let run = || -> Result<(), String> {
        let dev = open(&a.device)?;
        let len = a.bytes as usize;
        let mem = dev.alloc_device(len).map_err(|e| e.to_string())?;
        let host = vec![0u8; len];
        let (d, h) = (mem.addr(), host.as_ptr() as u64);
        let cfg = config(&dev, a.ipc);
        let dev2 = Arc::clone(&dev);
        LocalExecutorBuilder::default()
            .name("bench-device-peer")
            .spawn(move || async move {
                let t = TcpTransport::bind("127.0.0.1:0".parse().unwrap(), cfg)
                    .map_err(|e| e.to_string())?;
                // SAFETY: both buffers outlive the endpoint (this thread is
                // joined before they drop).
                unsafe {
                    t.register_device(d, len).map_err(|e| e.to_string())?;
                    t.register(h as usize as *mut u8, len)
                        .map_err(|e| e.to_string())?;
                }
                println!("{} {d} {h}", t.endpoint_addr());
                let lines = blocking_lines();
                while let Ok(line) = lines.recv_async().await {
                    let sum = match line.trim() {
                        "device" => device_digest(&dev2, d, len)?,
                        // SAFETY: read while the initiator waits.
                        _ => digest(unsafe { std::slice::from_raw_parts(h as *const u8, len) }),
                    };
                    println!("{sum}");
                }
                drop(t);
                Ok::<(), String>(())
            })
            .map_err(|e| e.to_string())?
            .join()
            .map_err(|e| e.to_string())??;
        drop((mem, host));
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvferry bench device-peer: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The peer of `bench device`: its endpoint and its memory's addresses.
struct Peer {
    process: PeerProcess,
    addr: EndpointAddr,
    device: u64,
    host: u64,
}

impl Peer {
    fn start(a: &DeviceArgs, ipc: bool) -> Result<Peer, String> {
        let mut args: Vec<String> = ["bench", "device-peer", "--device"]
            .map(String::from)
            .into();
        args.extend([a.device.clone(), "--bytes".into(), a.bytes.to_string()]);
        if ipc {
            args.push("--ipc".into());
        }
        let (process, line) = PeerProcess::spawn(&args)?;
        let w: Vec<&str> = line.split_whitespace().collect();
        let parsed = (w.len() == 3)
            .then(|| Some((w[0].parse().ok()?, w[1].parse().ok()?, w[2].parse().ok()?)))
            .flatten();
        let Some((addr, device, host)) = parsed else {
            return Err(format!("the peer said {line:?}"));
        };
        Ok(Peer {
            process,
            addr,
            device,
            host,
        })
    }

    fn digest(&mut self, which: &str) -> Result<u64, String> {
        self.process.ask(which)
    }
}

/// One measurement: median GB/s of kvferry and of its baseline.
#[derive(Clone, Copy, Debug, serde::Serialize)]
struct Row {
    kvferry_gbps: f64,
    baseline_gbps: f64,
    ratio: f64,
    verified: bool,
    /// `ipc` only: whether the bytes went through the opened allocation.
    opened: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9
}

/// Filled with a pattern, so a verified copy is a copy of these bytes.
fn patterned(dev: &Arc<dyn Device>, len: usize) -> Result<DeviceAlloc, String> {
    let mem = dev.alloc_device(len).map_err(|e| e.to_string())?;
    let mut host = vec![0u8; len];
    fill_pattern(&mut host);
    // SAFETY: a fresh allocation of `len` bytes.
    unsafe { dev.memcpy_sync(Dir::ToDevice, mem.addr(), host.as_ptr() as u64, len) }
        .map_err(|e| e.to_string())?;
    Ok(mem)
}

/// `cudaMemcpy` device to device of `len` bytes, timed `rounds` times.
fn baseline_copy(dev: &Arc<dyn Device>, a: &DeviceArgs) -> Result<f64, String> {
    let len = a.bytes as usize;
    let (src, dst) = (
        patterned(dev, len)?,
        dev.alloc_device(len).map_err(|e| e.to_string())?,
    );
    let mut samples = Vec::new();
    for _ in 0..a.rounds {
        let t = Instant::now();
        // SAFETY: two live allocations of `len` bytes.
        unsafe { dev.memcpy_sync(Dir::DeviceToDevice, dst.addr(), src.addr(), len) }
            .map_err(|e| e.to_string())?;
        samples.push(gbps(a.bytes, t.elapsed()));
    }
    Ok(median(samples))
}

/// The same bytes through a kvferry copy stream, descriptor by descriptor.
fn stream_copy(dev: &Arc<dyn Device>, a: &DeviceArgs) -> Result<Row, String> {
    let len = a.bytes as usize;
    let (src, dst) = (
        patterned(dev, len)?,
        dev.alloc_device(len).map_err(|e| e.to_string())?,
    );
    let stream = dev.copy_stream().map_err(|e| e.to_string())?;
    let mut samples = Vec::new();
    for _ in 0..a.rounds {
        let t = Instant::now();
        let mut off = 0;
        while off < a.bytes {
            let n = a.block_bytes.min(a.bytes - off);
            let (d, s) = (dst.addr() + off, src.addr() + off);
            // SAFETY: inside two live allocations.
            unsafe { stream.enqueue(Dir::DeviceToDevice, d, s, n as usize) }
                .map_err(|e| e.to_string())?;
            off += n;
        }
        let mark = stream.mark().map_err(|e| e.to_string())?;
        if !mark.wait_blocking(Duration::from_secs(60)) {
            return Err("a device copy did not end within 60 s".into());
        }
        samples.push(gbps(a.bytes, t.elapsed()));
    }
    let verified = device_digest(dev, dst.addr(), len)? == device_digest(dev, src.addr(), len)?;
    let base = baseline_copy(dev, a)?;
    let kv = median(samples);
    Ok(row(kv, base, verified, false))
}

fn row(kvferry_gbps: f64, baseline_gbps: f64, verified: bool, opened: bool) -> Row {
    Row {
        kvferry_gbps,
        baseline_gbps,
        ratio: kvferry_gbps / baseline_gbps.max(1e-9),
        verified,
        opened,
    }
}

/// Batches of `a.bytes` from `local` into the peer's `remote`, timed.
fn batches(
    dev: &Arc<dyn Device>,
    ipc: bool,
    a: &DeviceArgs,
    peer: &Peer,
    local: (u64, bool),
    remote: u64,
) -> Result<(f64, bool), String> {
    let (cfg, addr, a2) = (config(dev, ipc), peer.addr, a.clone());
    LocalExecutorBuilder::default()
        .name("bench-device")
        .spawn(move || async move {
            let t = TcpTransport::bind("127.0.0.1:0".parse().unwrap(), cfg)
                .map_err(|e| e.to_string())?;
            let (base, on_device) = local;
            // SAFETY: the caller's memory outlives this thread (joined).
            unsafe {
                match on_device {
                    true => t.register_device(base, a2.bytes as usize),
                    false => t.register(base as usize as *mut u8, a2.bytes as usize),
                }
            }
            .map_err(|e| e.to_string())?;
            let session = t.open(&addr).await.map_err(|e| e.to_string())?;
            let descs: Vec<Desc> = (0..a2.bytes.div_ceil(a2.block_bytes))
                .map(|k| {
                    let off = k * a2.block_bytes;
                    Desc {
                        local_addr: base + off,
                        remote_addr: remote + off,
                        len_bytes: a2.block_bytes.min(a2.bytes - off),
                    }
                })
                .collect();
            // One untimed batch: connections, the peer's map, the pools.
            session
                .transfer(Op::Write, &descs)
                .await
                .map_err(|e| e.to_string())?;
            let mut samples = Vec::new();
            for _ in 0..a2.rounds {
                let t0 = Instant::now();
                session
                    .transfer(Op::Write, &descs)
                    .await
                    .map_err(|e| e.to_string())?;
                samples.push(gbps(a2.bytes, t0.elapsed()));
            }
            let opened = session.shm_copied_bytes() > 0;
            session.close().await;
            Ok::<_, String>((median(samples), opened))
        })
        .map_err(|e| e.to_string())?
        .join()
        .map_err(|e| e.to_string())?
}

/// Device memory into a peer process's device memory, against `baseline`.
fn cross_process(dev: &Arc<dyn Device>, a: &DeviceArgs, ipc: bool) -> Result<Row, String> {
    let mut peer = Peer::start(a, ipc)?;
    let len = a.bytes as usize;
    let src = patterned(dev, len)?;
    let (kv, opened) = batches(dev, ipc, a, &peer, (src.addr(), true), peer.device)?;
    let verified = peer.digest("device")? == device_digest(dev, src.addr(), len)?;
    let (base, base_ok) = if ipc {
        (baseline_copy(dev, a)?, true)
    } else {
        // Host memory over tcp between the same two processes.
        let mut host = vec![0u8; len];
        fill_pattern(&mut host);
        let (gb, _) = batches(
            dev,
            false,
            a,
            &peer,
            (host.as_ptr() as u64, false),
            peer.host,
        )?;
        (gb, peer.digest("host")? == digest(&host))
    };
    Ok(row(kv, base, verified && base_ok, opened))
}

/// `kvferry bench device`.
pub(crate) fn main(a: &DeviceArgs) -> ExitCode {
    let run = || -> Result<serde_json::Value, String> {
        if a.bytes == 0 || a.block_bytes == 0 || a.rounds == 0 {
            return Err("--bytes, --block-bytes and --rounds must be positive".into());
        }
        let dev = open(&a.device)?;
        let copy = stream_copy(&dev, a)?;
        let ipc = cross_process(&dev, a, true)?;
        let staged = cross_process(&dev, a, false)?;
        Ok(serde_json::json!({
            "device": dev.name(),
            "bytes": a.bytes,
            "block_bytes": a.block_bytes,
            "rounds": a.rounds,
            "copy": copy,
            "ipc": ipc,
            "staged": staged,
        }))
    };
    match run() {
        Ok(v) if a.json => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Ok(v) => {
            println!("device {} ({} MiB per batch)", v["device"], a.bytes >> 20);
            for (name, base) in [
                ("copy", "cudaMemcpy D2D"),
                ("ipc", "cudaMemcpy D2D"),
                ("staged", "host tcp"),
            ] {
                let r = &v[name];
                println!(
                    "  {name:7} {:8.2} GB/s   {base}: {:8.2} GB/s   {:.2}x   verified {}   opened {}",
                    r["kvferry_gbps"].as_f64().unwrap_or(0.0),
                    r["baseline_gbps"].as_f64().unwrap_or(0.0),
                    r["ratio"].as_f64().unwrap_or(0.0),
                    r["verified"],
                    r["opened"],
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvferry bench device: {e}");
            ExitCode::FAILURE
        }
    }
}
