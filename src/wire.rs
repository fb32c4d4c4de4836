//! The side-channel wire format: a versioned envelope around a postcard
//! (serde) encoded [`Message`].
//!
//! A frame is a 4-byte header followed by the postcard body:
//!
//! ```text
//! +------+------+-----------------+--------------------------+
//! | 'K'  | 'F'  | version (u16 LE) | postcard(Message)        |
//! +------+------+-----------------+--------------------------+
//! ```
//!
//! Decoding never panics and never trusts a length the peer claims: every
//! variable-length field (strings, block lists, regions, id lists) is checked
//! against the configured [`Limits`] *before* anything is allocated for it,
//! and the whole frame is checked against `max_frame_bytes` before parsing
//! starts. Every failure is a [`WireError`]; all of them blame the peer that
//! sent the frame.
//!
//! ```
//! use kvferry::wire::{self, Message, Done, Limits};
//! let frame = wire::encode(&Message::Done(Done { transfer_id: 7, ok: true }));
//! assert_eq!(wire::decode(&frame, &Limits::default()).unwrap(),
//!            Message::Done(Done { transfer_id: 7, ok: true }));
//! ```

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// First two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"KF";
/// The only envelope version this build speaks. A peer with another version
/// is rejected with [`WireError::UnsupportedVersion`] rather than guessed at.
pub const VERSION: u16 = 1;
/// Length of the magic + version header.
pub const HEADER_LEN: usize = 4;

/// Upper bounds the decoder enforces. They bound the memory one frame can
/// make us allocate, so a hostile or buggy peer cannot exhaust it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Whole frame, header included. Also used as ZeroMQ's `MAXMSGSIZE`.
    pub max_frame_bytes: usize,
    /// KV-cache groups in one `Pull` or `Ready`.
    pub max_groups: usize,
    /// Block ids in one group.
    pub max_blocks_per_group: usize,
    /// Block ids across all groups of one message.
    pub max_total_blocks: usize,
    /// Regions announced in one `Hello`.
    pub max_regions: usize,
    /// Bytes of any string (engine id, endpoint, abort detail).
    pub max_string_bytes: usize,
    /// Transfer ids in one `Heartbeat` or `HeartbeatAck`.
    pub max_ids: usize,
}

impl Default for Limits {
    /// Generous enough for a 1M-token request with one-token pages
    /// (SGLang's default page size) and for tens of thousands of transfers in
    /// flight per peer, while keeping one frame under 16 MiB.
    fn default() -> Self {
        Limits {
            max_frame_bytes: 16 << 20,
            max_groups: 64,
            max_blocks_per_group: 1 << 20,
            max_total_blocks: 1 << 21,
            max_regions: 1 << 16,
            max_string_bytes: 1024,
            max_ids: 1 << 16,
        }
    }
}

/// Why a frame was rejected. Every variant means the peer sent something we
/// do not accept; none of them is our fault.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The frame is larger than `Limits::max_frame_bytes`.
    #[error("frame of {len_bytes} bytes exceeds the limit of {max_bytes} bytes")]
    FrameTooLarge { len_bytes: usize, max_bytes: usize },
    /// The frame ended before the header or the message was complete.
    #[error("truncated frame")]
    Truncated,
    /// The first two bytes are not [`MAGIC`].
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 2]),
    /// The envelope version is not [`VERSION`].
    #[error("unsupported wire version {0} (this build speaks {VERSION})")]
    UnsupportedVersion(u16),
    /// A variable-length field claims more elements than the limit allows.
    #[error("{field} has {len} elements, limit is {max}")]
    LimitExceeded {
        field: &'static str,
        len: u64,
        max: usize,
    },
    /// Bytes left over after a complete message.
    #[error("{count} trailing bytes after the message")]
    TrailingBytes { count: usize },
    /// The body is not a valid message (bad varint, unknown variant, bad
    /// UTF-8, bad bool, ...).
    #[error("malformed message: {0}")]
    Malformed(String),
}

/// How the data plane moves bytes for a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TransferMode {
    /// P writes into D's blocks (vLLM, SGLang).
    Push,
    /// D reads P's blocks (vLLM-Ascend).
    Pull,
}

/// Memory layout of the KV cache inside one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LayoutKind {
    /// `[block][head][token][dim]`.
    Hnd,
    /// `[block][token][head][dim]`.
    Nhd,
    /// Multi-head latent attention: one replicated latent cache, no heads.
    Mla,
}

/// One registered memory region as the peer sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionInfo {
    /// Start address in the owner's address space (or transport key space).
    pub base: u64,
    /// Total registered length.
    pub len_bytes: u64,
    /// Bytes of one block in this region.
    pub block_len_bytes: u64,
    /// Bytes of the K (or V) half of one block; equals `block_len_bytes`
    /// for MLA and for regions that hold only K or only V.
    pub kv_block_len_bytes: u64,
    /// KV-cache group this region belongs to (hybrid models).
    pub group: u32,
    /// Layer index, for debugging and for layer-wise plans.
    pub layer: u32,
}

/// A peer introduces itself: who it is and what memory it exposes.
/// Sent D → P on connect, answered P → D with P's own `Hello`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    #[serde(deserialize_with = "bounded_string")]
    pub engine_id: String,
    pub dp_rank: u32,
    pub tp_rank: u32,
    pub pp_rank: u32,
    pub tp_size: u32,
    /// KV heads of the whole model (before TP sharding); 1 for MLA.
    pub total_kv_heads: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Blocks in each region.
    pub num_blocks: u32,
    pub layout: LayoutKind,
    pub mode: TransferMode,
    #[serde(deserialize_with = "bounded_regions")]
    pub regions: Vec<RegionInfo>,
    /// Data-plane endpoint, `host:port`.
    #[serde(deserialize_with = "bounded_string")]
    pub transport_endpoint: String,
}

/// D asks P for a transfer into (push) or from (pull) the given blocks.
/// One per D rank and P rank it pairs with (`Msg::Pull` of the machines).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pull {
    pub transfer_id: u64,
    /// Destination block ids, one list per KV-cache group (push mode; P
    /// ignores them in pull mode).
    #[serde(deserialize_with = "bounded_groups")]
    pub dst_blocks: Vec<Vec<u32>>,
    /// Per group, how many of P's leading blocks D already holds (prefix
    /// hit): P's block at position `i >= prefix` lands in `dst[i - prefix]`.
    #[serde(deserialize_with = "bounded_per_group")]
    pub prefix_blocks: Vec<u32>,
    /// How many P ranks will send to this D rank (heterogeneous TP).
    pub expected_senders: u32,
    /// How many D ranks will send a `Pull` to this P rank for this transfer.
    pub receivers_expected: u32,
    /// Pull mode: the first lease request rides on the `Pull`.
    pub lease_seq: Option<u64>,
    /// Time left until D gives up, relative to when D sent this (clocks of
    /// two hosts are not comparable, durations are).
    pub deadline_ms: u64,
    /// Lease D grants P on its destination blocks with this request (push
    /// mode; 0 when leases only come from `LeaseGrant`).
    pub lease_ms: u64,
}

/// Pull mode: one chunk of P's KV is ready in these source blocks; D may
/// read them under its lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    pub transfer_id: u64,
    /// Chunk index, 0-based and dense.
    pub chunk: u32,
    /// Position in P's full block list of this chunk's first block, per group.
    #[serde(deserialize_with = "bounded_per_group")]
    pub start_blocks: Vec<u32>,
    /// Source block ids of this chunk, one list per KV-cache group.
    #[serde(deserialize_with = "bounded_groups")]
    pub src_blocks: Vec<Vec<u32>>,
    /// True on the last chunk of the request.
    pub is_last: bool,
}

/// Toucher → granter: please (re)grant the lease on this transfer's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRequest {
    pub transfer_id: u64,
    pub seq: u64,
}

/// Granter → toucher: lease for request `seq`, valid for `duration_ms`
/// counted by each side on its own clock (see DESIGN.md §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    pub transfer_id: u64,
    pub seq: u64,
    pub duration_ms: u64,
}

/// Pull mode: D finished reading (or gave up); P may release its blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {
    pub transfer_id: u64,
    pub ok: bool,
}

/// Why a transfer failed on the side that reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    /// The data plane failed.
    Transport,
    /// Layouts or block lists did not fit together.
    BadMetadata,
    /// The reporting side does not know this transfer.
    UnknownTransfer,
    /// A deadline or lease ran out.
    Expired,
    /// The request was aborted.
    Aborted,
    /// The reporting side is out of capacity (a bounded map or queue is full).
    Overloaded,
    /// The reporting side is shutting down.
    Shutdown,
}

/// Push mode: P's final word on a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub transfer_id: u64,
    pub result: Result<(), ErrorCode>,
}

/// Why a side aborts a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AbortCode {
    Engine,
    ClientDisconnect,
    Shutdown,
    Expired,
    PeerDead,
}

/// Either side stops a transfer; the other answers with [`AbortAck`] once it
/// no longer touches the aborter's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Abort {
    pub transfer_id: u64,
    pub reason: AbortCode,
}

/// The receiver of an [`Abort`] will not touch the aborter's blocks again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortAck {
    pub transfer_id: u64,
}

/// Peer liveness probe, sent periodically on every connection. It may also
/// renew the leases of the listed transfers in one message (a batched
/// alternative to one `LeaseRequest` per transfer; a node that uses
/// `LeaseRequest` sends it empty).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub seq: u64,
    /// Transfers whose leases the sender renews.
    #[serde(deserialize_with = "bounded_ids")]
    pub renew: Vec<u64>,
    /// Length of the renewed leases.
    pub lease_ms: u64,
}

/// Answer to a [`Heartbeat`] with the same `seq`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatAck {
    pub seq: u64,
    /// Renewed transfers this side does not know (so the peer can fail them
    /// at once instead of waiting for their deadline).
    #[serde(deserialize_with = "bounded_ids")]
    pub unknown: Vec<u64>,
}

/// Every control message of the protocol (DESIGN.md §3).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    Hello(Hello),
    Pull(Pull),
    Ready(Ready),
    Done(Done),
    Status(Status),
    Abort(Abort),
    AbortAck(AbortAck),
    Heartbeat(Heartbeat),
    HeartbeatAck(HeartbeatAck),
    LeaseRequest(LeaseRequest),
    LeaseGrant(LeaseGrant),
}

impl Message {
    /// The transfer this message is about, if any (`Hello`, `Heartbeat` and
    /// `HeartbeatAck` are about the peer, not one transfer).
    pub fn transfer_id(&self) -> Option<u64> {
        match self {
            Message::Pull(m) => Some(m.transfer_id),
            Message::Ready(m) => Some(m.transfer_id),
            Message::Done(m) => Some(m.transfer_id),
            Message::Status(m) => Some(m.transfer_id),
            Message::Abort(m) => Some(m.transfer_id),
            Message::AbortAck(m) => Some(m.transfer_id),
            Message::LeaseRequest(m) => Some(m.transfer_id),
            Message::LeaseGrant(m) => Some(m.transfer_id),
            Message::Hello(_) | Message::Heartbeat(_) | Message::HeartbeatAck(_) => None,
        }
    }

    /// Short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::Pull(_) => "pull",
            Message::Ready(_) => "ready",
            Message::Done(_) => "done",
            Message::Status(_) => "status",
            Message::Abort(_) => "abort",
            Message::AbortAck(_) => "abort_ack",
            Message::Heartbeat(_) => "heartbeat",
            Message::HeartbeatAck(_) => "heartbeat_ack",
            Message::LeaseRequest(_) => "lease_request",
            Message::LeaseGrant(_) => "lease_grant",
        }
    }

    /// Checks the message against `limits` as a receiver would, so a sender
    /// can refuse to emit what its peer is going to reject. Does not check
    /// the encoded size; compare `encode(..).len()` with `max_frame_bytes`.
    pub fn check_limits(&self, limits: &Limits) -> Result<(), WireError> {
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
        // Field names match the ones the decoder reports.
        let check_groups = |groups: &Vec<Vec<u32>>| {
            check("groups", groups.len(), limits.max_groups)?;
            let mut total = 0usize;
            for group in groups {
                check("blocks per group", group.len(), limits.max_blocks_per_group)?;
                total += group.len();
            }
            check("total blocks", total, limits.max_total_blocks)
        };
        match self {
            Message::Hello(m) => {
                check("string", m.engine_id.len(), limits.max_string_bytes)?;
                check(
                    "string",
                    m.transport_endpoint.len(),
                    limits.max_string_bytes,
                )?;
                check("regions", m.regions.len(), limits.max_regions)
            }
            Message::Pull(m) => {
                check("per-group values", m.prefix_blocks.len(), limits.max_groups)?;
                check_groups(&m.dst_blocks)
            }
            Message::Ready(m) => {
                check("per-group values", m.start_blocks.len(), limits.max_groups)?;
                check_groups(&m.src_blocks)
            }
            Message::Heartbeat(m) => check("transfer ids", m.renew.len(), limits.max_ids),
            Message::HeartbeatAck(m) => check("transfer ids", m.unknown.len(), limits.max_ids),
            Message::Done(_)
            | Message::Status(_)
            | Message::Abort(_)
            | Message::AbortAck(_)
            | Message::LeaseRequest(_)
            | Message::LeaseGrant(_) => Ok(()),
        }
    }
}

/// Encodes `msg` as one frame (header + postcard body).
pub fn encode(msg: &Message) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    encode_into(msg, &mut out);
    out
}

/// Appends the frame for `msg` to `out`, reusing its allocation.
pub fn encode_into(msg: &Message, out: &mut Vec<u8>) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    // postcard only fails for unknown-length sequences, `collect_str` and
    // custom serializer errors, none of which these plain types use.
    postcard::serialize_with_flavor::<Message, _, ()>(msg, AppendFlavor(out))
        .expect("postcard cannot fail on the wire message types");
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

/// Decodes one frame, enforcing `limits`. Never panics, whatever `frame` is.
pub fn decode(frame: &[u8], limits: &Limits) -> Result<Message, WireError> {
    if frame.len() > limits.max_frame_bytes {
        return Err(WireError::FrameTooLarge {
            len_bytes: frame.len(),
            max_bytes: limits.max_frame_bytes,
        });
    }
    if frame.len() < HEADER_LEN {
        // A frame that does not even start with our magic is garbage rather
        // than a truncated message; say so when we can tell.
        if frame.len() >= 2 && frame[..2] != MAGIC {
            return Err(WireError::BadMagic([frame[0], frame[1]]));
        }
        return Err(WireError::Truncated);
    }
    let magic = [frame[0], frame[1]];
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([frame[2], frame[3]]);
    if version != VERSION {
        return Err(WireError::UnsupportedVersion(version));
    }
    let body = &frame[HEADER_LEN..];

    let _scope = LimitScope::enter(*limits);
    match postcard::take_from_bytes::<Message>(body) {
        Ok((msg, [])) => Ok(msg),
        Ok((_, rest)) => Err(WireError::TrailingBytes { count: rest.len() }),
        Err(err) => {
            if let Some(violation) = VIOLATION.with(Cell::take) {
                return Err(violation);
            }
            Err(match err {
                postcard::Error::DeserializeUnexpectedEnd => WireError::Truncated,
                other => WireError::Malformed(other.to_string()),
            })
        }
    }
}

// The limits are runtime configuration, but serde's `Deserialize` has no way
// to pass context down to a field. A thread-local set for the duration of one
// `decode` call carries them to the bounded field deserializers below; the
// guard restores the previous value so nested or re-entrant decodes (and
// panics in a caller's code after a decode) leave no stale limits behind.
thread_local! {
    static ACTIVE: Cell<Option<Limits>> = const { Cell::new(None) };
    // serde erases custom error payloads into postcard's unit
    // `SerdeDeCustom`, so the precise violation travels out of band.
    static VIOLATION: Cell<Option<WireError>> = const { Cell::new(None) };
}

struct LimitScope {
    previous: Option<Limits>,
}

impl LimitScope {
    fn enter(limits: Limits) -> LimitScope {
        VIOLATION.with(Cell::take);
        LimitScope {
            previous: ACTIVE.with(|a| a.replace(Some(limits))),
        }
    }
}

impl Drop for LimitScope {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.set(self.previous));
    }
}

fn active_limits() -> Limits {
    ACTIVE.with(Cell::get).unwrap_or_default()
}

/// Records the violation and returns the serde error that aborts decoding.
fn violation<E: de::Error>(field: &'static str, len: u64, max: usize) -> E {
    VIOLATION.with(|v| v.set(Some(WireError::LimitExceeded { field, len, max })));
    E::custom("limit exceeded")
}

/// Length a sequence claims. postcard reports its length prefix, except when
/// the prefix claims more elements than there are bytes left; then it says
/// nothing, and the sequence is treated as claiming zero: nothing is
/// reserved, elements are counted while read, and decoding ends with
/// `Truncated` when the bytes run out (or `LimitExceeded` if the limit comes
/// first).
fn claimed_len<'de, A: SeqAccess<'de>>(seq: &A) -> usize {
    seq.size_hint().unwrap_or(0)
}

fn bounded_string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    struct V(usize);
    impl<'de> Visitor<'de> for V {
        type Value = String;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "a string of at most {} bytes", self.0)
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<String, E> {
            // Checked before `to_owned`, the only allocation.
            if s.len() > self.0 {
                return Err(violation("string", s.len() as u64, self.0));
            }
            Ok(s.to_owned())
        }
    }
    d.deserialize_string(V(active_limits().max_string_bytes))
}

/// Reads a sequence of `T` with at most `max` elements, checking the claimed
/// length before reserving and the actual count while reading.
fn bounded_vec<'de, A, T>(mut seq: A, field: &'static str, max: usize) -> Result<Vec<T>, A::Error>
where
    A: SeqAccess<'de>,
    T: Deserialize<'de>,
{
    let claimed = claimed_len(&seq);
    if claimed > max {
        return Err(violation(field, claimed as u64, max));
    }
    let mut out = Vec::with_capacity(claimed);
    while let Some(item) = seq.next_element()? {
        if out.len() == max {
            return Err(violation(field, max as u64 + 1, max));
        }
        out.push(item);
    }
    Ok(out)
}

fn bounded_regions<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<RegionInfo>, D::Error> {
    struct V(usize);
    impl<'de> Visitor<'de> for V {
        type Value = Vec<RegionInfo>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "at most {} regions", self.0)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            bounded_vec(seq, "regions", self.0)
        }
    }
    d.deserialize_seq(V(active_limits().max_regions))
}

/// One value per KV-cache group (prefix lengths, chunk start positions).
fn bounded_per_group<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
    struct V(usize);
    impl<'de> Visitor<'de> for V {
        type Value = Vec<u32>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "at most {} per-group values", self.0)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            bounded_vec(seq, "per-group values", self.0)
        }
    }
    d.deserialize_seq(V(active_limits().max_groups))
}

fn bounded_ids<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
    struct V(usize);
    impl<'de> Visitor<'de> for V {
        type Value = Vec<u64>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "at most {} transfer ids", self.0)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            bounded_vec(seq, "transfer ids", self.0)
        }
    }
    d.deserialize_seq(V(active_limits().max_ids))
}

/// Block lists per group: bounded in groups, blocks per group, and blocks in
/// total (the running total is threaded through a `DeserializeSeed`).
fn bounded_groups<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<u32>>, D::Error> {
    struct Outer(Limits);
    struct Inner<'a> {
        limits: Limits,
        total: &'a mut usize,
    }
    impl<'de> DeserializeSeed<'de> for Inner<'_> {
        type Value = Vec<u32>;
        fn deserialize<D2: Deserializer<'de>>(self, d: D2) -> Result<Vec<u32>, D2::Error> {
            d.deserialize_seq(self)
        }
    }
    impl<'de> Visitor<'de> for Inner<'_> {
        type Value = Vec<u32>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "at most {} block ids", self.limits.max_blocks_per_group)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            let claimed = claimed_len(&seq);
            let room = self.limits.max_total_blocks.saturating_sub(*self.total);
            if claimed > room {
                return Err(violation(
                    "total blocks",
                    (*self.total as u64).saturating_add(claimed as u64),
                    self.limits.max_total_blocks,
                ));
            }
            let group: Vec<u32> = bounded_vec(seq, "blocks per group", {
                self.limits.max_blocks_per_group.min(room)
            })?;
            *self.total += group.len();
            Ok(group)
        }
    }
    impl<'de> Visitor<'de> for Outer {
        type Value = Vec<Vec<u32>>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "at most {} groups of block ids", self.0.max_groups)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let limits = self.0;
            let claimed = claimed_len(&seq);
            if claimed > limits.max_groups {
                return Err(violation("groups", claimed as u64, limits.max_groups));
            }
            let mut total = 0usize;
            let mut out = Vec::with_capacity(claimed);
            loop {
                if out.len() == limits.max_groups {
                    // postcard's claimed length already bounds this, but a
                    // format without one must not loop unbounded.
                    if seq
                        .next_element_seed(Inner {
                            limits,
                            total: &mut total,
                        })?
                        .is_some()
                    {
                        return Err(violation(
                            "groups",
                            limits.max_groups as u64 + 1,
                            limits.max_groups,
                        ));
                    }
                    break;
                }
                match seq.next_element_seed(Inner {
                    limits,
                    total: &mut total,
                })? {
                    Some(group) => out.push(group),
                    None => break,
                }
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Outer(active_limits()))
}
