//! The bootstrap service over real HTTP on 127.0.0.1.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use kvferry::bootstrap::{
    BootstrapClient, BootstrapServer, ClientError, Metrics, Outcome, RegisterRequest,
    RegistryLimits, RetryPolicy, ServerConfig, LATENCY_BUCKETS_S,
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
    let server = BootstrapServer::start_with("127.0.0.1:0", config, Arc::new(Metrics::new()))
        .expect("server");
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
fn metrics_are_prometheus_text() {
    let metrics = Arc::new(Metrics::new());
    let server =
        BootstrapServer::start_with("127.0.0.1:0", ServerConfig::default(), Arc::clone(&metrics))
            .expect("server");
    let client = BootstrapClient::new(&server.local_addr().to_string()).expect("client");

    metrics.record_transfer(Outcome::Ok, Duration::from_micros(700));
    metrics.record_transfer(Outcome::Ok, Duration::from_millis(3));
    metrics.record_transfer(Outcome::Ok, Duration::from_secs(100));
    metrics.record_transfer(Outcome::Failed, Duration::from_millis(1));
    metrics.record_transfer(Outcome::Expired, Duration::from_secs(300));
    metrics.record_transfer(Outcome::Aborted, Duration::ZERO);
    metrics.add_bytes(12345);
    metrics.add_descriptors(67);
    metrics.record_expired_hold();
    metrics.record_peer_marked_dead();
    metrics.record_peer_marked_dead();

    let (status, _) = client.request("GET", "/metrics", None).expect("raw");
    assert_eq!(status, 200);
    let text = client.metrics_text().expect("metrics");

    // Every sample line is `name[{labels}] value` with a HELP and TYPE for
    // its family before it.
    let mut declared = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            let name = parts.next().expect("name").to_string();
            let kind = parts.next().expect("kind");
            assert!(matches!(kind, "counter" | "histogram"), "{line}");
            declared.push(name);
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample has a value");
        value.parse::<f64>().expect("numeric value");
        let name = series.split('{').next().expect("name");
        let family = name
            .strip_suffix("_bucket")
            .or_else(|| name.strip_suffix("_sum"))
            .or_else(|| name.strip_suffix("_count"))
            .filter(|f| declared.iter().any(|d| d == f))
            .unwrap_or(name);
        assert!(
            declared.iter().any(|d| d == family),
            "{name} has no TYPE line"
        );
    }

    let sample = |series: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
            .parse()
            .expect("number")
    };
    assert_eq!(sample("kvferry_transfers_total{outcome=\"ok\"}"), 3.0);
    assert_eq!(sample("kvferry_transfers_total{outcome=\"failed\"}"), 1.0);
    assert_eq!(sample("kvferry_transfers_total{outcome=\"expired\"}"), 1.0);
    assert_eq!(sample("kvferry_transfers_total{outcome=\"aborted\"}"), 1.0);
    assert_eq!(sample("kvferry_transfer_bytes_total"), 12345.0);
    assert_eq!(sample("kvferry_transfer_descriptors_total"), 67.0);
    assert_eq!(sample("kvferry_expired_holds_total"), 1.0);
    assert_eq!(sample("kvferry_peers_marked_dead_total"), 2.0);

    // Histogram of the three successful transfers: 0.7 ms, 3 ms, 100 s.
    let h = "kvferry_transfer_duration_seconds";
    assert_eq!(sample(&format!("{h}_bucket{{le=\"0.0005\"}}")), 0.0);
    assert_eq!(sample(&format!("{h}_bucket{{le=\"0.001\"}}")), 1.0);
    assert_eq!(sample(&format!("{h}_bucket{{le=\"0.005\"}}")), 2.0);
    assert_eq!(sample(&format!("{h}_bucket{{le=\"60\"}}")), 2.0);
    assert_eq!(sample(&format!("{h}_bucket{{le=\"+Inf\"}}")), 3.0);
    assert_eq!(sample(&format!("{h}_count")), 3.0);
    assert!((sample(&format!("{h}_sum")) - 100.0037).abs() < 1e-6);
    // Buckets are cumulative: never decreasing, one line per bound + Inf.
    let buckets: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{h}_bucket")))
        .map(|l| {
            l.rsplit_once(' ')
                .expect("value")
                .1
                .parse()
                .expect("number")
        })
        .collect();
    assert_eq!(buckets.len(), LATENCY_BUCKETS_S.len() + 1);
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]));
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
