//! The control protocol between an engine and `kvferry store serve`
//! (store/DESIGN.md, "The store server"): existence checks, puts, gets and
//! removes of keys. Only control rides it; a value's bytes move over the
//! tcp data plane, driven by the server (it reads the engine's blocks for
//! a put and writes them for a get), so neither side copies a value
//! through this protocol.
//!
//! # Frames
//!
//! Every message is one frame: a 12-byte header, then a postcard body.
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `KVFS` |
//! | 4..6 | protocol version, little-endian ([`VERSION`]) |
//! | 6..8 | zero |
//! | 8..12 | body length, little-endian, at most [`BODY_BYTES_MAX`] |
//!
//! An engine sends a [`Request`], the server answers each with one
//! [`Reply`] carrying the request's id, in order.
//!
//! With a cluster key ([`Channel`]) a connection opens with the
//! handshake of [`kvferry_auth::handshake`], each of its three messages
//! behind the 4 bytes `KVFA`, and every frame after it, both ways, is
//! followed by a 16-byte tag over the frame and its number on the
//! connection. A keyed server closes a connection whose first bytes are
//! anything else; a server without a key refuses `KVFA` as a bad magic. Both sides check every
//! count against the bounds below while decoding ([`ProtoError`]), so a
//! hostile peer can neither make the other allocate past them nor panic it.

use kvferry_auth::handshake::{Initiator, Responder, CHALLENGE_LEN, HELLO_LEN, PROOF_LEN};
use kvferry_auth::seal::{Opener, Sealer, TAG_LEN};
use kvferry_auth::ClusterKey;
use serde::{Deserialize, Serialize};

use kvferry_machines::wire::envelope::{decode_whole, encode_into, EnvelopeError};
use kvferry_transport::TcpConfig;

/// The data plane's settings for a store: parked waits, since a store
/// shares its cores with engines and other servers (spinning starves
/// them; see `kvferry_reactor::PollPolicy`), and four streams per engine,
/// the best of 2, 4 and 8 for batches of 32 values of 1 MiB on loopback
/// (docs/performance.md, "Store").
pub fn data_plane() -> TcpConfig {
    TcpConfig {
        poll: kvferry_transport::PollPolicy::Park,
        streams: STORE_STREAMS,
        ..TcpConfig::default()
    }
}

/// TCP streams per engine of a store's data plane.
pub const STORE_STREAMS: usize = 4;

/// The frame header's first bytes.
pub const MAGIC: [u8; 4] = *b"KVFS";
/// The protocol version this build speaks; a frame of another is refused.
pub const VERSION: u16 = 1;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 12;
/// Most bytes of a frame's body (a lookup of 65 536 keys of about 90
/// bytes fits six times over). Decoding can take up to eight times it
/// in memory (a 2-byte segment is a 16-byte `Span`), per connection.
pub const BODY_BYTES_MAX: u32 = 16 << 20;
/// Most keys in one request (and answers in one reply).
pub const KEYS_PER_CALL_MAX: usize = 1 << 16;
/// Most segments of one value (a block's bytes in each registered region).
pub const SEGMENTS_PER_VALUE_MAX: usize = 4096;
/// Most removed keys one reply carries; the rest wait for the next.
pub const REMOVED_PER_REPLY_MAX: usize = 4096;
/// Most bytes of an endpoint address in a hello.
pub const ENDPOINT_BYTES_MAX: usize = 256;

/// One contiguous piece of the engine's registered memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// Its first byte, in the engine's address space.
    pub addr: u64,
    /// Its length; zero is refused.
    pub len: u64,
}

/// One key of a put or get, and where its value is in the engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item {
    /// The key ([`kvferry_machines::store::ChunkKey`]'s text).
    pub key: String,
    /// The value's pieces, in value order.
    #[serde(deserialize_with = "bounded::segments")]
    pub segments: Vec<Span>,
}

/// What an engine asks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// The first message of a connection: where the engine's data-plane
    /// endpoint listens (`tcp://IP:PORT`), for the server to read and
    /// write the engine's blocks through.
    Hello {
        /// The endpoint; its IP must be the control connection's.
        endpoint: String,
        /// Where the engine's last connection left off in the server's
        /// log of removed keys ([`Reply::removed_next`]), so removals
        /// between two connections are told too; `None` on a first one.
        removed_from: Option<u64>,
    },
    /// Per key, whether a committed value exists.
    Exists {
        /// The keys.
        #[serde(deserialize_with = "bounded::keys")]
        keys: Vec<String>,
    },
    /// Store each item's value, read from the engine's memory by the server.
    Put {
        /// Milliseconds the engine waits for the answer; the server moves
        /// no byte after it.
        budget_ms: u32,
        /// The items.
        #[serde(deserialize_with = "bounded::items")]
        items: Vec<Item>,
    },
    /// Write each item's value into the engine's memory.
    Get {
        /// As for `Put`.
        budget_ms: u32,
        /// The items.
        #[serde(deserialize_with = "bounded::items")]
        items: Vec<Item>,
    },
    /// Remove the keys.
    Remove {
        /// The keys.
        #[serde(deserialize_with = "bounded::keys")]
        keys: Vec<String>,
    },
    /// Remove every key that starts with the prefix and nobody reads or
    /// writes now (a model's keys).
    RemovePrefix {
        /// The prefix (at most a key's length).
        prefix: String,
    },
}

/// What happened to one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KeyAnswer {
    /// Done (stored, loaded, removed).
    Done,
    /// A put's key was stored already; its value is left as it was.
    Exists,
    /// No committed value.
    NotFound,
    /// No room even after evicting every value not in use.
    Full,
    /// Larger than the whole store.
    TooLarge,
    /// The stored value has another length than the get's segments.
    WrongSize {
        /// The stored value's length.
        got_bytes: u64,
    },
    /// Another put of the key, or a get of it, is under way.
    Busy,
    /// A segment lies outside the regions the engine's endpoint announced.
    OutOfBounds,
    /// The bytes did not move (the engine's endpoint failed or fenced them).
    Transport,
    /// The bytes did not move within the request's budget.
    Timeout,
}

/// Why a whole request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Refusal {
    /// A put or get before a hello, or a hello naming no endpoint.
    NoHello,
    /// The hello's endpoint could not be reached.
    EndpointUnreachable,
    /// The request broke a bound or the protocol.
    Malformed,
}

/// The answer to one request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    /// To `Hello`.
    Hello {
        /// The store's capacity.
        capacity_bytes: u64,
    },
    /// To `Exists`, one per key.
    Exists(#[serde(deserialize_with = "bounded::answers")] Vec<bool>),
    /// To `Put`, `Get` or `Remove`, one per key.
    Keys(#[serde(deserialize_with = "bounded::answers")] Vec<KeyAnswer>),
    /// The request as a whole.
    Refused(Refusal),
    /// To `RemovePrefix`: how many keys were removed.
    Removed(u64),
}

/// A server's frame: the answer, and keys that left the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// The answer.
    pub answer: Answer,
    /// Keys evicted or removed since the previous reply on this
    /// connection, at most [`REMOVED_PER_REPLY_MAX`] (for `BlockRemoved`
    /// events).
    #[serde(deserialize_with = "bounded::removed")]
    pub removed: Vec<String>,
    /// Removed keys this connection will never be told of (they fell out
    /// of the server's bounded log before it asked).
    pub removed_lost: u64,
    /// The log position after `removed`: the next hello's `removed_from`.
    pub removed_next: u64,
}

/// Deserializers that refuse a sequence longer than its bound before
/// allocating it, so a hostile frame costs at most its bound in memory.
mod bounded {
    use std::fmt;
    use std::marker::PhantomData;

    use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};

    struct Bounded<T, const MAX: usize>(PhantomData<T>);

    impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for Bounded<T, MAX> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "at most {MAX} elements")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let claimed = seq.size_hint().unwrap_or(0);
            if claimed > MAX {
                return Err(de::Error::invalid_length(claimed, &self));
            }
            let mut out = Vec::with_capacity(claimed);
            while let Some(x) = seq.next_element()? {
                if out.len() == MAX {
                    return Err(de::Error::invalid_length(MAX + 1, &self));
                }
                out.push(x);
            }
            Ok(out)
        }
    }

    fn vec<'de, D: Deserializer<'de>, T: Deserialize<'de>, const MAX: usize>(
        d: D,
    ) -> Result<Vec<T>, D::Error> {
        d.deserialize_seq(Bounded::<T, MAX>(PhantomData))
    }

    pub(super) fn keys<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        vec::<_, _, { super::KEYS_PER_CALL_MAX }>(d)
    }

    pub(super) fn items<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<super::Item>, D::Error> {
        vec::<_, _, { super::KEYS_PER_CALL_MAX }>(d)
    }

    pub(super) fn segments<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<super::Span>, D::Error> {
        vec::<_, _, { super::SEGMENTS_PER_VALUE_MAX }>(d)
    }

    pub(super) fn answers<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
    ) -> Result<Vec<T>, D::Error> {
        vec::<_, _, { super::KEYS_PER_CALL_MAX }>(d)
    }

    pub(super) fn removed<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        vec::<_, _, { super::REMOVED_PER_REPLY_MAX }>(d)
    }
}

/// Why bytes are not a frame of this protocol.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// Fewer bytes than a header.
    #[error("a frame header is {HEADER_LEN} bytes, got {got}")]
    ShortHeader {
        /// Bytes given.
        got: usize,
    },
    /// Not `KVFS`.
    #[error("not a kvferry store frame (bad magic)")]
    BadMagic,
    /// Another protocol version.
    #[error("protocol version {got}, this build speaks {VERSION}")]
    Version {
        /// The frame's version.
        got: u16,
    },
    /// A body longer than [`BODY_BYTES_MAX`], or other than announced.
    #[error("a body of {len} bytes (at most {BODY_BYTES_MAX}, as announced)")]
    BodyLength {
        /// The length.
        len: u64,
    },
    /// The body does not decode.
    #[error("malformed body: {0}")]
    Body(EnvelopeError),
    /// A decoded message breaks a bound.
    #[error("{what}: {got} over the limit of {max}")]
    Bound {
        /// What is counted.
        what: &'static str,
        /// The count.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// A zero-length segment, or one whose end overflows.
    #[error("a segment is empty or wraps around")]
    BadSegment,
}

/// The header of a frame with a body of `len` bytes.
pub fn header(len: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&VERSION.to_le_bytes());
    h[8..12].copy_from_slice(&len.to_le_bytes());
    h
}

/// The body length a header announces, checked.
pub fn decode_header(h: &[u8]) -> Result<u32, ProtoError> {
    if h.len() < HEADER_LEN {
        return Err(ProtoError::ShortHeader { got: h.len() });
    }
    if h[..4] != MAGIC {
        return Err(ProtoError::BadMagic);
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != VERSION {
        return Err(ProtoError::Version { got: version });
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if len > BODY_BYTES_MAX || h[6..8] != [0, 0] {
        return Err(ProtoError::BodyLength { len: len.into() });
    }
    Ok(len)
}

/// A whole frame (header and body) of `msg`.
pub fn encode<T: Serialize>(id: u64, msg: &T) -> Result<Vec<u8>, ProtoError> {
    let max = BODY_BYTES_MAX as usize;
    let mut out = encode_into(&(id, msg), vec![0u8; HEADER_LEN], max).map_err(body_error)?;
    let len = (out.len() - HEADER_LEN) as u32; // at most BODY_BYTES_MAX
    out[..HEADER_LEN].copy_from_slice(&header(len));
    Ok(out)
}

/// Why [`read_body`] returned no body.
#[derive(Debug)]
pub enum ReadError {
    /// The stream ended or failed.
    Closed,
    /// The header is not one of this protocol.
    Malformed(ProtoError),
    /// A frame's tag did not verify, or the handshake failed.
    Unauthenticated,
}

/// What opens each handshake message of an authenticated connection.
pub const AUTH_MAGIC: [u8; 4] = *b"KVFA";

/// What the handshake binds a store connection's keys to.
const CONTEXT: &str = "kvferry store control";

/// One control connection's framing: plain, or authenticated after a
/// handshake (then every frame is sealed and checked, in order).
#[derive(Default)]
pub struct Channel {
    seal: Option<Sealer>,
    open: Option<Opener>,
}

impl Channel {
    /// A channel without authentication.
    pub fn plain() -> Channel {
        Channel::default()
    }

    /// The engine's side of the handshake on a new connection.
    pub async fn initiate<S>(stream: &mut S, key: &ClusterKey) -> Result<Channel, ReadError>
    where
        S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin,
    {
        use futures_lite::{AsyncReadExt, AsyncWriteExt};
        let init = Initiator::new(key, CONTEXT).map_err(|_| ReadError::Closed)?;
        let hello = [&AUTH_MAGIC[..], init.hello()].concat();
        stream
            .write_all(&hello)
            .await
            .map_err(|_| ReadError::Closed)?;
        let mut challenge = [0u8; 4 + CHALLENGE_LEN];
        (stream.read_exact(&mut challenge).await).map_err(|_| ReadError::Closed)?;
        if challenge[..4] != AUTH_MAGIC {
            return Err(ReadError::Unauthenticated);
        }
        let (proof, session) = init
            .handle_challenge(&challenge[4..])
            .map_err(|_| ReadError::Unauthenticated)?;
        let proof = [&AUTH_MAGIC[..], &proof].concat();
        stream
            .write_all(&proof)
            .await
            .map_err(|_| ReadError::Closed)?;
        Ok(Channel {
            seal: Some(session.seal),
            open: Some(session.open),
        })
    }

    /// The server's side: the connection's first bytes must be the
    /// handshake; anything else is [`ReadError::Unauthenticated`].
    pub async fn respond<S>(stream: &mut S, key: &ClusterKey) -> Result<Channel, ReadError>
    where
        S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin,
    {
        use futures_lite::{AsyncReadExt, AsyncWriteExt};
        let mut hello = [0u8; 4 + HELLO_LEN];
        (stream.read_exact(&mut hello[..4]).await).map_err(|_| ReadError::Closed)?;
        if hello[..4] != AUTH_MAGIC {
            return Err(ReadError::Unauthenticated);
        }
        (stream.read_exact(&mut hello[4..]).await).map_err(|_| ReadError::Closed)?;
        let resp =
            Responder::new(key, CONTEXT, &hello[4..]).map_err(|_| ReadError::Unauthenticated)?;
        let challenge = [&AUTH_MAGIC[..], resp.challenge()].concat();
        stream
            .write_all(&challenge)
            .await
            .map_err(|_| ReadError::Closed)?;
        let mut proof = [0u8; 4 + PROOF_LEN];
        (stream.read_exact(&mut proof).await).map_err(|_| ReadError::Closed)?;
        if proof[..4] != AUTH_MAGIC {
            return Err(ReadError::Unauthenticated);
        }
        let session = resp
            .handle_proof(&proof[4..])
            .map_err(|_| ReadError::Unauthenticated)?;
        Ok(Channel {
            seal: Some(session.seal),
            open: Some(session.open),
        })
    }

    /// Whether the connection is authenticated.
    pub fn is_sealed(&self) -> bool {
        self.seal.is_some()
    }

    /// A whole frame of `msg`, sealed when the channel is.
    pub fn encode<T: Serialize>(&mut self, id: u64, msg: &T) -> Result<Vec<u8>, ProtoError> {
        let mut frame = encode(id, msg)?;
        if let Some(seal) = &mut self.seal {
            let tag = seal.seal(&[&frame]);
            frame.extend_from_slice(&tag);
        }
        Ok(frame)
    }

    /// The next frame's body, its tag checked when the channel is sealed.
    pub async fn read_body<R: futures_lite::AsyncRead + Unpin>(
        &mut self,
        stream: &mut R,
    ) -> Result<Vec<u8>, ReadError> {
        use futures_lite::AsyncReadExt;
        let mut frame = vec![0u8; HEADER_LEN];
        (stream.read_exact(&mut frame).await).map_err(|_| ReadError::Closed)?;
        let len = decode_header(&frame).map_err(ReadError::Malformed)?;
        frame.resize(HEADER_LEN + len as usize, 0);
        (stream.read_exact(&mut frame[HEADER_LEN..]).await).map_err(|_| ReadError::Closed)?;
        if let Some(open) = &mut self.open {
            let mut tag = [0u8; TAG_LEN];
            (stream.read_exact(&mut tag).await).map_err(|_| ReadError::Closed)?;
            open.open(&[&frame], &tag)
                .map_err(|_| ReadError::Unauthenticated)?;
        }
        frame.drain(..HEADER_LEN);
        Ok(frame)
    }
}

/// The body of the next frame on `stream`: its header read and checked
/// first, so no more than [`BODY_BYTES_MAX`] is ever allocated.
pub async fn read_body<R: futures_lite::AsyncRead + Unpin>(
    stream: &mut R,
) -> Result<Vec<u8>, ReadError> {
    use futures_lite::AsyncReadExt;
    let mut header = [0u8; HEADER_LEN];
    (stream.read_exact(&mut header).await).map_err(|_| ReadError::Closed)?;
    let len = decode_header(&header).map_err(ReadError::Malformed)?;
    let mut body = vec![0u8; len as usize];
    (stream.read_exact(&mut body).await).map_err(|_| ReadError::Closed)?;
    Ok(body)
}

/// A request's id and the request, from a frame's body.
pub fn decode_request(body: &[u8]) -> Result<(u64, Request), ProtoError> {
    let (id, req): (u64, Request) = decode_body(body)?;
    check_request(&req)?;
    Ok((id, req))
}

/// A reply's id and the reply, from a frame's body.
pub fn decode_reply(body: &[u8]) -> Result<(u64, Reply), ProtoError> {
    let (id, reply): (u64, Reply) = decode_body(body)?;
    check_reply(&reply)?;
    Ok((id, reply))
}

fn decode_body<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ProtoError> {
    decode_whole(body, BODY_BYTES_MAX as usize).map_err(body_error)
}

fn body_error(e: EnvelopeError) -> ProtoError {
    match e {
        EnvelopeError::TooLarge { len, .. } => ProtoError::BodyLength { len: len as u64 },
        other => ProtoError::Body(other),
    }
}

fn bound(what: &'static str, got: usize, max: usize) -> Result<(), ProtoError> {
    if got > max {
        return Err(ProtoError::Bound { what, got, max });
    }
    Ok(())
}

fn check_keys(keys: &[String]) -> Result<(), ProtoError> {
    bound("keys", keys.len(), KEYS_PER_CALL_MAX)?;
    let max = kvferry_machines::store::key::KEY_BYTES_MAX;
    let longest = keys.iter().map(String::len).max().unwrap_or(0);
    bound("key bytes", longest, max)
}

fn check_items(items: &[Item]) -> Result<(), ProtoError> {
    bound("items", items.len(), KEYS_PER_CALL_MAX)?;
    for it in items {
        bound(
            "key bytes",
            it.key.len(),
            kvferry_machines::store::key::KEY_BYTES_MAX,
        )?;
        bound("segments", it.segments.len(), SEGMENTS_PER_VALUE_MAX)?;
        for s in &it.segments {
            if s.len == 0 || s.addr.checked_add(s.len).is_none() {
                return Err(ProtoError::BadSegment);
            }
        }
    }
    Ok(())
}

fn check_request(req: &Request) -> Result<(), ProtoError> {
    match req {
        Request::Hello { endpoint, .. } => {
            bound("endpoint bytes", endpoint.len(), ENDPOINT_BYTES_MAX)
        }
        Request::Exists { keys } | Request::Remove { keys } => check_keys(keys),
        Request::RemovePrefix { prefix } => bound(
            "prefix bytes",
            prefix.len(),
            kvferry_machines::store::key::KEY_BYTES_MAX,
        ),
        Request::Put { items, .. } | Request::Get { items, .. } => check_items(items),
    }
}

fn check_reply(reply: &Reply) -> Result<(), ProtoError> {
    match &reply.answer {
        Answer::Exists(v) => bound("answers", v.len(), KEYS_PER_CALL_MAX)?,
        Answer::Keys(v) => bound("answers", v.len(), KEYS_PER_CALL_MAX)?,
        Answer::Hello { .. } | Answer::Refused(_) | Answer::Removed(_) => {}
    }
    bound("removed keys", reply.removed.len(), REMOVED_PER_REPLY_MAX)?;
    check_keys(&reply.removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(frame: &[u8]) -> &[u8] {
        let len = decode_header(frame).unwrap() as usize;
        assert_eq!(frame.len(), HEADER_LEN + len);
        &frame[HEADER_LEN..]
    }

    #[test]
    fn requests_and_replies_round_trip() {
        let req = Request::Put {
            budget_ms: 250,
            items: vec![Item {
                key: "kvf1:m:k".into(),
                segments: vec![Span {
                    addr: 4096,
                    len: 64,
                }],
            }],
        };
        let frame = encode(7, &req).unwrap();
        assert_eq!(decode_request(body(&frame)).unwrap(), (7, req));
        let reply = Reply {
            answer: Answer::Keys(vec![KeyAnswer::Done, KeyAnswer::WrongSize { got_bytes: 3 }]),
            removed: vec!["kvf1:x".into()],
            removed_lost: 2,
            removed_next: 9,
        };
        let frame = encode(8, &reply).unwrap();
        assert_eq!(decode_reply(body(&frame)).unwrap(), (8, reply));
    }

    #[test]
    fn headers_of_another_protocol_or_size_are_refused() {
        let good = header(10);
        assert_eq!(decode_header(&good), Ok(10));
        assert_eq!(
            decode_header(&good[..5]),
            Err(ProtoError::ShortHeader { got: 5 })
        );
        let mut bad = good;
        bad[0] = b'X';
        assert_eq!(decode_header(&bad), Err(ProtoError::BadMagic));
        let mut bad = good;
        bad[4] = 9;
        assert_eq!(decode_header(&bad), Err(ProtoError::Version { got: 9 }));
        let big = header(BODY_BYTES_MAX + 1);
        assert!(matches!(
            decode_header(&big),
            Err(ProtoError::BodyLength { .. })
        ));
    }

    #[test]
    fn bodies_breaking_a_bound_are_refused() {
        let empty_seg = Request::Get {
            budget_ms: 1,
            items: vec![Item {
                key: "k".into(),
                segments: vec![Span { addr: 1, len: 0 }],
            }],
        };
        let f = encode(1, &empty_seg).unwrap();
        assert_eq!(decode_request(body(&f)), Err(ProtoError::BadSegment));
        let long_key = Request::Exists {
            keys: vec!["k".repeat(kvferry_machines::store::key::KEY_BYTES_MAX + 1)],
        };
        let f = encode(1, &long_key).unwrap();
        assert!(matches!(
            decode_request(body(&f)),
            Err(ProtoError::Bound {
                what: "key bytes",
                ..
            })
        ));
        let f = encode(1, &Request::Remove { keys: vec![] }).unwrap();
        let mut trailing = body(&f).to_vec();
        trailing.push(0);
        assert!(matches!(
            decode_request(&trailing),
            Err(ProtoError::Body(_))
        ));
    }

    #[test]
    fn a_sequence_past_its_bound_is_refused_before_it_is_allocated() {
        // A body claiming 2^20 keys of which it holds none.
        let mut body = postcard::to_allocvec(&(1u64, 1u32)).unwrap(); // id, Exists
        body.extend_from_slice(&[0x80, 0x80, 0x40]); // varint 2^20
        let e = decode_request(&body).unwrap_err();
        assert!(matches!(e, ProtoError::Body(_)), "{e:?}");
        let keys = Request::Exists {
            keys: vec![String::new(); KEYS_PER_CALL_MAX + 1],
        };
        let f = encode(1, &keys).unwrap();
        assert!(decode_request(body_of(&f)).is_err());
    }

    fn body_of(frame: &[u8]) -> &[u8] {
        &frame[HEADER_LEN..]
    }

    #[test]
    fn every_prefix_of_a_frame_fails_cleanly() {
        let req = Request::Hello {
            endpoint: "tcp://127.0.0.1:1".into(),
            removed_from: Some(3),
        };
        let f = encode(3, &req).unwrap();
        let b = body(&f);
        for n in 0..b.len() {
            assert!(decode_request(&b[..n]).is_err(), "prefix of {n} bytes");
        }
    }
}
