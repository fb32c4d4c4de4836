//! The glommio reactor end to end: executors, mailboxes, board, timers.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{TestAction, TestEvent, TestMachine, VecSink};
use kvferry_machines::{Phase, TransferId};
use kvferry_reactor::{
    ActionSink, Completion, EventPoster, ExecutorConfig, Outcome, Reactor, ReactorConfig,
    ReactorHandle, ShutdownPolicy, SubmitError,
};

const WAIT: Duration = Duration::from_secs(20);

fn one_executor() -> ReactorConfig {
    ReactorConfig {
        executors: vec![ExecutorConfig::unpinned("test-dev0")],
        ..ReactorConfig::default()
    }
}

fn start(config: ReactorConfig) -> Reactor<TestMachine> {
    Reactor::start(config, |_| VecSink::default()).expect("reactor starts")
}

fn recv(handle: &ReactorHandle<TestMachine>) -> Completion {
    handle
        .recv_finished(WAIT)
        .expect("a completion within the wait bound")
}

fn shut(reactor: Reactor<TestMachine>) {
    let report = reactor
        .shutdown(ShutdownPolicy::Abort {
            grace: Duration::ZERO,
        })
        .expect("clean shutdown");
    assert!(report.executors.iter().all(|e| e.dropped == 0));
}

/// Deterministic pseudo-random numbers (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

#[test]
fn ten_thousand_machines_expire_in_order_within_one_tick_on_glommio() {
    const N: u64 = 10_000;
    let tick = Duration::from_millis(1);
    let config = ReactorConfig {
        mailbox_capacity: 16_384,
        max_machines_per_executor: 16_384,
        timer_tick: tick,
        ..one_executor()
    };
    let reactor = start(config);
    let handle = reactor.handle();
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    // Deadlines 50 µs apart over 500 ms, starting far enough out (500 ms) that all
    // creations are in before the first one is due; created in a scrambled
    // order so the heap, not arrival order, decides.
    let base = Instant::now() + Duration::from_millis(500);
    let mut order: Vec<u64> = (0..N).collect();
    for i in (1..order.len()).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let mut deadlines = HashMap::new();
    for &i in &order {
        let deadline = base + Duration::from_micros(50 * i);
        deadlines.insert(TransferId(i), deadline);
        handle
            .create(0, TransferId(i), TestMachine::new(Some(deadline)))
            .expect("mailbox and board sized for all of them");
    }
    let created_by = Instant::now();
    assert!(
        created_by < base,
        "creation took longer than the test's head start"
    );

    let mut completions = Vec::with_capacity(N as usize);
    for _ in 0..N {
        completions.push(recv(&handle));
    }
    let stats = handle.stats();
    let bound = tick + Duration::from_nanos(stats.max_timer_lag_ns);

    let mut previous: Option<Instant> = None;
    let mut lateness: Vec<Duration> = Vec::with_capacity(N as usize);
    for c in &completions {
        let deadline = deadlines[&c.transfer_id];
        let Outcome::Finished { phase, terminal_at } = c.outcome else {
            panic!("unexpected {c:?}");
        };
        assert_eq!(phase, Phase::Expired);
        assert!(
            terminal_at >= deadline,
            "{:?} expired before its deadline",
            c.transfer_id
        );
        let late = terminal_at - deadline;
        assert!(
            late <= bound,
            "{:?} expired {late:?} after its deadline (tick {tick:?} + executor wake-up lag {:?})",
            c.transfer_id,
            bound - tick
        );
        if let Some(previous) = previous {
            assert!(
                deadline >= previous,
                "{:?} expired out of order",
                c.transfer_id
            );
        }
        previous = Some(deadline);
        lateness.push(late);
    }
    lateness.sort_unstable();
    eprintln!(
        "10k deadlines: lateness p50 {:?} p99 {:?} max {:?}; timer wake-ups {}, max wake-up lag {:?}",
        lateness[lateness.len() / 2],
        lateness[lateness.len() * 99 / 100],
        lateness[lateness.len() - 1],
        stats.timer_wakes,
        Duration::from_nanos(stats.max_timer_lag_ns)
    );
    // One timer for everyone: deadlines sharing a tick share a wake-up, so
    // there are far fewer wake-ups than machines.
    assert!(
        stats.timer_wakes < N,
        "{} wake-ups for {N} deadlines",
        stats.timer_wakes
    );
    assert_eq!(stats.created, N);
    assert_eq!(stats.finished, N);
    assert!(handle.get_finished(10).is_empty());
    shut(reactor);
}

#[test]
fn full_mailbox_is_back_pressure_and_hands_the_machine_back() {
    let config = ReactorConfig {
        mailbox_capacity: 4,
        ..one_executor()
    };
    let reactor = start(config);
    let handle = reactor.handle();
    // Park the executor thread inside a task so the mailbox cannot drain.
    let (started_tx, started_rx) = flume::bounded::<()>(1);
    let (release_tx, release_rx) = flume::bounded::<()>(1);
    handle
        .spawn_on(0, move || async move {
            started_tx.send(()).unwrap();
            // Blocking the executor on purpose: this test needs it stuck.
            release_rx.recv().unwrap();
        })
        .unwrap();
    started_rx
        .recv_timeout(WAIT)
        .expect("executor ran the task");
    for i in 0..4 {
        handle
            .create(0, TransferId(i), TestMachine::new(None))
            .unwrap();
    }
    let refused = handle
        .create(0, TransferId(4), TestMachine::new(None))
        .expect_err("fifth command must not fit");
    assert_eq!(refused.error, SubmitError::MailboxFull { executor: 0 });
    assert!(refused.error.is_backpressure());
    // Nothing was queued: the id is free again and the machine came back.
    assert_eq!(handle.poll(TransferId(4)), None);
    assert_eq!(refused.value.phase_for_test(), Phase::WaitingForInput);
    assert_eq!(handle.stats().mailbox_full, 1);
    let refused_event = handle
        .send_event(TransferId(0), TestEvent::Succeed)
        .expect_err("event must not fit either");
    assert_eq!(
        refused_event.error,
        SubmitError::MailboxFull { executor: 0 }
    );
    assert!(matches!(refused_event.value, TestEvent::Succeed));

    release_tx.send(()).unwrap();
    // Retry until the executor has made room: bounded, and each attempt is
    // an explicit back-pressure answer, not a sleep standing in for sync.
    let mut machine = refused.value;
    let mut attempts = 0;
    loop {
        match handle.create(0, TransferId(4), machine) {
            Ok(()) => break,
            Err(refused) => {
                assert_eq!(refused.error, SubmitError::MailboxFull { executor: 0 });
                machine = refused.value;
                attempts += 1;
                assert!(attempts < 1_000_000, "mailbox never drained");
                std::thread::yield_now();
            }
        }
    }
    // The mailbox holds only 4: the executor may still be catching up, so
    // each back-pressure answer is retried (bounded).
    for i in 0..5 {
        let mut event = TestEvent::Succeed;
        let mut attempts = 0;
        while let Err(refused) = handle.send_event(TransferId(i), event) {
            assert_eq!(refused.error, SubmitError::MailboxFull { executor: 0 });
            event = refused.value;
            attempts += 1;
            assert!(attempts < 1_000_000, "mailbox never drained");
            std::thread::yield_now();
        }
    }
    let mut ids: Vec<u64> = (0..5).map(|_| recv(&handle).transfer_id.0).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![0, 1, 2, 3, 4]);
    shut(reactor);
}

#[test]
fn capacity_and_misuse_are_typed_errors() {
    let config = ReactorConfig {
        max_machines_per_executor: 2,
        ..one_executor()
    };
    let reactor = start(config);
    let handle = reactor.handle();
    handle
        .create(0, TransferId(1), TestMachine::new(None))
        .unwrap();
    assert_eq!(
        handle
            .create(0, TransferId(1), TestMachine::new(None))
            .unwrap_err()
            .error,
        SubmitError::DuplicateTransfer(TransferId(1))
    );
    assert_eq!(
        handle
            .create(1, TransferId(5), TestMachine::new(None))
            .unwrap_err()
            .error,
        SubmitError::NoSuchExecutor {
            executor: 1,
            executors: 1
        }
    );
    assert_eq!(
        handle
            .send_event(TransferId(9), TestEvent::Succeed)
            .unwrap_err()
            .error,
        SubmitError::UnknownTransfer(TransferId(9))
    );
    handle
        .create(0, TransferId(2), TestMachine::new(None))
        .unwrap();
    let full = handle
        .create(0, TransferId(3), TestMachine::new(None))
        .unwrap_err();
    assert_eq!(
        full.error,
        SubmitError::AtCapacity {
            executor: 0,
            max_machines: 2
        }
    );
    assert!(full.error.is_backpressure());

    // A finished transfer holds its place until its completion is collected.
    handle
        .send_event(TransferId(1), TestEvent::Succeed)
        .unwrap();
    let done = recv(&handle);
    assert_eq!(done.transfer_id, TransferId(1));
    handle
        .create(0, TransferId(3), TestMachine::new(None))
        .unwrap();
    assert_eq!(handle.load(0), 2);
    shut(reactor);
}

#[test]
fn board_shows_phases_and_bad_input_is_counted() {
    let reactor = start(one_executor());
    let handle = reactor.handle();
    handle
        .create(0, TransferId(1), TestMachine::new(None))
        .unwrap();
    handle
        .create(0, TransferId(2), TestMachine::new(None))
        .unwrap();
    handle
        .send_event(TransferId(1), TestEvent::Emit(2))
        .unwrap();
    handle
        .send_event(TransferId(1), TestEvent::Garbage)
        .unwrap();
    handle
        .send_event(TransferId(2), TestEvent::Succeed)
        .unwrap();
    // One executor handles its mailbox in order, so once 2 finished, 1's
    // earlier inputs were handled and published.
    let done = recv(&handle);
    assert_eq!(done.transfer_id, TransferId(2));
    assert!(matches!(
        done.outcome,
        Outcome::Finished {
            phase: Phase::Success,
            ..
        }
    ));
    assert_eq!(handle.poll(TransferId(1)), Some(Phase::Transferring));
    assert_eq!(
        handle.poll(TransferId(2)),
        None,
        "collected completions leave the board"
    );
    let stats = handle.stats();
    assert_eq!(stats.input_errors, 1);
    assert_eq!((stats.created, stats.finished), (2, 1));
    shut(reactor);
}

/// A sink that runs `Work` actions asynchronously and reports back through
/// the poster, the way the node runs transfers.
struct AsyncSink {
    poster: EventPoster<TestMachine>,
}

impl ActionSink<TestMachine> for AsyncSink {
    fn execute(&mut self, transfer_id: TransferId, action: TestAction) {
        if let TestAction::Work(_) = action {
            let poster = self.poster.clone();
            glommio::spawn_local(async move {
                glommio::timer::sleep(Duration::from_millis(1)).await;
                poster.post(transfer_id, TestEvent::Succeed).await.unwrap();
            })
            .detach();
        }
    }
}

#[test]
fn async_actions_report_back_through_the_poster() {
    let reactor: Reactor<TestMachine> =
        Reactor::start(one_executor(), |ctx| AsyncSink { poster: ctx.poster }).unwrap();
    let handle = reactor.handle();
    for i in 0..100 {
        handle
            .create(0, TransferId(i), TestMachine::new(None))
            .unwrap();
        handle
            .send_event(TransferId(i), TestEvent::Emit(1))
            .unwrap();
    }
    let mut ids: Vec<u64> = (0..100)
        .map(|_| {
            let c = recv(&handle);
            assert!(matches!(
                c.outcome,
                Outcome::Finished {
                    phase: Phase::Success,
                    ..
                }
            ));
            c.transfer_id.0
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..100).collect::<Vec<_>>());
    let report = reactor
        .shutdown(ShutdownPolicy::Abort {
            grace: Duration::ZERO,
        })
        .unwrap();
    assert_eq!(report.executors[0].aborted, 0);
}

#[test]
fn more_devices_than_cores_mixes_pinned_and_unpinned_executors() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let config = ReactorConfig {
        executors: ReactorConfig::for_devices(cores + 1).executors,
        ..ReactorConfig::default()
    };
    assert_eq!(config.executors[0].core, Some(0));
    assert_eq!(config.executors[cores].core, None);
    let reactor = start(config);
    let handle = reactor.handle();
    let n = handle.executors();
    assert_eq!(n, cores + 1);
    for i in 0..(4 * n as u64) {
        let executor = (i % n as u64) as usize;
        handle
            .create(executor, TransferId(i), TestMachine::new(None))
            .unwrap();
        handle
            .send_event(TransferId(i), TestEvent::Succeed)
            .unwrap();
    }
    let mut seen = vec![0; n];
    for _ in 0..(4 * n) {
        let c = recv(&handle);
        assert_eq!(c.executor, (c.transfer_id.0 % n as u64) as usize);
        seen[c.executor] += 1;
    }
    assert!(seen.iter().all(|&count| count == 4));
    shut(reactor);
}

#[test]
fn a_core_that_does_not_exist_is_a_start_error() {
    let config = ReactorConfig {
        executors: vec![ExecutorConfig::pinned("bad", 4_096)],
        ..ReactorConfig::default()
    };
    let error = Reactor::<TestMachine>::start(config, |_| VecSink::default()).unwrap_err();
    assert!(
        matches!(
            error,
            kvferry_reactor::ReactorError::Start { executor: 0, .. }
        ),
        "{error}"
    );
}

#[test]
fn invalid_config_is_refused() {
    let config = ReactorConfig {
        mailbox_capacity: 0,
        ..ReactorConfig::default()
    };
    let error = Reactor::<TestMachine>::start(config, |_| VecSink::default()).unwrap_err();
    assert!(
        matches!(error, kvferry_reactor::ReactorError::Config(_)),
        "{error}"
    );
}

#[test]
fn handles_cross_threads() {
    fn send_sync<T: Send + Sync + Clone>(value: &T) -> T {
        value.clone()
    }
    let reactor = start(one_executor());
    let handle = send_sync(&reactor.handle());
    let from_engine = std::thread::spawn(move || {
        handle
            .create(0, TransferId(1), TestMachine::new(None))
            .map_err(|r| r.error)?;
        handle
            .send_event(TransferId(1), TestEvent::Succeed)
            .map_err(|r| r.error)?;
        Ok::<_, SubmitError>(recv(&handle))
    });
    let done = from_engine.join().unwrap().unwrap();
    assert_eq!(done.transfer_id, TransferId(1));
    shut(reactor);
}

/// An executor gives its core away after a turn in which requests ended
/// only while fewer than `yield_after_ends_below` are left live, and never
/// by default.
#[test]
fn an_executor_yields_after_ends_only_when_few_requests_are_live() {
    for (below, expected) in [(3usize, vec![0u64, 0, 1, 2, 3]), (0, vec![0, 0, 0, 0, 0])] {
        let reactor = start(ReactorConfig {
            yield_after_ends_below: below,
            ..one_executor()
        });
        let handle = reactor.handle();
        for t in 1..=5u64 {
            handle
                .create(0, TransferId(t), TestMachine::new(None))
                .unwrap();
        }
        let mut seen = Vec::new();
        for t in 1..=5u64 {
            handle
                .send_event(TransferId(t), TestEvent::Succeed)
                .unwrap();
            // One request ends per turn; counted before its completion goes
            // out. Live after it: 4, 3, 2, 1, 0.
            assert_eq!(recv(&handle).transfer_id, TransferId(t));
            seen.push(handle.stats().yields_after_ends);
        }
        assert_eq!(seen, expected, "below {below}");
        shut(reactor);
    }
}
