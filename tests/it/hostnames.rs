//! Nodes addressed by host name: a decode node reaching a prefill node
//! whose bootstrap service, side channel and data-plane endpoint are all
//! `localhost:PORT` (every socket still binds 127.0.0.1), names that do not
//! resolve failing with typed errors, and a name looked up again after a
//! failed connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvferry::bootstrap::{
    BootstrapClient, BootstrapServer, ClientError, RegisterRequest, RetryPolicy,
};
use kvferry::node::{
    AbortReason, BlockId, DataPlaneError, FailReason, Node, NodeConfig, NodeError, Phase,
    PrefillTarget, Role, TransferId,
};
use kvferry::resolve::{HostLookup, ResolveError, Resolver};
use kvferry_testkit::demo_timeouts;
use kvferry_testkit::model;
use kvferry_testkit::synth::{Rank, SynthKv};

/// A name under the reserved `.invalid` top-level domain (RFC 2606):
/// it never resolves.
const NOWHERE: &str = "kvferry-nowhere.invalid";

/// A node of `c` with synthetic KV registered (the testkit's `Rank`: shut
/// down before its KV drops).
fn engine(c: NodeConfig) -> Rank {
    Rank::start(c, SynthKv::new(model::medium(), 1, 0, 2, 32)).unwrap()
}

fn config(role: Role, engine_id: &str) -> NodeConfig {
    let mut c = NodeConfig::new(role, engine_id);
    c.host = "localhost".into();
    c.timeouts = demo_timeouts(5000);
    c
}

/// Moves `tid` from `p` to `d` through `target`; D's phase, with every
/// byte checked on success.
fn transfer(p: &Rank, d: &Rank, target: &PrefillTarget, tid: TransferId) -> Phase {
    let (src, dst) = ([3u32, 4, 9], [11u32, 12, 20]);
    p.send_one(d, target, tid, (&src, &dst), Duration::from_secs(20))
}

/// Waits (bounded) until the bootstrap service at `addr` lists engine
/// `engine_id` at DP rank `dp`; the side-channel address of its TP rank 0.
fn registered(addr: &str, engine_id: &str, dp: u32) -> String {
    let client = BootstrapClient::new(addr).unwrap();
    let found = client
        .wait_for_engine(engine_id, 1, RetryPolicy::default())
        .unwrap();
    found[&dp].addr(0, 0).unwrap().to_string()
}

#[test]
fn a_decode_node_reaches_a_prefill_node_by_host_name() {
    let mut pc = config(Role::Prefill, "p");
    pc.serve_bootstrap = Some("localhost:0".into());
    let p = engine(pc);
    let port = p
        .node
        .bootstrap_addr()
        .unwrap()
        .parse::<SocketAddr>()
        .unwrap()
        .port();
    let bootstrap = format!("localhost:{port}");
    // What the prefill node advertises is the name it was configured with.
    let side_channel = p.node.side_channel_addr();
    assert!(
        side_channel.starts_with("tcp://localhost:"),
        "{side_channel}"
    );
    // A prefill node that registers at the service by its name (another
    // engine, at DP rank 1: the service keeps one engine per DP rank).
    let mut p2c = config(Role::Prefill, "p2");
    p2c.dp_rank = 1;
    p2c.bootstrap = Some(bootstrap.clone());
    let p2 = engine(p2c);
    assert_eq!(registered(&bootstrap, "p", 0), side_channel);
    assert!(registered(&bootstrap, "p2", 1).starts_with("tcp://localhost:"));

    let mut dc = config(Role::Decode, "d");
    dc.bootstrap = Some(bootstrap.clone());
    let d = engine(dc);
    let by_service = PrefillTarget::Bootstrap {
        addr: bootstrap.clone(),
        engine_id: "p".into(),
        dp_rank: Some(0),
    };
    assert_eq!(transfer(&p, &d, &by_service, TransferId(1)), Phase::Success);
    let direct = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![side_channel],
    };
    assert_eq!(transfer(&p, &d, &direct, TransferId(2)), Phase::Success);
    let registered_p2 = PrefillTarget::Bootstrap {
        addr: format!("http://{bootstrap}/"),
        engine_id: "p2".into(),
        dp_rank: Some(1),
    };
    assert_eq!(
        transfer(&p2, &d, &registered_p2, TransferId(3)),
        Phase::Success
    );
    // The data plane was reached by the name each hello advertised: the
    // messages that ride it were taken, none fell back to ZeroMQ.
    let s = d.node.stats();
    assert_eq!(s.ok, 3);
    assert!(s.data_plane_messages > 0, "{s:?}");
    assert_eq!(s.data_plane_fallbacks, 0, "{s:?}");
}

#[test]
fn names_that_do_not_resolve_fail_with_typed_errors() {
    // The node's own host.
    let mut c = NodeConfig::new(Role::Prefill, "p");
    c.host = NOWHERE.into();
    match Node::start(c) {
        Err(NodeError::DataPlane(DataPlaneError::BadHost {
            source: ResolveError::NotFound { host, .. },
            ..
        })) => assert_eq!(host, NOWHERE),
        other => panic!("expected BadHost(NotFound), got {other:?}"),
    }
    // Malformed hosts never reach a lookup.
    for host in ["", "bad host", &"a".repeat(300)] {
        let mut c = NodeConfig::new(Role::Decode, "d");
        c.host = host.to_string();
        let e = Node::start(c).unwrap_err();
        assert!(
            matches!(e, NodeError::DataPlane(DataPlaneError::BadHost { .. })),
            "{host:?}: {e:?}"
        );
    }
    // The bootstrap service: one attempt, a typed error naming the host.
    let client = BootstrapClient::new(&format!("{NOWHERE}:8998")).unwrap();
    match client.query(None) {
        Err(ClientError::Resolve {
            source: ResolveError::NotFound { host, .. },
            ..
        }) => assert_eq!(host, NOWHERE),
        other => panic!("expected Resolve(NotFound), got {other:?}"),
    }
    for bad in ["", "localhost", "localhost:99999", ":8998"] {
        let e = BootstrapClient::new(bad).unwrap_err();
        assert!(
            matches!(e, ClientError::BadAddress(_)) && !e.is_retryable(),
            "{bad:?}: {e:?}"
        );
    }
    let e = BootstrapServer::start(&format!("{NOWHERE}:0"))
        .err()
        .unwrap();
    assert!(e.to_string().contains(NOWHERE), "{e}");
    // A decode request whose side channel does not resolve fails at once,
    // not at its bootstrap timeout (a minute here).
    let mut dc = config(Role::Decode, "d");
    dc.timeouts = demo_timeouts(60_000);
    let d = engine(dc);
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![format!("tcp://{NOWHERE}:5600")],
    };
    let rx = d.node.receiver(TransferId(7), &target).unwrap();
    rx.request(vec![vec![BlockId(1)]]).unwrap();
    assert_eq!(
        rx.wait(Duration::from_secs(30)),
        Phase::Failed(FailReason::Aborted(AbortReason::Engine))
    );
}

#[test]
fn a_lookup_that_hangs_fails_within_the_bound() {
    let (_hold, release) = std::sync::mpsc::channel::<()>();
    let release = Mutex::new(release);
    let resolver = Resolver::with_lookup(Duration::from_millis(50), move |_, _| {
        // Answers only once the test is over (the sender dropped).
        let _ = release.lock().unwrap().recv();
        Ok(Vec::new())
    });
    let client = BootstrapClient::new("bootstrap.kvferry.svc:8998")
        .unwrap()
        .with_resolver(resolver);
    let e = client.health().unwrap_err();
    match &e {
        ClientError::Resolve {
            source: ResolveError::Timeout { host, after_ms: 50 },
            ..
        } => assert_eq!(host, "bootstrap.kvferry.svc"),
        other => panic!("expected Resolve(Timeout), got {other:?}"),
    }
    assert!(e.is_retryable(), "a slow DNS server may answer next time");
}

#[test]
fn a_name_is_looked_up_again_after_a_failed_connection() {
    let server = BootstrapServer::start("127.0.0.1:0").unwrap();
    // A port nothing listens on: where the name pointed before it moved.
    let gone: SocketAddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let answers = Arc::new(Mutex::new(vec![server.local_addr(), gone]));
    let lookups = Arc::new(AtomicUsize::new(0));
    let (a, n) = (answers.clone(), lookups.clone());
    let resolver = Resolver::with_lookup(Duration::from_secs(5), move |host, _| {
        assert_eq!(host, "bootstrap.kvferry.svc");
        n.fetch_add(1, Ordering::SeqCst);
        let mut a = a.lock().unwrap();
        // The last answer sticks once the name moved.
        let next = if a.len() > 1 {
            a.pop()
        } else {
            a.last().copied()
        };
        Ok(next.into_iter().collect())
    });
    let client = BootstrapClient::new("http://bootstrap.kvferry.svc:8998")
        .unwrap()
        .with_resolver(resolver);
    let req = RegisterRequest {
        engine_id: "p".into(),
        dp_rank: 0,
        tp_rank: 0,
        pp_rank: 0,
        addr: "tcp://prefill-0.kvferry.svc:5600".into(),
    };
    let policy = RetryPolicy {
        deadline: Duration::from_secs(30),
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(20),
    };
    client.register(&req, policy).unwrap();
    assert_eq!(server.registered(), 1);
    assert_eq!(lookups.load(Ordering::SeqCst), 2, "one lookup per attempt");
}

#[test]
fn a_prefill_rank_that_moved_is_reached_again_by_its_name() {
    // Where "prefill-0.kvferry.svc" points: the test moves it.
    let at: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
    let lookups = Arc::new(AtomicUsize::new(0));
    let (a, n) = (at.clone(), lookups.clone());
    let lookup = HostLookup::new(move |host, port| {
        if host != "prefill-0.kvferry.svc" {
            return Resolver::default()
                .resolve_str(&format!("{host}:{port}"))
                .map(|a| vec![a])
                .map_err(std::io::Error::other);
        }
        n.fetch_add(1, Ordering::SeqCst);
        Ok(a.lock().unwrap().iter().copied().collect())
    });
    let side_channel = |e: &Rank| -> SocketAddr {
        let addr = e.node.side_channel_addr();
        addr.strip_prefix("tcp://").unwrap().parse().unwrap()
    };
    let mut pc = config(Role::Prefill, "p");
    pc.host = "127.0.0.1".into();
    let p1 = engine(pc.clone());
    *at.lock().unwrap() = Some(side_channel(&p1));
    let mut dc = config(Role::Decode, "d");
    dc.lookup = Some(lookup);
    dc.probe_interval = Some(Duration::from_millis(20));
    let d = engine(dc);
    // The port in the name's address is the lookup's, not this one.
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec!["tcp://prefill-0.kvferry.svc:1".into()],
    };
    assert_eq!(transfer(&p1, &d, &target, TransferId(1)), Phase::Success);
    // The rank restarts elsewhere (another port), under the same name.
    drop(p1);
    let p2 = engine(pc);
    *at.lock().unwrap() = Some(side_channel(&p2));
    let before = lookups.load(Ordering::SeqCst);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while d.node.stats().peer_recoveries == 0 {
        assert!(std::time::Instant::now() < deadline, "{:?}", d.node.stats());
        std::thread::yield_now();
    }
    assert!(lookups.load(Ordering::SeqCst) > before, "looked up again");
    assert_eq!(transfer(&p2, &d, &target, TransferId(2)), Phase::Success);
}

#[test]
fn a_slow_lookup_holds_up_no_other_peer() {
    // "slow.kvferry.svc" answers only when the test says so; everything
    // else resolves as usual.
    let (answer, asked) = std::sync::mpsc::channel::<SocketAddr>();
    let asked = Mutex::new(asked);
    let lookup = HostLookup::new(move |host, port| {
        if host != "slow.kvferry.svc" {
            return Resolver::default()
                .resolve_str(&format!("{host}:{port}"))
                .map(|a| vec![a])
                .map_err(std::io::Error::other);
        }
        let a = asked
            .lock()
            .unwrap()
            .recv()
            .map_err(std::io::Error::other)?;
        Ok(vec![a])
    });
    let mut pc = config(Role::Prefill, "p");
    pc.host = "127.0.0.1".into();
    let (p1, p2) = (engine(pc.clone()), engine(pc));
    let mut dc = config(Role::Decode, "d");
    dc.timeouts = demo_timeouts(60_000);
    dc.resolve_timeout = Duration::from_secs(30);
    dc.lookup = Some(lookup);
    let d = engine(dc);
    let slow = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec!["tcp://slow.kvferry.svc:1".into()],
    };
    let rx = d.node.receiver(TransferId(1), &slow).unwrap();
    rx.request(vec![vec![BlockId(1)]]).unwrap();
    // While that name is being looked up, a request to another prefill
    // engine goes through: the lookup runs off the bridge thread.
    let direct = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![p2.node.side_channel_addr()],
    };
    let (src, dst) = ([3u32, 4], [11u32, 12]);
    let phase = p2.send_one(
        &d,
        &direct,
        TransferId(2),
        (&src, &dst),
        Duration::from_secs(3),
    );
    assert_eq!(phase, Phase::Success);
    assert_eq!(
        rx.poll(),
        Phase::Bootstrapping,
        "still waiting for its name"
    );
    // The name resolves late, to the first prefill engine: its request
    // goes through too.
    let at = p1.node.side_channel_addr();
    answer
        .send(at.strip_prefix("tcp://").unwrap().parse().unwrap())
        .unwrap();
    p1.kv.fill(TransferId(1), &[5], 0);
    let tx = p1.node.sender(TransferId(1)).unwrap();
    tx.send(vec![vec![BlockId(5)]], true).unwrap();
    assert_eq!(rx.wait(Duration::from_secs(20)), Phase::Success);
    assert_eq!(d.kv.verify(TransferId(1), &[1], 0), Ok(()));
}

#[test]
fn listening_apart_from_the_advertised_host() {
    // Listening on an address while advertising a name for it: peers
    // reach the node at what it advertises. (Tests bind 127.0.0.1 only.)
    let mut pc = config(Role::Prefill, "p");
    pc.host = "localhost".into();
    pc.listen = Some("127.0.0.1".into());
    let p = engine(pc);
    assert!(p.node.side_channel_addr().starts_with("tcp://localhost:"));
    let d = engine(config(Role::Decode, "d"));
    let direct = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![p.node.side_channel_addr()],
    };
    assert_eq!(transfer(&p, &d, &direct, TransferId(1)), Phase::Success);

    // Advertising an address other hosts reach while listening on loopback
    // only: the node refuses to start, naming both.
    let mut c = config(Role::Prefill, "unreachable");
    c.host = "192.0.2.7".into(); // TEST-NET-1 (RFC 5737): never this host's
    c.listen = Some("127.0.0.1".into());
    let Err(e) = Node::start(c) else {
        panic!("a node nobody can reach started");
    };
    assert!(
        matches!(
            &e,
            NodeError::Misuse(kvferry::node::Misuse::UnreachableHost { host, .. }) if host == "192.0.2.7"
        ),
        "{e}"
    );
}
