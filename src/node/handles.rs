//! Per-request handles: a [`Sender`] on a prefill node, a [`Receiver`] on
//! a decode node.

use kvferry_reactor::lock;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_machines::{AbortReason, BlockLists, FailReason, Phase, TransferId};

use super::{Node, NodeError, PrefillTarget};

/// Waits for a terminal phase of `tid` on `node`, up to `timeout`: sleeps
/// on the node's condition variable, which the executor signals on every
/// terminal phase.
fn wait_terminal(node: &Node, tid: TransferId, timeout: Duration, before: Phase) -> Phase {
    let deadline = Instant::now() + timeout;
    let s = &node.inner.shared;
    loop {
        let seen = lock(&s.terminal_seq).seq;
        let p = node.phase(tid).unwrap_or(before);
        let now = Instant::now();
        if p.is_terminal() || now >= deadline {
            return p;
        }
        let mut guard = lock(&s.terminal_seq);
        if guard.seq == seen {
            // Counted under the lock the notifier bumps `seq` under: it
            // either sees us waiting or we see its bump.
            guard.waiters += 1;
            let (mut guard, _) = s
                .terminal_cv
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(|e| e.into_inner());
            guard.waiters -= 1;
        }
    }
}

/// Prefill-side handle of one transfer (SGLang's `KVSender`).
#[derive(Debug)]
pub struct Sender {
    pub(super) node: Node,
    pub(super) tid: TransferId,
    /// Set when the transfer was opened by string request id (here or by
    /// a decode rank's `Pull`).
    pub(super) request_id: Option<Arc<str>>,
}

impl Sender {
    /// The transfer.
    pub fn transfer_id(&self) -> TransferId {
        self.tid
    }

    /// The string request id of the transfer, if it has one.
    pub fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }

    /// Hands a chunk of ready KV (source blocks per group) to the transfer;
    /// `is_last` on the final chunk (a whole request is one chunk).
    pub fn send(&self, blocks: BlockLists, is_last: bool) -> Result<(), NodeError> {
        self.node.send_chunk(self.tid, blocks, is_last)
    }

    /// Current phase. Terminal once the source blocks may be reused.
    pub fn poll(&self) -> Phase {
        self.node
            .phase(self.tid)
            .unwrap_or(Phase::Failed(FailReason::Aborted(AbortReason::Engine)))
    }

    /// Aborts the transfer; the phase turns terminal once no peer can read
    /// the blocks anymore.
    pub fn abort(&self) -> Result<(), NodeError> {
        self.node.abort(self.tid)
    }

    /// Waits (bounded) for a terminal phase.
    pub fn wait(&self, timeout: Duration) -> Phase {
        wait_terminal(
            &self.node,
            self.tid,
            timeout,
            Phase::Failed(FailReason::Aborted(AbortReason::Engine)),
        )
    }
}

/// Decode-side handle of one transfer (SGLang's `KVReceiver`).
#[derive(Debug)]
pub struct Receiver {
    pub(super) node: Node,
    pub(super) tid: TransferId,
    /// Set by [`Node::receiver_named`].
    pub(super) request_id: Option<Arc<str>>,
    pub(super) target: PrefillTarget,
}

impl Receiver {
    /// The transfer.
    pub fn transfer_id(&self) -> TransferId {
        self.tid
    }

    /// The string request id of the transfer, if it was opened by one.
    pub fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }

    /// Asks the prefill ranks for the KV, into `dst_blocks` (per group).
    pub fn request(&self, dst_blocks: BlockLists) -> Result<(), NodeError> {
        let prefix = vec![0; dst_blocks.len()];
        self.node.request(self, dst_blocks, prefix)
    }

    /// Like [`Receiver::request`] with a partial prefix hit: per group, the
    /// number of the prefill side's leading blocks this rank already holds.
    pub fn request_with_prefix(
        &self,
        dst_blocks: BlockLists,
        prefix_blocks: Vec<u32>,
    ) -> Result<(), NodeError> {
        self.node.request(self, dst_blocks, prefix_blocks)
    }

    /// Current phase; `Bootstrapping` before `request`. Terminal once the
    /// destination blocks are the engine's again.
    pub fn poll(&self) -> Phase {
        self.node.phase(self.tid).unwrap_or(Phase::Bootstrapping)
    }

    /// Aborts the transfer. Before [`Receiver::request`] the prefill
    /// ranks are told all the same, so they release the KV they hold for
    /// it at once rather than at their bootstrap timeout.
    pub fn abort(&self) -> Result<(), NodeError> {
        match self.node.phase(self.tid) {
            None => self.node.abort_unrequested(self),
            Some(_) => self.node.abort(self.tid),
        }
    }

    /// Waits (bounded) for a terminal phase.
    pub fn wait(&self, timeout: Duration) -> Phase {
        wait_terminal(&self.node, self.tid, timeout, Phase::Bootstrapping)
    }
}
