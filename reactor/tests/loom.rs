//! Loom models of everything the reactor shares between threads outside the
//! channels: the shutdown latch, the completion board, the stats counters,
//! the mailbox doorbell.
//!
//! Run with:
//! `RUSTFLAGS="--cfg kvferry_loom" CARGO_TARGET_DIR=/work/tgt-reactor/loom LOOM_MAX_PREEMPTIONS=2 cargo test -p kvferry-reactor --release --test loom`
#![cfg(kvferry_loom)]

use kvferry_machines::{Phase, TransferId};
use kvferry_reactor::internal::sync::{
    lock, thread, Arc, AtomicBool, AtomicUsize, Mutex, Ordering,
};
use kvferry_reactor::{BoardError, CompletionBoard, Doorbell, ShutdownLatch, Stats};

/// Two submitters race a closer. Once `close` returns, no submission is
/// inside and none can get in: the number of submissions that got through
/// is final, which is what lets an executor drain its mailbox once and know
/// it saw every accepted `Create`.
#[test]
fn latch_close_waits_for_submitters_and_refuses_later_ones() {
    loom::model(|| {
        let latch = Arc::new(ShutdownLatch::new());
        let accepted = Arc::new(AtomicUsize::new(0));
        let submitters: Vec<_> = (0..2)
            .map(|_| {
                let latch = latch.clone();
                let accepted = accepted.clone();
                thread::spawn(move || {
                    if let Some(_inside) = latch.enter() {
                        // Stands for the `try_send` into a mailbox.
                        accepted.fetch_add(1, Ordering::Relaxed);
                        true
                    } else {
                        false
                    }
                })
            })
            .collect();
        latch.close();
        // (`inside()` may read 1 here: a refused submitter counts itself in
        // for an instant before it backs out. Only accepted work matters.)
        let seen_at_close = accepted.load(Ordering::Relaxed);
        assert!(latch.enter().is_none());
        let got_in = submitters
            .into_iter()
            .map(|t| usize::from(t.join().unwrap()))
            .sum::<usize>();
        // Every submission that got in finished before `close` returned.
        assert_eq!(accepted.load(Ordering::Relaxed), seen_at_close);
        assert_eq!(got_in, seen_at_close);
    });
}

/// Two engine threads race for the last slot of an executor: exactly one
/// wins, and the count the board keeps matches its entries.
#[test]
fn board_admits_exactly_one_for_the_last_slot() {
    loom::model(|| {
        let board = Arc::new(CompletionBoard::new(1, 1));
        let racers: Vec<_> = (0..2u64)
            .map(|i| {
                let board = board.clone();
                thread::spawn(move || board.reserve(TransferId(i), 0))
            })
            .collect();
        let results: Vec<_> = racers.into_iter().map(|t| t.join().unwrap()).collect();
        let wins = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(wins, 1, "{results:?}");
        assert!(results.contains(&Err(BoardError::Full {
            executor: 0,
            max: 1
        })));
        assert_eq!(board.len_for(0), 1);
        assert_eq!(board.len(), 1);
    });
}

fn rank(phase: Phase) -> u8 {
    match phase {
        Phase::Bootstrapping => 0,
        Phase::WaitingForInput => 1,
        Phase::Transferring => 2,
        Phase::Success | Phase::Failed(_) | Phase::Expired => 3,
    }
}

/// The executor publishes phases while an engine thread polls and then
/// collects the transfer: the engine never sees a phase go backwards, and
/// once the transfer is collected the executor's late publish changes
/// nothing and the slot is free again.
#[test]
fn board_phases_never_go_backwards_and_collection_frees_the_slot() {
    loom::model(|| {
        let board = Arc::new(CompletionBoard::new(1, 1));
        let id = TransferId(7);
        board.reserve(id, 0).unwrap();
        let executor = {
            let board = board.clone();
            thread::spawn(move || {
                board.publish(id, Phase::Transferring);
                board.publish(id, Phase::Success);
            })
        };
        let first = board.phase(id).map(rank);
        let second = board.phase(id).map(rank);
        assert!(first <= second, "{first:?} then {second:?}");
        executor.join().unwrap();
        assert_eq!(board.phase(id), Some(Phase::Success));
        assert_eq!(board.remove(id), Some(Phase::Success));
        assert!(!board.publish(id, Phase::Expired));
        assert_eq!(board.len_for(0), 0);
        board.reserve(TransferId(8), 0).unwrap();
    });
}

/// Two executors each create then finish a transfer while an engine thread
/// takes a snapshot: it never shows more finished than created.
#[test]
fn stats_snapshot_never_shows_more_finished_than_created() {
    loom::model(|| {
        let stats = Arc::new(Stats::new());
        let executors: Vec<_> = (0..2)
            .map(|_| {
                let stats = stats.clone();
                thread::spawn(move || {
                    stats.add_created();
                    stats.add_finished();
                })
            })
            .collect();
        let snapshot = stats.snapshot();
        assert!(
            snapshot.finished <= snapshot.created,
            "finished {} > created {}",
            snapshot.finished,
            snapshot.created
        );
        for t in executors {
            t.join().unwrap();
        }
        let last = stats.snapshot();
        assert_eq!((last.created, last.finished), (2, 2));
    });
}

/// What the executor's waker does in the doorbell model: remembers it was
/// woken, in a loom-visible flag.
struct Flag(AtomicBool);

impl std::task::Wake for Flag {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// An engine thread queues a command and rings while the executor polls its
/// mailbox once (look, arm, look again). Either the executor's poll finds
/// the command or its waker was woken: a command never sits in the mailbox
/// of an executor that went to sleep.
#[test]
fn doorbell_never_loses_a_wake_up() {
    loom::model(|| {
        let queue = Arc::new(Mutex::new(Vec::<u32>::new()));
        let bell = Arc::new(Doorbell::new());
        let flag = std::sync::Arc::new(Flag(AtomicBool::new(false)));
        let waker = std::task::Waker::from(flag.clone());
        let sender = {
            let queue = queue.clone();
            let bell = bell.clone();
            thread::spawn(move || {
                lock(&queue).push(7);
                bell.ring();
            })
        };
        let take = || lock(&queue).pop();
        let found = take().or_else(|| {
            bell.arm(&waker);
            take()
        });
        sender.join().unwrap();
        if found.is_none() {
            assert!(
                flag.0.load(Ordering::SeqCst),
                "the executor slept with a command queued and nobody woke it"
            );
            assert_eq!(take(), Some(7));
        }
    });
}
