//! The thread a backend runs on: calls in over a bounded flume channel,
//! answers out over the channel each call names. Neither the engine's
//! thread nor a glommio executor ever waits on the store itself; they post
//! and collect (a glommio task with flume's `recv_async`).

use std::cell::Cell;
use std::thread::JoinHandle;
use std::time::Instant;

use kvferry_machines::store::ChunkKey;
use kvferry_machines::RankLayout;

use super::backend::{Answers, CallError, GetItem, PutItem, PutOutcome, StoreBackend};

/// Most removed keys the thread collects after one call.
pub const REMOVED_PER_CALL_MAX: usize = 4096;

/// What a call asks the backend.
#[derive(Debug)]
pub enum BackendOp {
    /// [`StoreBackend::exists`].
    Exists(Vec<ChunkKey>),
    /// [`StoreBackend::put`].
    Put(Vec<PutItem>),
    /// [`StoreBackend::get`].
    Get(Vec<GetItem>),
    /// [`StoreBackend::remove`].
    Remove(Vec<ChunkKey>),
    /// [`StoreBackend::register`].
    Register(Box<RankLayout>),
}

impl BackendOp {
    fn keys(&self) -> usize {
        match self {
            BackendOp::Exists(k) | BackendOp::Remove(k) => k.len(),
            BackendOp::Put(i) => i.len(),
            BackendOp::Get(i) => i.len(),
            BackendOp::Register(_) => 0,
        }
    }
}

/// The backend's answer to an [`BackendOp`], of the same kind.
#[derive(Debug, PartialEq, Eq)]
pub enum BackendReply {
    /// To [`BackendOp::Exists`].
    Exists(Result<Vec<bool>, CallError>),
    /// To [`BackendOp::Put`].
    Put(Answers<PutOutcome>),
    /// To [`BackendOp::Get`].
    Get(Answers<()>),
    /// To [`BackendOp::Remove`].
    Remove(Answers<()>),
    /// To [`BackendOp::Register`].
    Register(Result<(), CallError>),
}

/// One call to the backend thread.
#[derive(Debug)]
pub struct Call {
    /// The caller's id for it, given back in [`Done::id`].
    pub id: u64,
    /// What to do.
    pub op: BackendOp,
    /// Posted time plus `op_bound`: a call not started by then is answered
    /// [`CallError::Timeout`] without touching memory.
    pub deadline: Instant,
    /// Where the answer goes.
    pub reply: flume::Sender<Done>,
}

/// The answer to a [`Call`].
#[derive(Debug)]
pub struct Done {
    /// The call's id.
    pub id: u64,
    /// The backend's answer; one of another length than the call's keys
    /// is turned into [`CallError::Refused`].
    pub reply: BackendReply,
    /// Keys that left the store since the previous call (for events).
    pub removed: Vec<ChunkKey>,
}

/// Why a call could not be posted.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PostError {
    /// The queue to the backend thread holds `capacity` calls already.
    #[error("the backend queue is full ({capacity} calls)")]
    QueueFull {
        /// The queue's bound.
        capacity: usize,
    },
    /// The backend thread is gone (it panicked).
    #[error("the backend thread is gone")]
    Gone,
}

/// A backend on its own thread. Dropping it closes the queue and waits
/// for the thread until the last deadline of the calls posted: past it no
/// call touches engine memory (the backend contract), so a backend stuck
/// in a call cannot hang the engine on drop.
#[derive(Debug)]
pub struct BackendWorker {
    name: &'static str,
    tx: Option<flume::Sender<Call>>,
    capacity: usize,
    /// Disconnected when the thread ends.
    ended: flume::Receiver<()>,
    /// The latest deadline of a call posted.
    last_deadline: Cell<Option<Instant>>,
    thread: Option<JoinHandle<()>>,
}

impl BackendWorker {
    /// Starts `backend`'s thread with a queue of at most `capacity` calls.
    pub fn spawn<B: StoreBackend>(backend: B, capacity: usize) -> std::io::Result<BackendWorker> {
        let name = backend.name();
        let capacity = capacity.max(1);
        let (tx, rx) = flume::bounded::<Call>(capacity);
        let (end_tx, ended) = flume::bounded::<()>(0);
        let thread = std::thread::Builder::new()
            .name(format!("kvferry-store-{name}"))
            .spawn(move || {
                let _end = end_tx;
                serve(backend, rx)
            })?;
        Ok(BackendWorker {
            name,
            tx: Some(tx),
            capacity,
            ended,
            last_deadline: Cell::new(None),
            thread: Some(thread),
        })
    }

    /// The backend's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Queues `call`; never waits.
    pub fn post(&self, call: Call) -> Result<(), PostError> {
        let tx = self.tx.as_ref().ok_or(PostError::Gone)?;
        let latest = self
            .last_deadline
            .get()
            .map_or(call.deadline, |d| d.max(call.deadline));
        self.last_deadline.set(Some(latest));
        tx.try_send(call).map_err(|e| match e {
            flume::TrySendError::Full(_) => PostError::QueueFull {
                capacity: self.capacity,
            },
            flume::TrySendError::Disconnected(_) => PostError::Gone,
        })
    }
}

impl Drop for BackendWorker {
    fn drop(&mut self) {
        self.tx = None;
        let ended = match self.last_deadline.get() {
            Some(d) => self.ended.recv_deadline(d) != Err(flume::RecvTimeoutError::Timeout),
            None => {
                let _ = self.ended.recv();
                true
            }
        };
        match self.thread.take() {
            Some(t) if ended => {
                let _ = t.join();
            }
            // Stuck past every deadline: it touches no memory anymore.
            _ => tracing::warn!("store backend {} still in a call; left behind", self.name),
        }
    }
}

fn serve<B: StoreBackend>(mut backend: B, rx: flume::Receiver<Call>) {
    // Removed keys of an answer nobody took (a caller that stopped waiting
    // at its deadline): they ride the next answer instead of being lost.
    let mut untold: Vec<ChunkKey> = Vec::new();
    for call in rx.iter() {
        let keys = call.op.keys();
        let reply = if Instant::now() >= call.deadline {
            timed_out(&call.op)
        } else {
            run(&mut backend, call.op, call.deadline)
        };
        let reply = checked(reply, keys);
        let room = REMOVED_PER_CALL_MAX.saturating_sub(untold.len());
        let mut removed = std::mem::take(&mut untold);
        removed.extend(backend.take_removed(room));
        let done = Done {
            id: call.id,
            reply,
            removed,
        };
        // The caller may be gone for good (a dropped connector): then the
        // keys are kept for nobody, within the bound.
        if let Err(flume::SendError(done)) = call.reply.send(done) {
            untold = done.removed;
        }
    }
}

fn run<B: StoreBackend>(backend: &mut B, op: BackendOp, deadline: Instant) -> BackendReply {
    match op {
        BackendOp::Exists(keys) => BackendReply::Exists(backend.exists(&keys, deadline)),
        BackendOp::Put(items) => BackendReply::Put(backend.put(&items, deadline)),
        BackendOp::Get(items) => BackendReply::Get(backend.get(&items, deadline)),
        BackendOp::Remove(keys) => BackendReply::Remove(backend.remove(&keys, deadline)),
        BackendOp::Register(layout) => BackendReply::Register(backend.register(&layout)),
    }
}

fn timed_out(op: &BackendOp) -> BackendReply {
    let e = CallError::Timeout;
    match op {
        BackendOp::Exists(_) => BackendReply::Exists(Err(e)),
        BackendOp::Put(_) => BackendReply::Put(Err(e)),
        BackendOp::Get(_) => BackendReply::Get(Err(e)),
        BackendOp::Remove(_) => BackendReply::Remove(Err(e)),
        BackendOp::Register(_) => BackendReply::Register(Err(e)),
    }
}

/// An answer for another number of keys than asked is a refused call.
fn checked(reply: BackendReply, keys: usize) -> BackendReply {
    fn len<T, E>(r: &Result<Vec<T>, E>) -> Option<usize> {
        r.as_ref().ok().map(Vec::len)
    }
    let got = match &reply {
        BackendReply::Exists(r) => len(r),
        BackendReply::Put(r) => len(r),
        BackendReply::Get(r) | BackendReply::Remove(r) => len(r),
        BackendReply::Register(_) => None,
    };
    if got.is_none_or(|n| n == keys) {
        return reply;
    }
    let e = CallError::Refused;
    match reply {
        BackendReply::Exists(_) => BackendReply::Exists(Err(e)),
        BackendReply::Put(_) => BackendReply::Put(Err(e)),
        BackendReply::Get(_) => BackendReply::Get(Err(e)),
        BackendReply::Remove(_) => BackendReply::Remove(Err(e)),
        BackendReply::Register(r) => BackendReply::Register(r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inproc::{InprocConfig, InprocStore};
    use std::time::Duration;

    #[test]
    fn a_glommio_task_collects_answers_without_blocking_its_executor() {
        let store = InprocStore::new(InprocConfig::default()).unwrap();
        let worker = BackendWorker::spawn(store.clone(), 4).unwrap();
        let answer = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .make()
            .unwrap()
            .run(async move {
                let (tx, rx) = flume::bounded(1);
                let call = Call {
                    id: 7,
                    op: BackendOp::Exists(Vec::new()),
                    deadline: Instant::now() + Duration::from_secs(60),
                    reply: tx,
                };
                worker.post(call).unwrap();
                // Another task runs while this one waits for the store.
                let other = glommio::spawn_local(async { 1 + 1 });
                let done = rx.recv_async().await.unwrap();
                assert_eq!(other.await, 2);
                (done.id, done.reply)
            });
        assert_eq!(answer, (7, BackendReply::Exists(Ok(Vec::new()))));
        assert_eq!(store.stats().exists_calls, 1);
    }

    #[test]
    fn an_answer_for_another_number_of_keys_is_a_refused_call() {
        let reply = checked(BackendReply::Exists(Ok(vec![true])), 2);
        assert_eq!(reply, BackendReply::Exists(Err(CallError::Refused)));
        let reply = checked(BackendReply::Get(Ok(vec![Ok(())])), 1);
        assert_eq!(reply, BackendReply::Get(Ok(vec![Ok(())])));
    }
}
