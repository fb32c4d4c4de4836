//! The challenge–response handshake that opens an authenticated
//! connection, sans-IO: the caller moves three fixed-size messages.
//!
//! ```text
//! initiator → target  HELLO      version, the initiator's key ids, nonce_i
//! target → initiator  CHALLENGE  version, the key chosen, nonce_t, proof_t
//! initiator → target  PROOF      proof_i
//! ```
//!
//! Each proof is a MAC, under the key both hold, over the connection's
//! context (which surface: `tcp`, `store`, …) and the transcript (HELLO
//! and CHALLENGE without its proof); the two proofs and the two frame keys
//! use distinct labels, so nothing one role sends serves as the other's.
//! Both nonces are fresh, so a recorded handshake proves nothing to
//! either side again, and the frame keys ([`crate::seal`]) are new for
//! each connection. During a rotation the HELLO lists both of the
//! initiator's keys and the target picks the first of its own the
//! initiator holds.

use crate::key::KeyId;
use crate::mac::Keyed;
use crate::seal::{Opener, Sealer};
use crate::{random, AuthError, ClusterKey};

/// Bytes of a HELLO.
pub const HELLO_LEN: usize = 56;
/// Bytes of a CHALLENGE.
pub const CHALLENGE_LEN: usize = 80;
/// Bytes of a PROOF.
pub const PROOF_LEN: usize = 32;

const VERSION: u8 = 1;
/// The part of a CHALLENGE that the proofs cover.
const CHALLENGE_HEAD: usize = 48;

/// What an authenticated connection seals and opens frames with.
pub struct Session {
    /// Seals the frames this side sends.
    pub seal: Sealer,
    /// Opens the frames the other side sends.
    pub open: Opener,
    /// The key the handshake settled on.
    pub key_id: KeyId,
}

/// The initiator's side, between its HELLO and the target's CHALLENGE.
pub struct Initiator {
    key: ClusterKey,
    context: &'static str,
    hello: [u8; HELLO_LEN],
}

impl Initiator {
    /// Starts a handshake for a connection of kind `context` with a fresh
    /// nonce.
    pub fn new(key: &ClusterKey, context: &'static str) -> Result<Initiator, AuthError> {
        Ok(Self::with_nonce(key, context, random()?))
    }

    /// Starts a handshake with `nonce` (tests and fuzzing; connections use
    /// [`Initiator::new`]).
    pub fn with_nonce(key: &ClusterKey, context: &'static str, nonce: [u8; 32]) -> Initiator {
        let mut hello = [0u8; HELLO_LEN];
        hello[0] = VERSION;
        let ids: Vec<KeyId> = key.ids().take(2).collect();
        hello[1] = ids.len() as u8;
        for (i, id) in ids.iter().enumerate() {
            hello[8 + 8 * i..16 + 8 * i].copy_from_slice(&id.0);
        }
        hello[24..56].copy_from_slice(&nonce);
        Initiator {
            key: key.clone(),
            context,
            hello,
        }
    }

    /// The HELLO to send.
    pub fn hello(&self) -> &[u8; HELLO_LEN] {
        &self.hello
    }

    /// Checks the target's CHALLENGE; returns the PROOF to send and the
    /// connection's session. A CHALLENGE that fails leaves the handshake
    /// as it was (a stale or forged one may come before the real one).
    pub fn handle_challenge(
        &self,
        challenge: &[u8],
    ) -> Result<([u8; PROOF_LEN], Session), AuthError> {
        if challenge.len() != CHALLENGE_LEN || challenge[0] != VERSION || challenge[1..8] != [0; 7]
        {
            return Err(AuthError::Malformed);
        }
        // The HELLO offered every key this side holds (two at most).
        let id = KeyId(challenge[8..16].try_into().expect("8 bytes"));
        let key = self.key.by_id(id).ok_or(AuthError::NoCommonKey)?;
        let t = Transcript::new(self.context, &self.hello, &challenge[..CHALLENGE_HEAD]);
        if !key.verify(
            b"kvferry/1 target proof",
            &t.parts(),
            &challenge[CHALLENGE_HEAD..],
        ) {
            return Err(AuthError::BadTag);
        }
        let proof = key.tag(b"kvferry/1 initiator proof", &t.parts());
        let (i2t, t2i) = t.keys(key);
        let session = Session {
            seal: Sealer::new(i2t),
            open: Opener::new(t2i),
            key_id: id,
        };
        Ok((proof, session))
    }
}

/// The target's side, between its CHALLENGE and the initiator's PROOF.
pub struct Responder {
    key: Keyed,
    key_id: KeyId,
    context: &'static str,
    hello: [u8; HELLO_LEN],
    challenge: [u8; CHALLENGE_LEN],
}

impl Responder {
    /// Answers a HELLO with a fresh nonce.
    pub fn new(
        key: &ClusterKey,
        context: &'static str,
        hello: &[u8],
    ) -> Result<Responder, AuthError> {
        Self::with_nonce(key, context, hello, random()?)
    }

    /// Answers a HELLO with `nonce` (tests and fuzzing).
    pub fn with_nonce(
        key: &ClusterKey,
        context: &'static str,
        hello: &[u8],
        nonce: [u8; 32],
    ) -> Result<Responder, AuthError> {
        let hello: [u8; HELLO_LEN] = hello.try_into().map_err(|_| AuthError::Malformed)?;
        if hello[0] != VERSION || !(1..=2).contains(&hello[1]) || hello[2..8] != [0; 6] {
            return Err(AuthError::Malformed);
        }
        let theirs: Vec<KeyId> = hello_ids(&hello).collect();
        let key_id = key
            .ids()
            .find(|id| theirs.contains(id))
            .ok_or(AuthError::NoCommonKey)?;
        let keyed = key.by_id(key_id).expect("an id of this key").clone();
        let mut challenge = [0u8; CHALLENGE_LEN];
        challenge[0] = VERSION;
        challenge[8..16].copy_from_slice(&key_id.0);
        challenge[16..48].copy_from_slice(&nonce);
        let t = Transcript::new(context, &hello, &challenge[..CHALLENGE_HEAD]);
        let proof = keyed.tag(b"kvferry/1 target proof", &t.parts());
        challenge[CHALLENGE_HEAD..].copy_from_slice(&proof);
        Ok(Responder {
            key: keyed,
            key_id,
            context,
            hello,
            challenge,
        })
    }

    /// The CHALLENGE to send.
    pub fn challenge(&self) -> &[u8; CHALLENGE_LEN] {
        &self.challenge
    }

    /// Checks the initiator's PROOF; returns the connection's session.
    pub fn handle_proof(self, proof: &[u8]) -> Result<Session, AuthError> {
        let t = Transcript::new(self.context, &self.hello, &self.challenge[..CHALLENGE_HEAD]);
        if proof.len() != PROOF_LEN
            || !self
                .key
                .verify(b"kvferry/1 initiator proof", &t.parts(), proof)
        {
            return Err(AuthError::BadTag);
        }
        let (i2t, t2i) = t.keys(&self.key);
        Ok(Session {
            seal: Sealer::new(t2i),
            open: Opener::new(i2t),
            key_id: self.key_id,
        })
    }
}

/// The key ids a HELLO lists.
fn hello_ids(hello: &[u8; HELLO_LEN]) -> impl Iterator<Item = KeyId> + '_ {
    let n = usize::from(hello[1]).min(2);
    (0..n).map(move |i| KeyId(hello[8 + 8 * i..16 + 8 * i].try_into().expect("8 bytes")))
}

/// What the proofs and frame keys cover.
struct Transcript<'a> {
    context: &'static str,
    hello: &'a [u8],
    challenge_head: &'a [u8],
}

impl<'a> Transcript<'a> {
    fn new(context: &'static str, hello: &'a [u8], challenge_head: &'a [u8]) -> Transcript<'a> {
        Transcript {
            context,
            hello,
            challenge_head,
        }
    }

    fn parts(&self) -> [&[u8]; 3] {
        [self.context.as_bytes(), self.hello, self.challenge_head]
    }

    /// The frame keys: initiator to target, target to initiator.
    fn keys(&self, key: &Keyed) -> (Keyed, Keyed) {
        let i2t = key.tag(b"kvferry/1 initiator to target", &self.parts());
        let t2i = key.tag(b"kvferry/1 target to initiator", &self.parts());
        (Keyed::new(&i2t), Keyed::new(&t2i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> ClusterKey {
        ClusterKey::from_bytes(&[b; 32], None).unwrap()
    }

    fn handshake(i: &ClusterKey, t: &ClusterKey) -> Result<(Session, Session), AuthError> {
        let init = Initiator::new(i, "tcp")?;
        let resp = Responder::new(t, "tcp", init.hello())?;
        let (proof, si) = init.handle_challenge(resp.challenge())?;
        let st = resp.handle_proof(&proof)?;
        Ok((si, st))
    }

    #[test]
    fn same_key_agrees_and_frames_open_in_order_only() {
        let (mut i, mut t) = handshake(&key(1), &key(1)).unwrap();
        let a = i.seal.seal(&[b"header a", b"table"]);
        let b = i.seal.seal(&[b"header b"]);
        // Out of order: b first fails, and the opener stays at a.
        assert_eq!(t.open.open(&[b"header b"], &b), Err(AuthError::BadTag));
        t.open.open(&[b"header a", b"table"], &a).unwrap();
        // Replayed a fails; b opens.
        assert_eq!(
            t.open.open(&[b"header a", b"table"], &a),
            Err(AuthError::BadTag)
        );
        t.open.open(&[b"header b"], &b).unwrap();
        // Parts split differently are another message.
        let c = t.seal.seal(&[b"ab", b"c"]);
        assert_eq!(i.open.open(&[b"a", b"bc"], &c), Err(AuthError::BadTag));
    }

    #[test]
    fn numbered_frames_may_skip_but_never_go_back() {
        let (mut i, mut t) = handshake(&key(1), &key(1)).unwrap();
        let (n0, t0) = i.seal.seal_numbered(&[b"zero"]);
        let (_, _lost) = i.seal.seal_numbered(&[b"one"]);
        let (n2, t2) = i.seal.seal_numbered(&[b"two"]);
        assert_eq!(t.open.open_numbered(n0, &[b"zero"], &t0), Ok(()));
        assert_eq!(
            t.open.open_numbered(n2, &[b"two"], &t2),
            Ok(()),
            "a lost frame is skipped"
        );
        assert_eq!(
            t.open.open_numbered(n0, &[b"zero"], &t0),
            Err(AuthError::Replayed)
        );
        assert_eq!(
            t.open.open_numbered(n2 + 1, &[b"two"], &t2),
            Err(AuthError::BadTag),
            "a changed number"
        );
    }

    #[test]
    fn payload_tags_bind_the_bytes_to_their_frame() {
        let (mut i, t) = handshake(&key(1), &key(1)).unwrap();
        let f1 = i.seal.seal(&[b"header 1"]);
        let f2 = i.seal.seal(&[b"header 2"]);
        let pieces: [&[u8]; 2] = [b"kv bytes ", b"of two blocks"];
        let tag = i.seal.payload_tag(&f1, pieces);
        assert_eq!(t.open.check_payload(&f1, pieces, &tag), Ok(()));
        assert_eq!(
            t.open.check_payload(&f2, pieces, &tag),
            Err(AuthError::BadTag),
            "another frame"
        );
        let changed: [&[u8]; 2] = [b"kv bytes ", b"of two blockz"];
        assert_eq!(
            t.open.check_payload(&f1, changed, &tag),
            Err(AuthError::BadTag)
        );
        let regrouped: [&[u8]; 2] = [b"kv bytes of", b" two blocks"];
        assert_eq!(
            t.open.check_payload(&f1, regrouped, &tag),
            Ok(()),
            "one stream"
        );
    }

    #[test]
    fn wrong_key_fails_both_ways() {
        // A target with another key that claims the initiator's key id:
        // its proof does not verify.
        let (k1, k2) = (key(1), key(2));
        let init = Initiator::with_nonce(&k1, "tcp", [5; 32]);
        let twin = Initiator::with_nonce(&k2, "tcp", [5; 32]);
        let mut forged = *Responder::new(&k2, "tcp", twin.hello())
            .unwrap()
            .challenge();
        forged[8..16].copy_from_slice(&k1.ids().next().unwrap().0);
        assert_eq!(
            init.handle_challenge(&forged).err(),
            Some(AuthError::BadTag)
        );
        // An initiator with another key cannot prove it: its proof under
        // its own key fails at the target.
        let resp =
            Responder::with_nonce(&k1, "tcp", init_hello_claiming(&k2, &k1), [6; 32]).unwrap();
        let guess = k2.current().tag(b"kvferry/1 initiator proof", &[b"tcp"]);
        assert_eq!(resp.handle_proof(&guess).err(), Some(AuthError::BadTag));
        // No common key at all is refused before any proof.
        let init = Initiator::new(&k1, "tcp").unwrap();
        assert_eq!(
            Responder::new(&key(3), "tcp", init.hello()).err(),
            Some(AuthError::NoCommonKey)
        );
    }

    /// A HELLO of an initiator holding `holds` that lists `claims`' id.
    fn init_hello_claiming(holds: &ClusterKey, claims: &ClusterKey) -> &'static [u8] {
        let mut h = *Initiator::with_nonce(holds, "tcp", [7; 32]).hello();
        h[8..16].copy_from_slice(&claims.ids().next().unwrap().0);
        Box::leak(Box::new(h))
    }

    #[test]
    fn proofs_are_bound_to_context_and_nonces() {
        let k = key(1);
        let init = Initiator::with_nonce(&k, "tcp", [9; 32]);
        let resp = Responder::with_nonce(&k, "store", init.hello(), [8; 32]).unwrap();
        assert_eq!(
            init.handle_challenge(resp.challenge()).err(),
            Some(AuthError::BadTag)
        );
        // A proof recorded from one connection does not open another.
        let init = Initiator::with_nonce(&k, "tcp", [9; 32]);
        let r1 = Responder::with_nonce(&k, "tcp", init.hello(), [1; 32]).unwrap();
        let (proof, _) = init.handle_challenge(r1.challenge()).unwrap();
        let init2 = Initiator::with_nonce(&k, "tcp", [9; 32]);
        let r2 = Responder::with_nonce(&k, "tcp", init2.hello(), [2; 32]).unwrap();
        assert_eq!(r2.handle_proof(&proof).err(), Some(AuthError::BadTag));
    }

    #[test]
    fn rotation_settles_on_a_shared_key() {
        let old = key(1);
        let rotated = ClusterKey::from_bytes(&[2; 32], Some(&[1; 32])).unwrap();
        let new_only = key(2);
        let (si, st) = handshake(&old, &rotated).unwrap();
        assert_eq!(si.key_id, old.ids().next().unwrap());
        assert_eq!(st.key_id, si.key_id);
        let (si, _) = handshake(&rotated, &old).unwrap();
        assert_eq!(si.key_id, old.ids().next().unwrap());
        let (si, _) = handshake(&rotated, &new_only).unwrap();
        assert_eq!(si.key_id, new_only.ids().next().unwrap());
        assert_eq!(
            handshake(&old, &new_only).err(),
            Some(AuthError::NoCommonKey)
        );
    }
}
