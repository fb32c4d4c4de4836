//! Property tests of the driver against random input sequences.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{TestAction, TestEvent, TestMachine, VecSink};
use kvferry_machines::{AbortReason, TransferId};
use kvferry_reactor::{Driver, DriverConfig, DriverError, Outcome};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Insert {
        id: u64,
        deadline_ms: Option<u64>,
        fence_ms: u64,
    },
    SetDeadline {
        id: u64,
        deadline_ms: u64,
    },
    Emit {
        id: u64,
        n: u32,
    },
    Succeed {
        id: u64,
    },
    Garbage {
        id: u64,
    },
    Abort {
        id: u64,
    },
    Advance {
        ms: u64,
    },
    Collect,
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0u64..12;
    prop_oneof![
        3 => (id.clone(), proptest::option::of(0u64..200), 0u64..30)
            .prop_map(|(id, deadline_ms, fence_ms)| Op::Insert { id, deadline_ms, fence_ms }),
        2 => (id.clone(), 0u64..200).prop_map(|(id, deadline_ms)| Op::SetDeadline { id, deadline_ms }),
        1 => (id.clone(), 0u32..6).prop_map(|(id, n)| Op::Emit { id, n }),
        1 => id.clone().prop_map(|id| Op::Succeed { id }),
        1 => id.clone().prop_map(|id| Op::Garbage { id }),
        1 => id.prop_map(|id| Op::Abort { id }),
        3 => (0u64..60).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Collect),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever the inputs: every accepted machine yields exactly one
    /// completion, nothing expires early, timers never lag the virtual
    /// clock, and the limits hold.
    #[test]
    fn every_accepted_machine_completes_exactly_once(ops in proptest::collection::vec(op(), 1..120)) {
        const MAX: usize = 6;
        let epoch = Instant::now();
        let mut now = epoch;
        let mut config = DriverConfig::with_max_machines(MAX);
        config.max_actions_per_input = 2;
        let mut driver: Driver<TestMachine> = Driver::new(0, config);
        let mut sink = VecSink::default();
        let mut accepted: HashMap<u64, usize> = HashMap::new();
        let mut completed: HashMap<u64, usize> = HashMap::new();
        let mut uncollected = 0usize;

        let collect = |driver: &mut Driver<TestMachine>, completed: &mut HashMap<u64, usize>, now: Instant| {
            while let Some(c) = driver.poll_completion() {
                *completed.entry(c.transfer_id.0).or_default() += 1;
                if let Outcome::Finished { phase, terminal_at } = c.outcome {
                    prop_assert!(phase.is_terminal());
                    prop_assert!(terminal_at <= now);
                }
            }
            Ok(())
        };

        for op in ops {
            match op {
                Op::Insert { id, deadline_ms, fence_ms } => {
                    let live = driver.phase(TransferId(id)).is_some();
                    let full = driver.len() + uncollected >= MAX;
                    let machine = TestMachine::with_fence(
                        deadline_ms.map(|ms| now + Duration::from_millis(ms)),
                        Duration::from_millis(fence_ms),
                    );
                    match driver.insert(now, TransferId(id), machine, &mut sink) {
                        Ok(()) => {
                            prop_assert!(!live && !full);
                            *accepted.entry(id).or_default() += 1;
                        }
                        Err(DriverError::Duplicate(_)) => prop_assert!(live),
                        Err(DriverError::Full { max }) => prop_assert!(full && !live && max == MAX),
                        Err(other) => prop_assert!(false, "unexpected {other}"),
                    }
                }
                Op::SetDeadline { id, deadline_ms } => {
                    let _ = driver.handle_event(now, TransferId(id), TestEvent::SetDeadline(now + Duration::from_millis(deadline_ms)), &mut sink);
                }
                Op::Emit { id, n } => {
                    let _ = driver.handle_event(now, TransferId(id), TestEvent::Emit(n), &mut sink);
                }
                Op::Succeed { id } => {
                    let _ = driver.handle_event(now, TransferId(id), TestEvent::Succeed, &mut sink);
                }
                Op::Garbage { id } => {
                    let phase = driver.phase(TransferId(id));
                    let result = driver.handle_event(now, TransferId(id), TestEvent::Garbage, &mut sink);
                    match phase {
                        None => prop_assert_eq!(result, Err(DriverError::Unknown(TransferId(id)))),
                        // Terminal machines absorb every input.
                        Some(phase) if phase.is_terminal() => prop_assert_eq!(result, Ok(())),
                        Some(_) => {
                            let refused = matches!(result, Err(DriverError::Input { .. }));
                            prop_assert!(refused, "live machine accepted garbage: {:?}", result);
                        }
                    }
                }
                Op::Abort { id } => {
                    let live = driver.phase(TransferId(id)).is_some();
                    let result = driver.abort(now, TransferId(id), AbortReason::Engine, &mut sink);
                    prop_assert_eq!(result.is_ok(), live);
                }
                Op::Advance { ms } => {
                    now += Duration::from_millis(ms);
                    driver.drive_pending(now, &mut sink);
                    driver.handle_timers(now, &mut sink);
                    // Test machines never ask for the past, so after a
                    // timer pass nothing is due any more.
                    prop_assert!(driver.poll_timeout().is_none_or(|t| t > now));
                }
                Op::Collect => {
                    collect(&mut driver, &mut completed, now)?;
                }
            }
            // Completions not yet collected count against the limit.
            uncollected = accepted.values().sum::<usize>() - completed.values().sum::<usize>() - driver.len();
            prop_assert!(driver.len() + uncollected <= MAX);
            prop_assert!(driver.deadline_entries() <= 2 * driver.len() + 65);
        }

        // Let everything run out: drain capped actions, fire every timer,
        // then drop the machines that wait for input forever.
        now += Duration::from_secs(3600);
        for _ in 0..1_000 {
            if !driver.has_pending() && driver.poll_timeout().is_none() {
                break;
            }
            driver.drive_pending(now, &mut sink);
            driver.handle_timers(now, &mut sink);
        }
        prop_assert!(!driver.has_pending());
        driver.drop_all();
        collect(&mut driver, &mut completed, now)?;
        prop_assert!(driver.is_empty());
        prop_assert_eq!(&accepted, &completed);
        for (_, action) in &sink.actions {
            if let TestAction::Expired { deadline, now } = action {
                prop_assert!(now >= deadline);
            }
        }
    }
}
