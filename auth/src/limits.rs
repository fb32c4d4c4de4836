//! Per-address budgets: what keeps one address's flood from taking what
//! the others need. Sans-IO like the rest of the crate: the caller passes
//! the time in (milliseconds of any monotonic clock).

use std::collections::HashMap;
use std::net::IpAddr;

/// How much work one address may ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Units granted per second, on average.
    pub per_second: u32,
    /// Most units granted at once (a bucket's size).
    pub burst: u32,
    /// Most addresses tracked; past it a new address is refused until a
    /// tracked one's bucket is full again (it is then forgotten).
    pub max_addrs: usize,
}

/// Token buckets per address, at most `budget.max_addrs` of them.
#[derive(Debug)]
pub struct PeerBudget {
    budget: Budget,
    /// Per address: thousandths of a unit left, and when last refilled.
    buckets: HashMap<IpAddr, (u64, u64)>,
}

impl PeerBudget {
    /// Empty: every address starts with a full bucket.
    pub fn new(budget: Budget) -> PeerBudget {
        PeerBudget {
            budget,
            buckets: HashMap::new(),
        }
    }

    /// Addresses tracked now.
    pub fn tracked(&self) -> usize {
        self.buckets.len()
    }

    /// Takes one unit for `addr` at `now_ms`; false when its bucket is
    /// empty, or when it is new and every tracked address is still busy.
    pub fn allow(&mut self, now_ms: u64, addr: IpAddr) -> bool {
        let full = u64::from(self.budget.burst) * 1000;
        let rate = u64::from(self.budget.per_second);
        if !self.buckets.contains_key(&addr) && !self.make_room(now_ms) {
            return false;
        }
        let (left, at) = self.buckets.entry(addr).or_insert((full, now_ms));
        *left = (*left + now_ms.saturating_sub(*at) * rate).min(full);
        *at = now_ms.max(*at);
        if *left < 1000 {
            return false;
        }
        *left -= 1000;
        true
    }

    /// Room for one more address: forgets those whose buckets refilled.
    fn make_room(&mut self, now_ms: u64) -> bool {
        if self.buckets.len() < self.budget.max_addrs {
            return true;
        }
        let full = u64::from(self.budget.burst) * 1000;
        let rate = u64::from(self.budget.per_second);
        self.buckets
            .retain(|_, (left, at)| *left + now_ms.saturating_sub(*at) * rate < full);
        self.buckets.len() < self.budget.max_addrs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    #[test]
    fn a_burst_then_the_rate() {
        let mut b = PeerBudget::new(Budget {
            per_second: 10,
            burst: 3,
            max_addrs: 8,
        });
        assert!((0..3).all(|_| b.allow(0, ip(1))));
        assert!(!b.allow(0, ip(1)), "the burst is spent");
        assert!(b.allow(0, ip(2)), "another address has its own bucket");
        assert!(!b.allow(99, ip(1)), "0.99 of a unit");
        assert!(b.allow(100, ip(1)), "one unit per 100 ms");
        assert!(b.allow(10_000, ip(1)) && b.allow(10_000, ip(1)) && b.allow(10_000, ip(1)));
        assert!(
            !b.allow(10_000, ip(1)),
            "refilled to the burst, not past it"
        );
    }

    #[test]
    fn addresses_are_bounded_and_busy_ones_are_kept() {
        let mut b = PeerBudget::new(Budget {
            per_second: 1,
            burst: 2,
            max_addrs: 2,
        });
        assert!(b.allow(0, ip(1)) && b.allow(0, ip(2)));
        assert!(!b.allow(0, ip(3)), "both tracked addresses are busy");
        assert_eq!(b.tracked(), 2);
        // Once ip(1) and ip(2) refilled they are forgotten for newcomers.
        assert!(b.allow(2_000, ip(3)));
        assert!(b.tracked() <= 2);
    }
}
