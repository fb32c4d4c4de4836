//! The shutdown latch: stop accepting work, then know that nobody is still
//! in the middle of submitting.

use crate::sync::{lock, AtomicUsize, Condvar, Mutex, Ordering};

/// Set in [`ShutdownLatch::state`] once the latch is closed.
const CLOSED: usize = 1 << (usize::BITS - 1);

/// Guards the submission path of engine threads against shutdown.
///
/// Every submission runs inside [`ShutdownLatch::enter`]. [`ShutdownLatch::close`]
/// refuses new entries and then waits until every submission that got in
/// has left. After `close` returns, no command can be added to any mailbox
/// any more, so an executor that drains its mailbox once after being told to
/// stop sees every command a caller was told was accepted. That is what lets
/// shutdown lose nothing.
///
/// The closed flag and the count of submissions inside live in one word, so
/// "am I closed?" and "I am inside" are one atomic read-modify-write and
/// cannot be reordered against each other (two separate atomics would need
/// `SeqCst` on both sides to rule out a submitter and the closer missing each
/// other).
#[derive(Debug)]
pub struct ShutdownLatch {
    /// `CLOSED` bit plus the number of submissions currently inside.
    state: AtomicUsize,
    /// Held only to sleep/wake the closer; protects no data of its own.
    sleep: Mutex<()>,
    wake: Condvar,
}

/// Proof that a submission is inside the latch; leaving drops it.
#[must_use = "the submission is only protected while the guard lives"]
#[derive(Debug)]
pub struct LatchGuard<'a> {
    latch: &'a ShutdownLatch,
}

impl Default for ShutdownLatch {
    fn default() -> Self {
        Self::new()
    }
}

impl ShutdownLatch {
    /// An open latch with nobody inside.
    pub fn new() -> Self {
        Self {
            state: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        }
    }

    /// Enters the latch, or returns `None` once it is closed.
    pub fn enter(&self) -> Option<LatchGuard<'_>> {
        // One read-modify-write both counts us in and tells us whether the
        // closer got there first, so there is no window between the two.
        // The count cannot reach the CLOSED bit: that would need 2^63
        // concurrent submissions.
        let previous = self.state.fetch_add(1, Ordering::Acquire);
        if previous & CLOSED != 0 {
            self.leave();
            return None;
        }
        Some(LatchGuard { latch: self })
    }

    /// True once [`ShutdownLatch::close`] started.
    pub fn is_closed(&self) -> bool {
        self.state.load(Ordering::Acquire) & CLOSED != 0
    }

    /// Number of submissions currently inside (for tests and stats).
    pub fn inside(&self) -> usize {
        self.state.load(Ordering::Acquire) & !CLOSED
    }

    /// Closes the latch and blocks until every submission inside has left.
    ///
    /// Submissions only do non-blocking work inside (a `try_send`), so the
    /// wait is short. Closing twice is harmless.
    pub fn close(&self) {
        self.state.fetch_or(CLOSED, Ordering::AcqRel);
        let mut guard = lock(&self.sleep);
        // Bounded by the number of submissions inside at the time of closing:
        // no new one can get in, and each one that leaves wakes us.
        while self.state.load(Ordering::Acquire) & !CLOSED != 0 {
            guard = self
                .wake
                .wait(guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    fn leave(&self) {
        // Release: everything the submission did (its `try_send`) happens
        // before the closer sees the count drop.
        let previous = self.state.fetch_sub(1, Ordering::Release);
        if previous == (CLOSED | 1) {
            // The last one out after closing. Taking the lock orders this
            // notification after the closer either checked the count (and
            // is now waiting) or has not checked it yet (and will see 0).
            let _guard = lock(&self.sleep);
            self.wake.notify_all();
        }
    }
}

impl Drop for LatchGuard<'_> {
    fn drop(&mut self) {
        self.latch.leave();
    }
}
