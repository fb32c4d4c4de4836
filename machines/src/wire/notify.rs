//! Frames packed for the data plane: a notification of the tcp transport
//! carries side-channel frames behind a write, so a transfer's last word can
//! ride with its bytes.
//!
//! ```text
//! u16 LE endpoint length, endpoint (UTF-8), { u32 LE frame length, frame }*
//! ```
//!
//! The endpoint is the sender's data-plane endpoint, which the receiver
//! knows from the sender's hello and maps to the sender's side-channel slot.

use super::{Limits, WireError};

/// Most frames one notification carries.
pub const MAX_NOTIFY_FRAMES: usize = 4096;

/// Packs `frames` (each an encoded [`super::Frame`]) behind the sender's
/// endpoint.
pub fn encode_notify<'a>(
    sender_endpoint: &str,
    frames: impl IntoIterator<Item = &'a [u8]>,
) -> Vec<u8> {
    let e = sender_endpoint.as_bytes();
    let e = &e[..e.len().min(u16::MAX as usize)];
    let mut out = Vec::with_capacity(2 + e.len() + 64);
    out.extend_from_slice(&(e.len() as u16).to_le_bytes());
    out.extend_from_slice(e);
    for f in frames {
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        out.extend_from_slice(f);
    }
    out
}

/// Bytes [`encode_notify`] spends on the sender's endpoint.
pub fn notify_endpoint_len(sender_endpoint: &str) -> u64 {
    2 + sender_endpoint.len().min(u16::MAX as usize) as u64
}

/// Bytes [`encode_notify`] spends on one frame.
pub fn notify_frame_len(frame: &[u8]) -> u64 {
    4 + frame.len() as u64
}

/// Unpacks [`encode_notify`]: the sender's endpoint and the frames, each
/// still to be decoded with [`super::decode`]. Never panics, whatever the
/// bytes.
pub fn decode_notify<'a>(
    bytes: &'a [u8],
    limits: &Limits,
) -> Result<(&'a str, Vec<&'a [u8]>), WireError> {
    let bad = |why| WireError::Invalid {
        field: "notification",
        why,
    };
    let (len, rest) = bytes
        .split_first_chunk::<2>()
        .ok_or(bad("truncated endpoint length"))?;
    let len = u16::from_le_bytes(*len) as usize;
    if len > limits.max_string_bytes {
        return Err(bad("endpoint too long"));
    }
    let (endpoint, mut rest) = rest
        .split_at_checked(len)
        .ok_or(bad("truncated endpoint"))?;
    let endpoint = std::str::from_utf8(endpoint).map_err(|_| bad("endpoint is not UTF-8"))?;
    let mut frames = Vec::new();
    while !rest.is_empty() {
        if frames.len() == MAX_NOTIFY_FRAMES {
            return Err(bad("too many frames"));
        }
        let (n, tail) = rest
            .split_first_chunk::<4>()
            .ok_or(bad("truncated frame length"))?;
        let n = u32::from_le_bytes(*n) as usize;
        if n > limits.max_frame_bytes {
            return Err(bad("frame too long"));
        }
        let (frame, tail) = tail.split_at_checked(n).ok_or(bad("truncated frame"))?;
        frames.push(frame);
        rest = tail;
    }
    Ok((endpoint, frames))
}
