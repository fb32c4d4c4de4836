//! What the decoder bounds and why it rejects a frame: shared by the
//! frame model and its bounded decoding, which depend on this and not on
//! each other's internals.

use crate::planner::REGIONS_MAX;

/// Upper bounds the decoder enforces. They bound the memory one frame can
/// make a receiver allocate, so a hostile or buggy peer cannot exhaust it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Whole frame, header included. Also ZeroMQ's `MAXMSGSIZE`.
    pub max_frame_bytes: usize,
    /// KV-cache groups in one block list (and per-group value lists).
    pub max_groups: usize,
    /// Block ids in one group.
    pub max_blocks_per_group: usize,
    /// Block ids across all groups of one message.
    pub max_total_blocks: usize,
    /// Regions announced in one `Hello`; at most the planner's
    /// [`REGIONS_MAX`](crate::planner::REGIONS_MAX).
    pub max_regions: usize,
    /// Bytes of any string (engine id, endpoint).
    pub max_string_bytes: usize,
}

impl Default for Limits {
    /// Generous enough for a 1M-token request with one-token pages
    /// (SGLang's default page size) while keeping one frame under 16 MiB.
    fn default() -> Self {
        Limits {
            max_frame_bytes: 16 << 20,
            max_groups: 64,
            max_blocks_per_group: 1 << 20,
            max_total_blocks: 1 << 21,
            max_regions: REGIONS_MAX,
            max_string_bytes: 1024,
        }
    }
}

/// Why a frame was rejected. Every variant means the peer sent something
/// this side does not accept; none of them is the receiver's fault.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The frame is larger than `Limits::max_frame_bytes`.
    #[error("frame of {len_bytes} bytes exceeds the limit of {max_bytes} bytes")]
    FrameTooLarge {
        /// Size of the frame.
        len_bytes: usize,
        /// The limit.
        max_bytes: usize,
    },
    /// The frame ended before the header or the frame body was complete.
    #[error("truncated frame")]
    Truncated,
    /// The first two bytes are not [`MAGIC`](super::MAGIC).
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 2]),
    /// The envelope names another protocol version.
    #[error("peer speaks wire version {theirs}, this build speaks {ours}")]
    UnsupportedVersion {
        /// The version in the frame's header.
        theirs: u16,
        /// [`VERSION`](super::VERSION).
        ours: u16,
    },
    /// A variable-length field claims more elements than the limit allows.
    #[error("{field} has {len} elements, limit is {max}")]
    LimitExceeded {
        /// Which kind of field.
        field: &'static str,
        /// How many elements it claims or holds.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// Bytes left over after a complete frame.
    #[error("{count} trailing bytes after the frame")]
    TrailingBytes {
        /// How many.
        count: usize,
    },
    /// The body is not a valid frame (bad varint, unknown variant, bad
    /// UTF-8, bad bool, ...).
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// A field decoded but is out of the range the protocol allows.
    #[error("{field}: {why}")]
    Invalid {
        /// Which field.
        field: &'static str,
        /// What is wrong with it.
        why: &'static str,
    },
}
