//! The vLLM-style batch API: the scheduler hands the worker a
//! [`LoadMeta`] each step, the worker starts it and collects what finished.

use kvferry_machines::common::{BlockId, BlockLists, TransferId};

use kvferry_machines::duplex::Direction;

use super::{Node, NodeError, PrefillTarget};

/// One load of a [`LoadMeta`] (decode).
#[derive(Clone, Debug)]
pub struct LoadRequest {
    /// The transfer.
    pub transfer_id: TransferId,
    /// The string request id the transfer was named by, if any; it travels
    /// in the `Pull` (see [`Node::receiver_named`]).
    pub request_id: Option<String>,
    /// Where its prefill ranks are.
    pub prefill: PrefillTarget,
    /// Destination blocks per group.
    pub dst_blocks: BlockLists,
    /// Per group, leading prefill blocks already held locally.
    pub prefix_blocks: Vec<u32>,
}

/// One send of a [`LoadMeta`] (prefill).
#[derive(Clone, Debug)]
pub struct SendRequest {
    /// The transfer.
    pub transfer_id: TransferId,
    /// The string request id the transfer was named by, if any (see
    /// [`Node::sender_named`]).
    pub request_id: Option<String>,
    /// Source blocks per group of this chunk.
    pub src_blocks: BlockLists,
    /// True on the request's last chunk.
    pub is_last: bool,
}

/// What the scheduler hands the worker each step (vLLM's connector metadata).
#[derive(Clone, Debug, Default)]
pub struct LoadMeta {
    /// Loads to start (decode).
    pub loads: Vec<LoadRequest>,
    /// Chunks to send (prefill).
    pub sends: Vec<SendRequest>,
}

impl Node {
    /// vLLM-style batch call: starts every load (decode) and send (prefill)
    /// of `meta`. Returns the first error; the requests before it started.
    /// Each executor is woken once for the whole batch (see
    /// [`Node::batch`]).
    pub fn start_load_kv(&self, meta: &LoadMeta) -> Result<(), NodeError> {
        Node::batch(|| self.start_load_kv_now(meta))
    }

    fn start_load_kv_now(&self, meta: &LoadMeta) -> Result<(), NodeError> {
        for l in &meta.loads {
            self.request_as(
                l.transfer_id,
                l.request_id.as_deref(),
                &l.prefill,
                l.dst_blocks.clone(),
                l.prefix_blocks.clone(),
            )?;
        }
        for s in &meta.sends {
            self.sender_as(s.transfer_id, s.request_id.as_deref())?
                .send(s.src_blocks.clone(), s.is_last)?;
        }
        Ok(())
    }

    /// vLLM-style: the transfers that finished since the last call, as
    /// `(finished sending, finished receiving)` (one of them is empty
    /// unless the role is [`Role::Both`](super::Role::Both)). Every terminal outcome counts; failed loads also appear
    /// in [`Node::block_ids_with_load_errors`].
    pub fn get_finished(&self) -> (Vec<TransferId>, Vec<TransferId>) {
        self.collect();
        let mut r = self
            .inner
            .shared
            .records
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (sent, received): (Vec<_>, Vec<_>) = r
            .finished
            .drain(..)
            .partition(|(_, d)| *d == Direction::Send);
        let ids = |v: Vec<(TransferId, Direction)>| v.into_iter().map(|(t, _)| t).collect();
        (ids(sent), ids(received))
    }

    /// vLLM-style: destination blocks whose load failed since the last call.
    pub fn block_ids_with_load_errors(&self) -> Vec<BlockId> {
        let mut r = self
            .inner
            .shared
            .records
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut r.load_errors)
    }
}
