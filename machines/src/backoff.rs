//! How long to wait before trying again: one exponential back-off policy.
//!
//! Every retry in kvferry waits the same way: a short first pause, so that
//! a peer or service that is merely slow is tried again soon, growing by a
//! factor after each try, so that one that is down is not flooded, and
//! never longer than a cap, so that one that comes back is found within
//! that cap. The state machines resend lost control messages on it
//! (`Config::resend_after` doubling up to `heartbeat_interval`), the
//! bootstrap client retries registrations and queries on it, the Mooncake
//! transport polls a batch's completion on it, and the store binding skips
//! a store found down on it (with a factor of 1: a fixed pause).
//!
//! Like the rest of this crate it reads no clock and sleeps on nothing: a
//! [`Backoff`] gives [`Duration`]s, and the one question that needs the
//! time ([`BackoffState::next_before`], how long may I wait before the
//! deadline) takes `now` from the caller. Arithmetic saturates, so no
//! setting, however large, panics or wraps.

use std::time::{Duration, Instant};

/// A back-off policy: pause `first`, then `factor` times longer after each
/// try, at most `max`.
///
/// The pause before try `step + 1` (`step` counting from 0) is
/// `min(first · factor^step, max)`. A `first` above `max` is cut to `max`:
/// `max` is the longest pause, whatever the rest says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    factor: u32,
}

impl Backoff {
    /// `first`, then `factor` times longer after each try, at most `max`.
    /// A factor of 0 counts as 1 (a pause never shrinks to nothing).
    pub const fn new(first: Duration, max: Duration, factor: u32) -> Backoff {
        Backoff {
            first,
            max,
            factor: if factor == 0 { 1 } else { factor },
        }
    }

    /// `first`, twice as long after each try, at most `max`: the schedule
    /// every retry in kvferry uses.
    pub const fn doubling(first: Duration, max: Duration) -> Backoff {
        Backoff::new(first, max, 2)
    }

    /// The same `pause` before every try (a factor of 1).
    pub const fn fixed(pause: Duration) -> Backoff {
        Backoff::new(pause, pause, 1)
    }

    /// The first pause, as configured (before the cap at [`Backoff::max`]).
    pub const fn first(&self) -> Duration {
        self.first
    }

    /// The longest pause.
    pub const fn max(&self) -> Duration {
        self.max
    }

    /// How much longer each pause is than the one before (at least 1).
    pub const fn factor(&self) -> u32 {
        self.factor
    }

    /// The pause before try `step + 1`: `min(first · factor^step, max)`.
    /// For callers that count their tries themselves (a resend step, a
    /// poll count); [`Backoff::start`] counts them instead.
    pub fn delay(&self, step: u32) -> Duration {
        let mut pause = self.first.min(self.max);
        for _ in 0..step {
            if !self.grows(pause) {
                break;
            }
            pause = self.grow(pause);
        }
        pause
    }

    /// A fresh schedule of this policy: its first pause is `delay(0)`.
    pub fn start(&self) -> BackoffState {
        BackoffState {
            policy: *self,
            pause: self.delay(0),
            step: 0,
        }
    }

    /// True while `pause` still changes when grown: below the cap, not
    /// zero, and a factor above 1. Bounds [`Backoff::delay`]'s loop by
    /// the number of doublings from 1 ns to the cap (under a hundred).
    fn grows(&self, pause: Duration) -> bool {
        self.factor > 1 && !pause.is_zero() && pause < self.max
    }

    /// The pause after `pause`.
    fn grow(&self, pause: Duration) -> Duration {
        pause.saturating_mul(self.factor).min(self.max)
    }
}

/// One run of tries under a [`Backoff`]: hands out the pauses in order.
///
/// Made by [`Backoff::start`]; [`BackoffState::reset`] starts it again
/// (after a success, say, so the next failure is retried soon).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackoffState {
    policy: Backoff,
    /// The pause the next call hands out.
    pause: Duration,
    /// Pauses handed out since the start.
    step: u32,
}

impl BackoffState {
    /// The policy this schedule follows.
    pub const fn policy(&self) -> Backoff {
        self.policy
    }

    /// Pauses handed out since the start or the last reset.
    pub const fn step(&self) -> u32 {
        self.step
    }

    /// The next pause, and the schedule moves on: the n-th call (from 0)
    /// returns `policy.delay(n)`.
    pub fn next_delay(&mut self) -> Duration {
        let pause = self.pause;
        if self.policy.grows(pause) {
            self.pause = self.policy.grow(pause);
        }
        self.step = self.step.saturating_add(1);
        pause
    }

    /// The next pause, cut short so that it ends by `deadline`; `None`
    /// (and the schedule stays where it is) once `now` has reached the
    /// deadline, when there is no time left to wait for another try. A
    /// caller that waits what this returns never waits past its deadline.
    pub fn next_before(&mut self, now: Instant, deadline: Instant) -> Option<Duration> {
        let left = deadline
            .checked_duration_since(now)
            .filter(|l| !l.is_zero())?;
        Some(self.next_delay().min(left))
    }

    /// Back to the first pause.
    pub fn reset(&mut self) {
        *self = self.policy.start();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn pauses(state: &mut BackoffState, n: usize) -> Vec<Duration> {
        (0..n).map(|_| state.next_delay()).collect()
    }

    #[test]
    fn doubles_from_the_first_pause() {
        let b = Backoff::doubling(ms(10), ms(1000));
        let want = [10, 20, 40, 80, 160].map(ms);
        assert_eq!(pauses(&mut b.start(), 5), want);
        assert_eq!((0..5).map(|s| b.delay(s)).collect::<Vec<_>>(), want);
    }

    #[test]
    fn caps_at_max_and_stays_there() {
        let b = Backoff::doubling(ms(10), ms(50));
        assert_eq!(pauses(&mut b.start(), 5), [10, 20, 40, 50, 50].map(ms));
        assert_eq!(b.delay(u32::MAX), ms(50));
        // The largest settings saturate instead of overflowing.
        let huge = Backoff::doubling(Duration::MAX / 3, Duration::MAX);
        assert_eq!(huge.delay(3), Duration::MAX);
    }

    #[test]
    fn a_first_pause_above_max_is_cut_to_max() {
        let b = Backoff::doubling(ms(80), ms(50));
        assert_eq!(pauses(&mut b.start(), 3), [50, 50, 50].map(ms));
    }

    #[test]
    fn factor_one_is_a_fixed_pause_and_zero_counts_as_one() {
        let fixed = Backoff::fixed(ms(7));
        assert_eq!(pauses(&mut fixed.start(), 3), [7, 7, 7].map(ms));
        assert_eq!(fixed.delay(u32::MAX), ms(7));
        assert_eq!(Backoff::new(ms(7), ms(100), 0).delay(5), ms(7));
        assert_eq!(Backoff::new(ms(1), ms(100), 3).delay(3), ms(27));
    }

    #[test]
    fn never_waits_past_the_deadline() {
        let t0 = Instant::now();
        let deadline = t0 + ms(100);
        let mut s = Backoff::doubling(ms(30), ms(1000)).start();
        assert_eq!(s.next_before(t0, deadline), Some(ms(30)));
        assert_eq!(s.next_before(t0 + ms(30), deadline), Some(ms(60)));
        // 120 ms due, 10 ms left: the pause ends at the deadline.
        assert_eq!(s.next_before(t0 + ms(90), deadline), Some(ms(10)));
        // At or past the deadline: no pause, and nothing handed out.
        let step = s.step();
        assert_eq!(s.next_before(deadline, deadline), None);
        assert_eq!(s.next_before(deadline + ms(1), deadline), None);
        assert_eq!(s.step(), step);
    }

    #[test]
    fn reset_starts_again_at_the_first_pause() {
        let b = Backoff::doubling(ms(10), ms(1000));
        let mut s = b.start();
        pauses(&mut s, 4);
        s.reset();
        assert_eq!(s, b.start());
        assert_eq!(s.next_delay(), ms(10));
    }

    fn policy() -> impl Strategy<Value = Backoff> {
        let d = || (0u64..=u64::MAX, 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n));
        let short = || (0u64..10_000_000).prop_map(Duration::from_nanos);
        (
            prop_oneof![short(), d()],
            prop_oneof![short(), d()],
            0u32..12,
        )
            .prop_map(|(first, max, factor)| Backoff::new(first, max, factor))
    }

    proptest! {
        /// The schedule is `min(first · factor^n, max)`: each pause is the
        /// one before times the factor, at most `max`; the state hands out
        /// exactly the stateless delays.
        #[test]
        fn grows_by_the_factor_up_to_max(b in policy(), n in 0usize..80) {
            let mut s = b.start();
            let mut want = b.first().min(b.max());
            for step in 0..n as u32 {
                prop_assert_eq!(b.delay(step), want);
                prop_assert_eq!(s.next_delay(), want);
                prop_assert!(want <= b.max());
                want = want.saturating_mul(b.factor()).min(b.max());
            }
        }

        /// Whatever the policy and the clock, a pause never ends after the
        /// deadline, and there is none once it has passed.
        #[test]
        fn never_past_the_deadline(
            b in policy(),
            now_ms in 0u64..10_000,
            deadline_ms in 0u64..10_000,
            tries in 1usize..20,
        ) {
            let t0 = Instant::now();
            let (now, deadline) = (t0 + ms(now_ms), t0 + ms(deadline_ms));
            let mut s = b.start();
            for _ in 0..tries {
                match s.next_before(now, deadline) {
                    Some(p) => prop_assert!(now + p <= deadline && now < deadline),
                    None => prop_assert!(now >= deadline),
                }
            }
        }

        /// A reset schedule hands out what a fresh one does.
        #[test]
        fn reset_is_a_fresh_start(b in policy(), used in 0usize..40, n in 0usize..20) {
            let mut s = b.start();
            pauses(&mut s, used);
            s.reset();
            prop_assert_eq!(pauses(&mut s, n), pauses(&mut b.start(), n));
        }
    }
}
