//! Authenticated tcp connections: the AUTH exchange that opens them and
//! the sealed headers that follow (`wire`'s "Authenticated connections").
//!
//! Both sides run the handshake before any other frame; a target bounds
//! it by `connect_timeout`, so a peer that connects and says nothing holds
//! a connection slot no longer than that.

use kvferry_auth::handshake::{Initiator, Responder, CHALLENGE_LEN, HELLO_LEN, PROOF_LEN};
use kvferry_auth::seal::{Opener, Sealer, TAG_LEN};
use kvferry_auth::{AuthError, ClusterKey, Surface};

use super::config::TcpConfig;
use super::fail::{conv, protocol};
use super::inbuf::InBuf;
use crate::fdio::{self, iov, Conn};
use crate::wire::{self, Header, RejectReason};
use crate::{PeerError, PollPolicy, TransportError};

/// What the handshake's proofs and keys are bound to: a tcp data-plane
/// connection, not a store's or a side channel's.
const CONTEXT: &str = "kvferry tcp data plane";

/// A header as it goes on a connection, either way: sealed when the
/// connection is authenticated. One read is kept until its frame's body
/// is read and the tag checked.
pub(super) struct Head {
    bytes: [u8; wire::SEALED_HEADER_LEN],
    len: usize,
}

impl Head {
    /// `h`, sealed with `body` when `seal` is set.
    pub(super) fn new(seal: &mut Option<Sealer>, h: &Header, body: &[u8]) -> Head {
        let mut bytes = [0u8; wire::SEALED_HEADER_LEN];
        let len = match seal {
            Some(s) => {
                bytes = h.encode_sealed(s, body);
                wire::SEALED_HEADER_LEN
            }
            None => {
                bytes[..wire::HEADER_LEN].copy_from_slice(&h.encode());
                wire::HEADER_LEN
            }
        };
        Head { bytes, len }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// The header's tag (empty when not sealed).
    pub(super) fn tag(&self) -> &[u8] {
        &self.bytes[wire::HEADER_LEN.min(self.len)..self.len]
    }

    /// An empty buffer for the next header on a connection opened by
    /// `open` (sealed or not).
    pub(super) fn empty(open: &Option<Opener>) -> Head {
        let len = match open {
            Some(_) => wire::SEALED_HEADER_LEN,
            None => wire::HEADER_LEN,
        };
        Head {
            bytes: [0; wire::SEALED_HEADER_LEN],
            len,
        }
    }

    pub(super) fn buf(&mut self) -> &mut [u8] {
        &mut self.bytes[..self.len]
    }

    /// The header's fields (its tag unchecked yet).
    pub(super) fn decode(&self) -> Result<Header, RejectReason> {
        if self.len == wire::SEALED_HEADER_LEN {
            Header::decode_sealed(&self.bytes)
        } else {
            let fixed: &[u8; wire::HEADER_LEN] =
                self.bytes[..wire::HEADER_LEN].try_into().expect("32 bytes");
            Header::decode(fixed)
        }
    }

    /// Checks the header's tag over it and `body` (nothing to check on a
    /// connection that is not authenticated).
    pub(super) fn check(&self, open: &mut Option<Opener>, body: &[u8]) -> Result<(), AuthError> {
        match open {
            Some(o) => wire::open_sealed(o, self.bytes(), body),
            None => Ok(()),
        }
    }
}

/// The tag of a payload in registered memory `ranges`, made by `seal`
/// for the frame whose own tag is `frame_tag`.
pub(super) fn payload_tag(
    seal: &Option<Sealer>,
    frame_tag: &[u8],
    ranges: impl Iterator<Item = (u64, u64)>,
) -> [u8; TAG_LEN] {
    let Some(seal) = seal else {
        return [0; TAG_LEN];
    };
    seal.payload_tag(frame_tag, memory(ranges))
}

/// The bytes of `ranges`.
fn memory<'a>(ranges: impl Iterator<Item = (u64, u64)>) -> impl Iterator<Item = &'a [u8]> {
    // SAFETY: every range is registered memory the caller holds pinned (or
    // its own staging buffer) for the frame's send or receive, which no
    // one writes while the tag is made or checked.
    ranges.map(|(a, l)| unsafe { std::slice::from_raw_parts(a as *const u8, l as usize) })
}

/// Checks the tag of a payload that landed in `ranges` ([`payload_tag`]).
pub(super) fn check_payload(
    open: &Option<Opener>,
    frame_tag: &[u8],
    ranges: impl Iterator<Item = (u64, u64)>,
    tag: &[u8],
) -> Result<(), AuthError> {
    let Some(open) = open else {
        return Err(AuthError::Missing);
    };
    open.check_payload(frame_tag, memory(ranges), tag)
}

/// The initiator's side of the handshake on a new connection; on success
/// the connection seals and opens every later header.
pub(super) async fn initiate(
    conn: &mut Conn,
    key: &ClusterKey,
    config: &TcpConfig,
) -> Result<(), TransportError> {
    let (rejects, poll) = (&config.rejects, config.poll);
    let refused = |why: &'static str| {
        rejects.count(Surface::DataPlane);
        TransportError::from(PeerError::Unauthenticated(why))
    };
    let init = Initiator::new(key, CONTEXT).map_err(|_| protocol("no randomness for a nonce"))?;
    // `count` 1: this side asks for payload tags.
    let h = Header {
        count: u32::from(config.payload_mac),
        ..auth_header(0, HELLO_LEN)
    };
    send(conn, &h, init.hello()).await?;
    let mut ab = [0u8; wire::HEADER_LEN];
    let mut v = [iov(ab.as_mut_ptr() as u64, ab.len() as u64)];
    fdio::recv_exact(&mut conn.rd, conn.fd, &mut v, poll, None)
        .await
        .map_err(conv("awaiting an AUTH answer"))?;
    let a = Header::decode(&ab).map_err(|_| protocol("bad AUTH answer header"))?;
    if a.opcode != wire::OP_AUTH || a.status != wire::STATUS_OK {
        return Err(refused(
            "the peer does not authenticate (it has no cluster key)",
        ));
    }
    if a.payload_len != CHALLENGE_LEN as u64 || a.count > 1 {
        return Err(protocol("AUTH answer of a bad size"));
    }
    let mut challenge = [0u8; CHALLENGE_LEN];
    let mut v = [iov(challenge.as_mut_ptr() as u64, challenge.len() as u64)];
    fdio::recv_exact(&mut conn.rd, conn.fd, &mut v, poll, None)
        .await
        .map_err(conv("reading a challenge"))?;
    let (proof, session) = init
        .handle_challenge(&challenge)
        .map_err(|_| refused("the peer did not prove the cluster key"))?;
    send(conn, &auth_header(1, PROOF_LEN), &proof).await?;
    conn.seal = Some(session.seal);
    conn.open = Some(session.open);
    conn.payload_mac = a.count == 1;
    Ok(())
}

/// The target's side: the connection's first frames must be the AUTH
/// exchange. Anything else, or a proof that fails, is refused and counted.
pub(super) async fn respond(
    conn: &mut Conn,
    inbuf: &mut InBuf,
    key: &ClusterKey,
    config: &TcpConfig,
    poll: PollPolicy,
) -> Result<(), TransportError> {
    let rejects = &config.rejects;
    let refuse = |why: &'static str| {
        rejects.count(Surface::DataPlane);
        protocol(why)
    };
    let mut hello = [0u8; HELLO_LEN];
    let h = match read_auth(conn, inbuf, poll, 0, &mut hello).await? {
        Ok(h) => h,
        Err(opcode) => {
            // Answered in the frame's own terms, so an initiator without
            // a key learns why at its first request.
            let _ = send(conn, &reject_header(opcode), &[]).await;
            return Err(refuse("a peer sent a frame before authenticating"));
        }
    };
    let resp = match Responder::new(key, CONTEXT, &hello) {
        Ok(r) => r,
        Err(AuthError::Random) => return Err(protocol("no randomness for a nonce")),
        Err(_) => {
            let _ = send(conn, &reject_header(h.opcode), &[]).await;
            return Err(refuse("a peer holds none of the cluster keys"));
        }
    };
    // Payload tags when either side asks for them.
    let payload_mac = h.count == 1 || config.payload_mac;
    let answer = Header {
        opcode: wire::OP_AUTH,
        count: u32::from(payload_mac),
        payload_len: CHALLENGE_LEN as u64,
        ..Header::default()
    };
    send(conn, &answer, resp.challenge()).await?;
    let mut proof = [0u8; PROOF_LEN];
    if read_auth(conn, inbuf, poll, 1, &mut proof).await?.is_err() {
        return Err(refuse("a peer did not send its proof"));
    }
    let session = resp
        .handle_proof(&proof)
        .map_err(|_| refuse("a peer's proof of the cluster key failed"))?;
    conn.seal = Some(session.seal);
    conn.open = Some(session.open);
    conn.payload_mac = payload_mac;
    Ok(())
}

/// Reads an AUTH request of step `step` and its body into `body`;
/// `Err(opcode)` when the frame is anything else (its body is not read:
/// the connection closes).
async fn read_auth(
    conn: &mut Conn,
    inbuf: &mut InBuf,
    poll: PollPolicy,
    step: u32,
    body: &mut [u8],
) -> Result<Result<Header, u8>, TransportError> {
    let mut hb = [0u8; wire::HEADER_LEN];
    inbuf
        .read_exact(conn, &mut hb, poll)
        .await
        .map_err(conv("reading an AUTH request"))?;
    let Ok(h) = Header::decode(&hb) else {
        return Ok(Err(hb[4]));
    };
    let fits = h.opcode == wire::OP_AUTH
        && h.status == wire::STATUS_OK
        && h.count <= u32::from(step == 0)
        && h.detail == step
        && h.payload_len == body.len() as u64;
    if !fits {
        return Ok(Err(h.opcode));
    }
    inbuf
        .read_exact(conn, body, poll)
        .await
        .map_err(conv("reading an AUTH request"))?;
    Ok(Ok(h))
}

fn auth_header(step: u32, len: usize) -> Header {
    Header {
        opcode: wire::OP_AUTH,
        detail: step,
        payload_len: len as u64,
        ..Header::default()
    }
}

fn reject_header(opcode: u8) -> Header {
    Header {
        opcode,
        status: RejectReason::Unauthenticated.to_status(),
        ..Header::default()
    }
}

/// Sends an unsealed header and its body.
async fn send(conn: &mut Conn, h: &Header, body: &[u8]) -> Result<(), TransportError> {
    let hb = h.encode();
    let mut v = [
        iov(hb.as_ptr() as u64, hb.len() as u64),
        iov(body.as_ptr() as u64, body.len() as u64),
    ];
    fdio::send_all(&mut conn.wr, conn.fd, &mut v, None)
        .await
        .map_err(conv("sending an AUTH frame"))
}
