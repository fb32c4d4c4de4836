//! The executor-agnostic driver, with a virtual clock.

use crate::common;

use std::time::{Duration, Instant};

use common::{TestAction, TestEvent, TestMachine, VecSink};
use kvferry_machines::{AbortReason, FailReason, InputError, Phase, TransferId};
use kvferry_reactor::{round_up_to_tick, Driver, DriverConfig, DriverError, Outcome};

/// Deterministic pseudo-random numbers (xorshift64*), so failures replay.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

fn config(max_machines: usize) -> DriverConfig {
    DriverConfig::with_max_machines(max_machines)
}

#[test]
fn ten_thousand_spread_deadlines_expire_in_order_within_one_tick() {
    const N: u64 = 10_000;
    let tick = Duration::from_millis(1);
    let epoch = Instant::now();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut driver: Driver<TestMachine> = Driver::new(0, config(N as usize));
    let mut sink = VecSink::default();

    // Deadlines spread over ~10 s in a scrambled insertion order; a third of
    // the machines then move their deadline, which leaves stale heap entries
    // behind that the driver must skip.
    let mut deadlines = vec![Instant::now(); N as usize];
    let mut order: Vec<u64> = (0..N).collect();
    for i in (1..order.len()).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    for &i in &order {
        let deadline = epoch + Duration::from_micros(1_000 + rng.next() % 10_000_000);
        deadlines[i as usize] = deadline;
        driver
            .insert(
                epoch,
                TransferId(i),
                TestMachine::new(Some(deadline)),
                &mut sink,
            )
            .unwrap();
        assert!(driver.deadline_entries() <= 2 * driver.len() + 65);
    }
    for i in (0..N).filter(|i| i % 3 == 0) {
        let moved = epoch + Duration::from_micros(1_000 + rng.next() % 10_000_000);
        deadlines[i as usize] = moved;
        driver
            .handle_event(
                epoch,
                TransferId(i),
                TestEvent::SetDeadline(moved),
                &mut sink,
            )
            .unwrap();
        assert!(driver.deadline_entries() <= 2 * driver.len() + 65);
    }

    // The virtual timer: fire at the armed tick, as the executor loop does.
    // Bounded: every firing expires at least one machine.
    let mut completions = Vec::new();
    let mut firings = 0;
    while let Some(earliest) = driver.poll_timeout() {
        let now = round_up_to_tick(earliest, epoch, tick);
        assert!(driver.handle_timers(now, &mut sink) >= 1);
        while let Some(c) = driver.poll_completion() {
            completions.push(c);
        }
        firings += 1;
        assert!(firings <= N, "timer fired without progress");
    }
    assert!(driver.is_empty());
    assert_eq!(completions.len(), N as usize);

    let mut previous = None;
    for c in &completions {
        let deadline = deadlines[c.transfer_id.0 as usize];
        let Outcome::Finished { phase, terminal_at } = c.outcome else {
            panic!("unexpected outcome {c:?}");
        };
        assert_eq!(phase, Phase::Expired);
        assert!(terminal_at >= deadline, "{:?} expired early", c.transfer_id);
        assert!(
            terminal_at - deadline < tick,
            "{:?} expired late",
            c.transfer_id
        );
        if let Some(previous) = previous {
            assert!(
                deadline >= previous,
                "{:?} expired out of deadline order",
                c.transfer_id
            );
        }
        previous = Some(deadline);
    }
    // Each machine's Expired action carries the `now` it was woken with.
    let expired = sink
        .actions
        .iter()
        .filter(|(_, a)| matches!(a, TestAction::Expired { .. }))
        .count();
    assert_eq!(expired, N as usize);
    assert_eq!(driver.deadline_entries(), 0);
}

#[test]
fn capacity_counts_uncollected_completions() {
    let now = Instant::now();
    let mut driver: Driver<TestMachine> = Driver::new(0, config(2));
    let mut sink = VecSink::default();
    driver
        .insert(now, TransferId(1), TestMachine::new(None), &mut sink)
        .unwrap();
    driver
        .insert(now, TransferId(2), TestMachine::new(None), &mut sink)
        .unwrap();
    assert_eq!(
        driver.insert(now, TransferId(3), TestMachine::new(None), &mut sink),
        Err(DriverError::Full { max: 2 })
    );
    driver
        .handle_event(now, TransferId(1), TestEvent::Succeed, &mut sink)
        .unwrap();
    assert_eq!(driver.len(), 1);
    // Finished but not collected: still counts.
    assert_eq!(
        driver.insert(now, TransferId(3), TestMachine::new(None), &mut sink),
        Err(DriverError::Full { max: 2 })
    );
    let done = driver.poll_completion().unwrap();
    assert_eq!(done.transfer_id, TransferId(1));
    assert!(matches!(
        done.outcome,
        Outcome::Finished {
            phase: Phase::Success,
            ..
        }
    ));
    driver
        .insert(now, TransferId(3), TestMachine::new(None), &mut sink)
        .unwrap();
}

#[test]
fn misuse_and_bad_input_are_typed_errors() {
    let now = Instant::now();
    let mut driver: Driver<TestMachine> = Driver::new(0, config(8));
    let mut sink = VecSink::default();
    driver
        .insert(now, TransferId(1), TestMachine::new(None), &mut sink)
        .unwrap();
    assert_eq!(
        driver.insert(now, TransferId(1), TestMachine::new(None), &mut sink),
        Err(DriverError::Duplicate(TransferId(1)))
    );
    assert_eq!(
        driver.handle_event(now, TransferId(9), TestEvent::Succeed, &mut sink),
        Err(DriverError::Unknown(TransferId(9)))
    );
    assert_eq!(
        driver.abort(now, TransferId(9), AbortReason::Engine, &mut sink),
        Err(DriverError::Unknown(TransferId(9)))
    );
    assert_eq!(
        driver.handle_event(now, TransferId(1), TestEvent::Garbage, &mut sink),
        Err(DriverError::Input {
            transfer_id: TransferId(1),
            error: InputError::Peer("garbage")
        })
    );
    assert_eq!(driver.phase(TransferId(1)), Some(Phase::WaitingForInput));
}

#[test]
fn capped_drains_resume_in_order() {
    let now = Instant::now();
    let mut cfg = config(8);
    cfg.max_actions_per_input = 3;
    let mut driver: Driver<TestMachine> = Driver::new(0, cfg);
    let mut sink = VecSink::default();
    driver
        .insert(now, TransferId(1), TestMachine::new(None), &mut sink)
        .unwrap();
    driver
        .handle_event(now, TransferId(1), TestEvent::Emit(10), &mut sink)
        .unwrap();
    assert_eq!(sink.actions.len(), 3);
    let mut rounds = 0;
    while driver.has_pending() {
        driver.drive_pending(now, &mut sink);
        rounds += 1;
        assert!(rounds <= 10);
    }
    let work: Vec<u32> = sink
        .actions
        .iter()
        .map(|(_, a)| match a {
            TestAction::Work(n) => *n,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(work, (0..10).collect::<Vec<_>>());
    assert_eq!(rounds, 3);
}

#[test]
fn terminal_machine_stays_until_its_fence_passes() {
    let now = Instant::now();
    let mut driver: Driver<TestMachine> = Driver::new(0, config(8));
    let mut sink = VecSink::default();
    let fence = Duration::from_millis(50);
    driver
        .insert(
            now,
            TransferId(7),
            TestMachine::with_fence(None, fence),
            &mut sink,
        )
        .unwrap();
    driver
        .abort(now, TransferId(7), AbortReason::Engine, &mut sink)
        .unwrap();
    assert_eq!(
        driver.phase(TransferId(7)),
        Some(Phase::Failed(FailReason::Aborted(AbortReason::Engine)))
    );
    assert!(
        driver.poll_completion().is_none(),
        "removed before its fence"
    );
    assert_eq!(driver.poll_timeout(), Some(now + fence));
    // A spurious early wake-up changes nothing.
    assert_eq!(driver.handle_timers(now + fence / 2, &mut sink), 0);
    assert_eq!(driver.len(), 1);
    assert_eq!(driver.handle_timers(now + fence, &mut sink), 1);
    let done = driver.poll_completion().unwrap();
    assert_eq!(
        done.outcome,
        Outcome::Finished {
            phase: Phase::Failed(FailReason::Aborted(AbortReason::Engine)),
            terminal_at: now
        }
    );
    assert_eq!(
        sink.phases,
        vec![
            (TransferId(7), Phase::WaitingForInput),
            (
                TransferId(7),
                Phase::Failed(FailReason::Aborted(AbortReason::Engine))
            )
        ]
    );
}

#[test]
fn drop_all_reports_every_machine() {
    let now = Instant::now();
    let mut driver: Driver<TestMachine> = Driver::new(3, config(8));
    let mut sink = VecSink::default();
    for i in 0..5 {
        driver
            .insert(
                now,
                TransferId(i),
                TestMachine::new(Some(now + Duration::from_secs(1))),
                &mut sink,
            )
            .unwrap();
    }
    assert_eq!(driver.drop_all(), 5);
    let mut ids: Vec<u64> = std::iter::from_fn(|| driver.poll_completion())
        .map(|c| {
            assert_eq!(c.executor, 3);
            assert_eq!(
                c.outcome,
                Outcome::Dropped {
                    last_phase: Phase::WaitingForInput
                }
            );
            c.transfer_id.0
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![0, 1, 2, 3, 4]);
    assert_eq!(driver.poll_timeout(), None);
}

#[test]
fn round_up_to_tick_lands_on_the_grid() {
    let epoch = Instant::now();
    let tick = Duration::from_millis(1);
    assert_eq!(
        round_up_to_tick(epoch + Duration::from_micros(1), epoch, tick),
        epoch + tick
    );
    assert_eq!(round_up_to_tick(epoch + tick, epoch, tick), epoch + tick);
    assert_eq!(
        round_up_to_tick(epoch + Duration::from_micros(1_001), epoch, tick),
        epoch + 2 * tick
    );
    assert_eq!(
        round_up_to_tick(epoch + Duration::from_micros(3), epoch, Duration::ZERO),
        epoch + Duration::from_micros(3)
    );
}
