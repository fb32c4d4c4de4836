//! `kvferry store serve` with a cluster key: engines holding it put and
//! get; an engine without it, with another key, or speaking the protocol
//! without the handshake reads and writes nothing, and is counted.

use std::io::{Read, Write};
use std::sync::Arc;

use crate::store_buffer::{far, key, Buffer};

use kvferry_auth::{ClusterKey, Rejects, Surface};
use kvferry_store::internal::proto::{self, Request};
use kvferry_store::{PutOutcome, RemoteConfig, RemoteStore, StoreBackend};
use kvferry_store_server::{ServeConfig, StoreServer};

fn key_of(byte: u8) -> ClusterKey {
    ClusterKey::from_bytes(&[byte; 32], None).unwrap()
}

fn keyed_server() -> StoreServer {
    let mut cfg = ServeConfig {
        capacity_bytes: 1 << 20,
        key: Some(key_of(1)),
        ..ServeConfig::default()
    };
    cfg.tcp.rejects = Arc::new(Rejects::default());
    StoreServer::start(cfg).unwrap()
}

fn engine(server: &StoreServer, key: Option<ClusterKey>) -> RemoteStore {
    let mut cfg = RemoteConfig::from_url(&server.local_addr().to_string());
    cfg.tcp.key = key;
    RemoteStore::connect(cfg).unwrap()
}

#[test]
fn only_engines_holding_the_key_put_and_get() {
    let srv = keyed_server();
    let mut owner = engine(&srv, Some(key_of(1)));
    let kv = Buffer::new(2, 256, 7);
    owner.register(&kv.layout()).unwrap();
    let stored = owner.put(&[kv.put("secret", 0)], far()).unwrap();
    assert_eq!(stored, [Ok(PutOutcome::Stored)]);
    assert_eq!(srv.auth_rejected(Surface::Store), 0);

    // No key, or another one: every call fails, nothing is read or written.
    for (n, k) in [None, Some(key_of(2))].into_iter().enumerate() {
        let mut intruder = engine(&srv, k);
        let mine = Buffer::new(2, 256, 0x66);
        intruder.register(&mine.layout()).unwrap();
        assert!(intruder.exists(&[key("secret")], far()).is_err());
        assert!(intruder.get(&[mine.get("secret", 0)], far()).is_err());
        assert!(intruder.put(&[mine.put("secret", 1)], far()).is_err());
        assert!(
            mine.bytes.iter().all(|&b| b == 0x66),
            "an intruder's memory changed"
        );
        assert!(srv.auth_rejected(Surface::Store) >= 3 * (n as u64 + 1));
    }

    // The protocol's own frames without the handshake: the connection
    // closes unanswered.
    let before = srv.auth_rejected(Surface::Store);
    let mut raw = std::net::TcpStream::connect(srv.local_addr()).unwrap();
    let remove = Request::RemovePrefix {
        prefix: String::new(),
    };
    // The server may close (and reset) before the whole frame is written.
    let _ = raw.write_all(&proto::encode(1, &remove).unwrap());
    // Closed with the frame unread: a reset, or an end of stream.
    let mut rest = Vec::new();
    let _ = raw.read_to_end(&mut rest);
    assert!(rest.is_empty(), "answered without a handshake");
    assert_eq!(srv.auth_rejected(Surface::Store), before + 1);

    // The value is intact and its owner reads it back.
    let mut back = Buffer::new(2, 256, 0);
    back.bytes.fill(0);
    owner.register(&back.layout()).unwrap();
    assert_eq!(
        owner.get(&[back.get("secret", 1)], far()).unwrap(),
        [Ok(())]
    );
    assert_eq!(back.block(1), kv.block(0));
    assert_eq!(srv.stats().removals, 0);
}

#[test]
fn without_a_key_the_server_listens_on_loopback_only() {
    let wide = ServeConfig {
        listen: "0.0.0.0:0".parse().unwrap(),
        capacity_bytes: 1 << 16,
        ..ServeConfig::default()
    };
    let e = StoreServer::start(wide.clone()).expect_err("0.0.0.0 without a key");
    assert!(e.to_string().contains("without a cluster key"), "{e}");
    StoreServer::start(ServeConfig {
        allow_unauthenticated_remote: true,
        ..wide.clone()
    })
    .expect("allowed explicitly");
    StoreServer::start(ServeConfig {
        key: Some(key_of(1)),
        ..wide
    })
    .expect("keyed");
}

#[test]
fn one_address_cannot_take_every_connection() {
    let mut cfg = ServeConfig {
        capacity_bytes: 1 << 20,
        key: Some(key_of(1)),
        max_connections_per_addr: 2,
        ..ServeConfig::default()
    };
    cfg.tcp.rejects = Arc::new(Rejects::default());
    let srv = StoreServer::start(cfg).unwrap();
    // Two silent connections hold this address's share.
    let held: Vec<_> = (0..2)
        .map(|_| std::net::TcpStream::connect(srv.local_addr()).unwrap())
        .collect();
    let mut third = std::net::TcpStream::connect(srv.local_addr()).unwrap();
    let mut rest = Vec::new();
    let _ = third.read_to_end(&mut rest);
    assert!(rest.is_empty(), "the third connection is closed unanswered");
    assert_eq!(srv.rate_limited(Surface::Store), 1);
    // Once one closes, an engine holding the key is served.
    drop(held);
    let mut owner = engine(&srv, Some(key_of(1)));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    // The server sees the closes when its tasks next run: retried within a bound.
    while owner.exists(&[key("k")], far()).is_err() {
        assert!(std::time::Instant::now() < deadline, "never served");
    }
    assert_eq!(owner.exists(&[key("k")], far()).unwrap(), [false]);
}
