#![warn(missing_docs)]
//! Authentication of everything a kvferry node serves: one cluster secret,
//! and what each surface builds from it.
//!
//! * [`ClusterKey`]: the secret (the raw bytes of a file, 32 or more), plus
//!   the previous one during a rotation. Never printed: its `Debug` shows
//!   only the keys' public ids.
//! * [`handshake`]: a challenge–response handshake for connections (tcp
//!   data plane, store server, side channel). Both sides prove the key
//!   over both sides' fresh nonces, and derive one key per direction.
//! * [`seal`]: what a connection does after its handshake: every frame
//!   carries a tag over its bytes and an implicit sequence number, so no
//!   frame can be forged, replayed, reordered or moved to another
//!   connection.
//! * [`request`]: one-shot HTTP requests (the bootstrap service): a tag over
//!   method, target, body, a timestamp and a nonce, checked against a
//!   clock-skew window and a bounded replay cache.
//! * [`limits`]: per-address budgets, so one address's flood cannot take
//!   what the others need.
//! * [`Rejects`]: what every surface counts when it refuses a peer or
//!   limits one.
//!
//! The primitives are HMAC-SHA-256 (RustCrypto `hmac` + `sha2`), constant
//! time comparisons (`subtle`, through `hmac`'s `verify`) and the OS's
//! random numbers (`getrandom`). Confidentiality is not a goal: bytes
//! travel in the clear, authenticated.
//!
//! Like `kvferry-machines`, this crate does no IO and reads no clock (the
//! key files excepted): callers pass the time in and move the bytes.

mod key;
mod mac;
mod rejects;

pub mod handshake;
pub mod limits;
pub mod request;
pub mod seal;

pub use key::{ClusterKey, KeyError, KeyId, KEY_FILE_ENV, MIN_KEY_BYTES, PREVIOUS_KEY_FILE_ENV};
pub use rejects::{Rejects, Surface};

/// Why a peer or a request was refused. Deliberately coarse: the peer is
/// told nothing more than "no" (a 401, a closed connection), and the
/// operator reads the counter and the debug log.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// A tag did not verify under any key (wrong key, tampered bytes, a
    /// replayed or reordered frame, a frame of another connection).
    #[error("authentication tag does not verify")]
    BadTag,
    /// The peer holds none of this side's keys.
    #[error("no key in common with the peer")]
    NoCommonKey,
    /// A handshake or header message that does not parse.
    #[error("malformed authentication message")]
    Malformed,
    /// A signed request outside the clock-skew window.
    #[error("request timestamp outside the accepted window")]
    Expired,
    /// A signed request seen before.
    #[error("request replayed")]
    Replayed,
    /// The replay cache is full of live entries: refused rather than
    /// forgotten, so a replay cannot slip through.
    #[error("replay cache full")]
    Busy,
    /// The peer presented no credentials where they are required.
    #[error("peer did not authenticate")]
    Missing,
    /// The OS's random number generator failed.
    #[error("no randomness from the operating system")]
    Random,
}

/// `n` fresh random bytes from the operating system.
pub fn random<const N: usize>() -> Result<[u8; N], AuthError> {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b).map_err(|_| AuthError::Random)?;
    Ok(b)
}
