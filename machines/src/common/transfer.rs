//! What names a transfer and its parts: the transfer and peer ids, block
//! ids and lists, and which side touches the other side's blocks.

use serde::{Deserialize, Serialize};

/// Identifies one request's transfer across P and D (vLLM's `transfer_id`,
/// SGLang's bootstrap room). The one type of a transfer id in every API:
/// the machines, the wire, the node, the scheduler. It serializes as its
/// number (`"transfer_id": 7` in `kv_transfer_params`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TransferId(pub u64);

impl From<u64> for TransferId {
    fn from(id: u64) -> Self {
        TransferId(id)
    }
}

impl std::fmt::Display for TransferId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Which side touches the other side's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Mode {
    /// P writes into D's destination blocks (vLLM, SGLang). D grants the lease.
    Push,
    /// D reads from P's source blocks, then sends `Done` (vLLM-Ascend). P grants the lease.
    Pull,
}

/// A remote rank as the driver names it for this transfer (an index into
/// the driver's session table). Machines only compare peer ids; they never
/// interpret them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PeerId(pub u32);

/// An engine KV block id (index into the registered regions of one side).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockId(pub u32);

/// Block ids per KV-cache group: `lists[g]` are the blocks of group `g`.
pub type BlockLists = Vec<Vec<BlockId>>;
