//! Shutdown policies and thread hygiene. One test function on purpose: it
//! counts the threads of this process, which parallel tests would disturb.

#[path = "it/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{TestEvent, TestMachine, VecSink};
use kvferry_machines::{AbortReason, FailReason, Phase, TransferId};
use kvferry_reactor::{
    Completion, ExecutorConfig, Outcome, Reactor, ReactorConfig, ShutdownPolicy, SubmitError,
};

fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .expect("Linux /proc")
        .map(|entry| {
            let path = entry.unwrap().path().join("comm");
            std::fs::read_to_string(path)
                .unwrap_or_default()
                .trim()
                .to_owned()
        })
        .collect()
}

fn threads() -> usize {
    thread_names().len()
}

/// Asserts that the process is back to `baseline` threads.
///
/// `shutdown` joins every executor thread before it returns. Each glommio
/// executor also owns one blocking-pool thread that glommio detaches rather
/// than joins; it exits as soon as its executor is dropped (its channel
/// closes), which has already happened here, but its exit is not joined by
/// anyone. So this waits for that exit, with a hard bound, instead of
/// asserting at one instant.
fn assert_no_leaked_threads(baseline: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    // Bounded by the deadline.
    while threads() != baseline && Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(
        threads(),
        baseline,
        "threads leaked by {what}: {:?}",
        thread_names()
    );
}

fn config() -> ReactorConfig {
    ReactorConfig {
        executors: vec![
            ExecutorConfig::pinned("shut-dev0", 0),
            ExecutorConfig::unpinned("shut-dev1"),
        ],
        ..ReactorConfig::default()
    }
}

fn start() -> Reactor<TestMachine> {
    Reactor::start(config(), |_| VecSink::default()).expect("reactor starts")
}

fn sorted_ids(completions: &[Completion]) -> Vec<u64> {
    let mut ids: Vec<u64> = completions.iter().map(|c| c.transfer_id.0).collect();
    ids.sort_unstable();
    ids
}

#[test]
fn shutdown_policies_settle_every_request_and_leak_no_threads() {
    let baseline = threads();
    let aborted = Phase::Failed(FailReason::Aborted(AbortReason::Shutdown));

    // Abort: every live request is aborted with Shutdown; machines with a
    // short fence finish inside the grace period.
    let reactor = start();
    let handle = reactor.handle();
    assert!(threads() > baseline, "executors run on their own threads");
    for i in 0..20u64 {
        let machine = TestMachine::with_fence(None, Duration::from_millis(5));
        handle
            .create((i % 2) as usize, TransferId(i), machine)
            .unwrap();
    }
    let report = reactor
        .shutdown(ShutdownPolicy::Abort {
            grace: Duration::from_secs(10),
        })
        .unwrap();
    assert_eq!(
        report.executors.iter().map(|e| e.aborted).sum::<usize>(),
        20
    );
    assert_eq!(report.executors.iter().map(|e| e.dropped).sum::<usize>(), 0);
    assert_eq!(sorted_ids(&report.completions), (0..20).collect::<Vec<_>>());
    for c in &report.completions {
        assert!(
            matches!(c.outcome, Outcome::Finished { phase, .. } if phase == aborted),
            "{c:?}"
        );
    }
    // The handle outlives the reactor and says so.
    let late = handle
        .create(0, TransferId(99), TestMachine::new(None))
        .unwrap_err();
    assert_eq!(late.error, SubmitError::ShuttingDown);
    assert_eq!(handle.stats().finished, 20);
    drop(handle);
    assert_no_leaked_threads(baseline, "Abort shutdown");

    // Abort with a grace shorter than the fences: what is left is dropped
    // and reported, not lost.
    let reactor = start();
    let handle = reactor.handle();
    for i in 0..6u64 {
        let machine = TestMachine::with_fence(None, Duration::from_secs(600));
        handle
            .create((i % 2) as usize, TransferId(i), machine)
            .unwrap();
    }
    let started = Instant::now();
    let report = reactor
        .shutdown(ShutdownPolicy::Abort {
            grace: Duration::from_millis(20),
        })
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "grace not honoured"
    );
    assert_eq!(report.executors.iter().map(|e| e.dropped).sum::<usize>(), 6);
    assert_eq!(sorted_ids(&report.completions), (0..6).collect::<Vec<_>>());
    for c in &report.completions {
        assert_eq!(
            c.outcome,
            Outcome::Dropped {
                last_phase: aborted
            }
        );
    }
    assert_eq!(handle.stats().dropped, 6);
    drop(handle);
    assert_no_leaked_threads(baseline, "a short grace");

    // Drain: requests finish on their own (here: their deadlines pass), and
    // events still reach them while draining; nothing is aborted.
    let reactor = start();
    let handle = reactor.handle();
    let deadline = Instant::now() + Duration::from_millis(50);
    for i in 0..10u64 {
        handle
            .create(
                (i % 2) as usize,
                TransferId(i),
                TestMachine::new(Some(deadline + Duration::from_secs(3600))),
            )
            .unwrap();
        handle
            .send_event(TransferId(i), TestEvent::SetDeadline(deadline))
            .unwrap();
    }
    let report = reactor
        .shutdown(ShutdownPolicy::Drain {
            drain: Duration::from_secs(30),
            grace: Duration::ZERO,
        })
        .unwrap();
    assert_eq!(report.executors.iter().map(|e| e.aborted).sum::<usize>(), 0);
    assert_eq!(sorted_ids(&report.completions), (0..10).collect::<Vec<_>>());
    for c in &report.completions {
        assert!(
            matches!(
                c.outcome,
                Outcome::Finished {
                    phase: Phase::Expired,
                    ..
                }
            ),
            "{c:?}"
        );
    }
    drop(handle);
    assert_no_leaked_threads(baseline, "Drain shutdown");

    // Creates still queued when the shutdown starts were accepted, so the
    // policy applies to them: they are created, then aborted.
    let reactor = start();
    let handle = reactor.handle();
    let (started_tx, started_rx) = flume::bounded::<()>(1);
    let (release_tx, release_rx) = flume::bounded::<()>(1);
    handle
        .spawn_on(0, move || async move {
            started_tx.send(()).unwrap();
            // Blocks executor 0 on purpose so the creates below stay queued.
            release_rx.recv().unwrap();
        })
        .unwrap();
    started_rx.recv_timeout(Duration::from_secs(20)).unwrap();
    for i in 0..3u64 {
        handle
            .create(0, TransferId(i), TestMachine::new(None))
            .unwrap();
    }
    let stopper = std::thread::spawn(move || {
        reactor.shutdown(ShutdownPolicy::Abort {
            grace: Duration::ZERO,
        })
    });
    // Shutdown closes the latch first; the executor is still blocked, so
    // this loop ends only through the latch. Bounded by the spin limit.
    let mut spins = 0u64;
    loop {
        match handle.create(1, TransferId(50), TestMachine::new(None)) {
            Err(refused) if refused.error == SubmitError::ShuttingDown => break,
            // Accepted before the latch closed: one more request to settle.
            // Its id is now taken, so wait for the latch on `spawn_on`.
            Ok(()) | Err(_) => {
                if handle.spawn_on(1, || async {}) == Err(SubmitError::ShuttingDown) {
                    break;
                }
            }
        }
        spins += 1;
        assert!(spins < 100_000_000, "latch never closed");
        std::thread::yield_now();
    }
    release_tx.send(()).unwrap();
    let report = stopper.join().unwrap().unwrap();
    let queued: Vec<&Completion> = report
        .completions
        .iter()
        .filter(|c| c.executor == 0)
        .collect();
    assert_eq!(queued.len(), 3);
    for c in queued {
        assert!(
            matches!(c.outcome, Outcome::Finished { phase, .. } if phase == aborted),
            "{c:?}"
        );
    }
    drop(handle);
    assert_no_leaked_threads(baseline, "queued creates");

    // Dropping a reactor without calling shutdown joins its threads too.
    let reactor = start();
    reactor
        .handle()
        .create(1, TransferId(1), TestMachine::new(None))
        .unwrap();
    drop(reactor);
    assert_no_leaked_threads(baseline, "Drop");
}
