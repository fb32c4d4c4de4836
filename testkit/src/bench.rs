//! A small benchmark harness for the `benches/` targets (`harness = false`).
//!
//! Each benchmark is timed in samples: a warm-up finds how many iterations
//! fill a sample, then the samples run and the report gives the median,
//! the fastest and the slowest sample per iteration, and the throughput at
//! the median. The median is what the performance tables quote: on a
//! shared, noisy machine it moves least between runs.
//!
//! `cargo bench --bench NAME -- FILTER` runs the benchmarks whose full name
//! (`group/name`) contains `FILTER`; flags cargo passes (`--bench`) are
//! ignored.

use std::hint::black_box;
use std::time::{Duration, Instant};

/// What one iteration moves, for the throughput column.
#[derive(Clone, Copy, Debug)]
pub enum Throughput {
    /// Bytes per iteration.
    Bytes(u64),
    /// Elements (events, requests) per iteration.
    Elements(u64),
}

/// A named set of benchmarks sharing sampling settings and throughput.
#[derive(Debug)]
pub struct Group {
    name: String,
    filter: Option<String>,
    samples: usize,
    measurement: Duration,
    throughput: Option<Throughput>,
}

/// A group named `name`, 30 samples over about 3 s per benchmark.
pub fn group(name: &str) -> Group {
    Group {
        name: name.to_owned(),
        filter: std::env::args().skip(1).find(|a| !a.starts_with("--")),
        samples: 30,
        measurement: Duration::from_secs(3),
        throughput: None,
    }
}

impl Group {
    /// How many samples each benchmark takes (at least 3).
    pub fn sample_size(&mut self, samples: usize) -> &mut Self {
        self.samples = samples.max(3);
        self
    }

    /// About how long each benchmark's samples take together.
    pub fn measurement_time(&mut self, d: Duration) -> &mut Self {
        self.measurement = d;
        self
    }

    /// What one iteration of the benchmarks that follow moves.
    pub fn throughput(&mut self, t: Throughput) -> &mut Self {
        self.throughput = Some(t);
        self
    }

    /// Runs `f` with a [`Bencher`] for each sample and prints the report;
    /// returns the median time per iteration (None when filtered out).
    pub fn bench(&mut self, name: &str, mut f: impl FnMut(&mut Bencher)) -> Option<Duration> {
        let full = format!("{}/{name}", self.name);
        if self.filter.as_ref().is_some_and(|x| !full.contains(x)) {
            return None;
        }
        let iters = self.iterations_per_sample(&mut f);
        let mut per_iter: Vec<Duration> = (0..self.samples)
            .map(|_| sample(&mut f, iters).div_f64(iters as f64))
            .collect();
        per_iter.sort_unstable();
        let median = per_iter[per_iter.len() / 2];
        println!(
            "{full:<48} median {:>12} [{} .. {}]  {} samples x {iters}{}",
            show(median),
            show(per_iter[0]),
            show(per_iter[per_iter.len() - 1]),
            self.samples,
            self.throughput.map(|t| rate(t, median)).unwrap_or_default(),
        );
        Some(median)
    }

    /// Iterations per sample: grown from one until a call takes a
    /// measurable time, then scaled so the samples fill the measurement time.
    fn iterations_per_sample(&self, f: &mut impl FnMut(&mut Bencher)) -> u64 {
        let mut iters = 1u64;
        let took = loop {
            let took = sample(f, iters);
            if took >= Duration::from_millis(20) || iters >= 1 << 30 {
                break took;
            }
            iters *= 2;
        };
        let per_iter = took.as_secs_f64() / iters as f64;
        let budget = self.measurement.as_secs_f64() / self.samples as f64;
        ((budget / per_iter.max(1e-12)) as u64).clamp(1, u32::MAX as u64)
    }
}

/// Hands a benchmark the number of iterations a sample wants and records
/// how long they took.
#[derive(Debug)]
pub struct Bencher {
    iters: u64,
    elapsed: Duration,
}

impl Bencher {
    /// Times `iters` calls of `f` (its result is kept from the optimiser).
    pub fn iter<T>(&mut self, mut f: impl FnMut() -> T) {
        let start = Instant::now();
        for _ in 0..self.iters {
            black_box(f());
        }
        self.elapsed = start.elapsed();
    }

    /// `f` runs and times the given number of iterations itself, for set-up
    /// that must stay out of the measurement.
    pub fn iter_custom(&mut self, mut f: impl FnMut(u64) -> Duration) {
        self.elapsed = f(self.iters);
    }
}

fn sample(f: &mut impl FnMut(&mut Bencher), iters: u64) -> Duration {
    let mut b = Bencher {
        iters,
        elapsed: Duration::ZERO,
    };
    f(&mut b);
    b.elapsed
}

fn show(d: Duration) -> String {
    let ns = d.as_secs_f64() * 1e9;
    match ns {
        x if x < 1e3 => format!("{x:.1} ns"),
        x if x < 1e6 => format!("{:.2} µs", x / 1e3),
        x if x < 1e9 => format!("{:.3} ms", x / 1e6),
        x => format!("{:.3} s", x / 1e9),
    }
}

fn rate(t: Throughput, per_iter: Duration) -> String {
    let s = per_iter.as_secs_f64().max(1e-15);
    match t {
        Throughput::Bytes(n) => format!("  {:.3} GiB/s", n as f64 / s / (1u64 << 30) as f64),
        Throughput::Elements(n) => format!("  {:.3} M/s", n as f64 / s / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_tracks_the_work_per_iteration() {
        let spin = |n: u64| {
            let start = Instant::now();
            while start.elapsed() < Duration::from_micros(n) {}
        };
        let mut g = group("t");
        g.filter = None;
        g.sample_size(5)
            .measurement_time(Duration::from_millis(100));
        let short = g.bench("short", |b| b.iter(|| spin(20))).unwrap();
        let long = g.bench("long", |b| b.iter(|| spin(200))).unwrap();
        assert!(short >= Duration::from_micros(20), "{short:?}");
        assert!(long >= Duration::from_micros(200), "{long:?}");
        assert!(long > short * 4, "{short:?} vs {long:?}");
    }

    #[test]
    fn a_filter_skips_the_benchmarks_it_does_not_name() {
        let mut g = group("t");
        g.filter = Some("wanted".into());
        g.sample_size(3).measurement_time(Duration::from_millis(10));
        let mut ran = false;
        assert!(g.bench("other", |b| b.iter(|| ran = true)).is_none());
        assert!(!ran);
        assert!(g.bench("wanted", |b| b.iter(|| 1)).is_some());
    }
}
