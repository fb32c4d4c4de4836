//! Arithmetic on deadlines.

use std::time::{Duration, Instant};

/// Earliest of two optional deadlines.
pub(crate) fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// `now + d`, saturating far in the future instead of panicking.
pub(crate) fn after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(u32::MAX as u64))
}
