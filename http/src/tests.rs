use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvferry_auth::request::{self, Verifier};
use kvferry_auth::ClusterKey;

use crate::*;

/// An answer as the wire carries it.
struct Answer {
    status: u16,
    head: String,
    body: String,
}

impl Answer {
    /// The value of the header `name`, if sent.
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// Sends one request (`headers` as whole lines) and reads the answer.
fn send(server: &Server, method: &str, target: &str, body: &[u8], headers: &[String]) -> Answer {
    let mut s = std::net::TcpStream::connect(server.local_addr()).unwrap();
    let mut head = format!(
        "{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for h in headers {
        head.push_str(&format!("{h}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head");
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok());
    Answer {
        status: status.expect("a status line"),
        head: head.to_string(),
        body: body.to_string(),
    }
}

fn get(server: &Server, target: &str) -> Answer {
    send(server, "GET", target, b"", &[])
}

fn text(body: &str) -> Reply {
    Reply::new(200, "text/plain", body.to_string())
}

/// `GET /a`, `POST /a` (echoes the path, query and body) and `GET /b`.
fn routes() -> Routes {
    let echo = |r: &Request<'_>| {
        let body = String::from_utf8_lossy(r.body());
        text(&format!("{} {} {body}", r.path(), r.query()))
    };
    Routes::new()
        .route(Method::Get, "/a", Access::Open, |_| text("a"))
        .route(Method::Post, "/a", Access::Open, echo)
        .route(Method::Get, "/b", Access::Open, |_| text("b"))
}

fn start(config: Config, routes: Routes) -> Server {
    Server::start("127.0.0.1:0", config, routes).unwrap()
}

#[test]
fn routes_match_on_method_and_path_without_the_query() {
    let server = start(Config::new("t"), routes());
    let a = get(&server, "/a?x=1");
    assert_eq!((a.status, a.body.as_str()), (200, "a"));
    assert_eq!(a.header("Content-Type"), Some("text/plain"));
    assert_eq!(get(&server, "/b").body, "b");
    let posted = send(&server, "POST", "/a?k=v", b"hello", &[]);
    assert_eq!((posted.status, posted.body.as_str()), (200, "/a k=v hello"));
}

#[test]
fn an_unknown_path_is_404_and_another_method_405_with_allow() {
    let server = start(Config::new("t"), routes());
    let missing = get(&server, "/nope");
    assert_eq!(missing.status, 404);
    assert_eq!(missing.body, "no route /nope\n");
    assert_eq!(missing.header("Allow"), None);

    let wrong = send(&server, "PUT", "/a", b"", &[]);
    assert_eq!(wrong.status, 405);
    assert_eq!(wrong.header("Allow"), Some("GET, POST"));
    assert_eq!(wrong.body, "method PUT not allowed on /a\n");
    let wrong = send(&server, "DELETE", "/b?x", b"", &[]);
    assert_eq!((wrong.status, wrong.header("Allow")), (405, Some("GET")));
}

#[test]
fn refusals_are_worded_by_the_server() {
    let config = Config {
        refusal: |r| Reply::new(r.status(), "application/json", format!("{{\"e\":\"{r}\"}}")),
        ..Config::new("t")
    };
    let server = start(config, routes());
    let wrong = send(&server, "DELETE", "/a", b"", &[]);
    assert_eq!(wrong.status, 405);
    assert_eq!(wrong.body, r#"{"e":"method DELETE not allowed on /a"}"#);
    assert_eq!(wrong.header("Content-Type"), Some("application/json"));
    assert_eq!(
        wrong.header("Allow"),
        Some("GET, POST"),
        "added to any wording"
    );
}

#[test]
fn a_body_past_the_limit_is_413() {
    let config = Config {
        max_body_bytes: 8,
        ..Config::new("t")
    };
    let server = start(config, routes());
    let at_limit = send(&server, "POST", "/a", b"12345678", &[]);
    assert_eq!(
        (at_limit.status, at_limit.body.as_str()),
        (200, "/a  12345678")
    );
    let past = send(&server, "POST", "/a", b"123456789", &[]);
    assert_eq!(past.status, 413);
    assert_eq!(past.body, "body larger than 8 bytes\n");
    // Even where no route would take it: the body is read first.
    assert_eq!(
        send(&server, "POST", "/nope", b"123456789", &[]).status,
        413
    );
}

#[test]
fn a_handler_panic_answers_500_and_the_worker_goes_on() {
    let routes = routes().route(Method::Get, "/panic", Access::Open, |_| panic!("boom"));
    let server = start(Config::new("t"), routes);
    for _ in 0..3 {
        let answer = get(&server, "/panic");
        assert_eq!(
            (answer.status, answer.body.as_str()),
            (500, "internal error\n")
        );
        assert_eq!(
            get(&server, "/a").status,
            200,
            "the one worker still serves"
        );
    }
}

#[test]
fn stop_finishes_the_request_in_flight_and_joins_every_worker() {
    let held = Arc::new(());
    let (entered_tx, entered_rx) = std::sync::mpsc::channel();
    let finished = Arc::new(AtomicBool::new(false));
    let routes = {
        let (held, finished) = (held.clone(), finished.clone());
        let entered = Mutex::new(entered_tx);
        Routes::new().route(Method::Get, "/slow", Access::Open, move |_| {
            let _held = &held;
            entered.lock().unwrap().send(()).unwrap();
            std::thread::sleep(Duration::from_millis(200));
            finished.store(true, Ordering::SeqCst);
            text("done")
        })
    };
    let config = Config {
        workers: 3,
        ..Config::new("t")
    };
    let mut server = start(config, routes);
    let addr = server.local_addr();
    let client = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        answer
    });
    entered_rx.recv().unwrap();
    server.stop();
    assert!(
        finished.load(Ordering::SeqCst),
        "stop waited for the handler"
    );
    // Every worker is gone: none holds the routes any more.
    assert_eq!(Arc::strong_count(&held), 1);
    assert!(client.join().unwrap().ends_with("done"));
    server.stop();
}

/// Lets a request in when it is signed with `key` (or when its route is
/// open), counting what it turns away.
struct Signed {
    key: ClusterKey,
    verifier: Mutex<Verifier>,
}

impl Gate for Signed {
    fn check(&self, request: &Request<'_>, access: Access) -> Result<(), Reply> {
        if access == Access::Open {
            return Ok(());
        }
        let verdict = verify_signed(&mut self.verifier.lock().unwrap(), &self.key, request);
        verdict.map_err(|_| Reply::new(401, "text/plain", "who?".into()))
    }
}

fn key(byte: u8) -> ClusterKey {
    ClusterKey::from_bytes(&[byte; 32], None).unwrap()
}

fn signature(key: &ClusterKey, method: &str, target: &str, body: &[u8]) -> Vec<String> {
    let value = request::sign(key, unix_ms(), method, target, body).unwrap();
    vec![format!("{}: {value}", request::HEADER)]
}

#[test]
fn signed_routes_pass_the_gate_and_open_ones_need_not() {
    let gate = Arc::new(Signed {
        key: key(1),
        verifier: Mutex::new(Verifier::new(30_000, 64)),
    });
    let routes = Routes::new()
        .route(Method::Get, "/open", Access::Open, |_| text("open"))
        .route(Method::Post, "/signed", Access::Signed, |r| {
            text(&String::from_utf8_lossy(r.body()))
        })
        .unmatched(Access::Signed)
        .gate(gate);
    let server = start(Config::new("t"), routes);
    assert_eq!(get(&server, "/open").status, 200);

    let body = b"payload";
    let unsigned = send(&server, "POST", "/signed", body, &[]);
    assert_eq!((unsigned.status, unsigned.body.as_str()), (401, "who?"));
    let other_key = signature(&key(2), "POST", "/signed", body);
    assert_eq!(
        send(&server, "POST", "/signed", body, &other_key).status,
        401
    );
    let good = signature(&key(1), "POST", "/signed", body);
    let signed = send(&server, "POST", "/signed", body, &good);
    assert_eq!((signed.status, signed.body.as_str()), (200, "payload"));

    // Unmatched requests are signed too: an unsigned caller hears nothing
    // of what the server has, a signed one its 404 or 405.
    assert_eq!(get(&server, "/nope").status, 401);
    assert_eq!(send(&server, "POST", "/open", b"", &[]).status, 401);
    let good = signature(&key(1), "GET", "/nope", b"");
    assert_eq!(send(&server, "GET", "/nope", b"", &good).status, 404);
    let good = signature(&key(1), "POST", "/open", b"");
    let wrong = send(&server, "POST", "/open", b"", &good);
    assert_eq!((wrong.status, wrong.header("Allow")), (405, Some("GET")));
}

#[test]
fn a_signed_route_without_a_gate_refuses() {
    let routes = Routes::new().route(Method::Get, "/s", Access::Signed, |_| text("s"));
    let server = start(Config::new("t"), routes);
    assert_eq!(get(&server, "/s").status, 401);
}

#[test]
#[should_panic(expected = "two routes for GET /a")]
fn two_routes_for_one_method_and_path_are_a_mistake() {
    let _ = routes().route(Method::Get, "/a", Access::Open, |_| text("again"));
}

#[test]
fn a_bad_address_is_an_error() {
    let e = Server::start("not an address", Config::new("t"), Routes::new());
    assert!(
        matches!(e, Err(ServerError::BadAddress { .. })),
        "{:?}",
        e.err()
    );
}
