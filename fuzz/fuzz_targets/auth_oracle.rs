//! Properties of kvferry's authentication on bytes a peer controls (the
//! `auth_messages` target, and the seed replay in `tests/it/fuzz_seeds.rs`).
//!
//! The first byte picks the message; the rest is it. Whatever the bytes,
//! nothing panics, and whatever is accepted is exactly what the key's
//! holder would have sent:
//!
//! * 0, a HELLO at a target: a CHALLENGE comes back only for a well-formed
//!   HELLO naming the target's key; a PROOF made of the same bytes fails.
//! * 1, a CHALLENGE at an initiator (fixed nonce): accepted only if it is
//!   the target's own CHALLENGE for the nonce it carries.
//! * 2, a signed bootstrap request's header over a fixed body: accepted
//!   once at most (the same request again is a replay).
//! * 3, a sealed tcp header and its table on a fresh connection: accepted
//!   only with the tag the connection's sealer makes for frame 0.

use kvferry::auth::handshake::{Initiator, Responder, Session};
use kvferry::auth::request::Verifier;
use kvferry::auth::{AuthError, ClusterKey};
use kvferry::transport::internal::wire;

/// The time the signed requests are checked at.
const NOW_MS: u64 = 1_800_000_000_000;

fn key() -> ClusterKey {
    ClusterKey::from_bytes(&[0x42; 32], None).expect("a 32-byte key")
}

/// A fixed handshake's sessions (initiator, target).
fn sessions() -> (Session, Session) {
    let k = key();
    let init = Initiator::with_nonce(&k, "fuzz", [1; 32]);
    let resp = Responder::with_nonce(&k, "fuzz", init.hello(), [2; 32]).expect("same key");
    let (proof, i) = init.handle_challenge(resp.challenge()).expect("genuine");
    (i, resp.handle_proof(&proof).expect("genuine"))
}

/// Checks the properties; true when the message was accepted.
pub(super) fn check_auth(data: &[u8]) -> bool {
    let Some((&which, msg)) = data.split_first() else {
        return false;
    };
    let k = key();
    match which % 4 {
        0 => match Responder::with_nonce(&k, "fuzz", msg, [3; 32]) {
            Ok(resp) => {
                assert_eq!(msg.len(), kvferry::auth::handshake::HELLO_LEN);
                assert!(
                    resp.handle_proof(&msg[..32]).is_err(),
                    "a HELLO proved the key"
                );
                true
            }
            Err(e) => {
                assert!(
                    matches!(e, AuthError::Malformed | AuthError::NoCommonKey),
                    "{e:?}"
                );
                false
            }
        },
        1 => {
            let init = Initiator::with_nonce(&k, "fuzz", [4; 32]);
            let hello = *init.hello();
            if init.handle_challenge(msg).is_err() {
                return false;
            }
            let nonce: [u8; 32] = msg[16..48].try_into().expect("a challenge is 80 bytes");
            let genuine = Responder::with_nonce(&k, "fuzz", &hello, nonce).expect("our HELLO");
            assert_eq!(
                genuine.challenge().as_slice(),
                msg,
                "a forged challenge was accepted"
            );
            true
        }
        2 => {
            let Ok(header) = std::str::from_utf8(msg) else {
                return false;
            };
            let mut v = Verifier::new(30_000, 16);
            let ok = v
                .verify(&k, NOW_MS, "POST", "/register", b"{}", Some(header))
                .is_ok();
            if ok {
                let again = v.verify(&k, NOW_MS, "POST", "/register", b"{}", Some(header));
                assert_eq!(again, Err(AuthError::Replayed), "a request accepted twice");
            }
            ok
        }
        _ => {
            let (mut i, mut t) = sessions();
            if msg.len() < wire::SEALED_HEADER_LEN || wire::Header::decode_sealed(msg).is_err() {
                return false;
            }
            let (head, table) = msg.split_at(wire::SEALED_HEADER_LEN);
            if wire::open_sealed(&mut t.open, head, table).is_err() {
                return false;
            }
            let h = wire::Header::decode_sealed(head).expect("decoded above");
            let genuine = h.encode_sealed(&mut i.seal, table);
            assert_eq!(genuine.as_slice(), head, "a forged tag was accepted");
            true
        }
    }
}

/// Valid messages of each kind, for the seeds (`gen_corpus`).
#[allow(dead_code)]
pub(super) fn genuine_messages() -> Vec<(&'static str, Vec<u8>)> {
    let k = key();
    let init = Initiator::with_nonce(&k, "fuzz", [4; 32]);
    let challenge = Responder::with_nonce(&k, "fuzz", init.hello(), [5; 32]).expect("same key");
    let signed =
        kvferry::auth::request::sign_with_nonce(&k, NOW_MS, [6; 16], "POST", "/register", b"{}");
    let (mut i, _) = sessions();
    let h = wire::Header {
        opcode: wire::OP_WRITE,
        count: 1,
        req_id: 1,
        payload_len: 64,
        ..wire::Header::default()
    };
    let mut table = Vec::new();
    wire::encode_entry(&mut table, 0x1000, 64);
    let sealed = [&h.encode_sealed(&mut i.seal, &table)[..], &table].concat();
    vec![
        (
            "hello",
            [
                &[0u8][..],
                Initiator::with_nonce(&k, "fuzz", [7; 32]).hello(),
            ]
            .concat(),
        ),
        ("challenge", [&[1u8][..], challenge.challenge()].concat()),
        ("signed_request", [&[2u8][..], signed.as_bytes()].concat()),
        ("sealed_header", [&[3u8][..], &sealed].concat()),
    ]
}
