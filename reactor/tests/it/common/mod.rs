//! A small machine implementing `kvferry_machines::Machine`, for driver and
//! reactor tests (the real send/receive machines are tested in `machines`).
#![allow(dead_code)]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvferry_machines::{AbortReason, FailReason, InputError, Machine, Phase};

/// Inputs of [`TestMachine`].
#[derive(Clone, Debug)]
pub(crate) enum TestEvent {
    /// Move the deadline (re-arms the driver's timer for this machine).
    SetDeadline(Instant),
    /// Start "transferring": emits one action per unit of `actions`.
    Emit(u32),
    /// Finish successfully.
    Succeed,
    /// Input the machine refuses (bad peer data).
    Garbage,
}

/// Outputs of [`TestMachine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TestAction {
    Work(u32),
    Expired { deadline: Instant, now: Instant },
    Aborted(AbortReason),
    Done,
}

/// Expires at its deadline; after an abort it holds a fence for `fence`
/// before it has nothing left to do (like a D machine waiting before block
/// reuse).
#[derive(Debug)]
pub(crate) struct TestMachine {
    deadline: Option<Instant>,
    fence: Duration,
    fence_until: Option<Instant>,
    phase: Phase,
    actions: VecDeque<TestAction>,
}

impl TestMachine {
    pub(crate) fn new(deadline: Option<Instant>) -> Self {
        Self::with_fence(deadline, Duration::ZERO)
    }

    pub(crate) fn with_fence(deadline: Option<Instant>, fence: Duration) -> Self {
        Self {
            deadline,
            fence,
            fence_until: None,
            phase: Phase::WaitingForInput,
            actions: VecDeque::new(),
        }
    }
}

impl Machine for TestMachine {
    type Event = TestEvent;
    type Action = TestAction;

    fn handle_event(&mut self, _now: Instant, event: TestEvent) -> Result<(), InputError> {
        if self.phase.is_terminal() {
            return Ok(());
        }
        match event {
            TestEvent::SetDeadline(deadline) => self.deadline = Some(deadline),
            TestEvent::Emit(n) => {
                self.phase = Phase::Transferring;
                self.actions.extend((0..n).map(TestAction::Work));
            }
            TestEvent::Succeed => {
                self.phase = Phase::Success;
                self.deadline = None;
                self.actions.push_back(TestAction::Done);
            }
            TestEvent::Garbage => return Err(InputError::Peer("garbage")),
        }
        Ok(())
    }

    fn handle_timeout(&mut self, now: Instant) {
        if let Some(until) = self.fence_until {
            if now >= until {
                self.fence_until = None;
            }
            return;
        }
        match self.deadline {
            Some(deadline) if now >= deadline && !self.phase.is_terminal() => {
                self.phase = Phase::Expired;
                self.deadline = None;
                self.actions
                    .push_back(TestAction::Expired { deadline, now });
            }
            Some(_) | None => {}
        }
    }

    fn abort(&mut self, now: Instant, reason: AbortReason) {
        if self.phase.is_terminal() {
            return;
        }
        self.phase = Phase::Failed(FailReason::Aborted(reason));
        self.deadline = None;
        if !self.fence.is_zero() {
            self.fence_until = Some(now + self.fence);
        }
        self.actions.push_back(TestAction::Aborted(reason));
    }

    fn poll_action(&mut self) -> Option<TestAction> {
        self.actions.pop_front()
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.fence_until.or(if self.phase.is_terminal() {
            None
        } else {
            self.deadline
        })
    }

    fn phase(&self) -> Phase {
        self.phase
    }
}

/// Collects actions with the transfer that emitted them.
#[derive(Debug, Default)]
pub(crate) struct VecSink {
    pub actions: Vec<(kvferry_machines::TransferId, TestAction)>,
    pub phases: Vec<(kvferry_machines::TransferId, Phase)>,
}

impl kvferry_reactor::ActionSink<TestMachine> for VecSink {
    fn execute(&mut self, transfer_id: kvferry_machines::TransferId, action: TestAction) {
        self.actions.push((transfer_id, action));
    }

    fn on_phase(
        &mut self,
        transfer_id: kvferry_machines::TransferId,
        _machine: &TestMachine,
        phase: Phase,
        _now: Instant,
    ) {
        self.phases.push((transfer_id, phase));
    }
}

impl TestMachine {
    /// The phase, without going through the trait (for assertions).
    pub(crate) fn phase_for_test(&self) -> Phase {
        self.phase
    }
}
