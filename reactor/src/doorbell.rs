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

use std::cell::RefCell;
use std::task::Waker;

use crate::sync::{lock, Arc, AtomicBool, Mutex, Ordering};

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

std::thread_local! {
    /// Doorbells whose rings this thread holds back (see [`batch`]); `None`
    /// outside a batch.
    static HELD: RefCell<Option<Vec<Arc<Doorbell>>>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's doorbell rings held back until it returns
/// (or unwinds), then rings each held doorbell once.
///
/// An engine that queues several commands for one executor in a row (a new
/// machine and its first event, or a step's worth of requests) otherwise
/// may wake it once per command: on a busy core the woken executor runs at
/// once, takes the first command, parks, and is woken again for the next.
/// Batches nest; only the outermost one rings.
///
/// Nothing queued inside `f` is seen by a sleeping executor before `f`
/// returns, so `f` must not wait for an executor to act by other means than
/// the reactor handle's reads (`poll`, `get_finished`, `recv_finished`),
/// which call [`release_held`] first, as must any other wait built on
/// executors' work (the node's memory registration).
pub fn batch<R>(f: impl FnOnce() -> R) -> R {
    struct Release {
        outermost: bool,
    }
    impl Drop for Release {
        fn drop(&mut self) {
            if self.outermost {
                release_held();
                HELD.with(|h| *h.borrow_mut() = None);
            }
        }
    }
    let outermost = HELD.with(|h| {
        let mut h = h.borrow_mut();
        let outermost = h.is_none();
        if outermost {
            *h = Some(Vec::new());
        }
        outermost
    });
    let _release = Release { outermost };
    f()
}

/// Rings the doorbells this thread's enclosing [`batch`] holds back; a
/// no-op outside a batch. The batch goes on holding later rings.
pub fn release_held() {
    let held = HELD.with(|h| h.borrow_mut().as_mut().map(std::mem::take));
    for doorbell in held.into_iter().flatten() {
        doorbell.ring();
    }
}

/// Rings `doorbell` now, or when this thread's enclosing [`batch`] ends.
pub(crate) fn ring_or_hold(doorbell: &Arc<Doorbell>) {
    let held = HELD.with(|h| match h.borrow_mut().as_mut() {
        Some(list) => {
            if !list.iter().any(|d| Arc::ptr_eq(d, doorbell)) {
                list.push(Arc::clone(doorbell));
            }
            true
        }
        None => false,
    });
    if !held {
        doorbell.ring();
    }
}

#[cfg(all(test, not(kvferry_loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn armed() -> (Arc<Doorbell>, std::sync::Arc<Count>) {
        let count = std::sync::Arc::new(Count(AtomicUsize::new(0)));
        let bell = Arc::new(Doorbell::new());
        bell.arm(&Waker::from(count.clone()));
        (bell, count)
    }

    fn wakes(c: &Count) -> usize {
        c.0.load(Ordering::SeqCst)
    }

    #[test]
    fn a_batch_rings_each_doorbell_once_when_it_ends() {
        let (a, ca) = armed();
        let (b, cb) = armed();
        batch(|| {
            ring_or_hold(&a);
            ring_or_hold(&b);
            ring_or_hold(&a);
            // A nested batch ending rings nothing.
            batch(|| ring_or_hold(&b));
            assert_eq!((wakes(&ca), wakes(&cb)), (0, 0), "held until the end");
        });
        assert_eq!((wakes(&ca), wakes(&cb)), (1, 1));
        // Outside a batch a ring wakes at once.
        a.arm(&Waker::from(ca.clone()));
        ring_or_hold(&a);
        assert_eq!(wakes(&ca), 2);
    }

    #[test]
    fn release_held_rings_inside_a_batch_and_a_panic_still_rings() {
        let (a, ca) = armed();
        batch(|| {
            ring_or_hold(&a);
            release_held();
            assert_eq!(wakes(&ca), 1, "released before a wait");
            a.arm(&Waker::from(ca.clone()));
            ring_or_hold(&a);
            assert_eq!(wakes(&ca), 1, "later rings are held again");
        });
        assert_eq!(wakes(&ca), 2);
        a.arm(&Waker::from(ca.clone()));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            batch(|| {
                ring_or_hold(&a);
                panic!("engine bug");
            })
        }));
        assert!(r.is_err());
        assert_eq!(wakes(&ca), 3, "an unwinding batch still rings");
        // And the thread is out of the batch afterwards.
        a.arm(&Waker::from(ca.clone()));
        ring_or_hold(&a);
        assert_eq!(wakes(&ca), 4);
    }
}
