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

/// Most bytes of a string request id (vLLM's `"cmpl-…"` ids, uuids). The
/// wire decoder checks a `Pull`'s id against it before allocating.
pub const REQUEST_ID_MAX_BYTES: usize = 256;

/// Why a string is not a request id.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestIdError {
    /// The empty string names no request.
    #[error("a request id may not be empty")]
    Empty,
    /// Longer than [`REQUEST_ID_MAX_BYTES`].
    #[error("a request id of {len_bytes} bytes exceeds the limit of {REQUEST_ID_MAX_BYTES} bytes")]
    TooLong {
        /// Its length.
        len_bytes: usize,
    },
}

/// Checks that `id` is a request id: 1 to [`REQUEST_ID_MAX_BYTES`] bytes.
pub fn check_request_id(id: &str) -> Result<(), RequestIdError> {
    match id.len() {
        0 => Err(RequestIdError::Empty),
        n if n > REQUEST_ID_MAX_BYTES => Err(RequestIdError::TooLong { len_bytes: n }),
        _ => Ok(()),
    }
}

impl TransferId {
    /// The transfer id of string request id `id`: the 64-bit FNV-1a hash
    /// of its UTF-8 bytes (offset basis `0xcbf29ce484222325`, prime
    /// `0x100000001b3`; for each byte, xor then multiply, wrapping). Part
    /// of the interface: prefill and decode compute it alike, and a
    /// router may too. Two strings can share a hash, so the string itself
    /// travels in the first message of a transfer and both nodes compare
    /// it (`docs/design.md` §7, "Transfer ids").
    pub fn of_request_id(id: &str) -> TransferId {
        const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        let mut h = OFFSET_BASIS;
        for b in id.as_bytes() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(PRIME);
        }
        TransferId(h)
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
