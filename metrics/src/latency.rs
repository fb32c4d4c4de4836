//! The one latency histogram of kvferry: the demo, the soak, the benches
//! and `/metrics` all record into it and read quantiles the same way.

use std::time::Duration;

use hdrhistogram::Histogram;

/// Fixed upper bounds (seconds) of the Prometheus buckets, derived from a
/// [`Latency`] at scrape time. Fixed so that histograms from different nodes
/// and runs can be summed.
pub const LATENCY_BUCKETS_S: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// Most microseconds recorded exactly; longer latencies are clamped to it
/// (an hour: past every deadline the node has).
const MAX_US: u64 = 3_600_000_000;

/// Latencies in microseconds, with 3 significant digits (HDR histogram:
/// every recorded value is within 0.1 % of what a quantile reports).
///
/// Quantiles use the nearest-rank rule: `quantile(q)` is the smallest
/// recorded value (to 3 digits) such that at least `q` of all values are at
/// most it.
#[derive(Clone, Debug)]
pub struct Latency {
    hist: Histogram<u64>,
    sum_us: u128,
}

impl Default for Latency {
    fn default() -> Self {
        Latency::new()
    }
}

impl Latency {
    /// An empty histogram.
    pub fn new() -> Latency {
        Latency {
            // 1 µs to an hour at 3 significant digits is a valid setting.
            hist: Histogram::new_with_bounds(1, MAX_US, 3).expect("valid histogram bounds"),
            sum_us: 0,
        }
    }

    /// Records one latency (below 1 µs counts as 1 µs, above an hour as an
    /// hour).
    pub fn record(&mut self, latency: Duration) {
        let us = u64::try_from(latency.as_micros())
            .unwrap_or(u64::MAX)
            .clamp(1, MAX_US);
        self.hist.saturating_record(us);
        self.sum_us += u128::from(us);
    }

    /// Adds every value of `other`.
    pub fn merge(&mut self, other: &Latency) {
        // Same bounds on both sides, so `add` cannot fail.
        let _ = self.hist.add(&other.hist);
        self.sum_us += other.sum_us;
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    /// Sum of the recorded values (after clamping).
    pub fn sum(&self) -> Duration {
        Duration::from_micros(u64::try_from(self.sum_us).unwrap_or(u64::MAX))
    }

    /// The nearest-rank `q` quantile (`0.0..=1.0`); zero when empty.
    pub fn quantile(&self, q: f64) -> Duration {
        if self.hist.is_empty() {
            return Duration::ZERO;
        }
        Duration::from_micros(self.hist.value_at_quantile(q.clamp(0.0, 1.0)))
    }

    /// Largest value recorded (to 3 digits); zero when empty.
    pub fn max(&self) -> Duration {
        Duration::from_micros(self.hist.max())
    }

    /// Mean of the recorded values; zero when empty.
    pub fn mean(&self) -> Duration {
        match self.count() {
            0 => Duration::ZERO,
            n => Duration::from_micros((self.sum_us / u128::from(n)) as u64),
        }
    }

    /// Values at most `bound` (to 3 digits).
    pub fn count_at_most(&self, bound: Duration) -> u64 {
        let us = u64::try_from(bound.as_micros()).unwrap_or(u64::MAX);
        if us == 0 {
            return 0;
        }
        self.hist.count_between(0, us.min(MAX_US))
    }

    /// Per-bucket counts for [`LATENCY_BUCKETS_S`] plus `+Inf` (not
    /// cumulative), as Prometheus histograms are derived from this one.
    pub fn buckets(&self) -> [u64; LATENCY_BUCKETS_S.len() + 1] {
        let mut out = [0u64; LATENCY_BUCKETS_S.len() + 1];
        let mut below = 0;
        for (slot, le) in out.iter_mut().zip(LATENCY_BUCKETS_S) {
            let at_most = self.count_at_most(Duration::from_secs_f64(le));
            *slot = at_most - below;
            below = at_most;
        }
        out[LATENCY_BUCKETS_S.len()] = self.count() - below;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank_to_three_digits() {
        let mut l = Latency::new();
        for us in 1..=1000u64 {
            l.record(Duration::from_micros(us));
        }
        assert_eq!(l.count(), 1000);
        assert_eq!(l.quantile(0.5), Duration::from_micros(500));
        assert_eq!(l.quantile(0.99), Duration::from_micros(990));
        assert_eq!(l.quantile(1.0), Duration::from_micros(1000));
        assert_eq!(l.quantile(0.0), Duration::from_micros(1));
        let mut big = Latency::new();
        big.record(Duration::from_micros(123_456));
        let q = big.quantile(0.5).as_micros() as f64;
        assert!((q - 123_456.0).abs() / 123_456.0 < 1e-3, "{q}");
        assert_eq!(Latency::new().quantile(0.5), Duration::ZERO);
    }

    #[test]
    fn buckets_partition_every_value() {
        let mut l = Latency::new();
        for d in [
            Duration::from_micros(700),
            Duration::from_millis(3),
            Duration::from_secs(100),
            Duration::ZERO,
        ] {
            l.record(d);
        }
        let b = l.buckets();
        assert_eq!(b.iter().sum::<u64>(), 4);
        assert_eq!(b[0], 1, "0 µs is recorded as 1 µs, at most 0.5 ms");
        assert_eq!(b[1], 1, "0.7 ms");
        assert_eq!(b[3], 1, "3 ms is at most 5 ms");
        assert_eq!(b[LATENCY_BUCKETS_S.len()], 1, "100 s is above 60 s");
        let mut m = Latency::new();
        m.merge(&l);
        m.merge(&l);
        assert_eq!(m.count(), 8);
        assert_eq!(m.sum(), l.sum() * 2);
    }
}
