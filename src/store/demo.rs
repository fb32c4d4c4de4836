//! A synthetic engine that saves the KV of requests sharing prefixes to a
//! store, drops its own copy, then looks the requests up again, loads the
//! hits and verifies every byte: what `kvferry demo --store` runs.

use std::time::{Duration, Instant};

use kvferry_machines::common::{BlockId, TransferId};
use kvferry_machines::layout::{LayoutKind, ModelSpec, RankLayout, Region, Stage};
use kvferry_machines::store::events::Medium;
use kvferry_machines::store::{BlockHash, GroupSpec, KeyspaceSpec, StoreConfig};

use super::backend::StoreBackend;
use super::config::{ConnectorConfig, ConnectorError, ConnectorLimits, LoadMeta, SaveMeta};
use super::{StoreConnector, StoreRequest};

/// The synthetic workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreDemo {
    /// Requests saved, then loaded.
    pub requests: u32,
    /// Leading blocks every request shares (dedup exercised).
    pub shared_blocks: u32,
    /// Blocks of each request after the shared ones.
    pub own_blocks: u32,
    /// Layers of the model (two regions each, K and V).
    pub layers: u32,
    /// KV heads of the model.
    pub kv_heads: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Bytes of one head of one token.
    pub head_bytes: u64,
    /// Bounds of the machines.
    pub store: StoreConfig,
}

impl Default for StoreDemo {
    fn default() -> Self {
        StoreDemo {
            requests: 8,
            shared_blocks: 16,
            own_blocks: 8,
            layers: 4,
            kv_heads: 8,
            block_tokens: 16,
            head_bytes: 256,
            store: StoreConfig::default(),
        }
    }
}

/// How far a [`StoreDemo::run_observed`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DemoProgress {
    /// `done` of `of` requests saved.
    Saved {
        /// Requests saved so far.
        done: u32,
        /// Requests in all.
        of: u32,
    },
    /// `done` of `of` requests looked up, loaded and verified.
    Loaded {
        /// Requests loaded so far.
        done: u32,
        /// Requests in all.
        of: u32,
    },
}

/// What the demo found; field names as `kvferry demo --json` prints them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct StoreDemoReport {
    /// Requests saved and loaded.
    pub requests: u32,
    /// Blocks the saves stored.
    pub saved_blocks: u64,
    /// Blocks the saves found stored already.
    pub dedup_skipped: u64,
    /// Tokens the lookups found, summed.
    pub lookup_hit_tokens: u64,
    /// Blocks loaded.
    pub loaded_blocks: u64,
    /// Blocks reported not loaded.
    pub load_errors: u64,
    /// Loaded blocks whose bytes differ from what was saved.
    pub verify_errors: u64,
    /// Stored bytes over the save phase's wall time, GB/s.
    pub put_gbps: f64,
    /// Loaded bytes over the load phase's wall time, GB/s.
    pub get_gbps: f64,
    /// Median lookup-and-load time of one request, ms.
    pub p50_ms: f64,
    /// 99th percentile of the same, ms.
    pub p99_ms: f64,
}

/// The engine's memory: one buffer per region.
struct Memory {
    regions: Vec<Vec<u8>>,
    kv_block: u64,
    num_blocks: u64,
}

impl Memory {
    fn layout(&self) -> RankLayout {
        RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks: self.num_blocks,
            regions: (self.regions.iter())
                .map(|r| Region {
                    base: r.as_ptr() as u64,
                    block_len: self.kv_block,
                    kv_block_len: self.kv_block,
                })
                .collect(),
            stage: Stage::SINGLE,
            pools: Vec::new(),
        }
    }

    fn block(&mut self, region: usize, block: u32) -> &mut [u8] {
        let start = (u64::from(block) * self.kv_block) as usize;
        &mut self.regions[region][start..start + self.kv_block as usize]
    }

    fn fill(&mut self, block: u32, hash: u64) {
        for r in 0..self.regions.len() {
            for (i, b) in self.block(r, block).iter_mut().enumerate() {
                *b = pattern(hash, r, i);
            }
        }
    }

    fn holds(&mut self, block: u32, hash: u64) -> bool {
        (0..self.regions.len()).all(|r| {
            (self.block(r, block).iter().enumerate()).all(|(i, b)| *b == pattern(hash, r, i))
        })
    }
}

/// The byte at `i` of region `region` of a block of hash `hash`.
fn pattern(hash: u64, region: usize, i: usize) -> u8 {
    let x =
        (hash.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_add((region as u64) << 40 | i as u64);
    (x ^ (x >> 29) ^ (x >> 47)) as u8
}

impl StoreDemo {
    fn hashes(&self, r: u32) -> Vec<u64> {
        let own = (0..self.own_blocks).map(|i| (1 + u64::from(r)) << 32 | u64::from(i));
        (0..u64::from(self.shared_blocks)).chain(own).collect()
    }

    fn blocks_per_request(&self) -> u32 {
        self.shared_blocks + self.own_blocks
    }

    fn config(&self) -> ConnectorConfig {
        ConnectorConfig {
            store: self.store,
            keyspace: KeyspaceSpec {
                model_name: "kvferry/demo".into(),
                model: ModelSpec {
                    layout: LayoutKind::Hnd,
                    total_kv_heads: self.kv_heads,
                    block_tokens: self.block_tokens,
                    head_bytes: self.head_bytes,
                },
                dtype: "bf16".into(),
                tp_size: 1,
                pp_size: 1,
                groups: vec![GroupSpec {
                    block_tokens: self.block_tokens,
                    window_tokens: None,
                }],
            },
            medium: Medium::Cpu,
            limits: ConnectorLimits {
                max_saves: self.requests.max(1) as usize,
                max_loads: self.requests.max(1) as usize,
                ..ConnectorLimits::default()
            },
        }
    }

    fn request(&self, id: u64, hashes: &[u64], first_block: u32) -> StoreRequest {
        StoreRequest {
            id: TransferId(id),
            block_hashes: vec![hashes.iter().map(|&h| BlockHash::from_u64(h)).collect()],
            block_ids: vec![(0..hashes.len() as u32)
                .map(|i| BlockId(first_block + i))
                .collect()],
            lora: None,
            extra_keys: Vec::new(),
        }
    }

    /// Runs the demo against `backend`.
    pub fn run<B: StoreBackend>(&self, backend: B) -> Result<StoreDemoReport, ConnectorError> {
        self.run_observed(backend, &mut |_| {})
    }

    /// [`StoreDemo::run`], telling `progress` after each request's save
    /// and each request's load (for a progress bar).
    pub fn run_observed<B: StoreBackend>(
        &self,
        backend: B,
        progress: &mut dyn FnMut(DemoProgress),
    ) -> Result<StoreDemoReport, ConnectorError> {
        let per = self.blocks_per_request();
        let kv_block = u64::from(self.kv_heads) * u64::from(self.block_tokens) * self.head_bytes;
        // Saves use the first half of the blocks, loads the second.
        let num_blocks = 2 * u64::from(self.requests) * u64::from(per);
        let mut mem = Memory {
            regions: (0..2 * self.layers)
                .map(|_| vec![0u8; (num_blocks * kv_block) as usize])
                .collect(),
            kv_block,
            num_blocks,
        };
        let value_bytes = kv_block * 2 * u64::from(self.layers);
        let mut c = StoreConnector::new(self.config(), backend)?;
        // SAFETY: `mem` outlives `c` (declared first, dropped last), and
        // the demo touches no block while a save or load holds it.
        unsafe { c.register_kv_caches(mem.layout())? };
        let mut report = StoreDemoReport {
            requests: self.requests,
            ..StoreDemoReport::default()
        };
        let started = Instant::now();
        for r in 0..self.requests {
            let hashes = self.hashes(r);
            for (i, h) in hashes.iter().enumerate() {
                mem.fill(r * per + i as u32, *h);
            }
            let meta = SaveMeta {
                request: self.request(u64::from(r), &hashes, r * per),
                token_len: per * self.block_tokens,
                token_ids: None,
            };
            c.start_save(Instant::now(), meta)?;
            // One save at a time, so later ones find the shared prefix.
            c.wait_for_save();
            progress(DemoProgress::Saved {
                done: r + 1,
                of: self.requests,
            });
        }
        let put_time = started.elapsed();
        let _ = c.get_finished();
        let stats = c.stats();
        report.saved_blocks = stats.saved_keys;
        report.dedup_skipped = stats.dedup_skipped;
        report.put_gbps = gbps(stats.saved_keys * value_bytes, put_time);
        for r in &mut mem.regions {
            r.fill(0);
        }
        let latencies = self.load_all(&mut c, &mut mem, &mut report, progress)?;
        report.p50_ms = percentile(&latencies, 0.50);
        report.p99_ms = percentile(&latencies, 0.99);
        report.get_gbps = gbps(
            report.loaded_blocks * value_bytes,
            latencies.iter().sum::<Duration>(),
        );
        Ok(report)
    }

    /// Looks up, loads and verifies each request; the per-request times.
    fn load_all(
        &self,
        c: &mut StoreConnector,
        mem: &mut Memory,
        report: &mut StoreDemoReport,
        progress: &mut dyn FnMut(DemoProgress),
    ) -> Result<Vec<Duration>, ConnectorError> {
        let per = self.blocks_per_request();
        let half = self.requests * per;
        let scope = c.keyspace().scope(None, &[])?;
        let mut latencies = Vec::with_capacity(self.requests as usize);
        for r in 0..self.requests {
            let hashes = self.hashes(r);
            let into = half + r * per;
            let started = Instant::now();
            let wanted = vec![hashes.iter().map(|&h| BlockHash::from_u64(h)).collect()];
            let hit = c.lookup_hit(&scope, per * self.block_tokens, &wanted)?;
            report.lookup_hit_tokens += u64::from(hit.tokens);
            let meta = LoadMeta {
                request: self.request(u64::from(self.requests + r), &hashes, into),
                hit: hit.clone(),
                local_tokens: 0,
            };
            c.start_load_kv(Instant::now(), meta)?;
            c.wait_for_load();
            latencies.push(started.elapsed());
            let (_, loaded) = c.get_finished_reports();
            let errors = c.block_ids_with_load_errors();
            report.load_errors += errors.len() as u64;
            for (_, rep) in loaded {
                report.loaded_blocks += rep.loaded() as u64;
            }
            let hit_blocks = hit.tokens / self.block_tokens;
            for (i, h) in hashes.iter().enumerate().take(hit_blocks as usize) {
                let b = into + i as u32;
                if !errors.contains(&BlockId(b)) && !mem.holds(b, *h) {
                    report.verify_errors += 1;
                }
            }
            progress(DemoProgress::Loaded {
                done: r + 1,
                of: self.requests,
            });
        }
        Ok(latencies)
    }
}

fn gbps(bytes: u64, time: Duration) -> f64 {
    let s = time.as_secs_f64();
    if s > 0.0 {
        bytes as f64 / s / 1e9
    } else {
        0.0
    }
}

fn percentile(times: &[Duration], q: f64) -> f64 {
    if times.is_empty() {
        return 0.0;
    }
    let mut ms: Vec<f64> = times.iter().map(|t| t.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let i = ((ms.len() - 1) as f64 * q).round() as usize;
    ms[i]
}
