//! What crosses from engine threads to executors, and back.

use std::future::Future;
use std::pin::Pin;

use kvferry_machines::{AbortReason, Machine, TransferId};

/// A local task shipped to an executor by [`crate::ReactorHandle::spawn_on`].
pub type SpawnFn = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()>>> + Send>;

/// One entry of an executor's mailbox.
pub enum Command<M: Machine> {
    /// Insert a new machine.
    Create {
        /// Its transfer.
        transfer_id: TransferId,
        /// The machine, built by the caller.
        machine: M,
    },
    /// Feed an event to a machine.
    Event {
        /// Its transfer.
        transfer_id: TransferId,
        /// The event.
        event: M::Event,
    },
    /// Abort a machine.
    Abort {
        /// Its transfer.
        transfer_id: TransferId,
        /// Why.
        reason: AbortReason,
    },
    /// Run a local task on the executor.
    Spawn(SpawnFn),
}

impl<M: Machine> std::fmt::Debug for Command<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Create { transfer_id, .. } => f
                .debug_struct("Create")
                .field("transfer_id", transfer_id)
                .finish(),
            Command::Event { transfer_id, .. } => f
                .debug_struct("Event")
                .field("transfer_id", transfer_id)
                .finish(),
            Command::Abort {
                transfer_id,
                reason,
            } => f
                .debug_struct("Abort")
                .field("transfer_id", transfer_id)
                .field("reason", reason)
                .finish(),
            Command::Spawn(_) => f.write_str("Spawn"),
        }
    }
}

/// Why a submission from an engine thread was refused. Nothing was queued.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Back-pressure: the executor's mailbox is full. Retry later.
    #[error("mailbox of executor {executor} is full (back-pressure); retry later")]
    MailboxFull {
        /// Executor index.
        executor: usize,
    },
    /// Back-pressure: the executor already holds its maximum of transfers
    /// (live ones plus finished ones not yet collected with `get_finished`).
    #[error("executor {executor} already holds its maximum of {max_machines} transfers; collect finished ones")]
    AtCapacity {
        /// Executor index.
        executor: usize,
        /// The configured maximum.
        max_machines: usize,
    },
    /// Misuse: the transfer already exists (or its completion was not
    /// collected yet).
    #[error("transfer {0:?} already exists")]
    DuplicateTransfer(TransferId),
    /// Misuse: no such transfer (never created, or its completion was
    /// already collected).
    #[error("unknown transfer {0:?}")]
    UnknownTransfer(TransferId),
    /// Misuse: no executor with that index.
    #[error("no executor {executor} (there are {executors})")]
    NoSuchExecutor {
        /// Requested index.
        executor: usize,
        /// Number of executors.
        executors: usize,
    },
    /// The reactor is shutting down and accepts nothing new.
    #[error("reactor is shutting down")]
    ShuttingDown,
}

impl SubmitError {
    /// True for back-pressure (retrying later can succeed); false for misuse
    /// and shutdown.
    pub fn is_backpressure(&self) -> bool {
        match self {
            SubmitError::MailboxFull { .. } | SubmitError::AtCapacity { .. } => true,
            SubmitError::DuplicateTransfer(_)
            | SubmitError::UnknownTransfer(_)
            | SubmitError::NoSuchExecutor { .. }
            | SubmitError::ShuttingDown => false,
        }
    }
}

/// A refused submission, with what was submitted handed back so that
/// nothing is lost.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct Refused<T> {
    /// Why it was refused.
    pub error: SubmitError,
    /// The machine or event that was not queued.
    pub value: T,
}

/// Why an [`EventPoster`] could not post.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum PostError<E> {
    /// The local event queue is full (only from `try_post`).
    #[error("local event queue is full")]
    Full(E),
    /// The executor's loop has ended.
    #[error("executor loop has ended")]
    Closed(E),
}

/// Lets work started by an [`crate::ActionSink`] feed its result back to the
/// machine as an event. Lives on the executor; cloning is cheap.
///
/// The queue behind it is bounded. [`EventPoster::post`] waits for room,
/// which is safe because the driver loop drains the queue on every turn and
/// never waits on the tasks that post.
pub struct EventPoster<M: Machine> {
    pub(crate) tx: flume::Sender<(TransferId, M::Event)>,
}

impl<M: Machine> Clone for EventPoster<M> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
        }
    }
}

impl<M: Machine> std::fmt::Debug for EventPoster<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventPoster")
            .field("queued", &self.tx.len())
            .finish()
    }
}

impl<M: Machine> EventPoster<M> {
    /// Posts an event, waiting for room in the queue.
    pub async fn post(
        &self,
        transfer_id: TransferId,
        event: M::Event,
    ) -> Result<(), PostError<M::Event>> {
        self.tx
            .send_async((transfer_id, event))
            .await
            .map_err(|flume::SendError((_, event))| PostError::Closed(event))
    }

    /// Posts an event if there is room now.
    pub fn try_post(
        &self,
        transfer_id: TransferId,
        event: M::Event,
    ) -> Result<(), PostError<M::Event>> {
        self.tx
            .try_send((transfer_id, event))
            .map_err(|error| match error {
                flume::TrySendError::Full((_, event)) => PostError::Full(event),
                flume::TrySendError::Disconnected((_, event)) => PostError::Closed(event),
            })
    }
}

/// What a sink factory gets when an executor starts.
#[derive(Debug)]
#[non_exhaustive]
pub struct ExecutorContext<M: Machine> {
    /// Index of the executor (position in `ReactorConfig::executors`).
    pub executor: usize,
    /// The core it is pinned to, if any.
    pub core: Option<usize>,
    /// For async actions to report back.
    pub poster: EventPoster<M>,
}
