//! Frame format of the `tcp` transport.
//!
//! Every frame, in both directions, starts with a fixed 32-byte header
//! (little endian):
//!
//! ```text
//! 0..4   magic "KVF1"         (the version is part of the magic)
//! 4      opcode               WRITE=1, READ=2, REGIONS=3, NOTIFY=4,
//!                             NOTIFY_AFTER_WRITE=5, SHM=6
//! 5      status               0 in requests; 0 = ok or a reject code in responses
//! 6..8   reserved, zero
//! 8..12  count                descriptors (requests) or regions (REGIONS response)
//! 12..16 detail               responses: index of the descriptor a reject blames
//! 16..24 req_id               echoed by the response
//! 24..32 payload_len          bytes after the descriptor table
//! ```
//!
//! A request is followed by `count` descriptors of 16 bytes
//! (`remote_addr u64, len_bytes u64`), then, for WRITE, the payload: the
//! bytes of every descriptor, concatenated. A WRITE response has no body; a
//! READ response that succeeded is followed by the payload; a REGIONS response
//! by `count` entries `(addr u64, len_bytes u64)`.
//!
//! A NOTIFY request has no descriptors (`count` 0) and carries
//! `payload_len` (at most [`MAX_NOTIFY_BYTES`]) opaque bytes for the
//! target's notification handler (the node uses it for side-channel
//! messages on a request's critical path); its response has no body and
//! says whether the handler took them.
//!
//! A NOTIFY_AFTER_WRITE request is a NOTIFY whose `detail` is a count `n`
//! (at least 1): the target hands its bytes to the handler only if the
//! `n` frames right before it on the same connection were WRITEs that
//! landed in full, and answers `Undeliverable` otherwise. An initiator
//! sends it behind a batch's last WRITE so that the target's node learns
//! the batch landed (say, a transfer's closing `Status`) without a round
//! trip through the initiator. It has its own opcode so that a target
//! that does not know the condition refuses it instead of ignoring it.
//!
//! A SHM request (the shm hello) has no descriptors and carries the
//! initiator's host identity (64 bytes: boot id, network namespace, user,
//! pid); a target that shares memory with it answers with its own
//! identity, a one-time token and the name of its abstract Unix socket
//! (144 bytes, see `shm`), any other answers `Undeliverable`, and a target
//! that predates it refuses the opcode.
//!
//! Responses come back in request order on each connection, so the
//! initiator matches them without a lookup table; `req_id` is a cross-check.
//!
//! # Authenticated connections
//!
//! An endpoint with a cluster key opens every connection with an AUTH
//! exchange ([`kvferry_auth::handshake`]): the initiator's AUTH request
//! (`detail` 0) carries the HELLO, the target's answer the CHALLENGE, and
//! a second AUTH request (`detail` 1, not answered) the PROOF. From then
//! on, both ways, every header is sealed: 48 bytes, the 32 above with the
//! magic `KVF2`, then a 16-byte tag ([`kvferry_auth::seal`]) over those 32
//! bytes, what the receiver reads before acting on the frame (a request's
//! descriptor table, a NOTIFY's or a SHM hello's bytes, a REGIONS or SHM
//! answer's body) and the frame's number on the connection. Payload bytes
//! are covered through the sealed table: where they go and how many, and,
//! when payload tags were agreed (`count` 1 in the initiator's first AUTH
//! request or in the target's answer: on when either side asks), by a
//! 16-byte tag after each WRITE payload and READ answer payload, over the
//! bytes and the frame's own tag. A keyed target refuses any other first
//! frame (`Unauthenticated`) and closes the connection; a target without
//! a key refuses AUTH as an unknown opcode, and a keyed initiator then
//! refuses the peer.

use std::fmt;

use kvferry_auth::seal::{Opener, Sealer};
use kvferry_auth::AuthError;

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KVF1";
/// First four bytes of every frame of an authenticated connection.
pub const MAGIC_SEALED: [u8; 4] = *b"KVF2";
/// Size of the fixed header.
pub const HEADER_LEN: usize = 32;
/// Size of a sealed header: the fixed header and its tag.
pub const SEALED_HEADER_LEN: usize = HEADER_LEN + kvferry_auth::seal::TAG_LEN;
/// Size of one descriptor (or region) entry.
pub const ENTRY_LEN: usize = 16;
/// Most descriptors a target accepts in one frame.
pub const MAX_FRAME_DESCS: u32 = 4096;
/// Most payload bytes a target accepts in one frame (so a rejected WRITE can
/// be drained with bounded work).
pub const MAX_FRAME_BYTES: u64 = 64 << 20;
/// Most regions a REGIONS response may list.
pub const MAX_REGIONS: u32 = 1 << 16;

/// Push bytes into the target.
pub const OP_WRITE: u8 = 1;
/// Pull bytes from the target.
pub const OP_READ: u8 = 2;
/// Ask for the target's registered regions.
pub const OP_REGIONS: u8 = 3;
/// Hand opaque bytes to the target's notification handler.
pub const OP_NOTIFY: u8 = 4;
/// NOTIFY delivered only if the WRITEs right before it landed.
pub const OP_NOTIFY_AFTER_WRITE: u8 = 5;
/// The shm hello: host identities, then a Unix socket (see `crate::shm`).
pub const OP_SHM: u8 = 6;
/// The authentication handshake that opens a keyed connection.
pub const OP_AUTH: u8 = 7;
/// Most bytes one NOTIFY may carry.
pub const MAX_NOTIFY_BYTES: u64 = 256 << 10;

/// Status byte of a response that succeeded.
pub const STATUS_OK: u8 = 0;

/// Why a target refused a frame (the status byte of its response).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// A descriptor is outside the target's registered regions.
    OutOfRegion,
    /// A descriptor has length zero.
    EmptyDescriptor,
    /// A descriptor's `addr + len` overflows.
    Overflow,
    /// Bad magic, non-zero reserved fields or a status in a request.
    BadHeader,
    /// An opcode the target does not know.
    UnknownOpcode,
    /// More descriptors or payload bytes than a frame may carry.
    TooLarge,
    /// The descriptor lengths do not add up to `payload_len`.
    LengthMismatch,
    /// The target has no notification handler, or it refused the bytes
    /// (the sender should use its other path).
    Undeliverable,
    /// The peer did not authenticate (no handshake, a failed one, a
    /// header whose tag does not verify); the connection closes.
    Unauthenticated,
    /// A status byte this build does not know.
    Other(u8),
}

impl RejectReason {
    /// The status byte on the wire.
    pub fn to_status(self) -> u8 {
        match self {
            RejectReason::OutOfRegion => 1,
            RejectReason::EmptyDescriptor => 2,
            RejectReason::Overflow => 3,
            RejectReason::BadHeader => 4,
            RejectReason::UnknownOpcode => 5,
            RejectReason::TooLarge => 6,
            RejectReason::LengthMismatch => 7,
            RejectReason::Undeliverable => 8,
            RejectReason::Unauthenticated => 9,
            RejectReason::Other(s) => s,
        }
    }

    /// Decodes a non-zero status byte.
    pub fn from_status(status: u8) -> RejectReason {
        match status {
            1 => RejectReason::OutOfRegion,
            2 => RejectReason::EmptyDescriptor,
            3 => RejectReason::Overflow,
            4 => RejectReason::BadHeader,
            5 => RejectReason::UnknownOpcode,
            6 => RejectReason::TooLarge,
            7 => RejectReason::LengthMismatch,
            8 => RejectReason::Undeliverable,
            9 => RejectReason::Unauthenticated,
            other => RejectReason::Other(other),
        }
    }

    /// Whether the connection stays usable after this reject: only when the
    /// frame's framing was sound, so the next header is where we expect it.
    pub fn keeps_connection(self) -> bool {
        matches!(
            self,
            RejectReason::OutOfRegion
                | RejectReason::EmptyDescriptor
                | RejectReason::Overflow
                | RejectReason::Undeliverable
        )
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectReason::OutOfRegion => f.write_str("range outside registered memory"),
            RejectReason::EmptyDescriptor => f.write_str("empty descriptor"),
            RejectReason::Overflow => f.write_str("address overflow"),
            RejectReason::BadHeader => f.write_str("malformed header"),
            RejectReason::UnknownOpcode => f.write_str("unknown opcode"),
            RejectReason::TooLarge => f.write_str("frame too large"),
            RejectReason::LengthMismatch => f.write_str("descriptor lengths do not match payload"),
            RejectReason::Undeliverable => f.write_str("notification not deliverable"),
            RejectReason::Unauthenticated => f.write_str("not authenticated"),
            RejectReason::Other(s) => write!(f, "unknown status {s}"),
        }
    }
}

/// The fixed header, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Header {
    /// WRITE, READ or REGIONS.
    pub opcode: u8,
    /// Zero in requests; [`STATUS_OK`] or a [`RejectReason`] in responses.
    pub status: u8,
    /// Entries in the table after the header.
    pub count: u32,
    /// Descriptor index a reject blames.
    pub detail: u32,
    /// Request id, echoed by the response.
    pub req_id: u64,
    /// Bytes after the table.
    pub payload_len: u64,
}

impl Header {
    /// Serialises the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = self.opcode;
        b[5] = self.status;
        b[8..12].copy_from_slice(&self.count.to_le_bytes());
        b[12..16].copy_from_slice(&self.detail.to_le_bytes());
        b[16..24].copy_from_slice(&self.req_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Serialises the header of an authenticated connection: the fixed
    /// header with the sealed magic, then its tag over those bytes and
    /// `body` (see the module's documentation).
    pub fn encode_sealed(&self, seal: &mut Sealer, body: &[u8]) -> [u8; SEALED_HEADER_LEN] {
        let mut b = [0u8; SEALED_HEADER_LEN];
        b[..HEADER_LEN].copy_from_slice(&self.encode());
        b[0..4].copy_from_slice(&MAGIC_SEALED);
        let tag = seal.seal(&[&b[..HEADER_LEN], body]);
        b[HEADER_LEN..].copy_from_slice(&tag);
        b
    }

    /// Parses a header; fails on a bad magic or non-zero reserved bytes.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, RejectReason> {
        Self::decode_with(b, MAGIC)
    }

    /// Parses the fixed part of a sealed header (its tag is checked by
    /// [`open_sealed`] once the frame's body is read).
    pub fn decode_sealed(b: &[u8]) -> Result<Header, RejectReason> {
        let fixed: &[u8; HEADER_LEN] = b
            .get(..HEADER_LEN)
            .and_then(|f| f.try_into().ok())
            .ok_or(RejectReason::BadHeader)?;
        Self::decode_with(fixed, MAGIC_SEALED)
    }

    fn decode_with(b: &[u8; HEADER_LEN], magic: [u8; 4]) -> Result<Header, RejectReason> {
        if b[0..4] != magic || b[6] != 0 || b[7] != 0 {
            return Err(RejectReason::BadHeader);
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        Ok(Header {
            opcode: b[4],
            status: b[5],
            count: u32_at(8),
            detail: u32_at(12),
            req_id: u64_at(16),
            payload_len: u64_at(24),
        })
    }
}

/// Checks a sealed header `raw` (as read) and the frame's `body` against
/// the connection's next tag.
pub fn open_sealed(open: &mut Opener, raw: &[u8], body: &[u8]) -> Result<(), AuthError> {
    if raw.len() != SEALED_HEADER_LEN {
        return Err(AuthError::Malformed);
    }
    open.open(&[&raw[..HEADER_LEN], body], &raw[HEADER_LEN..])
}

/// Serialises one table entry.
pub fn encode_entry(out: &mut Vec<u8>, addr: u64, len_bytes: u64) {
    out.extend_from_slice(&addr.to_le_bytes());
    out.extend_from_slice(&len_bytes.to_le_bytes());
}

/// Parses the table entry at `i`; the caller sized `table` from `count`.
pub fn decode_entry(table: &[u8], i: usize) -> (u64, u64) {
    let e = &table[i * ENTRY_LEN..(i + 1) * ENTRY_LEN];
    let mut a = [0u8; 8];
    let mut l = [0u8; 8];
    a.copy_from_slice(&e[0..8]);
    l.copy_from_slice(&e[8..16]);
    (u64::from_le_bytes(a), u64::from_le_bytes(l))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_rejects() {
        let h = Header {
            opcode: OP_READ,
            status: 0,
            count: 7,
            detail: 3,
            req_id: 99,
            payload_len: 1 << 40,
        };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[0] = b'X';
        assert_eq!(Header::decode(&b), Err(RejectReason::BadHeader));
        let mut b = h.encode();
        b[7] = 1;
        assert_eq!(Header::decode(&b), Err(RejectReason::BadHeader));
        for s in 1..=10u8 {
            assert_eq!(RejectReason::from_status(s).to_status(), s);
        }
    }
}
