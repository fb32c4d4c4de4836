//! The control protocol on the wire: one model of every frame and its one
//! encoding, a versioned envelope around a postcard (serde) body.
//!
//! ```text
//! +------+------+------------------+---------------------+
//! | 'K'  | 'F'  | version (u16 LE) | postcard(Frame)     |
//! +------+------+------------------+---------------------+
//! ```
//!
//! The frames carry the machines' own types ([`Msg`], [`ModelSpec`],
//! [`RankLayout`]): there is no second model to translate to. The node, the
//! simulator and the fuzz targets encode and decode through this module.
//!
//! Decoding never panics and never trusts a length the peer claims: every
//! variable-length field is checked against the configured [`Limits`]
//! *before* anything is allocated for it, and the whole frame against
//! `max_frame_bytes` before parsing starts. Every failure is a
//! [`WireError`]; all of them blame the peer that sent the frame.
//!
//! # Versions
//!
//! A build speaks exactly one protocol [`VERSION`]; there is no silent
//! compatibility between versions, because postcard bodies carry no field
//! tags and a guess would garble a transfer instead of refusing it.
//!
//! - A frame whose header names another version is rejected with
//!   [`WireError::UnsupportedVersion`] before its body is read.
//! - Two things are frozen for every version: the 4-byte header, and the
//!   body of [`Frame::Refuse`] (variant 0, [`Refuse`]'s fields). A peer
//!   answers a frame of another version with a `Refuse` naming its own
//!   version, and every version decodes a `Refuse` whatever version its
//!   header names. So when two builds of different versions meet, the first
//!   `Hello` is refused and *both* sides know why: the refuser from the
//!   decode error, the refused side from the `Refuse` it receives. Both count
//!   it; neither starts a transfer with the other.
//! - A change to any other frame's encoding increments [`VERSION`]. A
//!   future build that wants to talk to an older one may accept a range of
//!   versions explicitly (decode per version); nothing is inferred.
//!
//! ```
//! use kvferry_machines::wire::{self, Frame, Limits};
//! use kvferry_machines::{Msg, TransferId};
//! let frame = Frame::Transfer { transfer_id: TransferId(7), msg: Msg::Done { ok: true } };
//! let bytes = wire::encode(&frame);
//! assert_eq!(wire::decode(&bytes, &Limits::default()), Ok(frame));
//! ```

pub(crate) mod bounded;
pub mod envelope;
mod limits;
mod notify;

pub use limits::{Limits, WireError};

pub use notify::{
    decode_notify, encode_notify, notify_endpoint_len, notify_frame_len, MAX_NOTIFY_FRAMES,
};

use serde::{Deserialize, Serialize};

use crate::common::{Mode, Msg, TransferId, REQUEST_ID_MAX_BYTES};
use crate::layout::{ModelSpec, RankLayout, POOLS_MAX};

/// First two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"KF";
/// The protocol version this build speaks (see the module docs).
pub const VERSION: u16 = 5;
/// Length of the magic + version header.
pub const HEADER_LEN: usize = 4;

/// A rank introduces itself. Sent by decode when it connects (and as its
/// probe while the peer is not answering) and answered by prefill.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The sender's engine.
    #[serde(deserialize_with = "bounded::string")]
    pub engine_id: String,
    /// Push or pull; both sides must agree.
    pub mode: Mode,
    /// Model facts; both sides must agree.
    pub model: ModelSpec,
    /// The sender's TP place and registered KV regions.
    pub layout: RankLayout,
    /// The sender's data-plane endpoint (`tcp://..`, `local://..`).
    #[serde(deserialize_with = "bounded::string")]
    pub endpoint: String,
}

/// The answer to a frame this side will not read. Its encoding is frozen
/// for every protocol version (see the module docs): never add, remove or
/// reorder a field or a [`RefuseReason`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refuse {
    /// The protocol version the refusing side speaks.
    pub version: u16,
    /// Why it refused.
    pub reason: RefuseReason,
}

/// Why a peer refused a frame (frozen, like [`Refuse`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefuseReason {
    /// The frame's header names a version the refuser does not speak.
    UnsupportedVersion,
}

/// Every frame of the control protocol.
///
/// Variant order is part of the encoding; `Refuse` stays variant 0.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Frame {
    /// This side will not read the peer's frames (frozen encoding).
    Refuse(Refuse),
    /// Per peer, once per connection (and again after a reconnect).
    Hello(Hello),
    /// A machine message for one transfer.
    Transfer {
        /// The transfer.
        transfer_id: TransferId,
        /// The machines' message, unchanged.
        msg: Msg,
    },
    /// Liveness probe; answered with `HeartbeatAck` carrying the same `seq`.
    Heartbeat {
        /// Chosen by the sender; echoed back.
        seq: u64,
    },
    /// Answer to `Heartbeat`.
    HeartbeatAck {
        /// The `seq` of the heartbeat answered.
        seq: u64,
    },
    /// D → P: the `Pull` of a transfer the engine opened by string request
    /// id, with that string, so P can tell two strings of one
    /// [`TransferId::of_request_id`] apart. Only a `Pull` travels so.
    NamedTransfer {
        /// `TransferId::of_request_id(request_id)` on D.
        transfer_id: TransferId,
        /// The engine's request id, 1 to [`REQUEST_ID_MAX_BYTES`] bytes.
        #[serde(deserialize_with = "bounded::request_id")]
        request_id: String,
        /// A [`Msg::Pull`].
        msg: Msg,
    },
    /// P → D, answering a [`Frame::NamedTransfer`]: P holds this transfer
    /// id for another request id. D fails the request
    /// (`Aborted(IdCollision)`); P's own request goes on.
    IdCollision {
        /// The transfer id both strings hash to.
        transfer_id: TransferId,
    },
}

impl Frame {
    /// The transfer this frame is about, if any.
    pub fn transfer_id(&self) -> Option<TransferId> {
        match self {
            Frame::Transfer { transfer_id, .. }
            | Frame::NamedTransfer { transfer_id, .. }
            | Frame::IdCollision { transfer_id } => Some(*transfer_id),
            Frame::Refuse(_)
            | Frame::Hello(_)
            | Frame::Heartbeat { .. }
            | Frame::HeartbeatAck { .. } => None,
        }
    }

    /// Short name for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Frame::Refuse(_) => "refuse",
            Frame::Hello(_) => "hello",
            Frame::Transfer { msg, .. } | Frame::NamedTransfer { msg, .. } => msg.kind(),
            Frame::IdCollision { .. } => "id_collision",
            Frame::Heartbeat { .. } => "heartbeat",
            Frame::HeartbeatAck { .. } => "heartbeat_ack",
        }
    }

    /// Checks the frame against `limits` and the protocol's ranges as a
    /// receiver would, so a sender can refuse to emit what its peer is
    /// going to reject. Does not check the encoded size; compare `encode(..).len()` with `max_frame_bytes`.
    pub fn check_limits(&self, limits: &Limits) -> Result<(), WireError> {
        self.validate()?;
        match self {
            Frame::Hello(h) => {
                check("string", h.engine_id.len(), limits.max_string_bytes)?;
                check("string", h.endpoint.len(), limits.max_string_bytes)?;
                check("regions", h.layout.regions.len(), limits.max_regions)?;
                check("pools", h.layout.pools.len(), POOLS_MAX)?;
                for pool in &h.layout.pools {
                    check("pool regions", pool.regions.len(), limits.max_regions)?;
                }
                Ok(())
            }
            Frame::NamedTransfer {
                request_id, msg, ..
            } => {
                check("request id", request_id.len(), REQUEST_ID_MAX_BYTES)?;
                check_msg(msg, limits)
            }
            Frame::Transfer { msg, .. } => check_msg(msg, limits),
            Frame::Refuse(_)
            | Frame::Heartbeat { .. }
            | Frame::HeartbeatAck { .. }
            | Frame::IdCollision { .. } => Ok(()),
        }
    }

    /// The range checks serde cannot express, applied after decoding.
    fn validate(&self) -> Result<(), WireError> {
        match self {
            Frame::Hello(h) if h.layout.regions.is_empty() => Err(WireError::Invalid {
                field: "regions",
                why: "no region",
            }),
            Frame::NamedTransfer {
                request_id, msg, ..
            } => {
                // Its length is the decoder's (and `check_limits`') to judge.
                if request_id.is_empty() {
                    return Err(WireError::Invalid {
                        field: "request id",
                        why: "empty",
                    });
                }
                match msg {
                    Msg::Pull { .. } => Ok(()),
                    _ => Err(WireError::Invalid {
                        field: "named transfer",
                        why: "only a Pull names its request",
                    }),
                }
            }
            _ => Ok(()),
        }
    }
}

/// The bounds of one machine message, as the decoder applies them.
fn check_msg(msg: &Msg, limits: &Limits) -> Result<(), WireError> {
    match msg {
        Msg::Pull {
            dst_blocks,
            prefix_blocks,
            ..
        } => {
            check("per-group values", prefix_blocks.len(), limits.max_groups)?;
            check_groups(dst_blocks, limits)
        }
        Msg::Ready {
            start_blocks,
            src_blocks,
            ..
        } => {
            check("per-group values", start_blocks.len(), limits.max_groups)?;
            check_groups(src_blocks, limits)
        }
        Msg::LeaseRequest { .. }
        | Msg::LeaseGrant { .. }
        | Msg::Status { .. }
        | Msg::Done { .. }
        | Msg::Abort
        | Msg::AbortAck
        | Msg::Unneeded
        | Msg::NotPaired => Ok(()),
    }
}

// Field names match the ones the decoder reports.
fn check(field: &'static str, len: usize, max: usize) -> Result<(), WireError> {
    if len > max {
        return Err(WireError::LimitExceeded {
            field,
            len: len as u64,
            max,
        });
    }
    Ok(())
}

fn check_groups<T>(groups: &[Vec<T>], limits: &Limits) -> Result<(), WireError> {
    check("groups", groups.len(), limits.max_groups)?;
    // In the decoder's order: a group's length against the room left in
    // the total first, then against the per-group bound.
    let mut total = 0usize;
    for group in groups {
        check("total blocks", total + group.len(), limits.max_total_blocks)?;
        check("blocks per group", group.len(), limits.max_blocks_per_group)?;
        total += group.len();
    }
    Ok(())
}

/// Encodes `frame` (header + postcard body).
pub fn encode(frame: &Frame) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    encode_into(frame, &mut out);
    out
}

/// Appends the encoding of `frame` to `out`, reusing its allocation.
pub(crate) fn encode_into(frame: &Frame, out: &mut Vec<u8>) {
    encode_versioned(frame, VERSION, out);
}

/// The header with `version`, then the body. Tests use other versions to
/// play a peer of another build.
pub(crate) fn encode_versioned(frame: &Frame, version: u16, out: &mut Vec<u8>) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    // postcard only fails for unknown-length sequences, `collect_str` and
    // custom serializer errors, none of which these plain types use.
    postcard::serialize_with_flavor::<Frame, _, ()>(frame, AppendFlavor(out))
        .expect("postcard cannot fail on the wire frame types");
}

/// Appends to a `Vec` with `extend_from_slice`, where postcard's generic
/// `Extend` flavor goes through an iterator byte by byte.
struct AppendFlavor<'a>(&'a mut Vec<u8>);

impl postcard::ser_flavors::Flavor for AppendFlavor<'_> {
    type Output = ();

    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(data);
        Ok(())
    }

    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.0.push(data);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}

/// Decodes one frame, enforcing `limits`. Never panics, whatever `bytes` is.
pub fn decode(bytes: &[u8], limits: &Limits) -> Result<Frame, WireError> {
    let (version, body) = header(bytes, limits)?;
    if version != VERSION {
        return decode_refuse(body).ok_or(WireError::UnsupportedVersion {
            theirs: version,
            ours: VERSION,
        });
    }
    let frame = bounded::decode_body::<Frame>(body, limits)?;
    frame.validate()?;
    Ok(frame)
}

/// Checks size, magic and header; returns the version and the body.
fn header<'a>(bytes: &'a [u8], limits: &Limits) -> Result<(u16, &'a [u8]), WireError> {
    if bytes.len() > limits.max_frame_bytes {
        return Err(WireError::FrameTooLarge {
            len_bytes: bytes.len(),
            max_bytes: limits.max_frame_bytes,
        });
    }
    if bytes.len() < HEADER_LEN {
        // A frame that does not even start with the magic is garbage rather
        // than a truncated frame; say so when that can be told.
        if bytes.len() >= 2 && bytes[..2] != MAGIC {
            return Err(WireError::BadMagic([bytes[0], bytes[1]]));
        }
        return Err(WireError::Truncated);
    }
    let magic = [bytes[0], bytes[1]];
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    Ok((
        u16::from_le_bytes([bytes[2], bytes[3]]),
        &bytes[HEADER_LEN..],
    ))
}

/// A `Refuse` body, which every version reads (its encoding is frozen).
fn decode_refuse(body: &[u8]) -> Option<Frame> {
    let (&variant, fields) = body.split_first()?;
    if variant != 0 {
        return None;
    }
    match postcard::take_from_bytes::<Refuse>(fields) {
        Ok((refuse, [])) => Some(Frame::Refuse(refuse)),
        Ok(_) | Err(_) => None,
    }
}
