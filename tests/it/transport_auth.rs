//! The tcp data plane with a cluster key: only peers that hold it move
//! bytes, and no frame can be forged, tampered with, replayed or moved
//! from one connection to another, even by an on-path attacker that sees
//! and edits every byte (a proxy between the endpoints here). Each refusal
//! is counted, nothing outside a legitimate write changes, and the target
//! keeps serving.

use std::future::Future;
use std::sync::Arc;

use futures::io::{AsyncReadExt, AsyncWriteExt};
use glommio::net::TcpStream;
use glommio::{LocalExecutorBuilder, Placement};

use crate::proxy::{Edit, Proxy};
use kvferry::auth::handshake::Initiator;
use kvferry::auth::{ClusterKey, Rejects, Surface};
use kvferry::transport::internal::wire::{self, Header, RejectReason};
use kvferry::transport::{
    Desc, EndpointAddr, Op, PeerError, Session, TcpConfig, TcpTransport, Transport, TransportError,
};

fn block_on<T>(f: impl Future<Output = T>) -> T {
    LocalExecutorBuilder::new(Placement::Unbound)
        .make()
        .expect("executor")
        .run(f)
}

fn key(byte: u8) -> ClusterKey {
    ClusterKey::from_bytes(&[byte; 32], None).unwrap()
}

/// One stream per session and no shared memory: every frame of a session
/// goes over one connection at a time, whose layout the proxy knows.
fn config(key: Option<ClusterKey>, rejects: &Arc<Rejects>) -> TcpConfig {
    TcpConfig {
        streams: 1,
        key,
        rejects: rejects.clone(),
        shm: kvferry::transport::ShmConfig {
            mode: kvferry::transport::ShmMode::Off,
            ..Default::default()
        },
        ..TcpConfig::default()
    }
}

fn bind(key: Option<ClusterKey>, rejects: &Arc<Rejects>) -> TcpTransport {
    TcpTransport::bind("127.0.0.1:0".parse().unwrap(), config(key, rejects)).unwrap()
}

/// The target's memory: guard bytes around a window peers may write.
struct Kv {
    bytes: Vec<u8>,
}

const GUARD: u8 = 0xEE;
const WINDOW: std::ops::Range<usize> = 4096..8192;

impl Kv {
    fn new(t: &TcpTransport) -> Box<Kv> {
        let mut kv = Box::new(Kv {
            bytes: vec![GUARD; 12288],
        });
        // SAFETY: the buffer outlives the endpoint in each test, and is
        // read only between transfers.
        unsafe { t.register(kv.bytes.as_mut_ptr(), kv.bytes.len()).unwrap() };
        kv
    }
    fn window_addr(&self) -> u64 {
        self.bytes.as_ptr() as u64 + WINDOW.start as u64
    }
    /// The window holds `fill` and the guards are intact.
    fn holds(&self, fill: u8) -> bool {
        let guards = self.bytes[..WINDOW.start]
            .iter()
            .chain(&self.bytes[WINDOW.end..])
            .all(|&b| b == GUARD);
        guards && self.bytes[WINDOW].iter().all(|&b| b == fill)
    }
}

/// Sources of legitimate writes: one 4 KiB buffer per fill byte.
struct Src {
    bufs: Vec<Vec<u8>>,
}

impl Src {
    fn new(t: &TcpTransport, fills: &[u8]) -> Src {
        let mut bufs: Vec<Vec<u8>> = fills.iter().map(|&f| vec![f; WINDOW.len()]).collect();
        for b in &mut bufs {
            // SAFETY: as for `Kv`.
            unsafe { t.register(b.as_mut_ptr(), b.len()).unwrap() };
        }
        Src { bufs }
    }
    fn write_of(&self, fill: u8, kv: &Kv) -> Desc {
        let b = self.bufs.iter().find(|b| b[0] == fill).unwrap();
        Desc {
            local_addr: b.as_ptr() as u64,
            remote_addr: kv.window_addr(),
            len_bytes: WINDOW.len() as u64,
        }
    }
}

fn is_unauthenticated(e: &TransportError) -> bool {
    matches!(e, TransportError::Peer(PeerError::Unauthenticated(_)))
}

#[test]
fn only_peers_holding_the_key_connect() {
    block_on(async {
        let (tr, ir) = (Arc::new(Rejects::default()), Arc::new(Rejects::default()));
        let target = bind(Some(key(1)), &tr);
        let kv = Kv::new(&target);
        let peer = target.endpoint_addr();

        // Without a key: refused by the target, counted there.
        let plain = bind(None, &ir);
        let e = plain
            .open(&peer)
            .await
            .err()
            .expect("an unkeyed peer is refused");
        assert!(is_unauthenticated(&e), "{e}");
        assert_eq!(tr.get(Surface::DataPlane), 1);

        // Another key: the handshake fails at the target (no common key).
        let other = bind(Some(key(2)), &ir);
        let e = other
            .open(&peer)
            .await
            .err()
            .expect("a wrong key is refused");
        assert!(is_unauthenticated(&e), "{e}");
        assert_eq!(tr.get(Surface::DataPlane), 2);

        // A keyed initiator refuses a target without a key.
        let plain_target = bind(None, &tr);
        let keyed = bind(Some(key(1)), &ir);
        let before = ir.get(Surface::DataPlane);
        let e = keyed
            .open(&plain_target.endpoint_addr())
            .await
            .err()
            .expect("a keyed initiator refuses an unkeyed target");
        assert!(is_unauthenticated(&e), "{e}");
        assert_eq!(ir.get(Surface::DataPlane), before + 1);

        // The key's holder moves bytes; a rotation's previous key works too.
        let src = Src::new(&keyed, &[0x11]);
        let s = keyed.open(&peer).await.expect("same key");
        s.transfer(Op::Write, &[src.write_of(0x11, &kv)])
            .await
            .unwrap();
        assert!(kv.holds(0x11));
        let rotated = ClusterKey::from_bytes(&[3; 32], Some(&[1; 32])).unwrap();
        let rotating = bind(Some(rotated), &ir);
        let src2 = Src::new(&rotating, &[0x22]);
        let s = rotating
            .open(&peer)
            .await
            .expect("the previous key is shared");
        s.transfer(Op::Write, &[src2.write_of(0x22, &kv)])
            .await
            .unwrap();
        assert!(kv.holds(0x22));
        assert_eq!(
            tr.get(Surface::DataPlane),
            2,
            "legitimate peers are not counted"
        );
    });
}

/// Reads one response header (plain: an unauthenticated connection).
async fn response(s: &mut TcpStream) -> Option<Header> {
    let mut b = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut b).await.ok()?;
    Header::decode(&b).ok()
}

async fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b).await {
            Ok(0) | Err(_) => return true,
            Ok(_) => continue,
        }
    }
}

fn write_frame(addr: u64, payload: &[u8], magic: &[u8; 4]) -> Vec<u8> {
    let h = Header {
        opcode: wire::OP_WRITE,
        count: 1,
        req_id: 7,
        payload_len: payload.len() as u64,
        ..Header::default()
    };
    let mut f = h.encode().to_vec();
    f[..4].copy_from_slice(magic);
    if magic == &wire::MAGIC_SEALED {
        f.extend_from_slice(&[0u8; 16]); // a guessed tag
    }
    wire::encode_entry(&mut f, addr, payload.len() as u64);
    f.extend_from_slice(payload);
    f
}

#[test]
fn a_peer_without_the_key_writes_nothing() {
    block_on(async {
        let tr = Arc::new(Rejects::default());
        let target = bind(Some(key(1)), &tr);
        let kv = Kv::new(&target);
        let poison = vec![0x66u8; 256];
        let addr = target.local_addr();
        let hostile: Vec<(&str, Vec<u8>)> = vec![
            (
                "a plain WRITE",
                write_frame(kv.window_addr(), &poison, &wire::MAGIC),
            ),
            (
                "a sealed-looking WRITE",
                write_frame(kv.window_addr(), &poison, &wire::MAGIC_SEALED),
            ),
            ("a HELLO naming no key of the target", {
                let i = Initiator::new(&key(9), "kvferry tcp data plane").unwrap();
                auth_frame(0, i.hello())
            }),
            ("a HELLO with the target's key id and a guessed proof", {
                // Key ids are public (they travel in every HELLO).
                let i = Initiator::new(&key(1), "kvferry tcp data plane").unwrap();
                [auth_frame(0, i.hello()), auth_frame(1, &[0x55; 32])].concat()
            }),
        ];
        for (n, (name, bytes)) in hostile.into_iter().enumerate() {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(&bytes).await.unwrap();
            if let Some(h) = response(&mut s).await {
                // Only the AUTH answer with a challenge is not a refusal.
                let refused = RejectReason::from_status(h.status) == RejectReason::Unauthenticated;
                assert!(refused || h.opcode == wire::OP_AUTH, "{name}: {h:?}");
            }
            assert!(closed(&mut s).await, "{name}: the connection closes");
            assert_eq!(tr.get(Surface::DataPlane), n as u64 + 1, "{name}: counted");
            assert!(kv.holds(GUARD), "{name}: KV memory changed");
        }
        // The target still serves its cluster.
        let ir = Arc::new(Rejects::default());
        let peer = bind(Some(key(1)), &ir);
        let src = Src::new(&peer, &[0x33]);
        let s = peer.open(&target.endpoint_addr()).await.unwrap();
        s.transfer(Op::Write, &[src.write_of(0x33, &kv)])
            .await
            .unwrap();
        assert!(kv.holds(0x33));
    });
}

fn auth_frame(step: u32, body: &[u8]) -> Vec<u8> {
    let h = Header {
        opcode: wire::OP_AUTH,
        detail: step,
        payload_len: body.len() as u64,
        ..Header::default()
    };
    [&h.encode()[..], body].concat()
}

/// Bytes on a connection before its first frame: the AUTH exchange.
const HANDSHAKE: usize = 32 + 56 + 32 + 32;
/// A sealed REGIONS request (the session's first frame).
const REGIONS: usize = wire::SEALED_HEADER_LEN;
/// A sealed WRITE of the window: header, one descriptor, payload.
const FRAME: usize = wire::SEALED_HEADER_LEN + wire::ENTRY_LEN + WINDOW.end - WINDOW.start;

#[test]
fn tampered_replayed_and_transplanted_frames_are_refused() {
    block_on(async {
        let (tr, ir) = (Arc::new(Rejects::default()), Arc::new(Rejects::default()));
        let target = bind(Some(key(1)), &tr);
        let kv = Kv::new(&target);
        let proxy = Proxy::start(target.local_addr());
        let initiator = bind(Some(key(1)), &ir);
        let src = Src::new(
            &initiator,
            &[0xA1, 0xB2, 0xC3, 0xD4, 0xE5, 0xF6, 0x17, 0x28],
        );
        let s = initiator
            .open(&EndpointAddr::Tcp(proxy.addr))
            .await
            .unwrap();
        let write = |fill: u8| {
            let d = [src.write_of(fill, &kv)];
            let s = s.clone();
            async move { s.transfer(Op::Write, &d).await }
        };
        let refused = |n: u64, fill: u8, what: &str| {
            assert_eq!(tr.get(Surface::DataPlane), n, "{what}: counted once");
            assert!(kv.holds(fill), "{what}: KV memory changed");
        };

        // Connection 0: REGIONS, then A and B land.
        write(0xA1).await.unwrap();
        write(0xB2).await.unwrap();
        let a_start = HANDSHAKE + REGIONS;
        let frame_a = proxy.sent(0, a_start..a_start + FRAME);

        // Replayed on its own connection after B: it would put A back.
        proxy.edit(Edit::Insert {
            conn: 0,
            at: a_start + 2 * FRAME,
            bytes: frame_a.clone(),
        });
        write(0xC3)
            .await
            .expect_err("the connection closes at the replay");
        refused(1, 0xB2, "a replayed frame");

        // Connection 1: D lands; then a header byte (the request id) is
        // changed in the next frame.
        write(0xD4).await.unwrap();
        assert!(kv.holds(0xD4));
        let d_frame = proxy.sent(1, HANDSHAKE..HANDSHAKE + FRAME);
        proxy.edit(Edit::Flip {
            conn: 1,
            at: HANDSHAKE + FRAME + 16,
        });
        write(0xE5).await.expect_err("a tampered header is refused");
        refused(2, 0xD4, "a tampered header");

        // Connection 2: its descriptor's address is changed (into the
        // guard bytes).
        proxy.edit(Edit::Flip {
            conn: 2,
            at: HANDSHAKE + wire::SEALED_HEADER_LEN + 1,
        });
        write(0xF6)
            .await
            .expect_err("a tampered descriptor is refused");
        refused(3, 0xD4, "a tampered descriptor");

        // Connection 3: connection 1's first frame, valid there and with
        // the same number, arrives first: other keys, refused.
        proxy.edit(Edit::Insert {
            conn: 3,
            at: HANDSHAKE,
            bytes: d_frame,
        });
        write(0x17)
            .await
            .expect_err("a frame of another connection is refused");
        refused(4, 0xD4, "a frame from another connection");

        // Connection 0's bytes, recorded whole, sent again from the start:
        // the target's new nonce makes the old proof worthless.
        let mut replay = TcpStream::connect(target.local_addr()).await.unwrap();
        let recorded = proxy.sent(0, 0..a_start + 2 * FRAME);
        replay.write_all(&recorded).await.unwrap();
        assert!(closed(&mut replay).await);
        refused(5, 0xD4, "a recorded connection replayed");

        // Through all of it the target serves: the next write lands.
        write(0x28)
            .await
            .expect("a legitimate write after the attacks");
        assert!(kv.holds(0x28));
        assert_eq!(tr.get(Surface::DataPlane), 5);
        assert_eq!(
            ir.get(Surface::DataPlane),
            0,
            "the initiator never saw a bad proof"
        );
    });
}

#[test]
fn payload_tags_catch_bytes_changed_in_flight() {
    block_on(async {
        for payload_mac in [false, true] {
            let (tr, ir) = (Arc::new(Rejects::default()), Arc::new(Rejects::default()));
            let target = bind(Some(key(1)), &tr);
            let kv = Kv::new(&target);
            let proxy = Proxy::start(target.local_addr());
            let initiator = TcpTransport::bind(
                "127.0.0.1:0".parse().unwrap(),
                TcpConfig {
                    payload_mac,
                    ..config(Some(key(1)), &ir)
                },
            )
            .unwrap();
            let src = Src::new(&initiator, &[0x5A, 0x6B, 0x00]);
            let s = initiator
                .open(&EndpointAddr::Tcp(proxy.addr))
                .await
                .unwrap();
            // One byte inside the first WRITE's payload, on the wire.
            let payload = HANDSHAKE + REGIONS + wire::SEALED_HEADER_LEN + wire::ENTRY_LEN;
            proxy.edit(Edit::Flip {
                conn: 0,
                at: payload + 100,
            });
            let r = s.transfer(Op::Write, &[src.write_of(0x5A, &kv)]).await;
            if payload_mac {
                r.expect_err("a payload changed in flight fails its frame");
                assert_eq!(tr.get(Surface::DataPlane), 1, "counted");
            } else {
                // Without payload tags the header's tag covers where the
                // bytes go and how many, not the bytes.
                r.expect("lands");
                assert!(!kv.holds(0x5A) && tr.get(Surface::DataPlane) == 0);
            }
            // Tagged both ways: a clean WRITE lands and a READ brings the
            // window back byte for byte.
            s.transfer(Op::Write, &[src.write_of(0x6B, &kv)])
                .await
                .unwrap();
            assert!(kv.holds(0x6B));
            let back = src.write_of(0x00, &kv);
            s.transfer(Op::Read, &[back]).await.unwrap();
            let b = &src.bufs[2];
            assert!(
                b.iter().all(|&x| x == 0x6B),
                "payload_mac {payload_mac}: READ back"
            );
        }
    });
}
