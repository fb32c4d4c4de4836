//! The reactor: one pinned glommio executor per device, each running the
//! driver loop, plus the thread-safe handle engine threads call.

use std::future::Future;
use std::task::Poll;
use std::time::{Duration, Instant};

use futures_lite::{future, Stream};
use glommio::timer::Timer;
use glommio::{LocalExecutorBuilder, Placement};
use kvferry_machines::{AbortReason, Machine, Phase, TransferId};

use crate::board::{BoardError, CompletionBoard};
use crate::config::{PollPolicy, ReactorConfig, ShutdownPolicy};
use crate::doorbell::Doorbell;
use crate::driver::{
    round_up_to_tick, ActionSink, Completion, Driver, DriverConfig, DriverError, Outcome,
    RejectReason,
};
use crate::error::ReactorError;
use crate::latch::ShutdownLatch;
use crate::mailbox::{Command, EventPoster, ExecutorContext, Refused, SubmitError};
use crate::stats::{Stats, StatsSnapshot};
use crate::sync::Arc;

/// Locked memory glommio requires before it sets up an executor's io_uring
/// (its `MIN_MEMLOCK_LIMIT`); below it every executor fails to start.
pub const MIN_MEMLOCK_BYTES: u64 = 512 * 1024;

/// Refuses to start below [`MIN_MEMLOCK_BYTES`] of locked memory, with a
/// typed error that says how to fix it, instead of glommio's error from
/// inside the executor thread.
fn check_memlock() -> Result<(), ReactorError> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a valid pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        // Unknown: glommio checks again and reports its own error.
        return Ok(());
    }
    let have = limit.rlim_cur;
    if have != libc::RLIM_INFINITY && have < MIN_MEMLOCK_BYTES {
        return Err(ReactorError::MemLock {
            have,
            need: MIN_MEMLOCK_BYTES,
        });
    }
    Ok(())
}

/// What one executor did during shutdown.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecutorReport {
    /// Executor index.
    pub executor: usize,
    /// Machines aborted with `AbortReason::Shutdown`.
    pub aborted: usize,
    /// Machines dropped when the grace period ran out.
    pub dropped: usize,
}

/// Result of [`Reactor::shutdown`].
#[derive(Debug)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// One entry per executor that joined cleanly.
    pub executors: Vec<ExecutorReport>,
    /// Completions nobody collected before shutdown, so that none is lost.
    pub completions: Vec<Completion>,
}

/// State shared by the handle(s) and the executors.
struct Shared<M: Machine> {
    board: CompletionBoard,
    stats: Stats,
    latch: ShutdownLatch,
    mailboxes: Vec<flume::Sender<Command<M>>>,
    /// One per mailbox: rung after every command queued into it.
    doorbells: Vec<Arc<Doorbell>>,
    completions_tx: flume::Sender<Completion>,
    completions_rx: flume::Receiver<Completion>,
}

impl<M: Machine> Shared<M> {
    /// The state of a reactor configured by `config`, and the receiving
    /// end of each executor's mailbox.
    fn new(config: &ReactorConfig) -> (Arc<Self>, Vec<flume::Receiver<Command<M>>>) {
        let executors = config.executors.len();
        let total = executors.saturating_mul(config.max_machines_per_executor);
        // Every completion belongs to a transfer still on the board, so this
        // channel can never hold more than the board does.
        let (completions_tx, completions_rx) = flume::bounded(total);
        let mut mailboxes = Vec::with_capacity(executors);
        let mut receivers = Vec::with_capacity(executors);
        for _ in 0..executors {
            let (tx, rx) = flume::bounded(config.mailbox_capacity);
            mailboxes.push(tx);
            receivers.push(rx);
        }
        let shared = Arc::new(Shared {
            board: CompletionBoard::new(executors, config.max_machines_per_executor),
            stats: Stats::new(),
            latch: ShutdownLatch::new(),
            doorbells: (0..executors).map(|_| Arc::new(Doorbell::new())).collect(),
            mailboxes,
            completions_tx,
            completions_rx,
        });
        (shared, receivers)
    }

    /// Queues `command` for `executor` and wakes it (outside the channel's
    /// lock, see [`Doorbell`]).
    fn post(
        &self,
        executor: usize,
        command: Command<M>,
    ) -> Result<(), flume::TrySendError<Command<M>>> {
        self.mailboxes[executor].try_send(command)?;
        crate::doorbell::ring_or_hold(&self.doorbells[executor]);
        Ok(())
    }
}

/// Thread-safe handle engine threads use to reach the executors. Cheap to
/// clone; every call is non-blocking except [`ReactorHandle::recv_finished`].
pub struct ReactorHandle<M: Machine> {
    shared: Arc<Shared<M>>,
}

impl<M: Machine> Clone for ReactorHandle<M> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<M: Machine> std::fmt::Debug for ReactorHandle<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReactorHandle")
            .field("executors", &self.shared.mailboxes.len())
            .finish()
    }
}

impl<M> ReactorHandle<M>
where
    M: Machine + Send + 'static,
    M::Event: Send + 'static,
{
    /// Number of executors.
    pub fn executors(&self) -> usize {
        self.shared.mailboxes.len()
    }

    /// Hands a new machine to `executor`. On success the transfer is on the
    /// board (in `Bootstrapping`) and will produce exactly one
    /// [`Completion`].
    pub fn create(
        &self,
        executor: usize,
        transfer_id: TransferId,
        machine: M,
    ) -> Result<(), Refused<M>> {
        let Some(_inside) = self.shared.latch.enter() else {
            return Err(Refused {
                error: SubmitError::ShuttingDown,
                value: machine,
            });
        };
        if let Err(error) = self.shared.board.reserve(transfer_id, executor) {
            let error = match error {
                BoardError::Duplicate(id) => SubmitError::DuplicateTransfer(id),
                BoardError::Full { executor, max } => SubmitError::AtCapacity {
                    executor,
                    max_machines: max,
                },
                BoardError::NoSuchExecutor {
                    executor,
                    executors,
                } => SubmitError::NoSuchExecutor {
                    executor,
                    executors,
                },
            };
            return Err(Refused {
                error,
                value: machine,
            });
        }
        let command = Command::Create {
            transfer_id,
            machine,
        };
        match self.shared.post(executor, command) {
            Ok(()) => Ok(()),
            Err(error) => {
                // Not queued: take the reservation back so the caller can
                // retry with the same transfer id.
                self.shared.board.remove(transfer_id);
                let (error, command) = match error {
                    flume::TrySendError::Full(command) => {
                        self.shared.stats.add_mailbox_full();
                        (SubmitError::MailboxFull { executor }, command)
                    }
                    flume::TrySendError::Disconnected(command) => {
                        (SubmitError::ShuttingDown, command)
                    }
                };
                match command {
                    Command::Create { machine, .. } => Err(Refused {
                        error,
                        value: machine,
                    }),
                    // We built this command two statements above.
                    Command::Event { .. } | Command::Abort { .. } | Command::Spawn(_) => {
                        unreachable!("try_send handed back a different command")
                    }
                }
            }
        }
    }

    /// Feeds an event to the machine of `transfer_id`. Events keep flowing
    /// while a `Drain` shutdown is in progress, so in-flight requests can
    /// finish.
    pub fn send_event(
        &self,
        transfer_id: TransferId,
        event: M::Event,
    ) -> Result<(), Refused<M::Event>> {
        let Some(executor) = self.shared.board.executor_of(transfer_id) else {
            return Err(Refused {
                error: SubmitError::UnknownTransfer(transfer_id),
                value: event,
            });
        };
        match self
            .shared
            .post(executor, Command::Event { transfer_id, event })
        {
            Ok(()) => Ok(()),
            Err(error) => {
                let (error, command) = match error {
                    flume::TrySendError::Full(command) => {
                        self.shared.stats.add_mailbox_full();
                        (SubmitError::MailboxFull { executor }, command)
                    }
                    flume::TrySendError::Disconnected(command) => {
                        (SubmitError::ShuttingDown, command)
                    }
                };
                match command {
                    Command::Event { event, .. } => Err(Refused {
                        error,
                        value: event,
                    }),
                    Command::Create { .. } | Command::Abort { .. } | Command::Spawn(_) => {
                        unreachable!("try_send handed back a different command")
                    }
                }
            }
        }
    }

    /// Aborts the request of `transfer_id`.
    pub fn abort(&self, transfer_id: TransferId, reason: AbortReason) -> Result<(), SubmitError> {
        let executor = self
            .shared
            .board
            .executor_of(transfer_id)
            .ok_or(SubmitError::UnknownTransfer(transfer_id))?;
        self.shared
            .post(
                executor,
                Command::Abort {
                    transfer_id,
                    reason,
                },
            )
            .map_err(|error| self.map_send_error(executor, &error))
    }

    /// Runs a local task on `executor` (registering memory, opening a
    /// transport session, anything that must live on that thread). The
    /// closure runs on the executor and builds a future that need not be
    /// `Send`.
    pub fn spawn_on<F, Fut>(&self, executor: usize, make: F) -> Result<(), SubmitError>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let Some(_inside) = self.shared.latch.enter() else {
            return Err(SubmitError::ShuttingDown);
        };
        let executors = self.executors();
        if executor >= executors {
            return Err(SubmitError::NoSuchExecutor {
                executor,
                executors,
            });
        }
        let boxed: crate::mailbox::SpawnFn = Box::new(move || Box::pin(make()));
        self.shared
            .post(executor, Command::Spawn(boxed))
            .map_err(|error| self.map_send_error(executor, &error))
    }

    fn map_send_error<T>(&self, executor: usize, error: &flume::TrySendError<T>) -> SubmitError {
        match error {
            flume::TrySendError::Full(_) => {
                self.shared.stats.add_mailbox_full();
                SubmitError::MailboxFull { executor }
            }
            flume::TrySendError::Disconnected(_) => SubmitError::ShuttingDown,
        }
    }

    /// Latest phase of a transfer, without a round trip to its executor.
    /// `None` once its completion was collected (or if it never existed).
    pub fn poll(&self, transfer_id: TransferId) -> Option<Phase> {
        // A caller polling in a loop inside a `batch` must not starve what
        // it polls for; so for every call that reads what executors did.
        crate::doorbell::release_held();
        self.shared.board.phase(transfer_id)
    }

    /// Collects up to `max` completions without waiting. Each transfer
    /// leaves the board as its completion is collected.
    pub fn get_finished(&self, max: usize) -> Vec<Completion> {
        crate::doorbell::release_held();
        let mut out = Vec::new();
        // Bounded by `max`.
        while out.len() < max {
            match self.shared.completions_rx.try_recv() {
                Ok(completion) => {
                    self.shared.board.remove(completion.transfer_id);
                    out.push(completion);
                }
                Err(_) => break,
            }
        }
        out
    }

    /// Waits up to `timeout` for one completion.
    pub fn recv_finished(&self, timeout: Duration) -> Option<Completion> {
        crate::doorbell::release_held();
        let completion = self.shared.completions_rx.recv_timeout(timeout).ok()?;
        self.shared.board.remove(completion.transfer_id);
        Some(completion)
    }

    /// Reactor-wide counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// Transfers currently on the board for `executor` (live plus
    /// uncollected completions).
    pub fn load(&self, executor: usize) -> usize {
        self.shared.board.len_for(executor)
    }
}

/// The running executors. Dropping it shuts down with
/// [`ReactorConfig::drop_policy`] and joins the threads.
pub struct Reactor<M: Machine> {
    handle: ReactorHandle<M>,
    controls: Vec<flume::Sender<ShutdownPolicy>>,
    joins: Vec<glommio::ExecutorJoinHandle<ExecutorReport>>,
    drop_policy: ShutdownPolicy,
}

impl<M: Machine> std::fmt::Debug for Reactor<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reactor")
            .field("executors", &self.controls.len())
            .field("running", &!self.joins.is_empty())
            .finish()
    }
}

impl<M> Reactor<M>
where
    M: Machine + Send + 'static,
    M::Event: Send + 'static,
    M::Action: 'static,
{
    /// Starts one executor per entry of `config.executors` and waits until
    /// each runs. `make_sink` runs once on each executor thread to build
    /// that executor's [`ActionSink`] (which may hold `Rc`s: it never
    /// leaves its thread).
    pub fn start<S, F>(config: ReactorConfig, make_sink: F) -> Result<Self, ReactorError>
    where
        S: ActionSink<M> + 'static,
        F: Fn(ExecutorContext<M>) -> S + Send + Sync + 'static,
    {
        config.validate()?;
        check_memlock()?;
        let executors = config.executors.len();
        let (shared, receivers) = Shared::new(&config);
        let mut reactor = Reactor {
            handle: ReactorHandle {
                shared: shared.clone(),
            },
            controls: Vec::with_capacity(executors),
            joins: Vec::with_capacity(executors),
            drop_policy: config.drop_policy,
        };
        let make_sink = Arc::new(make_sink);
        let (ready_tx, ready_rx) = flume::bounded::<usize>(executors);
        for (index, commands) in receivers.into_iter().enumerate() {
            // Only one shutdown policy is ever sent per executor.
            let (control_tx, control_rx) = flume::bounded(1);
            let state = LoopState::new(
                &config,
                index,
                &shared,
                commands,
                control_rx,
                make_sink.clone(),
                ready_tx.clone(),
            );
            match executor_builder(&config, index).spawn(move || run_loop(state)) {
                Ok(join) => {
                    reactor.controls.push(control_tx);
                    reactor.joins.push(join);
                }
                Err(error) => {
                    // `reactor` drops here and stops the ones already running.
                    return Err(ReactorError::Start {
                        executor: index,
                        message: error.to_string(),
                    });
                }
            }
        }
        drop(ready_tx);
        reactor.wait_ready(&ready_rx, Instant::now() + config.start_timeout)?;
        Ok(reactor)
    }

    /// Waits until every executor reported that it runs, or `deadline`.
    fn wait_ready(
        &mut self,
        ready: &flume::Receiver<usize>,
        deadline: Instant,
    ) -> Result<(), ReactorError> {
        for _ in 0..self.joins.len() {
            if ready.recv_deadline(deadline).is_err() {
                // A thread died before reporting (bad core, io_uring refused)
                // or took too long. Find out which, after stopping the rest.
                let failed = self.shutdown_inner(ShutdownPolicy::Abort {
                    grace: Duration::ZERO,
                });
                let (executor, message) = match failed {
                    Err(ReactorError::Join { executor, message }) => (executor, message),
                    _ => (0, "executor did not start in time".to_owned()),
                };
                return Err(ReactorError::Start { executor, message });
            }
        }
        Ok(())
    }

    /// A handle for engine threads.
    pub fn handle(&self) -> ReactorHandle<M> {
        self.handle.clone()
    }

    /// Stops accepting new requests, settles the in-flight ones by `policy`,
    /// joins every executor thread, and returns the completions nobody
    /// collected.
    pub fn shutdown(mut self, policy: ShutdownPolicy) -> Result<ShutdownReport, ReactorError> {
        self.shutdown_inner(policy)
    }

    fn shutdown_inner(&mut self, policy: ShutdownPolicy) -> Result<ShutdownReport, ReactorError> {
        let shared = &self.handle.shared;
        // After this returns no `Create` can enter any mailbox.
        shared.latch.close();
        for control in &self.controls {
            // Capacity 1 and sent once; a closed channel means that executor
            // already ended, which the join below reports.
            let _ = control.try_send(policy);
        }
        let mut executors = Vec::with_capacity(self.joins.len());
        let mut failure = None;
        for (index, join) in self.joins.drain(..).enumerate() {
            match join.join() {
                Ok(report) => executors.push(report),
                Err(error) => {
                    failure.get_or_insert(ReactorError::Join {
                        executor: index,
                        message: error.to_string(),
                    });
                }
            }
        }
        self.controls.clear();
        let completions: Vec<Completion> = shared.completions_rx.try_iter().collect();
        for completion in &completions {
            shared.board.remove(completion.transfer_id);
        }
        match failure {
            Some(error) => Err(error),
            None => Ok(ShutdownReport {
                executors,
                completions,
            }),
        }
    }
}

impl<M: Machine> Drop for Reactor<M> {
    fn drop(&mut self) {
        if self.joins.is_empty() {
            return;
        }
        // Same steps as `shutdown_inner`, which needs the `Send` bounds
        // that `Drop` cannot add.
        let shared = &self.handle.shared;
        shared.latch.close();
        for control in &self.controls {
            let _ = control.try_send(self.drop_policy);
        }
        for join in self.joins.drain(..) {
            if let Err(error) = join.join() {
                tracing::error!(%error, "executor failed during drop");
            }
        }
    }
}

/// The glommio executor builder for executor `index`: its placement,
/// name, IO memory and poll policy.
fn executor_builder(config: &ReactorConfig, index: usize) -> LocalExecutorBuilder {
    let exec_config = &config.executors[index];
    let placement = match exec_config.core {
        Some(core) => Placement::Fixed(core),
        None => Placement::Unbound,
    };
    let builder = LocalExecutorBuilder::new(placement)
        .name(&exec_config.label)
        .io_memory(config.io_memory_bytes);
    match config.poll_policy.for_this_process() {
        PollPolicy::Park => builder,
        PollPolicy::Spin { spin } => builder.spin_before_park(spin),
    }
}

/// Everything one executor's loop owns.
struct LoopState<M: Machine, F> {
    index: usize,
    core: Option<usize>,
    shared: Arc<Shared<M>>,
    commands: flume::Receiver<Command<M>>,
    control: flume::Receiver<ShutdownPolicy>,
    make_sink: Arc<F>,
    ready: flume::Sender<usize>,
    driver_config: DriverConfig,
    max_inputs_per_turn: usize,
    local_event_capacity: usize,
    mailbox_capacity: usize,
    timer_tick: Duration,
    yield_after_ends_below: usize,
}

impl<M: Machine, F> LoopState<M, F> {
    /// What executor `index` of a reactor configured by `config` owns.
    fn new(
        config: &ReactorConfig,
        index: usize,
        shared: &Arc<Shared<M>>,
        commands: flume::Receiver<Command<M>>,
        control: flume::Receiver<ShutdownPolicy>,
        make_sink: Arc<F>,
        ready: flume::Sender<usize>,
    ) -> Self {
        LoopState {
            index,
            core: config.executors[index].core,
            shared: shared.clone(),
            commands,
            control,
            make_sink,
            ready,
            driver_config: DriverConfig {
                max_machines: config.max_machines_per_executor,
                max_actions_per_input: config.max_actions_per_input,
            },
            max_inputs_per_turn: config.max_inputs_per_turn,
            local_event_capacity: config.local_event_capacity,
            mailbox_capacity: config.mailbox_capacity,
            timer_tick: config.timer_tick,
            yield_after_ends_below: config.yield_after_ends_below,
        }
    }
}

/// Forwards to the node's sink and mirrors phase changes onto the board.
struct BoardSink<'a, S> {
    inner: &'a mut S,
    board: &'a CompletionBoard,
    /// Terminal phases reported this turn.
    ended: usize,
}

impl<M: Machine, S: ActionSink<M>> ActionSink<M> for BoardSink<'_, S> {
    fn execute(&mut self, transfer_id: TransferId, action: M::Action) {
        self.inner.execute(transfer_id, action);
    }

    fn on_phase(&mut self, transfer_id: TransferId, machine: &M, phase: Phase, now: Instant) {
        if !phase.is_terminal() {
            self.board.publish(transfer_id, phase);
            self.inner.on_phase(transfer_id, machine, phase, now);
            return;
        }
        // The sink first (it closes the request's blocks to every copy,
        // shared-memory peers' included, and records the outcome), then
        // the board: whoever sees the phase there may reuse the blocks at
        // once and expects the outcome among the finished ones.
        self.ended += 1;
        self.inner.on_phase(transfer_id, machine, phase, now);
        self.board.publish(transfer_id, phase);
        self.inner.on_published(transfer_id, phase);
    }

    fn on_published(&mut self, transfer_id: TransferId, phase: Phase) {
        self.inner.on_published(transfer_id, phase);
    }

    fn on_late_event(&mut self, transfer_id: TransferId, event: M::Event) {
        self.inner.on_late_event(transfer_id, event);
    }
}

/// Where an executor is in its life.
#[derive(Clone, Copy, Debug)]
enum Stage {
    Running,
    /// Letting requests finish until `until`, then abort and wait `grace`.
    Draining {
        until: Instant,
        grace: Duration,
    },
    /// Aborted; dropping what is left at `until`.
    Grace {
        until: Instant,
    },
}

impl Stage {
    /// When the stage moves on by itself, if it does.
    fn deadline(self) -> Option<Instant> {
        match self {
            Stage::Running => None,
            Stage::Draining { until, .. } | Stage::Grace { until } => Some(until),
        }
    }
}

enum Wake<M: Machine> {
    Control(Option<ShutdownPolicy>),
    Local(TransferId, M::Event),
    Command(Command<M>),
    Timer,
}

/// Where one executor's inputs come from.
struct Inputs<'a, M: Machine> {
    commands: &'a flume::Receiver<Command<M>>,
    /// False once the shutdown policy (or the control channel's end) came.
    control_open: bool,
    control: flume::r#async::RecvStream<'a, ShutdownPolicy>,
    local_rx: &'a flume::Receiver<(TransferId, M::Event)>,
    local: flume::r#async::RecvStream<'a, (TransferId, M::Event)>,
    /// Rung after every command queued into `commands`.
    doorbell: &'a Doorbell,
}

impl<M: Machine> Inputs<'_, M> {
    /// Waits for the next wake-up: the shutdown policy, a local event, the
    /// timer or a command, looked at in that order.
    async fn next(&mut self, alarm: &mut Alarm) -> Wake<M> {
        future::poll_fn(|cx| {
            if self.control_open {
                if let Poll::Ready(policy) = std::pin::Pin::new(&mut self.control).poll_next(cx) {
                    return Poll::Ready(Wake::Control(policy));
                }
            }
            if let Poll::Ready(Some((id, event))) =
                std::pin::Pin::new(&mut self.local).poll_next(cx)
            {
                return Poll::Ready(Wake::Local(id, event));
            }
            if alarm.poll(cx) {
                return Poll::Ready(Wake::Timer);
            }
            // The handle keeps a sender alive for as long as the reactor
            // exists, so the mailbox does not disconnect while we run.
            // Armed before the second look, never after (see `Doorbell`).
            if let Ok(command) = self.commands.try_recv() {
                return Poll::Ready(Wake::Command(command));
            }
            self.doorbell.arm(cx.waker());
            if let Ok(command) = self.commands.try_recv() {
                return Poll::Ready(Wake::Command(command));
            }
            Poll::Pending
        })
        .await
    }
}

/// The one timer of an executor, re-armed to the earliest deadline.
struct Alarm {
    timer: Timer,
    /// The deadline the timer is armed for; `None`: not armed.
    armed_for: Option<Instant>,
    /// Origin of the timer ticks.
    epoch: Instant,
    tick: Duration,
}

impl Alarm {
    fn new(tick: Duration) -> Self {
        let epoch = Instant::now();
        Alarm {
            timer: Timer::new(Duration::from_secs(3600)),
            armed_for: None,
            epoch,
            tick,
        }
    }

    /// Arms the timer for the driver's earliest deadline (rounded up to the
    /// tick) or the stage's, whichever comes first, or for now when the
    /// driver has work pending.
    fn arm<M: Machine>(&mut self, now: Instant, driver: &mut Driver<M>, stage: Stage) {
        let mut target = driver
            .poll_timeout()
            .map(|deadline| round_up_to_tick(deadline, self.epoch, self.tick));
        target = match (target, stage.deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if driver.has_pending() {
            target = Some(now);
        }
        if target != self.armed_for {
            if let Some(when) = target {
                self.timer.reset(when.saturating_duration_since(now));
            }
            self.armed_for = target;
        }
    }

    /// True when the armed timer fired.
    fn poll(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        self.armed_for.is_some() && std::pin::Pin::new(&mut self.timer).poll(cx).is_ready()
    }

    /// The timer woke the executor at `now`: counts how late, and disarms.
    fn fired(&mut self, now: Instant, stats: &Stats) {
        if let Some(armed) = self.armed_for {
            let lag = now.saturating_duration_since(armed);
            stats.add_timer_wake(u64::try_from(lag.as_nanos()).unwrap_or(u64::MAX));
        }
        self.armed_for = None;
    }
}

/// What one executor's loop works on between wake-ups.
struct Executor<'a, M: Machine, S> {
    index: usize,
    shared: &'a Shared<M>,
    driver: Driver<M>,
    sink: S,
    report: ExecutorReport,
    stage: Stage,
    max_inputs_per_turn: usize,
    mailbox_capacity: usize,
    yield_after_ends_below: usize,
    early: Early<Held<M::Event>>,
}

/// Events and aborts that came before their machine: a transfer is on the
/// board from the moment its creation is accepted, before its `Create` is
/// in the mailbox, so another thread that sees it there can queue an event
/// or an abort ahead of the `Create`. Such an input waits here and is
/// handed to the machine right after it is created, in the order the inputs
/// came; one whose creation was taken back (the board no longer names it
/// for this executor) is dropped as a late event. At most `max` wait.
struct Early<E> {
    waiting: Vec<(TransferId, E)>,
    max: usize,
}

/// True when the `Create` of `transfer_id` is on its way to `executor`: the
/// board names the transfer for it, not ended, and it has no machine yet.
fn create_coming<M: Machine>(
    board: &CompletionBoard,
    driver: &Driver<M>,
    executor: usize,
    transfer_id: TransferId,
) -> bool {
    !driver.contains(transfer_id) && board.is_live_on(transfer_id, executor)
}

/// An input that came before its machine's `Create`.
enum Held<E> {
    Event(E),
    Abort(AbortReason),
}

impl<E> Early<E> {
    /// Takes the events waiting for `transfer_id`, oldest first.
    fn take(&mut self, transfer_id: TransferId) -> Vec<E> {
        if self.waiting.is_empty() {
            return Vec::new();
        }
        let (mine, rest) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|(id, _)| *id == transfer_id);
        self.waiting = rest;
        mine.into_iter().map(|(_, e)| e).collect()
    }
}

/// The driver loop of one executor (see the crate docs for its shape).
async fn run_loop<M, S, F>(state: LoopState<M, F>) -> ExecutorReport
where
    M: Machine + Send + 'static,
    M::Event: Send + 'static,
    M::Action: 'static,
    S: ActionSink<M> + 'static,
    F: Fn(ExecutorContext<M>) -> S + Send + Sync + 'static,
{
    let LoopState {
        index,
        core,
        shared,
        commands,
        control,
        make_sink,
        ready,
        driver_config,
        max_inputs_per_turn,
        local_event_capacity,
        mailbox_capacity,
        timer_tick,
        yield_after_ends_below,
    } = state;
    let (local_tx, local_rx) = flume::bounded::<(TransferId, M::Event)>(local_event_capacity);
    let sink = make_sink(ExecutorContext {
        executor: index,
        core,
        poster: EventPoster { tx: local_tx },
    });
    let mut exec = Executor::new(index, &shared, Driver::new(index, driver_config), sink);
    exec.max_inputs_per_turn = max_inputs_per_turn;
    exec.yield_after_ends_below = yield_after_ends_below;
    exec.set_mailbox_capacity(mailbox_capacity);
    let _ = ready.send(index);
    drop(ready);

    let mut alarm = Alarm::new(timer_tick);
    let mut inputs = Inputs {
        commands: &commands,
        control_open: true,
        control: control.stream(),
        local_rx: &local_rx,
        local: local_rx.stream(),
        doorbell: &shared.doorbells[index],
    };
    // Each turn waits for one wake-up, handles it plus at most
    // `max_inputs_per_turn` more queued inputs, then runs due timers. The
    // loop ends only in a shutdown stage, when the driver is empty or the
    // grace period ran out; both are reached in bounded time.
    loop {
        alarm.arm(Instant::now(), &mut exec.driver, exec.stage);
        let wake = inputs.next(&mut alarm).await;
        if exec.turn(Instant::now(), wake, &mut inputs, &mut alarm) {
            break;
        }
    }
    exec.reject_queued(&commands);
    tracing::debug!(executor = index, report = ?exec.report, "executor stopped");
    exec.report
}

impl<'a, M: Machine, S> Executor<'a, M, S> {
    /// A running executor with nothing driven yet and no limits; its loop
    /// sets them from the executor's config.
    fn new(index: usize, shared: &'a Shared<M>, driver: Driver<M>, sink: S) -> Self {
        Executor {
            index,
            shared,
            driver,
            sink,
            report: ExecutorReport {
                executor: index,
                ..ExecutorReport::default()
            },
            stage: Stage::Running,
            max_inputs_per_turn: 0,
            mailbox_capacity: 0,
            yield_after_ends_below: 0,
            early: Early {
                waiting: Vec::new(),
                max: 0,
            },
        }
    }

    /// The mailbox's capacity, which also bounds the events held for
    /// machines not created yet.
    fn set_mailbox_capacity(&mut self, capacity: usize) {
        self.mailbox_capacity = capacity;
        self.early.max = capacity;
    }
}

impl<M: Machine, S: ActionSink<M>> Executor<'_, M, S> {
    /// Handles one wake-up and the inputs queued behind it, runs due timers
    /// and the shutdown stage, and hands out the completions. True once the
    /// executor may stop.
    fn turn(
        &mut self,
        now: Instant,
        wake: Wake<M>,
        inputs: &mut Inputs<M>,
        alarm: &mut Alarm,
    ) -> bool {
        let mut sink = BoardSink {
            inner: &mut self.sink,
            board: &self.shared.board,
            ended: 0,
        };
        let mut run = Turn {
            index: self.index,
            driver: &mut self.driver,
            sink: &mut sink,
            board: &self.shared.board,
            early: &mut self.early,
            stats: &self.shared.stats,
            stage: self.stage,
        };
        match wake {
            Wake::Control(policy) => {
                inputs.control_open = false;
                // A closed control channel means the reactor went away
                // without a policy; abort promptly.
                let policy = policy.unwrap_or(ShutdownPolicy::Abort {
                    grace: Duration::ZERO,
                });
                self.report.aborted +=
                    run.start_shutdown(now, policy, inputs.commands, self.mailbox_capacity);
                tracing::debug!(executor = self.index, ?policy, "shutdown started");
            }
            Wake::Local(id, event) => run.handle_event(now, id, event),
            Wake::Command(command) => run.handle_command(now, command),
            Wake::Timer => alarm.fired(now, &self.shared.stats),
        }
        run.handle_queued(now, inputs, self.max_inputs_per_turn);
        run.drop_stale_early();
        run.driver.drive_pending(now, run.sink);
        run.driver.handle_timers(now, run.sink);
        run.advance_stage(now, &mut self.report);
        self.stage = run.stage;
        let ended = sink.ended;
        self.hand_out(ended);
        let stopping = !matches!(self.stage, Stage::Running);
        stopping && self.driver.is_empty() && !self.driver.has_pending()
    }

    /// Sends this turn's completions to the handle, after `ended` requests
    /// turned terminal in it.
    fn hand_out(&mut self, ended: usize) {
        // Decided and counted before the completions go out, so whoever
        // collects one sees the count.
        let give_way = ended > 0 && self.driver.len() < self.yield_after_ends_below;
        if give_way {
            self.shared.stats.add_yield_after_ends();
        }
        flush_completions(&mut self.driver, self.shared);
        if give_way {
            // Engine threads waiting for these requests were woken, and on
            // a shared core the kernel lets us run on first: through the
            // answers and acknowledgements our other tasks send next, and
            // often through the peer those wake as well. Give the core away
            // once so the engine hears of its requests first. Only with few
            // requests live: with many, the engine is busy feeding us rather
            // than waiting, and a yield per turn only adds context switches.
            std::thread::yield_now();
        }
    }

    /// Rejects the creations still queued once the loop ended.
    fn reject_queued(&mut self, commands: &flume::Receiver<Command<M>>) {
        // Latch closed before the shutdown policy was sent, so no `Create` can
        // arrive any more; the ones still queued get a rejection so that every
        // accepted creation yields exactly one completion. Bounded by the
        // mailbox capacity (events may still trickle in from other threads).
        for _ in 0..self.mailbox_capacity {
            match commands.try_recv() {
                Ok(Command::Create { transfer_id, .. }) => {
                    reject(
                        &mut self.driver,
                        self.shared,
                        self.index,
                        transfer_id,
                        RejectReason::ShuttingDown,
                    );
                }
                Ok(Command::Event { .. } | Command::Abort { .. }) => {
                    self.shared.stats.add_late_event()
                }
                Ok(Command::Spawn(_)) => {}
                Err(_) => break,
            }
        }
    }
}

/// One turn's borrowed view, so command handling reads as one method.
struct Turn<'a, 'b, M: Machine, S> {
    index: usize,
    driver: &'a mut Driver<M>,
    sink: &'a mut BoardSink<'b, S>,
    board: &'a CompletionBoard,
    early: &'a mut Early<Held<M::Event>>,
    stats: &'a Stats,
    stage: Stage,
}

impl<M: Machine, S: ActionSink<M>> Turn<'_, '_, M, S> {
    fn handle_event(&mut self, now: Instant, transfer_id: TransferId, event: M::Event) {
        if create_coming(self.board, self.driver, self.index, transfer_id) {
            if self.early.waiting.len() < self.early.max {
                self.early.waiting.push((transfer_id, Held::Event(event)));
            } else {
                self.stats.add_late_event();
            }
            return;
        }
        if !self.driver.contains(transfer_id) {
            // Its machine ended (an engine's abort can overtake a peer's
            // message queued for it): the sink may still answer the peer.
            self.stats.add_late_event();
            self.sink.on_late_event(transfer_id, event);
            return;
        }
        match self.driver.handle_event(now, transfer_id, event, self.sink) {
            Ok(()) => {}
            Err(DriverError::Unknown(_)) => self.stats.add_late_event(),
            Err(DriverError::Input { transfer_id, error }) => {
                tracing::debug!(?transfer_id, %error, "event refused by machine");
                self.stats.add_input_error();
            }
            Err(error @ (DriverError::Full { .. } | DriverError::Duplicate(_))) => {
                unreachable!("handle_event cannot fail with {error}")
            }
        }
    }

    fn handle_command(&mut self, now: Instant, command: Command<M>) {
        match command {
            Command::Create {
                transfer_id,
                machine,
            } => match self.stage {
                Stage::Running => match self.driver.insert(now, transfer_id, machine, self.sink) {
                    Ok(()) => {
                        self.stats.add_created();
                        for held in self.early.take(transfer_id) {
                            match held {
                                Held::Event(event) => self.handle_event(now, transfer_id, event),
                                Held::Abort(reason) => self.abort(now, transfer_id, reason),
                            }
                        }
                    }
                    Err(error) => {
                        tracing::error!(?transfer_id, %error, "create refused by driver despite board admission");
                        self.driver_reject(transfer_id, RejectReason::Refused);
                    }
                },
                Stage::Draining { .. } | Stage::Grace { .. } => {
                    self.driver_reject(transfer_id, RejectReason::ShuttingDown);
                }
            },
            Command::Event { transfer_id, event } => self.handle_event(now, transfer_id, event),
            Command::Abort {
                transfer_id,
                reason,
            } => {
                // An engine that saw the transfer on the board (a peer's
                // first message created it) may abort before its `Create`
                // is handled: the abort waits for the machine like an event.
                if create_coming(self.board, self.driver, self.index, transfer_id) {
                    if self.early.waiting.len() < self.early.max {
                        self.early.waiting.push((transfer_id, Held::Abort(reason)));
                    } else {
                        self.stats.add_late_event();
                    }
                    return;
                }
                self.abort(now, transfer_id, reason);
            }
            Command::Spawn(make) => {
                glommio::spawn_local(make()).detach();
            }
        }
    }

    /// Shutdown `policy` arrived: handles the creations already queued,
    /// then starts draining or aborts. Returns how many machines it aborted.
    fn start_shutdown(
        &mut self,
        now: Instant,
        policy: ShutdownPolicy,
        commands: &flume::Receiver<Command<M>>,
        mailbox_capacity: usize,
    ) -> usize {
        // The latch closed before the policy was sent, so every
        // `Create` a caller was told was accepted is already in the
        // mailbox. Handle them now, while still running, so that the
        // policy applies to them like to every other in-flight
        // request. Bounded by the mailbox capacity.
        for _ in 0..mailbox_capacity {
            match commands.try_recv() {
                Ok(command) => self.handle_command(now, command),
                Err(_) => break,
            }
        }
        let mut aborted = 0;
        self.stage = match policy {
            ShutdownPolicy::Abort { grace } => {
                aborted = self.driver.abort_all(now, AbortReason::Shutdown, self.sink);
                Stage::Grace { until: now + grace }
            }
            ShutdownPolicy::Drain { drain, grace } => Stage::Draining {
                until: now + drain,
                grace,
            },
        };
        aborted
    }

    /// More queued input, bounded so timers are not starved, and taken
    /// alternately from both queues so neither starves the other.
    fn handle_queued(&mut self, now: Instant, inputs: &Inputs<M>, max_inputs_per_turn: usize) {
        for _ in 0..max_inputs_per_turn {
            let mut idle = true;
            if let Ok((id, event)) = inputs.local_rx.try_recv() {
                self.handle_event(now, id, event);
                idle = false;
            }
            if let Ok(command) = inputs.commands.try_recv() {
                self.handle_command(now, command);
                idle = false;
            }
            if idle {
                break;
            }
        }
    }

    /// Moves a shutdown stage on once its time is up: a drain ends by
    /// aborting what is left, the grace period by dropping it.
    fn advance_stage(&mut self, now: Instant, report: &mut ExecutorReport) {
        match self.stage {
            Stage::Running => {}
            Stage::Draining { until, grace } => {
                if now >= until {
                    report.aborted += self.driver.abort_all(now, AbortReason::Shutdown, self.sink);
                    self.stage = Stage::Grace { until: now + grace };
                }
            }
            Stage::Grace { until } => {
                if now >= until {
                    report.dropped += self.driver.drop_all();
                }
            }
        }
    }

    fn abort(&mut self, now: Instant, transfer_id: TransferId, reason: AbortReason) {
        if self
            .driver
            .abort(now, transfer_id, reason, self.sink)
            .is_err()
        {
            self.stats.add_late_event();
        }
    }

    fn driver_reject(&mut self, transfer_id: TransferId, reason: RejectReason) {
        for _ in self.early.take(transfer_id) {
            self.stats.add_late_event();
        }
        self.driver.push_rejection(transfer_id, reason);
    }

    /// Drops the waiting events whose `Create` will not come (the creation
    /// was taken back after a full mailbox, or the transfer ended).
    fn drop_stale_early(&mut self) {
        if self.early.waiting.is_empty() {
            return;
        }
        let (board, driver, index) = (self.board, &*self.driver, self.index);
        let before = self.early.waiting.len();
        (self.early.waiting).retain(|(id, _)| create_coming(board, driver, index, *id));
        for _ in self.early.waiting.len()..before {
            self.stats.add_late_event();
        }
    }
}

fn reject<M: Machine>(
    driver: &mut Driver<M>,
    shared: &Shared<M>,
    _executor: usize,
    transfer_id: TransferId,
    reason: RejectReason,
) {
    driver.push_rejection(transfer_id, reason);
    flush_completions(driver, shared);
}

/// Moves the driver's completions to the completion channel.
fn flush_completions<M: Machine>(driver: &mut Driver<M>, shared: &Shared<M>) {
    // Bounded by the driver's completion queue, itself bounded by
    // `max_machines`.
    while let Some(completion) = driver.poll_completion() {
        match completion.outcome {
            Outcome::Finished { .. } => shared.stats.add_finished(),
            Outcome::Rejected(_) => shared.stats.add_rejected(),
            Outcome::Dropped { .. } => shared.stats.add_dropped(),
        }
        if let Err(error) = shared.completions_tx.try_send(completion) {
            // The channel holds one slot per board entry and every
            // completion's transfer is still on the board, so it cannot be
            // full; the handle holds the receiver, so it cannot be closed.
            panic!(
                "completion channel refused {:?}: board admission invariant broken",
                error.into_inner()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ExecutorConfig;
    use crate::driver::{ActionSink, Outcome};
    use kvferry_machines::InputError;

    /// Records its events; event 0 ends it.
    struct Recorder {
        seen: Vec<u32>,
        done: bool,
    }

    impl Machine for Recorder {
        type Event = u32;
        type Action = Vec<u32>;

        fn handle_event(&mut self, _: Instant, e: u32) -> Result<(), InputError> {
            self.seen.push(e);
            self.done |= e == 0;
            Ok(())
        }
        fn handle_timeout(&mut self, _: Instant) {}
        fn abort(&mut self, _: Instant, _: AbortReason) {
            self.seen.push(ABORTED);
            self.done = true;
        }
        fn poll_action(&mut self) -> Option<Vec<u32>> {
            (self.done && !self.seen.is_empty()).then(|| std::mem::take(&mut self.seen))
        }
        fn poll_timeout(&self) -> Option<Instant> {
            None
        }
        fn phase(&self) -> Phase {
            match self.done {
                true => Phase::Success,
                false => Phase::WaitingForInput,
            }
        }
    }

    /// Sends what the machines saw to the test.
    struct Seen(flume::Sender<Vec<u32>>);

    impl ActionSink<Recorder> for Seen {
        fn execute(&mut self, _: TransferId, seen: Vec<u32>) {
            let _ = self.0.send(seen);
        }

        fn on_late_event(&mut self, _: TransferId, event: u32) {
            let _ = self.0.send(vec![LATE, event]);
        }
    }

    /// What `Seen` reports before an event that came after its machine.
    const LATE: u32 = u32::MAX;
    /// What a `Recorder` saw when it was aborted.
    const ABORTED: u32 = u32::MAX - 1;

    fn reactor() -> (Reactor<Recorder>, flume::Receiver<Vec<u32>>) {
        let (tx, rx) = flume::unbounded();
        let config = ReactorConfig {
            executors: vec![ExecutorConfig::unpinned("early-events")],
            ..ReactorConfig::default()
        };
        let reactor = Reactor::start(config, move |_| Seen(tx.clone())).expect("reactor");
        (reactor, rx)
    }

    fn recorder() -> Recorder {
        Recorder {
            seen: Vec::new(),
            done: false,
        }
    }

    const WAIT: Duration = Duration::from_secs(20);

    #[test]
    fn events_queued_before_their_create_reach_the_machine_in_order() {
        let (reactor, seen) = reactor();
        let h = reactor.handle();
        let id = TransferId(7);
        // What another thread can do between an engine's reservation and
        // its `Create` reaching the mailbox: see the transfer on the board
        // and queue events for it.
        h.shared.board.reserve(id, 0).unwrap();
        for e in [3, 2, 1] {
            h.send_event(id, e).unwrap();
        }
        let create = Command::Create {
            transfer_id: id,
            machine: recorder(),
        };
        h.shared.post(0, create).unwrap();
        h.send_event(id, 0).unwrap();
        assert_eq!(seen.recv_timeout(WAIT).unwrap(), vec![3, 2, 1, 0]);
        let done = h.recv_finished(WAIT).expect("a completion");
        assert!(matches!(
            done.outcome,
            Outcome::Finished {
                phase: Phase::Success,
                ..
            }
        ));
        assert_eq!(h.stats().late_events, 0);
        reactor
            .shutdown(ShutdownPolicy::Abort {
                grace: Duration::ZERO,
            })
            .unwrap();
    }

    #[test]
    fn events_for_a_creation_taken_back_are_dropped_as_late() {
        let (reactor, _seen) = reactor();
        let h = reactor.handle();
        let (gone, live) = (TransferId(8), TransferId(9));
        h.shared.board.reserve(gone, 0).unwrap();
        h.send_event(gone, 5).unwrap();
        // The creation fails after all (a full mailbox): the board forgets
        // the transfer, and its waiting event goes at the next turn.
        h.shared.board.remove(gone);
        h.create(0, live, recorder()).map_err(|r| r.error).unwrap();
        h.send_event(live, 0).unwrap();
        let done = h.recv_finished(WAIT).expect("a completion");
        assert_eq!(done.transfer_id, live);
        assert_eq!(h.stats().late_events, 1);
        reactor
            .shutdown(ShutdownPolicy::Abort {
                grace: Duration::ZERO,
            })
            .unwrap();
    }

    #[test]
    fn an_event_queued_for_a_machine_that_ended_goes_to_the_sink() {
        let (reactor, seen) = reactor();
        let h = reactor.handle();
        let id = TransferId(10);
        h.create(0, id, recorder()).map_err(|r| r.error).unwrap();
        h.send_event(id, 0).unwrap();
        assert_eq!(
            seen.recv_timeout(WAIT).unwrap(),
            vec![0],
            "the machine ended"
        );
        // Its completion is not collected, so the board still names it and
        // this event is queued for a machine that is gone: as a peer's
        // message overtaken by an engine's abort.
        h.send_event(id, 42).unwrap();
        assert_eq!(seen.recv_timeout(WAIT).unwrap(), vec![LATE, 42]);
        assert_eq!(h.stats().late_events, 1);
        assert_eq!(h.recv_finished(WAIT).expect("a completion").transfer_id, id);
        reactor
            .shutdown(ShutdownPolicy::Abort {
                grace: Duration::ZERO,
            })
            .unwrap();
    }

    #[test]
    fn an_abort_queued_before_its_create_aborts_the_machine() {
        let (reactor, seen) = reactor();
        let h = reactor.handle();
        let id = TransferId(11);
        // A peer's first message created the transfer on another thread:
        // the engine sees it on the board and aborts before the `Create`
        // reaches the mailbox.
        h.shared.board.reserve(id, 0).unwrap();
        h.abort(id, AbortReason::Engine).unwrap();
        let create = Command::Create {
            transfer_id: id,
            machine: recorder(),
        };
        h.shared.post(0, create).unwrap();
        assert_eq!(seen.recv_timeout(WAIT).unwrap(), vec![ABORTED]);
        assert_eq!(h.recv_finished(WAIT).expect("a completion").transfer_id, id);
        assert_eq!(h.stats().late_events, 0);
        reactor
            .shutdown(ShutdownPolicy::Abort {
                grace: Duration::ZERO,
            })
            .unwrap();
    }
}
