//! `kvferry bench transport ...`: throughput and latency of a transport on
//! loopback, next to single-thread memcpy of the same buffers in the same run.

use std::process::ExitCode;
use std::time::Duration;

use glommio::Placement;

use clap::{Args, ValueEnum};
use kvferry::transport::{Cadence, MooncakeConfig, Op, PollPolicy};

use super::baseline::{self, BaselineArg, BaselineRun};
use super::loopback::measure;
use super::measure::{placement, Measured, Params};
use super::pingpong;
use super::sweep::{self, SweepArgs};
use crate::shape::TransportArg;
use crate::usage::{usage_error, UsageError};

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
