use std::time::Duration;

use super::wire::*;
use super::*;
use kvferry_machines::store::BlockHash;
use proptest::prelude::*;

fn query(groups: usize, per_group: u32) -> LookupQuery {
    LookupQuery {
        token_len: per_group * 16,
        block_hashes: (0..groups)
            .map(|g| {
                (0..per_group)
                    .map(|i| BlockHash::from_u64((g as u64) << 32 | u64::from(i)))
                    .collect()
            })
            .collect(),
        lora: Some("adapter".into()),
        extra_keys: vec!["mm:1".into()],
    }
}

fn hit(tokens: u32) -> LookupHit {
    LookupHit {
        tokens,
        load: std::iter::once(0..tokens / 16).collect(),
    }
}

#[test]
fn messages_survive_their_bytes() {
    let q = query(2, 5);
    assert_eq!(decode_query(&encode_query(7, &q).unwrap()).unwrap(), (7, q));
    let a: LookupAnswer = Ok(hit(48));
    assert_eq!(decode_reply(&encode_reply(9, &a).unwrap()).unwrap(), (9, a));
    let f: LookupAnswer = Err(ServerFault::StoreTimeout);
    assert_eq!(decode_reply(&encode_reply(1, &f).unwrap()).unwrap(), (1, f));
}

#[test]
fn messages_out_of_bounds_are_typed_errors() {
    let too_many = query(1, LOOKUP_HASHES_MAX as u32 + 1);
    assert_eq!(
        encode_query(1, &too_many),
        Err(LookupWireError::TooManyHashes {
            count: LOOKUP_HASHES_MAX + 1
        })
    );
    // The decoder checks the bound itself, whatever a peer encodes.
    let wire = QueryWire {
        version: LOOKUP_WIRE_VERSION,
        seq: 1,
        token_len: 0,
        group_lens: vec![LOOKUP_HASHES_MAX as u32 + 1],
        hashes: (0..=LOOKUP_HASHES_MAX as u64)
            .map(|i| WireHash(BlockHash::from_u64(i)))
            .collect(),
        lora: None,
        extra_keys: Vec::new(),
    };
    let bytes = postcard::to_allocvec(&wire).unwrap();
    assert_eq!(
        decode_query(&bytes),
        Err(LookupWireError::TooManyHashes {
            count: LOOKUP_HASHES_MAX + 1
        })
    );
    let wire = QueryWire {
        group_lens: vec![2],
        hashes: vec![WireHash(BlockHash::from_u64(0))],
        ..wire
    };
    let bytes = postcard::to_allocvec(&wire).unwrap();
    assert_eq!(
        decode_query(&bytes),
        Err(LookupWireError::GroupLengths { sum: 2, hashes: 1 })
    );
    let mut good = encode_query(1, &query(1, 2)).unwrap();
    good.push(0);
    assert_eq!(
        decode_query(&good),
        Err(LookupWireError::TrailingBytes { extra: 1 })
    );
    let mut other = encode_query(1, &query(1, 2)).unwrap();
    other[0] = 2;
    assert_eq!(
        decode_query(&other),
        Err(LookupWireError::Version { got: 2 })
    );
    let big = vec![1u8; LOOKUP_MESSAGE_MAX_BYTES + 1];
    assert_eq!(
        decode_reply(&big),
        Err(LookupWireError::TooLarge { len: big.len() })
    );
    assert_eq!(decode_reply(&[]), Err(LookupWireError::Malformed));
}

proptest! {
    #[test]
    fn no_bytes_make_a_decoder_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_query(&bytes);
        let _ = decode_reply(&bytes);
    }

    #[test]
    fn no_corruption_of_a_message_makes_a_decoder_panic(at in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<prop::sample::Index>()) {
        let mut q = encode_query(3, &query(2, 4)).unwrap();
        let i = at.index(q.len());
        q[i] = byte;
        q.truncate(cut.index(q.len() + 1).max(1));
        let _ = decode_query(&q);
        let mut r = encode_reply(3, &Ok(hit(64))).unwrap();
        let i = at.index(r.len());
        r[i] = byte;
        let _ = decode_reply(&r);
    }
}

fn fixed(tokens: u32) -> impl FnMut(&LookupQuery) -> Result<LookupHit, LookupFailure> + Send {
    move |q: &LookupQuery| Ok(hit(tokens.min(q.token_len / 16 * 16)))
}

#[test]
fn a_client_gets_one_answer_per_round_trip() {
    let server = LookupServer::spawn("tcp://127.0.0.1:0", fixed(32)).unwrap();
    let mut client = LookupClient::connect(server.endpoint(), Duration::from_secs(30)).unwrap();
    for n in [1u32, 2, 5] {
        let want = hit(32.min(n * 16));
        assert_eq!(client.lookup(&query(1, n)).unwrap(), want);
    }
    let stats = client.stats();
    assert_eq!(
        (stats.round_trips, stats.timeouts, stats.sockets),
        (3, 0, 1)
    );
    assert_eq!(server.stats().answered, 3);
}

#[test]
fn a_client_makes_a_new_socket_after_a_timeout() {
    let path = std::env::temp_dir().join(format!("kvferry-lookup-{}.sock", std::process::id()));
    let endpoint = format!("ipc://{}", path.display());
    let _ = std::fs::remove_file(&path);
    // No server yet: the request is not answered in time.
    let mut client = LookupClient::connect(&endpoint, Duration::from_millis(50)).unwrap();
    let e = client.lookup(&query(1, 2));
    assert!(matches!(e, Err(LookupFailure::Timeout(_))), "{e:?}");
    let server = LookupServer::spawn(&endpoint, fixed(16)).unwrap();
    let mut client2 = client;
    // The stuck REQ socket is gone: the next lookup goes out on a new
    // one (with a longer wait, since the server is there now).
    client2.timeout = Duration::from_secs(30);
    assert_eq!(client2.lookup(&query(1, 2)).unwrap(), hit(16));
    let stats = client2.stats();
    assert_eq!(
        (stats.round_trips, stats.timeouts, stats.sockets),
        (1, 1, 2)
    );
    drop(server);
    assert!(!path.exists(), "the socket file stays behind");
}

#[test]
fn an_undecodable_request_gets_a_fault_and_the_server_goes_on() {
    let server = LookupServer::spawn("tcp://127.0.0.1:0", fixed(16)).unwrap();
    let ctx = zmq::Context::new();
    let raw = ctx.socket(zmq::REQ).unwrap();
    raw.set_linger(0).unwrap();
    raw.connect(server.endpoint()).unwrap();
    raw.send(&[0xff, 0xff, 0xff][..], 0).unwrap();
    let reply = raw.recv_bytes(0).unwrap();
    assert_eq!(
        decode_reply(&reply).unwrap(),
        (0, Err(ServerFault::Undecodable))
    );
    let mut client = LookupClient::connect(server.endpoint(), Duration::from_secs(30)).unwrap();
    assert_eq!(client.lookup(&query(1, 1)).unwrap(), hit(16));
    assert_eq!(
        server.stats(),
        LookupServerStats {
            answered: 1,
            failed: 1
        }
    );
}

#[test]
fn only_local_endpoints_are_served() {
    let e = LookupServer::spawn("tcp://0.0.0.0:0", fixed(0));
    assert!(matches!(e, Err(LookupServerError::Endpoint(_))));
}

/// A server whose every lookup waits for a word on `go` first.
fn held(
    go: flume::Receiver<()>,
) -> impl FnMut(&LookupQuery) -> Result<LookupHit, LookupFailure> + Send {
    move |q: &LookupQuery| {
        let _ = go.recv();
        Ok(hit(q.token_len / 16 * 16))
    }
}

fn board(endpoint: &str, timeout: Duration, max: usize) -> LookupBoard {
    let down = kvferry_machines::Backoff::fixed(Duration::from_secs(60));
    LookupBoard::start(endpoint, timeout, down, max).unwrap()
}

fn stat(board: &LookupBoard, name: &str) -> u64 {
    board.stats().iter().find(|(n, _)| *n == name).unwrap().1
}

#[test]
fn the_board_posts_once_answers_once_and_bounds_what_is_out() {
    let (go, wait) = flume::unbounded();
    let server = LookupServer::spawn("tcp://127.0.0.1:0", held(wait)).unwrap();
    let b = board(server.endpoint(), Duration::from_secs(30), 1);
    // Out, not answered: the scheduler is not kept waiting.
    assert_eq!(b.answer("a", query(1, 2), Duration::ZERO), None);
    assert_eq!(stat(&b, "lookups_out"), 1);
    // The bound: a second request goes without.
    let refused = b.answer("b", query(1, 2), Duration::ZERO);
    assert!(
        matches!(&refused, Some(Err(e)) if e.contains("lookups out")),
        "{refused:?}"
    );
    // Asked again, it is not posted again: one answer comes, once.
    go.send(()).unwrap();
    assert_eq!(
        b.answer("a", query(1, 2), Duration::from_secs(30)),
        Some(Ok(hit(32)))
    );
    assert_eq!(stat(&b, "lookups_out"), 0);
    assert_eq!(server.stats().answered, 1);
}

#[test]
fn an_answer_given_up_on_comes_late_and_is_counted() {
    let (go, wait) = flume::unbounded();
    let server = LookupServer::spawn("tcp://127.0.0.1:0", held(wait)).unwrap();
    let b = board(server.endpoint(), Duration::from_secs(30), 4);
    assert_eq!(b.answer("a", query(1, 1), Duration::ZERO), None);
    assert!(b.give_up("a", Duration::ZERO));
    assert!(!b.give_up("a", Duration::ZERO), "given up once");
    go.send(()).unwrap();
    go.send(()).unwrap();
    // The thread answers in order: once "b" is answered, "a" came back.
    assert_eq!(
        b.answer("b", query(1, 1), Duration::from_secs(30)),
        Some(Ok(hit(16)))
    );
    assert_eq!(
        (stat(&b, "lookups_given_up"), stat(&b, "lookups_late")),
        (1, 1)
    );
}

#[test]
fn after_a_lookup_finds_the_server_down_lookups_are_misses_for_a_while() {
    let path = std::env::temp_dir().join(format!("kvferry-board-{}.sock", std::process::id()));
    let endpoint = format!("ipc://{}", path.display());
    let _ = std::fs::remove_file(&path);
    let b = board(&endpoint, Duration::from_millis(50), 4);
    let first = b.answer("a", query(1, 1), Duration::from_secs(30));
    assert!(matches!(first, Some(Err(_))), "{first:?}");
    let next = b.answer("b", query(1, 1), Duration::from_secs(30));
    assert!(
        matches!(&next, Some(Err(e)) if e.contains("down")),
        "{next:?}"
    );
    assert_eq!(
        (stat(&b, "lookup_errors"), stat(&b, "lookups_skipped_down")),
        (1, 1)
    );
}
