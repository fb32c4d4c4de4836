//! `kvferry bench transport --sweep`: tcp and local over block sizes from
//! 4 KiB to 64 MiB, next to the iperf3 and memcpy baselines, as a table and
//! optionally CSV; plus one run of single-descriptor 4 KiB batches per
//! transport whose every batch latency can be written out
//! (`scripts/plot_sweep.py` turns both files into plots).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use super::baseline::{Baseline, IPERF3_MAX_LEN};
use super::loopback::measure;
use super::measure::{Measured, Params};
use crate::usage::UsageError;

/// Block sizes a sweep measures.
const BLOCKS: [u64; 8] = [
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
];

/// Most bytes one batch of the sweep moves (the buffers are twice that).
const MAX_BATCH_BYTES: u64 = 256 << 20;

/// Most latencies written per transport (`--samples`).
const MAX_SAMPLES: usize = 100_000;

/// The options of `--sweep`.
#[derive(Clone, Debug, Args)]
pub(crate) struct SweepArgs {
    /// Measure tcp and local, and the iperf3 (when on PATH) and memcpy
    /// baselines, at block sizes 4 KiB..64 MiB (`--batch` descriptors per
    /// batch, at most 256 MiB), then 4 KiB single-descriptor batches;
    /// `--transport` and `--block-bytes` are not used.
    #[arg(long)]
    pub(crate) sweep: bool,
    /// Largest block size of the sweep.
    #[arg(long, value_name = "N", default_value_t = 64 << 20, requires = "sweep")]
    sweep_max_bytes: u64,
    /// Seconds per point of the sweep.
    #[arg(long, value_name = "S", default_value_t = 1.0, requires = "sweep")]
    point_seconds: f64,
    /// Write the sweep as CSV: block_bytes, batch, streams, transport,
    /// gbps, p50_us, p99_us (latencies empty for the baselines).
    #[arg(long, value_name = "FILE", requires = "sweep")]
    csv: Option<PathBuf>,
    /// Write the latencies of the 4 KiB single-descriptor batches as CSV:
    /// transport, seq (the batch's number), latency_us; every batch, or
    /// every k-th of a run longer than 100 000 batches.
    #[arg(long, value_name = "FILE", requires = "sweep")]
    samples: Option<PathBuf>,
}

/// One row of the sweep.
struct Row {
    block_bytes: u64,
    batch: u64,
    streams: usize,
    transport: &'static str,
    gbps: f64,
    /// p50 and p99 batch latency in µs, for the transports.
    latency_us: Option<(f64, f64)>,
}

impl Row {
    fn csv(&self) -> String {
        let (p50, p99) = self
            .latency_us
            .map_or((String::new(), String::new()), |(a, b)| {
                (format!("{a:.1}"), format!("{b:.1}"))
            });
        format!(
            "{},{},{},{},{:.4},{p50},{p99}",
            self.block_bytes, self.batch, self.streams, self.transport, self.gbps
        )
    }

    fn print(&self) {
        let lat = self.latency_us.map_or(String::new(), |(a, b)| {
            format!("  p50 {a:.1} us  p99 {b:.1} us")
        });
        println!(
            "{:>9} B x {:<3} {:<7} {:>8.3} GB/s{lat}",
            self.block_bytes, self.batch, self.transport, self.gbps
        );
    }
}

/// Entry point of `kvferry bench transport --sweep`.
pub(crate) fn main(base: &Params, a: &SweepArgs) -> Result<ExitCode, UsageError> {
    if !(a.point_seconds > 0.0 && a.point_seconds <= 3600.0) {
        return Err(UsageError("--point-seconds must be in (0, 3600]".into()));
    }
    let iperf3 = Baseline::find_iperf3().ok();
    if iperf3.is_none() {
        eprintln!("kvferry bench transport --sweep: iperf3 is not on PATH; no iperf3 rows");
    }
    let base = Params {
        seconds: a.point_seconds,
        json: false,
        ..base.clone()
    };
    let mut rows = Vec::new();
    let mut samples = String::from("transport,seq,latency_us\n");
    let run = sweep_blocks(&base, a.sweep_max_bytes, iperf3.as_ref(), &mut rows)
        .and_then(|()| sweep_latency(&base, &mut rows, &mut samples));
    if let Err(e) = run {
        eprintln!("kvferry bench transport --sweep: {e}");
        return Ok(ExitCode::FAILURE);
    }
    let mut csv = String::from("block_bytes,batch,streams,transport,gbps,p50_us,p99_us\n");
    for r in &rows {
        let _ = writeln!(csv, "{}", r.csv());
    }
    for (path, text) in [(&a.csv, &csv), (&a.samples, &samples)] {
        if let Some(path) = path {
            if let Err(e) = std::fs::write(path, text) {
                eprintln!("kvferry bench transport --sweep: {}: {e}", path.display());
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Throughput of every transport and baseline at every block size.
fn sweep_blocks(
    base: &Params,
    max_bytes: u64,
    iperf3: Option<&Baseline>,
    rows: &mut Vec<Row>,
) -> Result<(), String> {
    for block_bytes in BLOCKS.into_iter().take_while(|&b| b <= max_bytes) {
        let batch = base.batch.min(MAX_BATCH_BYTES / block_bytes).max(1);
        let p = Params {
            block_bytes,
            batch,
            ..base.clone()
        };
        let mut memcpy = 0.0;
        for transport in ["tcp", "shm", "local"] {
            let m = measure_verified(&Params {
                transport: transport.into(),
                ..p.clone()
            })?;
            memcpy = m.memcpy_gbps;
            push(rows, transport_row(&p, transport, &m));
        }
        push(rows, baseline_row(&p, "memcpy", memcpy));
        // iperf3 takes at most 1 MiB per write; larger blocks compare
        // against its 1 MiB row.
        if let Some(b) = iperf3.filter(|_| block_bytes <= IPERF3_MAX_LEN) {
            let r = b.run(&p)?;
            push(rows, baseline_row(&p, "iperf3", r.gbps));
        }
    }
    Ok(())
}

/// Single-descriptor 4 KiB batches, every latency kept in `samples`.
fn sweep_latency(base: &Params, rows: &mut Vec<Row>, samples: &mut String) -> Result<(), String> {
    for transport in ["tcp", "shm", "local"] {
        let p = Params {
            transport: transport.into(),
            block_bytes: 4 << 10,
            batch: 1,
            keep_samples: true,
            ..base.clone()
        };
        let m = measure_verified(&p)?;
        // Every k-th batch, evenly over the run: the same distribution in
        // at most MAX_SAMPLES lines.
        let k = m.samples.len().div_ceil(MAX_SAMPLES).max(1);
        for (seq, d) in m.samples.iter().enumerate().step_by(k) {
            let _ = writeln!(samples, "{transport},{seq},{:.3}", d.as_secs_f64() * 1e6);
        }
        push(rows, transport_row(&p, transport, &m));
    }
    Ok(())
}

fn measure_verified(p: &Params) -> Result<Measured, String> {
    let m = measure(p)?;
    if !m.verified {
        return Err(format!(
            "{} {} B x {}: destination differs from source",
            p.transport, p.block_bytes, p.batch
        ));
    }
    Ok(m)
}

fn push(rows: &mut Vec<Row>, r: Row) {
    r.print();
    rows.push(r);
}

fn transport_row(p: &Params, transport: &'static str, m: &Measured) -> Row {
    let us = |q: f64| m.latencies.quantile(q).as_secs_f64() * 1e6;
    Row {
        block_bytes: p.block_bytes,
        batch: p.batch,
        streams: p.streams,
        transport,
        gbps: m.gbps(p),
        latency_us: Some((us(0.50), us(0.99))),
    }
}

/// A baseline's row: one thread (memcpy) or one stream (iperf3).
fn baseline_row(p: &Params, transport: &'static str, gbps: f64) -> Row {
    Row {
        block_bytes: p.block_bytes,
        batch: p.batch,
        streams: 1,
        transport,
        gbps,
        latency_us: None,
    }
}
