//! The bootstrap service with a cluster key: only signed `/register`
//! requests are served (and signed `/query` ones, when it is closed);
//! forged, tampered, replayed and stale ones get 401 and are counted, and
//! nothing they carry reaches the registry. `GET /query` is open by
//! default, for routers that ask it unsigned.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvferry::auth::limits::Budget;
use kvferry::auth::{request, ClusterKey, Rejects, Surface};
use kvferry::bootstrap::{
    BootstrapClient, BootstrapServer, ClientError, RegisterRequest, RetryPolicy, ServerAuth,
    ServerConfig, ServerLimits,
};

fn key(byte: u8) -> ClusterKey {
    ClusterKey::from_bytes(&[byte; 32], None).unwrap()
}

fn keyed_server(open_metrics: bool, open_query: bool) -> (BootstrapServer, Arc<Rejects>) {
    let rejects = Arc::new(Rejects::default());
    let config = ServerConfig {
        auth: Some(ServerAuth {
            open_metrics,
            open_query,
            ..ServerAuth::new(key(1))
        }),
        rejects: rejects.clone(),
        ..ServerConfig::default()
    };
    let metrics: kvferry::bootstrap::MetricsSource = Arc::new(|| "# EOF\n".to_string());
    let server = BootstrapServer::start_with("127.0.0.1:0", config, Some(metrics)).unwrap();
    (server, rejects)
}

fn worker(addr: &str) -> RegisterRequest {
    RegisterRequest {
        engine_id: "prefill-a".into(),
        dp_rank: 0,
        tp_rank: 0,
        pp_rank: 0,
        addr: addr.into(),
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Sends one raw HTTP request with `auth` as the signature header; the
/// status code of the answer.
fn raw(
    server: &BootstrapServer,
    method: &str,
    target: &str,
    body: &[u8],
    auth: Option<&str>,
) -> u16 {
    let answer = raw_answer(server, method, target, body, auth);
    answer
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status line")
}

/// [`raw`]'s whole answer, head and body.
fn raw_answer(
    server: &BootstrapServer,
    method: &str,
    target: &str,
    body: &[u8],
    auth: Option<&str>,
) -> String {
    let mut s = std::net::TcpStream::connect(server.local_addr()).unwrap();
    let mut head = format!(
        "{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(a) = auth {
        head.push_str(&format!("{}: {a}\r\n", request::HEADER));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer
}

/// A hostile request: name, method, target, body and signature header.
type Case<'a> = (&'a str, &'a str, &'a str, Vec<u8>, Option<String>);

#[test]
fn only_signed_requests_reach_the_registry() {
    let (server, rejects) = keyed_server(true, false);
    let body = serde_json::to_vec(&worker("tcp://127.0.0.1:5000")).unwrap();
    let signed = |k: &ClusterKey, t: u64, method: &str, target: &str, b: &[u8]| {
        request::sign(k, t, method, target, b).unwrap()
    };
    let forged_body = serde_json::to_vec(&worker("tcp://10.6.6.6:5000")).unwrap();
    let cases: Vec<Case> = vec![
        ("unsigned", "POST", "/register", body.clone(), None),
        (
            "another key",
            "POST",
            "/register",
            body.clone(),
            Some(signed(&key(2), now_ms(), "POST", "/register", &body)),
        ),
        (
            "a body changed after signing",
            "POST",
            "/register",
            forged_body,
            Some(signed(&key(1), now_ms(), "POST", "/register", &body)),
        ),
        (
            "a stale timestamp",
            "POST",
            "/register",
            body.clone(),
            Some(signed(
                &key(1),
                now_ms() - 60_000,
                "POST",
                "/register",
                &body,
            )),
        ),
        (
            "a signature of another route",
            "GET",
            "/query",
            Vec::new(),
            Some(signed(&key(1), now_ms(), "GET", "/query?engine_id=x", b"")),
        ),
        (
            "garbage",
            "GET",
            "/query",
            Vec::new(),
            Some("v1 1 2 3".into()),
        ),
    ];
    for (n, (name, method, target, body, auth)) in cases.into_iter().enumerate() {
        let status = raw(&server, method, target, &body, auth.as_deref());
        assert_eq!(status, 401, "{name}");
        assert_eq!(
            rejects.get(Surface::Bootstrap),
            n as u64 + 1,
            "{name}: counted"
        );
        assert_eq!(server.registered(), 0, "{name}: the registry changed");
    }

    // A signed registration lands once; the same bytes again are a replay.
    let good = signed(&key(1), now_ms(), "POST", "/register", &body);
    assert_eq!(raw(&server, "POST", "/register", &body, Some(&good)), 200);
    assert_eq!(server.registered(), 1);
    assert_eq!(raw(&server, "POST", "/register", &body, Some(&good)), 401);
    assert_eq!(rejects.get(Surface::Bootstrap), 7, "the replay is counted");

    // /health and (by default) /metrics stay open.
    assert_eq!(raw(&server, "GET", "/health", b"", None), 200);
    assert_eq!(raw(&server, "GET", "/metrics", b"", None), 200);
    assert_eq!(rejects.get(Surface::Bootstrap), 7);
}

#[test]
fn clients_sign_and_an_unkeyed_client_fails_at_once() {
    let (server, rejects) = keyed_server(false, true);
    let addr = server.local_addr().to_string();
    let keyed = BootstrapClient::new(&addr).unwrap().with_key(Some(key(1)));
    let policy = RetryPolicy {
        deadline: Duration::from_secs(30),
        ..RetryPolicy::default()
    };
    keyed
        .register(&worker("tcp://127.0.0.1:5001"), policy)
        .unwrap();
    let found = keyed.query(Some("prefill-a")).unwrap();
    assert_eq!(found[&0].addr(0, 0), Some("tcp://127.0.0.1:5001"));
    keyed
        .metrics_text()
        .expect("a signed scrape of a closed /metrics");
    assert_eq!(rejects.get(Surface::Bootstrap), 0);

    // Without the key: refused, not retried for the 30 s deadline.
    let plain = BootstrapClient::new(&addr).unwrap();
    let started = std::time::Instant::now();
    let e = plain
        .register(&worker("tcp://10.6.6.6:5001"), policy)
        .unwrap_err();
    assert!(matches!(e, ClientError::Unauthorized), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5), "retried a 401");
    assert!(matches!(
        plain.metrics_text(),
        Err(ClientError::Unauthorized)
    ));
    assert_eq!(rejects.get(Surface::Bootstrap), 2);
    // `GET /query` is open: what a router without the key reads.
    let found = plain.query(None).expect("an open /query");
    assert_eq!(
        found[&0].addr(0, 0),
        Some("tcp://127.0.0.1:5001"),
        "the forged address landed"
    );
}

#[test]
fn an_open_query_serves_unsigned_reads_and_nothing_else() {
    let (server, rejects) = keyed_server(true, true);
    let body = serde_json::to_vec(&worker("tcp://10.6.6.6:5000")).unwrap();
    assert_eq!(raw(&server, "POST", "/register", &body, None), 401);
    assert_eq!(raw(&server, "POST", "/query", &body, None), 401);
    assert_eq!(raw(&server, "GET", "/query", b"", None), 200);
    assert_eq!(raw(&server, "GET", "/query?engine_id=x", b"", None), 200);
    assert_eq!(rejects.get(Surface::Bootstrap), 2);
    assert_eq!(server.registered(), 0);
}

#[test]
fn unsigned_callers_hear_401_off_the_open_routes_signed_ones_404_and_405() {
    let (server, rejects) = keyed_server(true, true);
    let sign =
        |method: &str, target: &str| request::sign(&key(1), now_ms(), method, target, b"").unwrap();
    // Unsigned: an unknown path, or an open path with another method,
    // tells nothing of the routes.
    assert_eq!(raw(&server, "GET", "/nope", b"", None), 401);
    assert_eq!(raw(&server, "POST", "/health", b"", None), 401);
    assert_eq!(raw(&server, "POST", "/metrics", b"", None), 401);
    assert_eq!(rejects.get(Surface::Bootstrap), 3);
    // Signed: the one rule, 404 for an unknown path and 405 naming the
    // methods a known one takes, errors in JSON as every error.
    let missing = raw_answer(&server, "GET", "/nope", b"", Some(&sign("GET", "/nope")));
    assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
    assert!(
        missing.ends_with(r#"{"error":"no route /nope"}"#),
        "{missing}"
    );
    let wrong = raw_answer(
        &server,
        "POST",
        "/health",
        b"",
        Some(&sign("POST", "/health")),
    );
    assert!(wrong.starts_with("HTTP/1.1 405"), "{wrong}");
    assert!(wrong.contains("\r\nAllow: GET\r\n"), "{wrong}");
    assert!(wrong.contains("application/json"), "{wrong}");
    assert_eq!(rejects.get(Surface::Bootstrap), 3);

    // Without a key, the same 404 and 405.
    let open = BootstrapServer::start("127.0.0.1:0").unwrap();
    let wrong = raw_answer(&open, "GET", "/register", b"", None);
    assert!(wrong.starts_with("HTTP/1.1 405"), "{wrong}");
    assert!(wrong.contains("\r\nAllow: POST\r\n"), "{wrong}");
    assert!(raw_answer(&open, "GET", "/nope", b"", None).starts_with("HTTP/1.1 404"));
}

#[test]
fn a_flood_of_bad_requests_is_limited_apart_from_the_good_ones() {
    let rejects = Arc::new(Rejects::default());
    let budget = |burst| Budget {
        per_second: 1,
        burst,
        max_addrs: 16,
    };
    let config = ServerConfig {
        auth: Some(ServerAuth::new(key(1))),
        rejects: rejects.clone(),
        limits: ServerLimits {
            requests: budget(5),
            refusals: budget(3),
        },
        ..ServerConfig::default()
    };
    let server = BootstrapServer::start_with("127.0.0.1:0", config, None).unwrap();
    let body = serde_json::to_vec(&worker("tcp://10.6.6.6:1")).unwrap();
    let statuses: Vec<u16> = (0..10)
        .map(|_| raw(&server, "POST", "/register", &body, None))
        .collect();
    assert_eq!(statuses, [401, 401, 401, 429, 429, 429, 429, 429, 429, 429]);
    assert_eq!(rejects.get(Surface::Bootstrap), 3);
    assert_eq!(rejects.limited(Surface::Bootstrap), 7);
    // The same address's signed requests have their own budget.
    let keyed = BootstrapClient::new(&server.local_addr().to_string())
        .unwrap()
        .with_key(Some(key(1)));
    for _ in 0..5 {
        keyed.query(None).expect("within the address's budget");
    }
    let e = keyed.query(None).unwrap_err();
    assert!(
        matches!(e, ClientError::Rejected { status: 429, .. }),
        "{e}"
    );
    assert!(e.is_retryable());
    assert_eq!(rejects.limited(Surface::Bootstrap), 8);
    assert_eq!(server.registered(), 0);
}
