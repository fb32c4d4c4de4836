//! The node's side-channel frames: a versioned postcard envelope that
//! carries the machines' [`Msg`] unchanged, plus the per-peer messages
//! (hello, heartbeat).
//!
//! ```text
//! +------+------+------------------+-----------------------+
//! | 'K'  | 'N'  | version (u16 LE) | postcard(Frame)       |
//! +------+------+------------------+-----------------------+
//! ```
//!
//! The machines' lease protocol (`LeaseRequest`/`LeaseGrant`), chunk
//! indices and prefix hits have no counterpart in the generic
//! `kvferry::wire` messages, so the node speaks this envelope; every field a
//! peer sends is checked here (sizes) and again by the machines and the
//! planner (meaning) before it is used.

use kvferry_machines::common::{Mode, Msg};
use kvferry_machines::layout::{ModelSpec, RankLayout};
use kvferry_machines::planner::REGIONS_MAX;
use serde::{Deserialize, Serialize};

/// First two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"KN";
/// The envelope version this build speaks; others are rejected.
pub const VERSION: u16 = 1;
const HEADER_LEN: usize = 4;

/// Bounds the decoder enforces after parsing (the frame size bounds what
/// parsing can allocate).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// Whole frame, header included (also ZeroMQ's `MAXMSGSIZE`).
    pub max_frame_bytes: usize,
    /// KV-cache groups in one block list.
    pub max_groups: usize,
    /// Blocks in one group.
    pub max_blocks_per_group: usize,
    /// Bytes of the engine id and endpoint strings.
    pub max_string_bytes: usize,
}

impl Default for FrameLimits {
    fn default() -> Self {
        FrameLimits {
            max_frame_bytes: 16 << 20,
            max_groups: 64,
            max_blocks_per_group: 1 << 20,
            max_string_bytes: 1024,
        }
    }
}

/// A rank introduces itself; sent by D when it connects and answered by P.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The sender's engine.
    pub engine_id: String,
    /// Push or pull; both sides must agree.
    pub mode: Mode,
    /// Model facts; both sides must agree.
    pub model: ModelSpec,
    /// The sender's TP place and registered KV regions.
    pub layout: RankLayout,
    /// The sender's data-plane endpoint (`tcp://..`, `local://..`).
    pub endpoint: String,
    /// True on P's answer (so the answer is not answered again).
    pub is_reply: bool,
}

/// Every frame of the node protocol.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Frame {
    /// Per peer, once per connection (and again after a reconnect).
    Hello(Hello),
    /// A machine message for one transfer.
    Transfer {
        /// The transfer.
        transfer_id: u64,
        /// The machines' message, unchanged.
        msg: Msg,
    },
    /// Liveness probe; answered with `HeartbeatAck` carrying the same `seq`.
    Heartbeat { seq: u64 },
    /// Answer to `Heartbeat`.
    HeartbeatAck { seq: u64 },
}

/// Why a frame was rejected. Every variant blames the peer that sent it.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Larger than `max_frame_bytes`.
    #[error("frame of {len_bytes} bytes exceeds {max_bytes}")]
    TooLarge { len_bytes: usize, max_bytes: usize },
    /// Shorter than the header or the message.
    #[error("truncated frame")]
    Truncated,
    /// Not our magic.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 2]),
    /// Another envelope version.
    #[error("unsupported version {0} (this build speaks {VERSION})")]
    UnsupportedVersion(u16),
    /// A field over its bound.
    #[error("{field}: {len} exceeds the limit {max}")]
    LimitExceeded {
        field: &'static str,
        len: usize,
        max: usize,
    },
    /// Bytes after the message.
    #[error("{0} trailing bytes")]
    TrailingBytes(usize),
    /// Not a valid message.
    #[error("malformed frame: {0}")]
    Malformed(String),
}

/// Encodes one frame.
pub fn encode(frame: &Frame) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    // postcard fails only for unknown-length sequences and custom
    // serializer errors; these plain types have neither.
    postcard::to_extend(frame, out).expect("postcard cannot fail on node frames")
}

fn check(field: &'static str, len: usize, max: usize) -> Result<(), FrameError> {
    if len > max {
        return Err(FrameError::LimitExceeded { field, len, max });
    }
    Ok(())
}

fn check_lists(
    field: &'static str,
    lists: &[Vec<kvferry_machines::common::BlockId>],
    l: &FrameLimits,
) -> Result<(), FrameError> {
    check(field, lists.len(), l.max_groups)?;
    for g in lists {
        check(field, g.len(), l.max_blocks_per_group)?;
    }
    Ok(())
}

/// Checks a decoded frame's sizes against `limits`.
pub fn check_limits(frame: &Frame, limits: &FrameLimits) -> Result<(), FrameError> {
    match frame {
        Frame::Hello(h) => {
            check("engine_id", h.engine_id.len(), limits.max_string_bytes)?;
            check("endpoint", h.endpoint.len(), limits.max_string_bytes)?;
            check("regions", h.layout.regions.len(), REGIONS_MAX)
        }
        Frame::Transfer { msg, .. } => match msg {
            Msg::Pull {
                dst_blocks,
                prefix_blocks,
                ..
            } => {
                check_lists("dst_blocks", dst_blocks, limits)?;
                check("prefix_blocks", prefix_blocks.len(), limits.max_groups)
            }
            Msg::Ready {
                start_blocks,
                src_blocks,
                ..
            } => {
                check_lists("src_blocks", src_blocks, limits)?;
                check("start_blocks", start_blocks.len(), limits.max_groups)
            }
            Msg::LeaseRequest { .. }
            | Msg::LeaseGrant { .. }
            | Msg::Status { .. }
            | Msg::Done { .. }
            | Msg::Abort
            | Msg::AbortAck => Ok(()),
        },
        Frame::Heartbeat { .. } | Frame::HeartbeatAck { .. } => Ok(()),
    }
}

/// Decodes one frame. Never panics, whatever the bytes.
pub fn decode(bytes: &[u8], limits: &FrameLimits) -> Result<Frame, FrameError> {
    if bytes.len() > limits.max_frame_bytes {
        return Err(FrameError::TooLarge {
            len_bytes: bytes.len(),
            max_bytes: limits.max_frame_bytes,
        });
    }
    if bytes.len() < HEADER_LEN {
        return Err(FrameError::Truncated);
    }
    let magic = [bytes[0], bytes[1]];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([bytes[2], bytes[3]]);
    if version != VERSION {
        return Err(FrameError::UnsupportedVersion(version));
    }
    // serde's sequence visitors cap their pre-allocation, so a claimed
    // length far beyond the frame cannot make us allocate more than the
    // frame itself can fill.
    let frame = match postcard::take_from_bytes::<Frame>(&bytes[HEADER_LEN..]) {
        Ok((frame, [])) => frame,
        Ok((_, rest)) => return Err(FrameError::TrailingBytes(rest.len())),
        Err(postcard::Error::DeserializeUnexpectedEnd) => return Err(FrameError::Truncated),
        Err(e) => return Err(FrameError::Malformed(e.to_string())),
    };
    check_limits(&frame, limits)?;
    Ok(frame)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_machines::common::BlockId;

    #[test]
    fn round_trip_and_rejections() {
        let f = Frame::Transfer {
            transfer_id: 9,
            msg: Msg::Pull {
                receivers_expected: 1,
                dst_blocks: vec![vec![BlockId(1), BlockId(2)]],
                prefix_blocks: vec![0],
                lease_seq: None,
            },
        };
        let bytes = encode(&f);
        let l = FrameLimits::default();
        assert_eq!(decode(&bytes, &l).unwrap(), f);
        assert_eq!(
            decode(&bytes[..bytes.len() - 1], &l),
            Err(FrameError::Truncated)
        );
        let mut v = bytes.clone();
        v[2] = 9;
        assert_eq!(decode(&v, &l), Err(FrameError::UnsupportedVersion(9)));
        let mut v = bytes.clone();
        v.push(0);
        assert_eq!(decode(&v, &l), Err(FrameError::TrailingBytes(1)));
        let small = FrameLimits {
            max_blocks_per_group: 1,
            ..l
        };
        assert!(matches!(
            decode(&bytes, &small),
            Err(FrameError::LimitExceeded { .. })
        ));
        assert!(matches!(
            decode(b"XX\x01\x00", &l),
            Err(FrameError::BadMagic(_))
        ));
    }

    #[test]
    fn random_bytes_never_panic() {
        let l = FrameLimits::default();
        let mut rng = fastrand::Rng::with_seed(5);
        let base = encode(&Frame::Heartbeat { seq: 3 });
        for _ in 0..20_000 {
            let mut v: Vec<u8> = if rng.bool() {
                base.clone()
            } else {
                MAGIC.iter().copied().chain([1, 0]).collect()
            };
            let n = rng.usize(0..64);
            v.extend((0..n).map(|_| rng.u8(..)));
            if !v.is_empty() && rng.bool() {
                let i = rng.usize(..v.len());
                v[i] = rng.u8(..);
            }
            let _ = decode(&v, &l);
        }
    }
}
