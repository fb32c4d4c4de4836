//! The lookup server's messages.
//!
//! One frame each way, postcard, the version first (a `u16`,
//! [`LOOKUP_WIRE_VERSION`]) then a sequence number the reply repeats:
//!
//! * request: `version, seq, token_len: u32, group_lens: [u32], hashes:
//!   [bytes], lora: Option<str>, extra_keys: [str]` (the hashes of every
//!   group in one list, `group_lens` saying how many each has);
//! * reply: `version, seq, Hit { tokens: u32, load: [(u32, u32)] }` or
//!   `Failed(ServerFault)`.
//!
//! A message is at most [`LOOKUP_MESSAGE_MAX_BYTES`], a request names at
//! most [`LOOKUP_HASHES_MAX`] hashes and [`GROUPS_MAX`] groups; the
//! decoders answer a typed [`LookupWireError`] for anything else and never
//! panic, whatever the bytes (`fuzz/fuzz_targets/lookup_msg_decode.rs`).
//!
//! `WireHash` and the `wire_hashes`/`wire_hit` serde helpers are the
//! block hashes and hits as every store message carries them
//! ([`super::super::StoreMeta`] too).

use std::ops::Range;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use kvferry_machines::store::key::GROUPS_MAX;
use kvferry_machines::store::lookup::LookupHit;
use kvferry_machines::store::{BlockHash, StoreFault};
use kvferry_machines::wire::envelope::{decode_whole, encode_into, EnvelopeError};

use super::{LookupFailure, LookupQuery};
use crate::config::ConnectorError;

/// The message format's version, the first field of every message.
pub const LOOKUP_WIRE_VERSION: u16 = 1;
/// Most bytes of one message.
pub const LOOKUP_MESSAGE_MAX_BYTES: usize = 1 << 20;
/// Most hashes one request names, every group together (a 128k-token
/// request with two groups of 16-token blocks).
pub const LOOKUP_HASHES_MAX: usize = 1 << 14;

/// Why a message was not decoded (or not encoded).
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LookupWireError {
    /// Longer than [`LOOKUP_MESSAGE_MAX_BYTES`].
    #[error("a lookup message of {len} bytes, at most {LOOKUP_MESSAGE_MAX_BYTES}")]
    TooLarge {
        /// Its length.
        len: usize,
    },
    /// Another version than [`LOOKUP_WIRE_VERSION`].
    #[error("lookup message version {got}, this side speaks {LOOKUP_WIRE_VERSION}")]
    Version {
        /// The version it names.
        got: u16,
    },
    /// Not a message of this version (a truncated or corrupt one).
    #[error("a malformed lookup message")]
    Malformed,
    /// Bytes after the message.
    #[error("{extra} bytes after a lookup message")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
    /// More than [`LOOKUP_HASHES_MAX`] hashes.
    #[error("{count} hashes in a lookup, at most {LOOKUP_HASHES_MAX}")]
    TooManyHashes {
        /// How many.
        count: usize,
    },
    /// More than [`GROUPS_MAX`] groups.
    #[error("{count} groups in a lookup message, at most {GROUPS_MAX}")]
    TooManyGroups {
        /// How many.
        count: usize,
    },
    /// The group lengths do not add up to the hashes sent.
    #[error("group lengths add up to {sum}, {hashes} hashes sent")]
    GroupLengths {
        /// Their sum (saturating).
        sum: usize,
        /// Hashes in the message.
        hashes: usize,
    },
    /// A reply to another request than the one asked.
    #[error("the reply answers request {got}, request {want} was asked")]
    WrongSeq {
        /// The reply's sequence number.
        got: u64,
        /// The request's.
        want: u64,
    },
    /// More than one frame.
    #[error("a lookup message of {frames} frames, one expected")]
    Frames {
        /// How many.
        frames: usize,
    },
}

/// Why the server could not answer a lookup.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServerFault {
    /// The store call failed as a whole (`StoreFault::Transport`).
    StoreTransport,
    /// The store call passed its deadline.
    StoreTimeout,
    /// The store refused the call.
    StoreRefused,
    /// The request does not fit the server's keyspace or bounds.
    BadRequest,
    /// The request did not decode.
    Undecodable,
}

impl From<&LookupFailure> for ServerFault {
    fn from(e: &LookupFailure) -> ServerFault {
        match e {
            LookupFailure::Connector(ConnectorError::Lookup(f)) => match f {
                StoreFault::Timeout => ServerFault::StoreTimeout,
                StoreFault::Refused => ServerFault::StoreRefused,
                _ => ServerFault::StoreTransport,
            },
            LookupFailure::Connector(_) => ServerFault::BadRequest,
            LookupFailure::Server(f) => *f,
            _ => ServerFault::StoreTransport,
        }
    }
}

#[derive(Serialize, Deserialize)]
pub(super) struct QueryWire {
    pub(super) version: u16,
    pub(super) seq: u64,
    pub(super) token_len: u32,
    pub(super) group_lens: Vec<u32>,
    pub(super) hashes: Vec<WireHash>,
    pub(super) lora: Option<String>,
    pub(super) extra_keys: Vec<String>,
}

#[derive(Serialize, Deserialize)]
enum AnswerWire {
    Hit { tokens: u32, load: Vec<Range<u32>> },
    Failed(ServerFault),
}

#[derive(Serialize, Deserialize)]
struct ReplyWire {
    version: u16,
    seq: u64,
    answer: AnswerWire,
}

/// A lookup's answer as a reply carries it.
pub type LookupAnswer = Result<LookupHit, ServerFault>;

/// Checks the length and the version, then decodes all of `bytes`.
fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, LookupWireError> {
    // The length, then the version (a message of another version may have
    // another shape), then the whole message.
    if bytes.len() > LOOKUP_MESSAGE_MAX_BYTES {
        return Err(LookupWireError::TooLarge { len: bytes.len() });
    }
    let (version, _) =
        postcard::take_from_bytes::<u16>(bytes).map_err(|_| LookupWireError::Malformed)?;
    if version != LOOKUP_WIRE_VERSION {
        return Err(LookupWireError::Version { got: version });
    }
    decode_whole(bytes, LOOKUP_MESSAGE_MAX_BYTES).map_err(envelope_error)
}

fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, LookupWireError> {
    encode_into(msg, Vec::new(), LOOKUP_MESSAGE_MAX_BYTES).map_err(envelope_error)
}

fn envelope_error(e: EnvelopeError) -> LookupWireError {
    match e {
        EnvelopeError::TooLarge { len, .. } => LookupWireError::TooLarge { len },
        EnvelopeError::Trailing { extra } => LookupWireError::TrailingBytes { extra },
        _ => LookupWireError::Malformed,
    }
}

/// A request's bytes, checked against the bounds the server checks.
pub fn encode_query(seq: u64, q: &LookupQuery) -> Result<Vec<u8>, LookupWireError> {
    let count: usize = q.block_hashes.iter().map(Vec::len).sum();
    check_shape(q.block_hashes.len(), count)?;
    encode(&QueryWire {
        version: LOOKUP_WIRE_VERSION,
        seq,
        token_len: q.token_len,
        group_lens: q.block_hashes.iter().map(|g| g.len() as u32).collect(),
        hashes: (q.block_hashes.iter().flatten())
            .map(|h| WireHash(*h))
            .collect(),
        lora: q.lora.clone(),
        extra_keys: q.extra_keys.clone(),
    })
}

fn check_shape(groups: usize, hashes: usize) -> Result<(), LookupWireError> {
    if groups > GROUPS_MAX {
        return Err(LookupWireError::TooManyGroups { count: groups });
    }
    if hashes > LOOKUP_HASHES_MAX {
        return Err(LookupWireError::TooManyHashes { count: hashes });
    }
    Ok(())
}

/// A request from its bytes: its sequence number and query.
pub fn decode_query(bytes: &[u8]) -> Result<(u64, LookupQuery), LookupWireError> {
    let w: QueryWire = decode(bytes)?;
    check_shape(w.group_lens.len(), w.hashes.len())?;
    let sum = (w.group_lens.iter()).fold(0usize, |s, &n| s.saturating_add(n as usize));
    if sum != w.hashes.len() {
        let hashes = w.hashes.len();
        return Err(LookupWireError::GroupLengths { sum, hashes });
    }
    let mut hashes = w.hashes.into_iter().map(|h| h.0);
    let block_hashes = (w.group_lens.iter())
        .map(|&n| hashes.by_ref().take(n as usize).collect())
        .collect();
    let query = LookupQuery {
        token_len: w.token_len,
        block_hashes,
        lora: w.lora,
        extra_keys: w.extra_keys,
    };
    Ok((w.seq, query))
}

/// A reply's bytes.
pub fn encode_reply(seq: u64, answer: &LookupAnswer) -> Result<Vec<u8>, LookupWireError> {
    let answer = match answer {
        Ok(hit) => {
            check_shape(hit.load.len(), 0)?;
            AnswerWire::Hit {
                tokens: hit.tokens,
                load: hit.load.clone(),
            }
        }
        Err(f) => AnswerWire::Failed(*f),
    };
    encode(&ReplyWire {
        version: LOOKUP_WIRE_VERSION,
        seq,
        answer,
    })
}

/// A reply from its bytes: its sequence number and answer.
pub fn decode_reply(bytes: &[u8]) -> Result<(u64, LookupAnswer), LookupWireError> {
    let w: ReplyWire = decode(bytes)?;
    let answer = match w.answer {
        AnswerWire::Hit { tokens, load } => {
            check_shape(load.len(), 0)?;
            Ok(LookupHit { tokens, load })
        }
        AnswerWire::Failed(f) => Err(f),
    };
    Ok((w.seq, answer))
}

/// A block hash as its bytes on the wire, checked when decoded.
pub(crate) struct WireHash(pub(crate) BlockHash);

impl Serialize for WireHash {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0.as_bytes())
    }
}

impl<'de> Deserialize<'de> for WireHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<WireHash, D::Error> {
        struct Bytes;
        impl serde::de::Visitor<'_> for Bytes {
            type Value = WireHash;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("1 to 32 bytes of a block hash")
            }
            fn visit_bytes<E: serde::de::Error>(self, b: &[u8]) -> Result<WireHash, E> {
                BlockHash::from_bytes(b).map(WireHash).map_err(E::custom)
            }
        }
        d.deserialize_bytes(Bytes)
    }
}

/// `Vec<Vec<BlockHash>>` as lists of [`WireHash`].
pub(crate) mod wire_hashes {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(h: &[Vec<BlockHash>], s: S) -> Result<S::Ok, S::Error> {
        let wire: Vec<Vec<WireHash>> = (h.iter())
            .map(|g| g.iter().map(|h| WireHash(*h)).collect())
            .collect();
        wire.serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Vec<Vec<BlockHash>>, D::Error> {
        let wire = Vec::<Vec<WireHash>>::deserialize(d)?;
        Ok((wire.into_iter())
            .map(|g| g.into_iter().map(|h| h.0).collect())
            .collect())
    }
}

/// [`LookupHit`] as its tokens and load ranges.
pub(crate) mod wire_hit {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(h: &LookupHit, s: S) -> Result<S::Ok, S::Error> {
        (h.tokens, &h.load).serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<LookupHit, D::Error> {
        let (tokens, load) = <(u32, Vec<Range<u32>>)>::deserialize(d)?;
        Ok(LookupHit { tokens, load })
    }
}
