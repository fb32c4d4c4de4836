//! HMAC-SHA-256 with domain separation: every tag names what it is for
//! (a label) and length-prefixes each part, so no two different messages,
//! of one kind or of two, feed the same bytes to the MAC.

use hmac::{Hmac, Mac as _};
use sha2::Sha256;

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// Bytes of a full HMAC-SHA-256 output.
pub(crate) const FULL: usize = 32;

/// A keyed MAC, ready to be cloned for each message (cloning skips the
/// key schedule, two of the four compressions of a short message).
#[derive(Clone)]
pub(crate) struct Keyed(HmacSha256);

impl Keyed {
    pub(crate) fn new(key: &[u8]) -> Keyed {
        Keyed(HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length"))
    }

    /// A MAC over `label` and `parts`, in progress.
    pub(crate) fn start(&self, label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
        let mut m = self.0.clone();
        feed(&mut m, label);
        for p in parts {
            feed(&mut m, p);
        }
        m
    }

    /// The full tag over `label` and `parts`.
    pub(crate) fn tag(&self, label: &[u8], parts: &[&[u8]]) -> [u8; FULL] {
        self.start(label, parts).finalize().into_bytes().into()
    }

    /// Whether `tag` (full or truncated to at least 16 bytes) is the tag
    /// over `label` and `parts`, compared in constant time.
    pub(crate) fn verify(&self, label: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
        tag.len() >= 16 && self.start(label, parts).verify_truncated_left(tag).is_ok()
    }
}

/// One part: its length, then its bytes.
pub(crate) fn feed(m: &mut HmacSha256, part: &[u8]) {
    m.update(&(part.len() as u64).to_le_bytes());
    m.update(part);
}
