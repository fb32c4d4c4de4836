//! Signed one-shot requests: what the bootstrap service's clients send.
//!
//! A request carries one header, [`HEADER`]:
//!
//! ```text
//! X-Kvferry-Auth: v1 <unix ms> <nonce: 32 hex> <tag: 64 hex>[ <tag: 64 hex>]
//! ```
//!
//! Each tag is an HMAC under one of the signer's keys (two during a
//! rotation, so a verifier that holds either accepts) over the method,
//! the request target (path and query), the time, the nonce and the body.
//! The verifier accepts a time within its window of its own clock and
//! remembers each accepted nonce until its time leaves the window, so a
//! captured request cannot be sent again. Only requests whose tag
//! verified enter that memory: strangers cannot fill it.

use std::collections::{HashSet, VecDeque};
use std::fmt::Write as _;

use crate::{random, AuthError, ClusterKey};

/// The header carrying a request's signature.
pub const HEADER: &str = "X-Kvferry-Auth";

const LABEL: &[u8] = b"kvferry/1 request";

/// The value of [`HEADER`] for a request signed now (`now_ms`, Unix
/// milliseconds) with a fresh nonce.
pub fn sign(
    key: &ClusterKey,
    now_ms: u64,
    method: &str,
    target: &str,
    body: &[u8],
) -> Result<String, AuthError> {
    Ok(sign_with_nonce(
        key,
        now_ms,
        random()?,
        method,
        target,
        body,
    ))
}

/// [`sign`] with a given nonce (tests).
pub fn sign_with_nonce(
    key: &ClusterKey,
    now_ms: u64,
    nonce: [u8; 16],
    method: &str,
    target: &str,
    body: &[u8],
) -> String {
    let mut v = format!("v1 {now_ms} {}", hex(&nonce));
    let time = now_ms.to_le_bytes();
    let parts = parts(method, target, &time, &nonce, body);
    for k in key.all() {
        let _ = write!(v, " {}", hex(&k.tag(LABEL, &parts)));
    }
    v
}

/// Checks signed requests: their tags, their times, their freshness.
#[derive(Debug)]
pub struct Verifier {
    window_ms: u64,
    capacity: usize,
    seen: HashSet<[u8; 16]>,
    /// `(expiry, nonce)` in acceptance order, to forget old nonces.
    expiries: VecDeque<(u64, [u8; 16])>,
}

impl Verifier {
    /// Accepts times within `window_ms` of the verifier's clock, and
    /// remembers at most `capacity` nonces (a request past it is refused
    /// with [`AuthError::Busy`], never let through unchecked).
    pub fn new(window_ms: u64, capacity: usize) -> Verifier {
        Verifier {
            window_ms,
            capacity,
            seen: HashSet::new(),
            expiries: VecDeque::new(),
        }
    }

    /// Nonces remembered now.
    pub fn remembered(&self) -> usize {
        self.seen.len()
    }

    /// Checks one request; `header` is [`HEADER`]'s value, if any.
    pub fn verify(
        &mut self,
        key: &ClusterKey,
        now_ms: u64,
        method: &str,
        target: &str,
        body: &[u8],
        header: Option<&str>,
    ) -> Result<(), AuthError> {
        let signed = Signed::parse(header.ok_or(AuthError::Missing)?)?;
        let time = signed.time_ms.to_le_bytes();
        let p = parts(method, target, &time, &signed.nonce, body);
        let ok = signed
            .tags
            .iter()
            .any(|tag| key.all().any(|k| k.verify(LABEL, &p, tag)));
        if !ok {
            return Err(AuthError::BadTag);
        }
        if signed.time_ms.abs_diff(now_ms) > self.window_ms {
            return Err(AuthError::Expired);
        }
        self.forget_before(now_ms);
        if self.seen.contains(&signed.nonce) {
            return Err(AuthError::Replayed);
        }
        if self.seen.len() >= self.capacity {
            return Err(AuthError::Busy);
        }
        self.seen.insert(signed.nonce);
        // Past `time + window` the time check refuses it anyway.
        let expiry = signed.time_ms.saturating_add(self.window_ms);
        let at = self.expiries.partition_point(|(e, _)| *e <= expiry);
        self.expiries.insert(at, (expiry, signed.nonce));
        Ok(())
    }

    fn forget_before(&mut self, now_ms: u64) {
        while let Some(&(expiry, nonce)) = self.expiries.front() {
            if expiry >= now_ms {
                break;
            }
            self.expiries.pop_front();
            self.seen.remove(&nonce);
        }
    }
}

struct Signed {
    time_ms: u64,
    nonce: [u8; 16],
    tags: Vec<[u8; 32]>,
}

impl Signed {
    fn parse(v: &str) -> Result<Signed, AuthError> {
        let mut it = v.split_ascii_whitespace();
        if it.next() != Some("v1") {
            return Err(AuthError::Malformed);
        }
        let time_ms = it
            .next()
            .and_then(|t| t.parse().ok())
            .ok_or(AuthError::Malformed)?;
        let nonce = it
            .next()
            .and_then(unhex::<16>)
            .ok_or(AuthError::Malformed)?;
        let tags: Vec<[u8; 32]> = it
            .map(unhex::<32>)
            .collect::<Option<_>>()
            .ok_or(AuthError::Malformed)?;
        if tags.is_empty() || tags.len() > 2 {
            return Err(AuthError::Malformed);
        }
        Ok(Signed {
            time_ms,
            nonce,
            tags,
        })
    }
}

fn parts<'a>(
    method: &'a str,
    target: &'a str,
    time: &'a [u8; 8],
    nonce: &'a [u8; 16],
    body: &'a [u8],
) -> [&'a [u8]; 5] {
    [method.as_bytes(), target.as_bytes(), time, nonce, body]
}

fn hex(b: &[u8]) -> String {
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u64 = 1_800_000_000_000;

    fn key(b: u8) -> ClusterKey {
        ClusterKey::from_bytes(&[b; 32], None).unwrap()
    }

    #[test]
    fn a_signed_request_verifies_once() {
        let k = key(1);
        let mut v = Verifier::new(30_000, 8);
        let h = sign(&k, T, "POST", "/register", b"{}").unwrap();
        assert_eq!(
            v.verify(&k, T + 10, "POST", "/register", b"{}", Some(&h)),
            Ok(())
        );
        assert_eq!(
            v.verify(&k, T + 20, "POST", "/register", b"{}", Some(&h)),
            Err(AuthError::Replayed)
        );
    }

    #[test]
    fn tampering_wrong_keys_and_stale_times_are_refused() {
        let k = key(1);
        let mut v = Verifier::new(30_000, 8);
        let h = sign(&k, T, "POST", "/register", b"{\"a\":1}").unwrap();
        let check = |v: &mut Verifier, key: &ClusterKey, now, m, t, b: &[u8], h: Option<&str>| {
            v.verify(key, now, m, t, b, h)
        };
        assert_eq!(
            check(&mut v, &k, T, "POST", "/register", b"{\"a\":2}", Some(&h)),
            Err(AuthError::BadTag)
        );
        assert_eq!(
            check(&mut v, &k, T, "GET", "/register", b"{\"a\":1}", Some(&h)),
            Err(AuthError::BadTag)
        );
        assert_eq!(
            check(&mut v, &k, T, "POST", "/query", b"{\"a\":1}", Some(&h)),
            Err(AuthError::BadTag)
        );
        assert_eq!(
            check(
                &mut v,
                &key(2),
                T,
                "POST",
                "/register",
                b"{\"a\":1}",
                Some(&h)
            ),
            Err(AuthError::BadTag)
        );
        assert_eq!(
            check(&mut v, &k, T, "POST", "/register", b"{}", None),
            Err(AuthError::Missing)
        );
        assert_eq!(
            check(&mut v, &k, T, "POST", "/register", b"{}", Some("v1 x")),
            Err(AuthError::Malformed)
        );
        assert_eq!(
            check(
                &mut v,
                &k,
                T + 30_001,
                "POST",
                "/register",
                b"{\"a\":1}",
                Some(&h)
            ),
            Err(AuthError::Expired)
        );
        // None of those was remembered; the request itself still verifies.
        assert_eq!(v.remembered(), 0);
        assert_eq!(
            check(
                &mut v,
                &k,
                T - 30_000,
                "POST",
                "/register",
                b"{\"a\":1}",
                Some(&h)
            ),
            Ok(())
        );
    }

    #[test]
    fn memory_is_bounded_and_forgets_expired_nonces() {
        let k = key(1);
        let mut v = Verifier::new(1_000, 2);
        let req = |t, n| sign_with_nonce(&k, t, [n; 16], "GET", "/query", b"");
        assert_eq!(
            v.verify(&k, T, "GET", "/query", b"", Some(&req(T, 1))),
            Ok(())
        );
        assert_eq!(
            v.verify(&k, T, "GET", "/query", b"", Some(&req(T, 2))),
            Ok(())
        );
        assert_eq!(
            v.verify(&k, T, "GET", "/query", b"", Some(&req(T, 3))),
            Err(AuthError::Busy)
        );
        // Once the first two expire there is room again.
        let later = T + 1_001;
        assert_eq!(
            v.verify(&k, later, "GET", "/query", b"", Some(&req(later, 3))),
            Ok(())
        );
        assert_eq!(v.remembered(), 1);
    }

    #[test]
    fn a_rotating_signer_is_accepted_by_either_side() {
        let (old, rotated, new) = (
            key(1),
            ClusterKey::from_bytes(&[2; 32], Some(&[1; 32])).unwrap(),
            key(2),
        );
        let mut v = Verifier::new(30_000, 8);
        let h = sign(&rotated, T, "GET", "/query", b"").unwrap();
        assert_eq!(v.verify(&old, T, "GET", "/query", b"", Some(&h)), Ok(()));
        let h = sign(&rotated, T, "GET", "/query", b"").unwrap();
        assert_eq!(v.verify(&new, T, "GET", "/query", b"", Some(&h)), Ok(()));
        let h = sign(&old, T, "GET", "/query", b"").unwrap();
        assert_eq!(
            v.verify(&new, T, "GET", "/query", b"", Some(&h)),
            Err(AuthError::BadTag)
        );
    }
}
