//! `kvferry bench store`: put and get throughput of fresh keys through a
//! store backend, in the shape of Mooncake Store's own benchmark
//! (`../shared/bench/mooncake_store_baseline.sh`): per iteration one timed
//! batched put of fresh keys, one timed batched get of them into other
//! memory, then (untimed) every byte compared and the keys removed.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use kvferry::machines::store::lookup::Lookup;
use kvferry::machines::store::{BlockHash, ChunkKey, GroupSpec, Keyspace, KeyspaceSpec};
use kvferry::machines::{LayoutKind, ModelSpec, RankLayout, Region, Stage};
use kvferry::transport::SharedMem;
use kvferry_store::{AnyStore, GetItem, InprocConfig, PutItem, Scatter, Segment, StoreBackend};

use super::measure::measure_memcpy;
use crate::usage::usage_error;

/// The options of `kvferry bench store`.
#[derive(Clone, Debug, Args)]
pub(crate) struct StoreBenchArgs {
    /// The store: `inproc`, `kvferry://HOST:PORT`,
    /// `redis://[user:password@]HOST:PORT` or
    /// `redis+cluster://[user:password@]HOST:PORT[,HOST:PORT...]`.
    #[arg(long, value_name = "URL")]
    store: String,
    /// Bytes of each value.
    #[arg(long, value_name = "N", default_value_t = 1 << 20,
          value_parser = clap::value_parser!(u64).range(1..=(1 << 30)))]
    value_bytes: u64,
    /// Keys per batched put and get.
    #[arg(long, value_name = "N", default_value_t = 32,
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    batch: u64,
    /// Seconds of timed iterations, in (0, 3600].
    #[arg(long, value_name = "S", default_value_t = 5.0)]
    seconds: f64,
    /// Hashes of the lookup measured after the timed part (8192: a
    /// 128k-token request of 16-token blocks); 0 skips it.
    #[arg(long, value_name = "N", default_value_t = 8192)]
    lookup_hashes: u32,
    /// TP size of the lookup's engine: every rank's key of every block is
    /// asked about.
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    lookup_tp: u32,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// What the benchmark measured (GB = 10^9 bytes).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub(crate) struct StoreBenchReport {
    /// The store measured.
    pub store: String,
    /// Bytes of each value.
    pub value_bytes: u64,
    /// Keys per batch.
    pub batch: u64,
    /// Iterations (one put and one get batch each).
    pub iters: u64,
    /// Put throughput.
    pub put_gbps: f64,
    /// Get throughput.
    pub get_gbps: f64,
    /// Median milliseconds of one put batch.
    pub put_ms_p50: f64,
    /// Median milliseconds of one get batch.
    pub get_ms_p50: f64,
    /// Single-thread memcpy, value by value, of the source buffer into
    /// one of eight batch-sized windows of a buffer in turn, in the same
    /// run: a store's memory receives a batch where older values are not
    /// (copying into one batch-sized buffer again and again measures the
    /// cache, about twice as fast here).
    pub memcpy_gbps: f64,
    /// Put throughput over memcpy.
    pub put_ratio_to_memcpy: f64,
    /// Get throughput over memcpy.
    pub get_ratio_to_memcpy: f64,
    /// Values whose bytes came back other than put (must be 0).
    pub verify_errors: u64,
    /// Keys a put or get answered with an error.
    pub key_errors: u64,
    /// Keys one lookup asked about (hashes × TP ranks).
    pub lookup_keys: u64,
    /// Tokens the lookup found stored (the first half of its blocks is).
    pub lookup_hit_tokens: u64,
    /// Median milliseconds of one lookup.
    pub lookup_ms_p50: f64,
    /// Requests to the store per lookup (1: one batched round trip;
    /// 0 where the store counts none, as the in-process one).
    pub lookup_round_trips: f64,
}

/// Runs `kvferry bench store`.
pub(crate) fn main(a: &StoreBenchArgs) -> ExitCode {
    const CMD: &str = "kvferry bench store";
    if !(a.seconds > 0.0 && a.seconds <= 3600.0) {
        return usage_error(CMD, "--seconds must be in (0, 3600]");
    }
    // Twice a batch: the in-process store keeps the values of the batch
    // being read while the next is put.
    let inproc = InprocConfig {
        capacity_bytes: a.value_bytes * a.batch * 2,
        ..InprocConfig::default()
    };
    let result = match AnyStore::open_with(&a.store, inproc) {
        Ok(store) => run(a, store, AnyStore::round_trips),
        Err(e) if e.is_bad_url() => return usage_error(CMD, &format!("--store {e}")),
        Err(e) => Err(e.to_string()),
    };
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{CMD}: {e}");
            return ExitCode::from(1);
        }
    };
    print_report(&report, a.json);
    if report.verify_errors > 0 || report.key_errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn print_report(r: &StoreBenchReport, json: bool) {
    if json {
        println!("{}", serde_json::to_string(r).unwrap_or_default());
        return;
    }
    println!(
        "store {}: {} iterations of {} x {} B; put {:.2} GB/s (p50 {:.2} ms/batch), \
         get {:.2} GB/s (p50 {:.2} ms/batch); memcpy {:.2} GB/s; {} verify errors, {} key errors",
        r.store,
        r.iters,
        r.batch,
        r.value_bytes,
        r.put_gbps,
        r.put_ms_p50,
        r.get_gbps,
        r.get_ms_p50,
        r.memcpy_gbps,
        r.verify_errors,
        r.key_errors
    );
    if r.lookup_keys > 0 {
        println!(
            "lookup of {} keys: p50 {:.2} ms, {} round trip(s) each, {} tokens hit",
            r.lookup_keys, r.lookup_ms_p50, r.lookup_round_trips, r.lookup_hit_tokens
        );
    }
}

/// Engine memory in a sealed `memfd`, as an engine allocates KV that a
/// store server on its host may copy straight into and out of (the
/// transport finds it shared when the backend registers it).
struct Shared(SharedMem);

impl Shared {
    fn zeroed(len: usize) -> Result<Shared, String> {
        SharedMem::new("kvferry-bench-store", len)
            .map(Shared)
            .map_err(|e| format!("allocating {len} bytes of shared memory: {e}"))
    }
}

impl std::ops::Deref for Shared {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the bench touches its buffers only between calls, when
        // no transfer runs.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr(), self.0.len()) }
    }
}

impl std::ops::DerefMut for Shared {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_ptr(), self.0.len()) }
    }
}

/// The engine memory: `batch` values to put from and as many to get into.
struct Buffers {
    src: Shared,
    dst: Shared,
    value: u64,
    batch: u64,
}

impl Buffers {
    fn layout(&self) -> RankLayout {
        let region = |base: &Shared| Region {
            base: base.as_ptr() as u64,
            block_len: self.value,
            kv_block_len: self.value,
        };
        RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks: self.batch,
            regions: vec![region(&self.src), region(&self.dst)],
            stage: Stage::SINGLE,
            pools: Vec::new(),
        }
    }

    fn scatter(&self, buf: &[u8], i: u64) -> Scatter {
        let addr = buf.as_ptr() as u64 + i * self.value;
        // SAFETY: value `i` of a buffer that outlives every call (the
        // backend is dropped before the buffers, in `run`).
        unsafe {
            Scatter::from_raw(vec![Segment {
                addr,
                len: self.value,
            }])
        }
    }

    /// A small value (the lookup's stored keys need only exist): the
    /// first bytes of the source buffer.
    fn small(&self) -> Scatter {
        let len = self.value.min(64);
        // SAFETY: as for `scatter`.
        unsafe {
            Scatter::from_raw(vec![Segment {
                addr: self.src.as_ptr() as u64,
                len,
            }])
        }
    }

    /// Fresh bytes for iteration `iter`, so a get of stale keys shows.
    fn fill(&mut self, iter: u64) {
        for (i, chunk) in self.src.chunks_mut(8).enumerate() {
            let v = (iter << 40) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let b = v.to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
        self.dst.fill(0);
    }
}

fn run<B: StoreBackend>(
    a: &StoreBenchArgs,
    mut backend: B,
    round_trips: fn(&B) -> u64,
) -> Result<StoreBenchReport, String> {
    let len = (a.value_bytes * a.batch) as usize;
    let mut bufs = Buffers {
        src: Shared::zeroed(len)?,
        dst: Shared::zeroed(len)?,
        value: a.value_bytes,
        batch: a.batch,
    };
    backend
        .register(&bufs.layout())
        .map_err(|e| format!("registering memory: {e}"))?;
    let mut r = StoreBenchReport {
        store: a.store.clone(),
        value_bytes: a.value_bytes,
        batch: a.batch,
        ..StoreBenchReport::default()
    };
    let (mut put_t, mut get_t) = (Vec::new(), Vec::new());
    let run_id = std::process::id();
    let until = Instant::now() + Duration::from_secs_f64(a.seconds);
    while Instant::now() < until {
        bufs.fill(r.iters);
        let keys: Vec<ChunkKey> = (0..a.batch)
            .map(|i| ChunkKey::from_stored(format!("bench:{run_id}:{}:{i}", r.iters)))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let (p, g) = iteration(&mut backend, &bufs, &keys, &mut r)?;
        put_t.push(p);
        get_t.push(g);
        if *bufs.src != *bufs.dst {
            r.verify_errors += (0..a.batch)
                .filter(|&i| {
                    let s = (i * a.value_bytes) as usize..((i + 1) * a.value_bytes) as usize;
                    bufs.src[s.clone()] != bufs.dst[s]
                })
                .count() as u64;
        }
        r.iters += 1;
    }
    if a.lookup_hashes > 0 {
        lookup(a, &mut backend, &bufs, round_trips, &mut r)?;
    }
    drop(backend);
    let bytes = (r.iters * a.batch * a.value_bytes) as f64;
    let secs = |t: &[Duration]| t.iter().map(Duration::as_secs_f64).sum::<f64>();
    r.put_gbps = bytes / secs(&put_t).max(1e-9) / 1e9;
    r.get_gbps = bytes / secs(&get_t).max(1e-9) / 1e9;
    r.put_ms_p50 = median_ms(&put_t);
    r.get_ms_p50 = median_ms(&get_t);
    // Eight batch-sized windows, as the field's doc says.
    let mut windows = vec![1u8; bufs.src.len() * 8];
    r.memcpy_gbps = measure_memcpy(&bufs.src, &mut windows, a.value_bytes as usize, 1.0);
    r.put_ratio_to_memcpy = r.put_gbps / r.memcpy_gbps.max(1e-9);
    r.get_ratio_to_memcpy = r.get_gbps / r.memcpy_gbps.max(1e-9);
    Ok(r)
}

/// One timed put and one timed get of `keys`, then their removal.
fn iteration<B: StoreBackend>(
    backend: &mut B,
    bufs: &Buffers,
    keys: &[ChunkKey],
    r: &mut StoreBenchReport,
) -> Result<(Duration, Duration), String> {
    let deadline = || Instant::now() + Duration::from_secs(30);
    let puts: Vec<PutItem> = (keys.iter().enumerate())
        .map(|(i, k)| PutItem {
            key: k.clone(),
            from: bufs.scatter(&bufs.src, i as u64),
        })
        .collect();
    let gets: Vec<GetItem> = (keys.iter().enumerate())
        .map(|(i, k)| GetItem {
            key: k.clone(),
            into: bufs.scatter(&bufs.dst, i as u64),
        })
        .collect();
    let t = Instant::now();
    let put = backend
        .put(&puts, deadline())
        .map_err(|e| format!("put: {e}"))?;
    let put_time = t.elapsed();
    let t = Instant::now();
    let got = backend
        .get(&gets, deadline())
        .map_err(|e| format!("get: {e}"))?;
    let get_time = t.elapsed();
    r.key_errors += put.iter().filter(|a| a.is_err()).count() as u64;
    r.key_errors += got.iter().filter(|a| a.is_err()).count() as u64;
    let _ = backend.remove(keys, deadline());
    let _ = backend.take_removed(usize::MAX);
    Ok((put_time, get_time))
}

/// The median of `t` in ms, by the one percentile rule of
/// [`kvferry::Latency`].
fn median_ms(t: &[Duration]) -> f64 {
    let mut l = kvferry::Latency::new();
    t.iter().for_each(|d| l.record(*d));
    if l.count() == 0 {
        return 0.0;
    }
    l.quantile(0.5).as_secs_f64() * 1e3
}

/// Times the lookup of one long request at TP `lookup_tp` (every rank's
/// key of every block, one batched existence call) with the first half
/// of its blocks stored for every rank.
fn lookup<B: StoreBackend>(
    a: &StoreBenchArgs,
    backend: &mut B,
    bufs: &Buffers,
    round_trips: fn(&B) -> u64,
    r: &mut StoreBenchReport,
) -> Result<(), String> {
    const BLOCK_TOKENS: u32 = 16;
    const REPS: usize = 9;
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let keyspace = Keyspace::new(&KeyspaceSpec {
        model_name: "bench/lookup".into(),
        model: ModelSpec {
            layout: LayoutKind::Hnd,
            total_kv_heads: a.lookup_tp,
            block_tokens: BLOCK_TOKENS,
            head_bytes: 256,
        },
        dtype: "bf16".into(),
        tp_size: a.lookup_tp,
        pp_size: 1,
        groups: vec![GroupSpec {
            block_tokens: BLOCK_TOKENS,
            window_tokens: None,
        }],
    })
    .map_err(|x| e(&x))?;
    let scope = keyspace.scope(None, &[]).map_err(|x| e(&x))?;
    let hashes: Vec<BlockHash> = (0..a.lookup_hashes)
        .map(|i| BlockHash::from_u64(u64::from(i) ^ u64::from(std::process::id()) << 32))
        .collect();
    let tokens = a.lookup_hashes * BLOCK_TOKENS;
    let plan = Lookup::new(&keyspace, &scope, tokens, &[hashes], usize::MAX).map_err(|x| e(&x))?;
    let keys = plan.keys();
    let stored = &keys[..keys.len() / 2];
    for chunk in stored.chunks(4096) {
        let items: Vec<PutItem> = (chunk.iter())
            .map(|k| PutItem {
                key: k.clone(),
                from: bufs.small(),
            })
            .collect();
        backend
            .put(&items, Instant::now() + Duration::from_secs(30))
            .map_err(|x| format!("lookup setup: {x}"))?;
    }
    let mut times = Vec::with_capacity(REPS);
    let trips_before = round_trips(backend);
    let mut hit = 0;
    for _ in 0..REPS {
        let t = Instant::now();
        let exists = (backend.exists(keys, Instant::now() + Duration::from_secs(30)))
            .map_err(|x| format!("lookup: {x}"))?;
        times.push(t.elapsed());
        hit = plan.resolve(&exists).map_err(|x| e(&x))?.tokens;
    }
    r.lookup_round_trips = (round_trips(backend) - trips_before) as f64 / REPS as f64;
    r.lookup_keys = keys.len() as u64;
    r.lookup_hit_tokens = u64::from(hit);
    r.lookup_ms_p50 = median_ms(&times);
    for chunk in stored.chunks(4096) {
        let _ = backend.remove(chunk, Instant::now() + Duration::from_secs(30));
    }
    let _ = backend.take_removed(usize::MAX);
    Ok(())
}
