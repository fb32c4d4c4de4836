//! Deserializers that bound every variable-length field *before*
//! allocating for it, and the body decoder that arms them.
//!
//! The limits are runtime configuration, but serde's `Deserialize` has no
//! way to pass context down to a field. A thread-local set for the duration
//! of one decode carries them to the field deserializers; the guard restores
//! the previous value so nested or re-entrant decodes (and panics in a
//! caller's code after a decode) leave no stale limits behind. Outside a
//! decode (a JSON plan spec, say) the fields are bounded by the defaults.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::envelope::{decode_whole, EnvelopeError};
use super::limits::{Limits, WireError};
use crate::common::{BlockId, REQUEST_ID_MAX_BYTES};
use crate::layout::{Pool, PoolRegion, Region, POOLS_MAX};

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

/// Decodes a body of the current version (a frame) under `limits`.
pub(super) fn decode_body<T: de::DeserializeOwned>(
    body: &[u8],
    limits: &Limits,
) -> Result<T, WireError> {
    let _scope = LimitScope::enter(*limits);
    // The frame's length was bounded with its header (`max_frame_bytes`).
    decode_whole::<T>(body, usize::MAX).map_err(|e| {
        if let Some(violation) = VIOLATION.with(Cell::take) {
            return violation;
        }
        match e {
            EnvelopeError::Trailing { extra } => WireError::TrailingBytes { count: extra },
            EnvelopeError::Truncated => WireError::Truncated,
            other => WireError::Malformed(other.to_string()),
        }
    })
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

/// A string of at most `max_string_bytes`.
pub(crate) fn string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    struct V(usize);
    impl Visitor<'_> for V {
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

/// A string request id of at most [`REQUEST_ID_MAX_BYTES`] (a protocol
/// constant, not a configured limit: both sides hash the same ids).
pub(crate) fn request_id<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    struct V;
    impl Visitor<'_> for V {
        type Value = String;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "a request id of at most {REQUEST_ID_MAX_BYTES} bytes")
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<String, E> {
            // Checked before `to_owned`, the only allocation.
            if s.len() > REQUEST_ID_MAX_BYTES {
                return Err(violation(
                    "request id",
                    s.len() as u64,
                    REQUEST_ID_MAX_BYTES,
                ));
            }
            Ok(s.to_owned())
        }
    }
    d.deserialize_string(V)
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

/// A sequence of `T` bounded by the limit `max` picks, reported as `field`.
struct Seq<T> {
    field: &'static str,
    max: usize,
    item: std::marker::PhantomData<T>,
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for Seq<T> {
    type Value = Vec<T>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "at most {} {}", self.max, self.field)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        bounded_vec(seq, self.field, self.max)
    }
}

fn seq<'de, D, T>(d: D, field: &'static str, max: usize) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    d.deserialize_seq(Seq {
        field,
        max,
        item: std::marker::PhantomData,
    })
}

/// A rank's regions, at most `max_regions`.
pub(crate) fn regions<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Region>, D::Error> {
    seq(d, "regions", active_limits().max_regions)
}

/// A rank's pools, at most [`POOLS_MAX`] (a protocol constant: both sides
/// must declare the same pools).
pub(crate) fn pools<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Pool>, D::Error> {
    seq(d, "pools", POOLS_MAX)
}

/// The buffers of one pool, at most `max_regions`.
pub(crate) fn pool_regions<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<PoolRegion>, D::Error> {
    seq(d, "pool regions", active_limits().max_regions)
}

/// One value per KV-cache group (prefix lengths, chunk start positions).
pub(crate) fn per_group<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
    seq(d, "per-group values", active_limits().max_groups)
}

/// Block lists per group: bounded in groups, blocks per group, and blocks in
/// total (the running total is threaded through a `DeserializeSeed`).
pub(crate) fn groups<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<BlockId>>, D::Error> {
    d.deserialize_seq(Outer(active_limits()))
}

struct Outer(Limits);

struct Inner<'a> {
    limits: Limits,
    total: &'a mut usize,
}

impl<'de> DeserializeSeed<'de> for Inner<'_> {
    type Value = Vec<BlockId>;
    fn deserialize<D2: Deserializer<'de>>(self, d: D2) -> Result<Vec<BlockId>, D2::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Inner<'_> {
    type Value = Vec<BlockId>;
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
        // Both bounds are counted while reading: postcard claims no length
        // when the prefix is longer than the bytes left.
        let per = self.limits.max_blocks_per_group;
        if claimed > per {
            return Err(violation("blocks per group", claimed as u64, per));
        }
        let mut seq = seq;
        let mut group = Vec::with_capacity(claimed.min(per));
        while let Some(id) = seq.next_element()? {
            if group.len() == per {
                return Err(violation("blocks per group", per as u64 + 1, per));
            }
            if group.len() == room {
                let len = (*self.total as u64).saturating_add(room as u64 + 1);
                return Err(violation("total blocks", len, self.limits.max_total_blocks));
            }
            group.push(id);
        }
        *self.total += group.len();
        Ok(group)
    }
}

impl<'de> Visitor<'de> for Outer {
    type Value = Vec<Vec<BlockId>>;
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
            let next = seq.next_element_seed(Inner {
                limits,
                total: &mut total,
            })?;
            let Some(group) = next else { break };
            if out.len() == limits.max_groups {
                // postcard's claimed length already bounds this, but a
                // format without one must not loop unbounded.
                return Err(violation(
                    "groups",
                    limits.max_groups as u64 + 1,
                    limits.max_groups,
                ));
            }
            out.push(group);
        }
        Ok(out)
    }
}
