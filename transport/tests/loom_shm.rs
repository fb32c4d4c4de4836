//! Loom model of the shared-memory fence handshake
//! (`kvferry_transport::internal::shm_protocol`, the functions the
//! transport runs on its control file): a peer's copy never overlaps the
//! owner's use of a block after the owner closed it.
//!
//! Run with:
//! `RUSTFLAGS="--cfg kvferry_loom_shm" CARGO_TARGET_DIR=target/loom-shm cargo test -p kvferry-transport --release --test loom_shm`
#![cfg(kvferry_loom_shm)]

use kvferry_transport::internal::shm_protocol::{busy, enter, leave, Lane, Word};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicU64, Ordering::SeqCst};
use loom::sync::Arc;
use loom::thread;

struct W(AtomicU64);

impl Word for W {
    fn get(&self) -> u64 {
        self.0.load(SeqCst)
    }
    fn set(&self, v: u64) {
        self.0.store(v, SeqCst)
    }
    fn clear(&self, mask: u64) {
        self.0.fetch_and(!mask, SeqCst);
    }
    fn raise(&self, mask: u64) {
        self.0.fetch_or(mask, SeqCst);
    }
    fn fence() {
        loom::sync::atomic::fence(SeqCst)
    }
}

/// A lane, one fence word (bit 0: block 0 open) and the block's bytes.
struct Shared {
    seq: W,
    range: [W; 3],
    bits: W,
    block: UnsafeCell<u64>,
}

impl Shared {
    fn lane(&self) -> Lane<'_, W> {
        Lane {
            seq: &self.seq,
            range: [&self.range[0], &self.range[1], &self.range[2]],
        }
    }
}

/// The peer copies into block 0 (`copies` times) while the owner closes
/// it and then reuses it. Loom's cell checker fails the model if a copy's
/// write can race the owner's write after the close: the handshake must
/// order every copy either before the close returned or not at all.
fn model(copies: usize) {
    loom::model(move || {
        let s = Arc::new(Shared {
            seq: W(AtomicU64::new(0)),
            range: [
                W(AtomicU64::new(0)),
                W(AtomicU64::new(0)),
                W(AtomicU64::new(0)),
            ],
            bits: W(AtomicU64::new(1)),
            block: UnsafeCell::new(0),
        });
        let peer = {
            let s = s.clone();
            thread::spawn(move || {
                for _ in 0..copies {
                    let lane = s.lane();
                    if let Ok(seq) = enter(&lane, [0, 0, 0], || s.bits.get() & 1 != 0) {
                        // SAFETY: loom checks this access for races.
                        s.block.with_mut(|b| unsafe { *b = 7 });
                        leave(&lane, seq);
                    }
                }
            })
        };
        // The owner closes block 0, drains, then the engine reuses it.
        s.bits.clear(1);
        let lane = s.lane();
        let hits = |space, first, last| space == 0 && first == 0 && last == 0;
        if let Some(seq) = busy(&lane, hits) {
            while s.seq.get() == seq {
                thread::yield_now();
            }
        }
        // SAFETY: loom checks this access for races.
        s.block.with_mut(|b| unsafe { *b = 1 });
        peer.join().unwrap();
    });
}

#[test]
fn one_copy_never_overlaps_the_reuse_after_a_close() {
    model(1);
}

#[test]
fn back_to_back_copies_never_overlap_the_reuse_after_a_close() {
    model(2);
}
