//! Sealed frames: what a connection does after its [handshake](crate::handshake).
//!
//! Each direction has its own key and counts its frames; a frame's tag
//! covers the frame's bytes and its number, which is not sent. A frame
//! that was forged, tampered with, replayed, dropped, reordered or taken
//! from another connection (other nonces, other keys) fails the next
//! [`Opener::open`]; the connection is then closed, never resynchronised.

use hmac::Mac as _;

use crate::mac::{feed, HmacSha256, Keyed};
use crate::AuthError;

/// Bytes of a frame's tag (HMAC-SHA-256 truncated to 128 bits).
pub const TAG_LEN: usize = 16;

const LABEL: &[u8] = b"kvferry/1 frame";

/// Seals the frames one side sends.
#[derive(Clone)]
pub struct Sealer {
    key: Keyed,
    seq: u64,
}

impl Sealer {
    pub(crate) fn new(key: Keyed) -> Sealer {
        Sealer { key, seq: 0 }
    }

    /// The tag of the next frame, made of `parts` (its header, its table:
    /// whatever the receiver reads before acting on the frame).
    pub fn seal(&mut self, parts: &[&[u8]]) -> [u8; TAG_LEN] {
        self.seal_numbered(parts).1
    }

    /// The number and tag of the next frame, for a channel that may lose
    /// frames (a ZeroMQ socket past its high-water mark): the number
    /// travels with the frame, and [`Opener::open_numbered`] takes any
    /// number above the last it accepted.
    pub fn seal_numbered(&mut self, parts: &[&[u8]]) -> (u64, [u8; TAG_LEN]) {
        let seq = self.seq;
        self.seq += 1;
        (seq, truncated(frame_mac(&self.key, seq, parts)))
    }

    /// The tag of a frame's payload (optional on a connection: its bulk
    /// bytes, which the frame's own tag covers only through their length):
    /// over the frame's tag, which ties it to that frame, and the payload's
    /// pieces in order.
    pub fn payload_tag<'a>(
        &self,
        frame_tag: &[u8],
        pieces: impl IntoIterator<Item = &'a [u8]>,
    ) -> [u8; TAG_LEN] {
        truncated(payload_mac(&self.key, frame_tag, pieces))
    }
}

/// Checks the frames the other side sends, in order.
#[derive(Clone)]
pub struct Opener {
    key: Keyed,
    seq: u64,
}

impl Opener {
    pub(crate) fn new(key: Keyed) -> Opener {
        Opener { key, seq: 0 }
    }

    /// Checks the next frame's `tag` over `parts`; the frame number
    /// advances only when it verifies.
    pub fn open(&mut self, parts: &[&[u8]], tag: &[u8]) -> Result<(), AuthError> {
        self.open_numbered(self.seq, parts, tag)
    }

    /// Checks frame number `seq`'s `tag` over `parts`: the number must be
    /// above every number accepted before (gaps are lost frames; a number
    /// seen before is a replay).
    pub fn open_numbered(
        &mut self,
        seq: u64,
        parts: &[&[u8]],
        tag: &[u8],
    ) -> Result<(), AuthError> {
        if seq < self.seq {
            return Err(AuthError::Replayed);
        }
        check(frame_mac(&self.key, seq, parts), tag)?;
        self.seq = seq + 1;
        Ok(())
    }

    /// Checks a payload's `tag` ([`Sealer::payload_tag`]).
    pub fn check_payload<'a>(
        &self,
        frame_tag: &[u8],
        pieces: impl IntoIterator<Item = &'a [u8]>,
        tag: &[u8],
    ) -> Result<(), AuthError> {
        check(payload_mac(&self.key, frame_tag, pieces), tag)
    }
}

/// A finished MAC, truncated to a tag.
fn truncated(m: HmacSha256) -> [u8; TAG_LEN] {
    let mut tag = [0u8; TAG_LEN];
    tag.copy_from_slice(&m.finalize().into_bytes()[..TAG_LEN]);
    tag
}

/// Whether `tag` is the tag of MAC `m`, compared in constant time.
fn check(m: HmacSha256, tag: &[u8]) -> Result<(), AuthError> {
    if tag.len() != TAG_LEN || m.verify_truncated_left(tag).is_err() {
        return Err(AuthError::BadTag);
    }
    Ok(())
}

fn payload_mac<'a>(
    key: &Keyed,
    frame_tag: &[u8],
    pieces: impl IntoIterator<Item = &'a [u8]>,
) -> HmacSha256 {
    // The pieces' boundaries are the frame's descriptors, which its own
    // tag covers: the bytes are fed as one stream.
    let mut m = key.start(b"kvferry/1 payload", &[frame_tag]);
    for p in pieces {
        m.update(p);
    }
    m
}

/// The MAC of frame `seq` made of `parts`, in progress.
fn frame_mac(key: &Keyed, seq: u64, parts: &[&[u8]]) -> HmacSha256 {
    let mut m = key.start(LABEL, &[&seq.to_le_bytes()]);
    for p in parts {
        feed(&mut m, p);
    }
    m
}
