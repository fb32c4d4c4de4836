//! How engine threads wake an executor after queueing a command.
//!
//! A `flume` stream wakes its receiver from inside `send`, with the
//! channel's lock still held. On a busy core the woken executor often runs
//! at once, preempting the sender while it holds the lock; its first
//! `try_recv` then blocks on that lock and the core goes back to the sender
//! to let it unlock: two extra context switches and two `futex` calls per
//! command (seen with `perf sched` on every small request). The executor
//! therefore does not register with the channel; it arms this doorbell
//! before its last look at the queue, and a sender rings it after `try_send`
//! returned, when no lock is held.
//!
//! The handshake is the store-buffer pattern, hence `SeqCst` on both sides:
//! the executor stores `armed` and then looks at the queue; a sender stores
//! into the queue and then swaps `armed`. At least one sees the other, so a
//! command is never left in the queue of a sleeping executor.

use std::task::Waker;

use crate::sync::{lock, AtomicBool, Mutex, Ordering};

/// One executor's doorbell (see the module docs).
#[derive(Debug, Default)]
pub struct Doorbell {
    armed: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Doorbell {
    /// An unarmed doorbell.
    pub fn new() -> Doorbell {
        Doorbell::default()
    }

    /// Receiver side: the next [`Doorbell::ring`] wakes `waker`. Call it
    /// before the final look at the queue, never after.
    pub fn arm(&self, waker: &Waker) {
        {
            let mut slot = lock(&self.waker);
            if !slot.as_ref().is_some_and(|w| w.will_wake(waker)) {
                *slot = Some(waker.clone());
            }
        }
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Sender side, after the command is in the queue: wakes the receiver
    /// if it armed the doorbell since it last woke. Cheap when it did not
    /// (one atomic swap), so a burst of commands costs one wake-up.
    pub fn ring(&self) {
        if self.armed.swap(false, Ordering::SeqCst) {
            // The guard is a temporary: the lock is released before `wake`.
            let waker = lock(&self.waker).take();
            if let Some(waker) = waker {
                waker.wake();
            }
        }
    }
}
