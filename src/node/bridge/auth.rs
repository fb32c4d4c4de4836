//! The side channel with a cluster key: each ZeroMQ connection opens with
//! the handshake of [`kvferry_auth::handshake`] and every frame after it,
//! both ways, carries its number and a tag under that connection's keys
//! (`frame ‖ number u64 ‖ tag`); numbers only go up, so a frame cannot be
//! forged, replayed or moved from another connection.
//!
//! ZeroMQ reconnects on its own and a ROUTER names each connection anew,
//! so keys belong to one connection: a decode rank's DEALER starts a new
//! handshake whenever its monitor reports the connection dropped, and
//! frames it sends meanwhile wait in the slot (bounded) until the new
//! keys seal them. Frames already inside ZeroMQ when the connection
//! dropped arrive under the old keys and are refused; the machines resend
//! what matters.
//!
//! Handshake messages are `KVFA`, a step byte (1 HELLO, 2 CHALLENGE, 3
//! PROOF) and the message; machine frames start with `KF`, so the two
//! never mix. On prefill's ROUTER, handshakes under way and authenticated
//! connections that have not said hello yet are kept in bounded tables
//! of their own (`max_peers` each, oldest first out), apart from the
//! peer slots: strangers cannot push registered peers out.

use std::collections::{HashMap, VecDeque};

use kvferry_auth::handshake::{Initiator, Responder};
use kvferry_auth::limits::{Budget, PeerBudget};
use kvferry_auth::seal::{Opener, Sealer, TAG_LEN};
use kvferry_auth::{AuthError, ClusterKey, Surface};

use super::{Bridge, Route, Sender};

/// What opens every handshake message.
const PREFIX: [u8; 4] = *b"KVFA";
/// What the handshake binds a side-channel connection's keys to.
const CONTEXT: &str = "kvferry side channel";
/// Frames one peer may have waiting for its handshake.
const QUEUE_MAX: usize = 4096;
/// Bytes after a sealed frame: its number and its tag.
const TRAILER: usize = 8 + TAG_LEN;

/// A peer's side of the side channel's authentication.
pub(super) enum Gate {
    /// No cluster key: frames go as they are.
    Plain,
    /// Decode: our HELLO is out; frames wait for the keys.
    Waiting {
        init: Initiator,
        queue: VecDeque<Vec<u8>>,
        /// When the HELLO went out: one unanswered for a probe period
        /// (lost, or dropped by a prefill rank past its HELLO budget) is
        /// said again.
        since: std::time::Instant,
    },
    /// Authenticated: frames are sealed and opened.
    Sealed { seal: Sealer, open: Opener },
}

/// What to do with a frame for a peer.
pub(super) enum Outgoing {
    /// Send these bytes.
    Send(Vec<u8>),
    /// Held until the handshake ends.
    Held,
    /// The peer's queue is full: dropped.
    Dropped,
}

impl Gate {
    /// The gate of a new peer slot: plain without a key; on prefill, the
    /// ROUTER's `session` for the identity.
    pub(super) fn sealed(session: kvferry_auth::handshake::Session) -> Gate {
        Gate::Sealed {
            seal: session.seal,
            open: session.open,
        }
    }

    /// `bytes` as they go out now, if they do.
    pub(super) fn outgoing(&mut self, bytes: Vec<u8>) -> Outgoing {
        match self {
            Gate::Plain => Outgoing::Send(bytes),
            Gate::Waiting { queue, .. } if queue.len() >= QUEUE_MAX => Outgoing::Dropped,
            Gate::Waiting { queue, .. } => {
                queue.push_back(bytes);
                Outgoing::Held
            }
            Gate::Sealed { seal, .. } => Outgoing::Send(seal_frame(seal, bytes)),
        }
    }

    /// A received frame's machine bytes, once its tag verifies.
    pub(super) fn incoming(&mut self, mut payload: Vec<u8>) -> Result<Vec<u8>, AuthError> {
        match self {
            Gate::Plain => Ok(payload),
            Gate::Waiting { .. } => Err(AuthError::Missing),
            Gate::Sealed { open, .. } => {
                let at = payload
                    .len()
                    .checked_sub(TRAILER)
                    .ok_or(AuthError::Malformed)?;
                let seq = u64::from_le_bytes(payload[at..at + 8].try_into().expect("8 bytes"));
                open.open_numbered(seq, &[&payload[..at]], &payload[at + 8..])?;
                payload.truncate(at);
                Ok(payload)
            }
        }
    }
}

fn seal_frame(seal: &mut Sealer, mut bytes: Vec<u8>) -> Vec<u8> {
    let (seq, tag) = seal.seal_numbered(&[&bytes]);
    bytes.extend_from_slice(&seq.to_le_bytes());
    bytes.extend_from_slice(&tag);
    bytes
}

fn message(step: u8, body: &[u8]) -> Vec<u8> {
    [&PREFIX[..], &[step], body].concat()
}

/// The step and body of a handshake message, if `payload` is one.
pub(super) fn handshake_message(payload: &[u8]) -> Option<(u8, &[u8])> {
    (payload.len() > PREFIX.len() && payload[..4] == PREFIX).then(|| (payload[4], &payload[5..]))
}

/// Prefill's ROUTER side: identities part way through a handshake, and
/// authenticated identities that have no slot yet. Each table holds at
/// most `max` entries, the oldest evicted first.
pub(super) struct RouterGates {
    /// HELLOs answered, all peers together (ZeroMQ does not say who sent
    /// a frame): past it a HELLO is dropped and counted as limited. The
    /// handshakes of peers that proved the key are not touched.
    hellos: PeerBudget,
    started: std::time::Instant,
    responders: HashMap<Vec<u8>, Responder>,
    responder_order: VecDeque<Vec<u8>>,
    sessions: HashMap<Vec<u8>, Gate>,
    session_order: VecDeque<Vec<u8>>,
}

impl Default for RouterGates {
    fn default() -> Self {
        RouterGates {
            hellos: PeerBudget::new(HELLO_BUDGET),
            started: std::time::Instant::now(),
            responders: HashMap::new(),
            responder_order: VecDeque::new(),
            sessions: HashMap::new(),
            session_order: VecDeque::new(),
        }
    }
}

/// HELLOs a prefill rank answers: a connection of each decode rank of a
/// large cluster reconnecting at once fits the burst.
const HELLO_BUDGET: Budget = Budget {
    per_second: 1000,
    burst: 4096,
    max_addrs: 1,
};

impl RouterGates {
    /// Takes one HELLO from the budget; false when it is spent.
    fn allow_hello(&mut self) -> bool {
        let now_ms = self.started.elapsed().as_millis() as u64;
        self.hellos
            .allow(now_ms, std::net::Ipv4Addr::UNSPECIFIED.into())
    }

    /// The authenticated gate of `identity`, taken to be kept in its new
    /// slot.
    pub(super) fn take_session(&mut self, identity: &[u8]) -> Option<Gate> {
        self.sessions.remove(identity)
    }

    /// The gate of an identity without a slot, to open its frame.
    pub(super) fn session(&mut self, identity: &[u8]) -> Option<&mut Gate> {
        self.sessions.get_mut(identity)
    }
}

fn bounded_insert<V>(
    map: &mut HashMap<Vec<u8>, V>,
    order: &mut VecDeque<Vec<u8>>,
    max: usize,
    k: Vec<u8>,
    v: V,
) {
    while map.len() >= max.max(1) {
        let Some(old) = order.pop_front() else { break };
        map.remove(&old);
    }
    if map.insert(k.clone(), v).is_none() {
        order.push_back(k);
    }
}

impl Bridge {
    fn key(&self) -> Option<&ClusterKey> {
        self.shared.key.as_ref()
    }

    /// Counts a refused frame or handshake on the side channel.
    pub(super) fn auth_reject(&self, why: &str) {
        tracing::debug!(why, "side channel: not authenticated");
        self.shared.counters.auth.count(Surface::SideChannel);
    }

    /// The gate of a new DEALER slot; with a key, its HELLO goes out
    /// first (ZeroMQ holds it until the connection is up).
    pub(super) fn dealer_gate(&self, socket: &zmq::Socket) -> Gate {
        let Some(key) = self.key() else {
            return Gate::Plain;
        };
        match Initiator::new(key, CONTEXT) {
            Ok(init) => {
                let _ = socket.send(message(1, init.hello()), zmq::DONTWAIT);
                Gate::Waiting {
                    init,
                    queue: VecDeque::new(),
                    since: std::time::Instant::now(),
                }
            }
            Err(_) => {
                tracing::error!("side channel: no randomness for a handshake");
                Gate::Waiting {
                    init: Initiator::with_nonce(key, CONTEXT, [0; 32]),
                    queue: VecDeque::new(),
                    since: std::time::Instant::now(),
                }
            }
        }
    }

    /// Decode: dealer `i`'s connection dropped; its next one starts with a
    /// new handshake, and frames wait for it (those already waiting too).
    pub(super) fn rekey_dealer(&mut self, i: u32) {
        if self.key().is_none() {
            return;
        }
        let Some(slot) = self.slots.get(i as usize) else {
            return;
        };
        let Route::Dealer(socket) = &slot.route else {
            return;
        };
        let mut gate = self.dealer_gate(socket);
        let slot = &mut self.slots[i as usize];
        if let (Gate::Waiting { queue: old, .. }, Gate::Waiting { queue, .. }) =
            (&mut slot.gate, &mut gate)
        {
            queue.append(old);
        }
        slot.gate = gate;
    }

    /// Decode, on a probe: says HELLO again on dealer `i` if its last one
    /// went unanswered for `period`.
    pub(super) fn rehello_if_unanswered(&mut self, i: u32, period: std::time::Duration) {
        let stale = matches!(
            self.slots.get(i as usize).map(|s| &s.gate),
            Some(Gate::Waiting { since, .. }) if since.elapsed() >= period
        );
        if stale {
            self.rekey_dealer(i);
        }
    }

    /// Decode: a handshake message on dealer `i`.
    pub(super) fn dealer_handshake(&mut self, i: u32, step: u8, body: &[u8]) {
        let Some(slot) = self.slots.get_mut(i as usize) else {
            return;
        };
        if step != 2 || !matches!(slot.gate, Gate::Waiting { .. }) {
            return self.auth_reject("an unexpected handshake message from a prefill peer");
        }
        let Gate::Waiting { init, .. } = &slot.gate else {
            unreachable!("matched above")
        };
        let (proof, session) = match init.handle_challenge(body) {
            Ok(r) => r,
            Err(e) => {
                // A stale CHALLENGE (for a HELLO said again) fails too;
                // the handshake waits on for the right one.
                tracing::warn!(peer = i, %e, "a prefill peer's challenge does not verify");
                return self.auth_reject("a prefill peer's challenge failed");
            }
        };
        let Gate::Waiting { queue, .. } = std::mem::replace(&mut slot.gate, Gate::sealed(session))
        else {
            unreachable!("matched above")
        };
        if let Route::Dealer(socket) = &slot.route {
            let _ = socket.send(message(3, &proof), zmq::DONTWAIT);
        }
        for bytes in queue {
            self.send_bytes(i, bytes);
        }
    }

    /// Prefill: a handshake message from ROUTER identity `identity`.
    pub(super) fn router_handshake(&mut self, identity: Vec<u8>, step: u8, body: &[u8]) {
        let Some(key) = self.key().cloned() else {
            return self.auth_reject("a handshake, but this node has no key");
        };
        let max = self.shared.config.max_peers;
        match step {
            1 if !self.router_gates.allow_hello() => {
                self.shared
                    .counters
                    .auth
                    .count_limited(Surface::SideChannel);
            }
            1 => match Responder::new(&key, CONTEXT, body) {
                Ok(resp) => {
                    let challenge = message(2, resp.challenge());
                    let g = &mut self.router_gates;
                    bounded_insert(
                        &mut g.responders,
                        &mut g.responder_order,
                        max,
                        identity.clone(),
                        resp,
                    );
                    self.send_raw_to_identity(&identity, challenge);
                }
                Err(_) => self.auth_reject("a decode peer holds none of the keys"),
            },
            3 => {
                let Some(resp) = self.router_gates.responders.remove(&identity) else {
                    return self.auth_reject("a proof without a handshake");
                };
                match resp.handle_proof(body) {
                    Ok(session) => {
                        let gate = Gate::sealed(session);
                        // A reconnect names the connection anew; a proof
                        // on a known identity replaces its keys.
                        match self.by_identity.get(&identity) {
                            Some(&p) => self.slots[p as usize].gate = gate,
                            None => {
                                let g = &mut self.router_gates;
                                bounded_insert(
                                    &mut g.sessions,
                                    &mut g.session_order,
                                    max,
                                    identity,
                                    gate,
                                );
                            }
                        }
                    }
                    Err(_) => self.auth_reject("a decode peer's proof failed"),
                }
            }
            _ => self.auth_reject("an unknown handshake step"),
        }
    }

    /// The machine bytes of a frame from `peer` (a slot, or an identity
    /// without one), or `None` when it does not verify (counted).
    pub(super) fn unseal(&mut self, peer: &Sender, payload: Vec<u8>) -> Option<Vec<u8>> {
        if self.key().is_none() {
            return Some(payload);
        }
        let gate = match peer {
            Ok(p) => self.slots.get_mut(*p as usize).map(|s| &mut s.gate),
            Err(identity) => self.router_gates.session(identity),
        };
        let Some(gate) = gate else {
            self.auth_reject("a frame from an unauthenticated peer");
            return None;
        };
        match gate.incoming(payload) {
            Ok(bytes) => Some(bytes),
            Err(e) => {
                self.auth_reject(&e.to_string());
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_auth::handshake::Session;

    fn pair(key: &ClusterKey) -> (Session, Session) {
        let init = Initiator::new(key, CONTEXT).unwrap();
        let resp = Responder::new(key, CONTEXT, init.hello()).unwrap();
        let (proof, i) = init.handle_challenge(resp.challenge()).unwrap();
        (i, resp.handle_proof(&proof).unwrap())
    }

    fn sent(gate: &mut Gate, bytes: &[u8]) -> Vec<u8> {
        match gate.outgoing(bytes.to_vec()) {
            Outgoing::Send(b) => b,
            _ => panic!("not sent"),
        }
    }

    #[test]
    fn frames_open_once_on_their_own_connection_only() {
        let key = ClusterKey::from_bytes(&[1; 32], None).unwrap();
        let (a, b) = pair(&key);
        let (c, d) = pair(&key);
        let (mut tx, mut rx) = (Gate::sealed(a), Gate::sealed(b));
        let (mut tx2, mut rx2) = (Gate::sealed(c), Gate::sealed(d));
        let first = sent(&mut tx, b"KF pull 1");
        let second = sent(&mut tx, b"KF pull 2");
        assert_eq!(rx.incoming(first.clone()).unwrap(), b"KF pull 1");
        assert_eq!(rx.incoming(first.clone()), Err(AuthError::Replayed));
        // A frame of another connection, with a number this one expects.
        let other = sent(&mut tx2, b"KF pull 9");
        let other2 = sent(&mut tx2, b"KF pull 9");
        assert_eq!(rx.incoming(other2), Err(AuthError::BadTag));
        let mut tampered = second.clone();
        tampered[3] ^= 1;
        assert_eq!(rx.incoming(tampered), Err(AuthError::BadTag));
        assert_eq!(rx.incoming(second).unwrap(), b"KF pull 2");
        assert_eq!(rx.incoming(b"short".to_vec()), Err(AuthError::Malformed));
        assert_eq!(rx2.incoming(other).unwrap(), b"KF pull 9");
    }

    #[test]
    fn frames_wait_for_the_handshake_within_a_bound() {
        let key = ClusterKey::from_bytes(&[1; 32], None).unwrap();
        let mut gate = Gate::Waiting {
            init: Initiator::new(&key, CONTEXT).unwrap(),
            queue: VecDeque::new(),
            since: std::time::Instant::now(),
        };
        for _ in 0..QUEUE_MAX {
            assert!(matches!(gate.outgoing(vec![1]), Outgoing::Held));
        }
        assert!(matches!(gate.outgoing(vec![1]), Outgoing::Dropped));
        assert_eq!(gate.incoming(vec![0; 64]), Err(AuthError::Missing));
    }
}
