//! The bootstrap service over real HTTP on 127.0.0.1.

use std::net::TcpListener;
use std::time::Duration;

use kvferry::bootstrap::{
    BootstrapClient, BootstrapServer, ClientError, ExpectedRanks, RegisterRequest, RegistryLimits,
    RetryPolicy, ServerConfig,
};

fn start() -> (BootstrapServer, BootstrapClient) {
    let server = BootstrapServer::start("127.0.0.1:0").expect("server starts");
    let client = BootstrapClient::new(&server.local_addr().to_string()).expect("client");
    (server, client)
}

fn worker(engine_id: &str, dp: u32, tp: u32, pp: u32, addr: &str) -> RegisterRequest {
    RegisterRequest {
        engine_id: engine_id.into(),
        dp_rank: dp,
        tp_rank: tp,
        pp_rank: pp,
        addr: addr.into(),
    }
}

fn quick() -> RetryPolicy {
    RetryPolicy {
        deadline: Duration::from_secs(5),
        ..RetryPolicy::default()
    }
}

#[test]
fn register_then_query_like_vllm() {
    let (server, client) = start();
    for tp in 0..2 {
        let resp = client
            .register(
                &worker(
                    "prefill-a",
                    0,
                    tp,
                    0,
                    &format!("tcp://127.0.0.1:{}", 5000 + tp),
                ),
                quick(),
            )
            .expect("register");
        assert_eq!(resp.status, "ok");
        assert!(!resp.replaced);
    }
    client
        .register(
            &worker("prefill-b", 1, 0, 0, "tcp://127.0.0.1:6000"),
            quick(),
        )
        .expect("register b");
    assert_eq!(server.registered(), 3);

    let all = client.query(None).expect("query");
    assert_eq!(all.len(), 2);
    assert_eq!(all[&0].engine_id, "prefill-a");
    assert_eq!(all[&0].tp_size(), 2);
    assert_eq!(all[&0].addr(1, 0), Some("tcp://127.0.0.1:5001"));
    assert_eq!(all[&1].engine_id, "prefill-b");

    let only_b = client.query(Some("prefill-b")).expect("query b");
    assert_eq!(only_b.keys().copied().collect::<Vec<_>>(), vec![1]);
    assert!(client.query(Some("nobody")).expect("query").is_empty());

    // The raw JSON has vLLM's shape: string keys dp → tp → pp.
    let (status, body) = client.request("GET", "/query", None).expect("raw");
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(
        json["0"]["worker_addr"]["1"]["0"],
        serde_json::json!("tcp://127.0.0.1:5001")
    );
    assert_eq!(json["1"]["engine_id"], serde_json::json!("prefill-b"));
    server.shutdown();
}

#[test]
fn reregistering_a_slot_replaces_its_address() {
    let (_server, client) = start();
    client
        .register(&worker("e", 0, 0, 0, "tcp://h:1"), quick())
        .expect("first");
    let resp = client
        .register(&worker("e", 0, 0, 0, "tcp://h:2"), quick())
        .expect("restart");
    assert!(resp.replaced);
    assert_eq!(
        client.query(None).expect("query")[&0].addr(0, 0),
        Some("tcp://h:2")
    );
}

#[test]
fn another_engine_on_a_taken_dp_rank_is_a_conflict() {
    let (_server, client) = start();
    client
        .register(&worker("e1", 0, 0, 0, "tcp://h:1"), quick())
        .expect("first");
    let err = client
        .register(&worker("e2", 0, 1, 0, "tcp://h:2"), quick())
        .expect_err("conflict");
    match err {
        ClientError::Rejected { status, reason } => {
            assert_eq!(status, 409);
            assert!(reason.contains("e1"), "{reason}");
        }
        other => panic!("expected a 409, got {other:?}"),
    }
}

#[test]
fn malformed_bodies_get_400_with_a_reason() {
    let (server, client) = start();
    let cases: [(&[u8], &str); 6] = [
        (b"{not json", "malformed"),
        (b"{\"engine_id\":\"e\"}", "missing field"),
        (
            b"{\"engine_id\":\"e\",\"dp_rank\":-1,\"tp_rank\":0,\"pp_rank\":0,\"addr\":\"a\"}",
            "invalid value",
        ),
        (
            b"{\"engine_id\":\"\",\"dp_rank\":0,\"tp_rank\":0,\"pp_rank\":0,\"addr\":\"a\"}",
            "engine_id is empty",
        ),
        (
            b"{\"engine_id\":\"e\",\"dp_rank\":0,\"tp_rank\":4000000000,\"pp_rank\":0,\"addr\":\"a\"}",
            "out of range",
        ),
        (b"", "malformed"),
    ];
    for (body, expected) in cases {
        let (status, resp) = client
            .request("POST", "/register", Some(body))
            .expect("answered");
        let resp = String::from_utf8_lossy(&resp);
        assert_eq!(status, 400, "{resp}");
        let json: serde_json::Value = serde_json::from_str(&resp).expect("errors are JSON");
        let reason = json["error"].as_str().expect("error field");
        assert!(reason.contains(expected), "{reason:?} lacks {expected:?}");
    }
    assert_eq!(server.registered(), 0, "nothing malformed was registered");

    // Typed error through the client API.
    let err = client
        .register(&worker("e", 0, 0, 0, ""), quick())
        .expect_err("empty addr");
    assert!(
        matches!(err, ClientError::Rejected { status: 400, .. }),
        "{err:?}"
    );
    assert!(!err.is_retryable());
}

#[test]
fn unknown_paths_methods_and_parameters() {
    let (_server, client) = start();
    assert_eq!(client.request("GET", "/nope", None).expect("404").0, 404);
    assert_eq!(
        client.request("GET", "/register", None).expect("405").0,
        405
    );
    assert_eq!(
        client
            .request("POST", "/query", Some(b"{}"))
            .expect("405")
            .0,
        405
    );
    assert_eq!(
        client
            .request("GET", "/query?bogus=1", None)
            .expect("400")
            .0,
        400
    );
    assert_eq!(
        client
            .request("GET", "/query?engine_id=%zz", None)
            .expect("400")
            .0,
        400
    );
    assert_eq!(
        client
            .request("GET", "/query?engine_id=%+1", None)
            .expect("400")
            .0,
        400
    );
    // Percent-encoded ids work (the client encodes them).
    client
        .register(&worker("engine/é 1", 0, 0, 0, "tcp://h:1"), quick())
        .expect("register");
    let found = client.query(Some("engine/é 1")).expect("query");
    assert_eq!(found[&0].engine_id, "engine/é 1");
    client.health().expect("healthy");
}

#[test]
fn body_size_and_registry_size_are_bounded() {
    let config = ServerConfig {
        max_body_bytes: 256,
        registry: RegistryLimits {
            max_workers: 2,
            ..RegistryLimits::default()
        },
        ..ServerConfig::default()
    };
    let server = BootstrapServer::start_with("127.0.0.1:0", config, None).expect("server");
    let client = BootstrapClient::new(&server.local_addr().to_string()).expect("client");

    let big = vec![b' '; 257];
    let (status, _) = client
        .request("POST", "/register", Some(&big))
        .expect("answered");
    assert_eq!(status, 413);

    client
        .register(&worker("e", 0, 0, 0, "a"), quick())
        .expect("1");
    client
        .register(&worker("e", 0, 1, 0, "b"), quick())
        .expect("2");
    // Replacing an existing slot is still allowed when full.
    client
        .register(&worker("e", 0, 1, 0, "c"), quick())
        .expect("replace");
    let full = RetryPolicy {
        deadline: Duration::from_millis(100),
        ..RetryPolicy::default()
    };
    let err = client
        .register(&worker("e", 0, 2, 0, "d"), full)
        .expect_err("full");
    // 503 is retried until the deadline, then reported as such.
    match err {
        ClientError::DeadlineExceeded { last, .. } => assert!(last.contains("503"), "{last}"),
        other => panic!("expected the deadline to pass, got {other:?}"),
    }
    assert_eq!(server.registered(), 2);
}

#[test]
fn an_engines_service_answers_query_once_all_its_ranks_registered() {
    // Two dp ranks of TP 2 × PP 1: a router that kept an answer listing
    // fewer would route to ranks nobody can reach.
    let config = ServerConfig {
        expect: Some(ExpectedRanks {
            dp_size: 2,
            workers: 2,
        }),
        ..ServerConfig::default()
    };
    let server = BootstrapServer::start_with("127.0.0.1:0", config, None).expect("server");
    let client = BootstrapClient::new(&server.local_addr().to_string()).expect("client");
    let ranks = [(0, 0), (1, 0), (0, 1), (1, 1)];
    for (i, (dp, tp)) in ranks.into_iter().enumerate() {
        match client.query(None) {
            Err(ClientError::Rejected {
                status: 503,
                reason,
            }) => {
                assert!(reason.contains("waiting for ranks"), "{reason}");
            }
            other => panic!("{i} of 4 ranks registered: {other:?}"),
        }
        // One engine's ranks, as a decode rank asks: what is there.
        let some = client.query(Some("p_dp0")).expect("a filtered query");
        assert_eq!(some.len(), usize::from(i > 0));
        let id = format!("p_dp{dp}");
        client
            .register(&worker(&id, dp, tp, 0, &format!("tcp://h:{i}")), quick())
            .expect("register");
    }
    let all = client.query(None).expect("every rank registered");
    assert_eq!(all.len(), 2);
    assert!(all.values().all(|e| e.tp_size() == 2));
    assert_eq!(
        client.query(Some("p_dp1")).expect("one engine")[&1].addr(1, 0),
        Some("tcp://h:3")
    );
}

#[test]
fn a_standalone_service_has_no_metrics() {
    let server = BootstrapServer::start("127.0.0.1:0").expect("server");
    let client = BootstrapClient::new(&server.local_addr().to_string()).expect("client");
    let (status, _) = client.request("GET", "/metrics", None).expect("raw");
    assert_eq!(status, 404);
    let (status, _) = client.request("GET", "/health", None).expect("raw");
    assert_eq!(status, 200);
}

#[test]
fn register_retries_until_the_service_is_up() {
    // Reserve a port, and make the client's first attempt fail visibly: the
    // raw listener accepts its connection and closes it without answering.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let client = BootstrapClient::new(&addr.to_string()).expect("client");
    let registering = std::thread::spawn(move || {
        client.register(
            &worker("late", 0, 0, 0, "tcp://h:9"),
            RetryPolicy {
                deadline: Duration::from_secs(20),
                initial_backoff: Duration::from_millis(5),
                max_backoff: Duration::from_millis(50),
            },
        )
    });
    let (first_attempt, _) = listener.accept().expect("first attempt arrives");
    drop(first_attempt);
    drop(listener);
    // Attempts made between here and the server start are refused and
    // retried too.
    let server = BootstrapServer::start(&addr.to_string()).expect("server on the same port");
    let resp = registering
        .join()
        .expect("thread")
        .expect("registered after retrying");
    assert_eq!(resp.status, "ok");
    assert_eq!(server.registered(), 1);
}

#[test]
fn register_gives_up_at_its_deadline() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let client = BootstrapClient::new(&format!("http://127.0.0.1:{port}/")).expect("client");
    let policy = RetryPolicy {
        deadline: Duration::from_millis(150),
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(20),
    };
    match client.register(&worker("e", 0, 0, 0, "a"), policy) {
        Err(ClientError::DeadlineExceeded { waited_ms, .. }) => assert!(waited_ms >= 150),
        other => panic!("expected DeadlineExceeded, got {other:?}"),
    }
    assert!(matches!(
        BootstrapClient::new("not an address"),
        Err(ClientError::BadAddress(_))
    ));
}

#[test]
fn wait_for_engine_returns_once_every_tp_rank_registered() {
    let (_server, client) = start();
    let short = RetryPolicy {
        deadline: Duration::from_millis(100),
        initial_backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(20),
    };
    client
        .register(&worker("p", 0, 0, 0, "tcp://h:1"), quick())
        .expect("rank 0");
    // Only one of two ranks: the wait runs out and says why.
    match client.wait_for_engine("p", 2, short) {
        Err(ClientError::DeadlineExceeded { last, .. }) => {
            assert!(last.contains("1 of 2"), "{last}")
        }
        other => panic!("expected the deadline to pass, got {other:?}"),
    }
    // The second rank registers while a waiter is waiting.
    let waiter = {
        let client = client.clone();
        std::thread::spawn(move || client.wait_for_engine("p", 2, quick()))
    };
    client
        .register(&worker("p", 0, 1, 0, "tcp://h:2"), quick())
        .expect("rank 1");
    let found = waiter.join().expect("thread").expect("complete engine");
    assert_eq!(found[&0].tp_size(), 2);
    assert_eq!(found[&0].addr(1, 0), Some("tcp://h:2"));
}
