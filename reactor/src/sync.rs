//! The synchronisation primitives every cross-thread piece of the reactor uses.
//!
//! Normal builds re-export `std`. Under `--cfg kvferry_loom` the same names
//! come from [`loom`](https://docs.rs/loom), so the completion board, the
//! stats counters and the shutdown latch can be model-checked unchanged
//! (see `reactor/tests/loom.rs`). Code outside this module must not name
//! `std::sync` or `std::thread` for state shared between threads, or loom
//! would not see those accesses and the models would prove nothing.

#[cfg(not(kvferry_loom))]
pub use std::sync::{Arc, Condvar, Mutex, MutexGuard};

#[cfg(not(kvferry_loom))]
pub use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

#[cfg(not(kvferry_loom))]
pub use std::thread;

#[cfg(kvferry_loom)]
pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard};

#[cfg(kvferry_loom)]
pub use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

#[cfg(kvferry_loom)]
pub use loom::thread;

/// Locks `mutex`, ignoring poisoning.
///
/// Every structure guarded by a mutex in this crate keeps its invariants
/// across each statement that can panic (nothing panics while it is half
/// updated), so the data behind a poisoned lock is still consistent and
/// refusing it would only turn one panic into many.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
