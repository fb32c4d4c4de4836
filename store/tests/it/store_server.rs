//! `kvferry store serve` in this process: engines' connectors over the
//! `kvferry://` backend, the server moving every byte over the tcp data
//! plane into and out of the engines' registered memory.

use std::io::{Read, Write};
use std::time::Instant;

use crate::store_buffer;

use kvferry_store::internal::proto::{self, Answer, Refusal, Request};
use kvferry_store::{
    CallError, GetItem, ItemError, PutItem, PutOutcome, RemoteConfig, RemoteStore, Scatter,
    Segment, StoreBackend,
};
use kvferry_store_server::{ServeConfig, StoreServer};
use store_buffer::{check_remove_prefix, far, key, Buffer};

fn server(capacity_bytes: u64) -> StoreServer {
    StoreServer::start(ServeConfig {
        capacity_bytes,
        metrics_listen: Some("127.0.0.1:0".into()),
        ..ServeConfig::default()
    })
    .unwrap()
}

fn remote(server: &StoreServer) -> RemoteStore {
    let url = format!("kvferry://{}", server.local_addr());
    RemoteStore::connect(RemoteConfig::from_url(&url)).unwrap()
}

#[test]
fn a_segment_outside_the_engines_registered_memory_moves_no_byte() {
    let srv = server(1 << 20);
    let mut engine = remote(&srv);
    let kv = Buffer::new(4, 256, 7);
    engine.register(&kv.layout()).unwrap();
    // Memory the engine never registered.
    let outside = Buffer::new(1, 256, 9);
    let items = [
        PutItem {
            key: key("in"),
            from: kv.scatter(1),
        },
        PutItem {
            key: key("out"),
            from: outside.scatter(0),
        },
    ];
    let answers = engine.put(&items, far()).unwrap();
    assert_eq!(answers[0], Ok(PutOutcome::Stored));
    assert_eq!(answers[1], Err(ItemError::Transport));
    assert_eq!(
        engine.exists(&[key("in"), key("out")], far()).unwrap(),
        [true, false]
    );
    assert_eq!(
        srv.stats().bytes_in,
        256,
        "only the registered block was read"
    );
}

#[test]
fn gets_check_the_stored_length_and_write_only_their_blocks() {
    let srv = server(1 << 20);
    let mut engine = remote(&srv);
    let mut kv = Buffer::new(4, 256, 0);
    for (i, b) in kv.bytes.iter_mut().enumerate() {
        *b = (i / 256) as u8 + 1;
    }
    engine.register(&kv.layout()).unwrap();
    let put = [PutItem {
        key: key("b2"),
        from: kv.scatter(2),
    }];
    assert_eq!(engine.put(&put, far()).unwrap(), [Ok(PutOutcome::Stored)]);
    assert_eq!(engine.put(&put, far()).unwrap(), [Ok(PutOutcome::Exists)]);
    // Load block 2's value into block 0; block 1 gets a wrong-size ask.
    let half = {
        let addr = kv.bytes.as_ptr() as u64 + 256;
        // SAFETY: the first half of block 1, inside `kv`.
        unsafe { Scatter::from_raw(vec![Segment { addr, len: 128 }]) }
    };
    let gets = [
        GetItem {
            key: key("b2"),
            into: kv.scatter(0),
        },
        GetItem {
            key: key("b2"),
            into: half,
        },
        GetItem {
            key: key("none"),
            into: kv.scatter(3),
        },
    ];
    let answers = engine.get(&gets, far()).unwrap();
    assert_eq!(answers[0], Ok(()));
    assert_eq!(
        answers[1],
        Err(ItemError::WrongSize {
            got_bytes: 256,
            want_bytes: 128
        })
    );
    assert_eq!(answers[2], Err(ItemError::NotFound));
    assert!(
        kv.bytes[..256].iter().all(|&b| b == 3),
        "block 0 holds block 2's bytes"
    );
    assert!(
        kv.bytes[256..512].iter().all(|&b| b == 2),
        "block 1 untouched"
    );
    assert!(kv.bytes[768..].iter().all(|&b| b == 4), "block 3 untouched");
}

#[test]
fn evictions_reach_the_engine_as_removed_keys() {
    // Room for two values of 256 bytes.
    let srv = server(512);
    let mut engine = remote(&srv);
    let kv = Buffer::new(4, 256, 1);
    engine.register(&kv.layout()).unwrap();
    for (i, k) in ["a", "b", "c"].iter().enumerate() {
        let put = [PutItem {
            key: key(k),
            from: kv.scatter(i as u64),
        }];
        assert_eq!(engine.put(&put, far()).unwrap(), [Ok(PutOutcome::Stored)]);
    }
    assert_eq!(engine.take_removed(16), [key("a")]);
    assert_eq!(srv.stats().evictions, 1);
    let too_big = Buffer::new(1, 1024, 1);
    engine.register(&too_big.layout()).unwrap();
    let put = [PutItem {
        key: key("big"),
        from: too_big.scatter(0),
    }];
    assert_eq!(engine.put(&put, far()).unwrap(), [Err(ItemError::TooLarge)]);
}

#[test]
fn a_call_to_a_server_that_is_gone_fails_and_a_new_server_is_picked_up() {
    let srv = server(1 << 20);
    let addr = srv.local_addr();
    let mut engine = remote(&srv);
    let kv = Buffer::new(2, 256, 5);
    engine.register(&kv.layout()).unwrap();
    assert_eq!(engine.exists(&[key("x")], far()).unwrap(), [false]);
    drop(srv);
    assert_eq!(engine.exists(&[key("x")], far()), Err(CallError::Transport));
    let again = StoreServer::start(ServeConfig {
        listen: addr,
        capacity_bytes: 1 << 20,
        ..ServeConfig::default()
    })
    .expect("the port is free again at once");
    let put = [PutItem {
        key: key("x"),
        from: kv.scatter(0),
    }];
    assert_eq!(engine.put(&put, far()).unwrap(), [Ok(PutOutcome::Stored)]);
    assert_eq!(again.stats().commits, 1);
}

fn raw_call(stream: &mut std::net::TcpStream, frame: &[u8]) -> Answer {
    stream.write_all(frame).unwrap();
    let mut header = [0u8; proto::HEADER_LEN];
    stream.read_exact(&mut header).unwrap();
    let len = proto::decode_header(&header).unwrap();
    let mut body = vec![0u8; len as usize];
    stream.read_exact(&mut body).unwrap();
    proto::decode_reply(&body).unwrap().1.answer
}

#[test]
fn malformed_and_out_of_order_requests_are_refused_and_others_served() {
    let srv = server(1 << 20);
    let mut a = std::net::TcpStream::connect(srv.local_addr()).unwrap();
    let put = Request::Put {
        budget_ms: 100,
        items: Vec::new(),
    };
    let answer = raw_call(&mut a, &proto::encode(1, &put).unwrap());
    assert_eq!(answer, Answer::Refused(Refusal::NoHello));
    let mut garbage = proto::header(3).to_vec();
    garbage.extend_from_slice(&[0xFF, 0xFF, 0xFF]);
    assert_eq!(
        raw_call(&mut a, &garbage),
        Answer::Refused(Refusal::Malformed)
    );
    let mut rest = Vec::new();
    assert_eq!(a.read_to_end(&mut rest).unwrap(), 0, "the server hung up");
    // Another engine is served as ever.
    let mut engine = remote(&srv);
    assert_eq!(engine.exists(&[key("k")], far()).unwrap(), [false]);
    assert_eq!(srv.stats().refused, 2);
}

#[test]
fn metrics_are_served_in_prometheus_text() {
    let srv = server(1 << 20);
    let mut engine = remote(&srv);
    assert_eq!(engine.exists(&[key("k")], far()).unwrap(), [false]);
    let addr = srv.metrics_addr().unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    assert!(
        text.contains("kvferry_store_capacity_bytes 1048576"),
        "{text}"
    );
    assert!(text.contains("kvferry_store_requests_total "), "{text}");
}

mod through_the_connector {
    //! The connector's paths over the server: pressure, and a long lookup
    //! in one round trip.

    use super::*;
    use kvferry_machines::internal::common::{BlockId, TransferId};
    use kvferry_machines::internal::store::events::Medium;
    use kvferry_machines::internal::store::{BlockHash, KeyspaceSpec, StoreConfig};
    use kvferry_store::{
        ConnectorConfig, ConnectorLimits, StoreConnector, StoreRequest, StoreSaveMeta,
    };
    use kvferry_testkit::model::{self, ModelSpecExt};

    const BLOCK_TOKENS: u32 = 16;

    fn config(tp_size: u32, max_keys_per_batch: usize) -> ConnectorConfig {
        ConnectorConfig {
            store: StoreConfig {
                max_keys_per_batch,
                ..StoreConfig::default()
            },
            keyspace: KeyspaceSpec {
                tp_size,
                ..model::keyspace(
                    "server/model",
                    model::medium()
                        .with_block_tokens(BLOCK_TOKENS)
                        .with_head_bytes(16),
                )
            },
            medium: Medium::Cpu,
            limits: ConnectorLimits::default(),
        }
    }

    fn save(c: &mut StoreConnector, id: u64, blocks: std::ops::Range<u32>) {
        let ids: Vec<u32> = blocks.collect();
        let meta = StoreSaveMeta {
            request: StoreRequest {
                id: TransferId(id),
                block_hashes: vec![ids.iter().map(|&b| BlockHash::from_u64(b.into())).collect()],
                block_ids: vec![ids.iter().map(|&b| BlockId(b)).collect()],
                lora: None,
                extra_keys: Vec::new(),
            },
            token_len: ids.len() as u32 * BLOCK_TOKENS,
            token_ids: None,
        };
        c.start_save(Instant::now(), meta).unwrap();
        c.wait_for_save();
        assert_eq!(c.get_finished().0, [TransferId(id)]);
    }

    #[test]
    fn a_server_smaller_than_a_batch_takes_the_pressure_path_until_a_save_succeeds() {
        // One block is 8 heads x 16 tokens x 16 bytes = 2 KiB: room for 3.
        let kv = Buffer::new(16, 2048, 4);
        let srv = server(3 * 2048);
        let mut c = StoreConnector::new(config(1, 8), remote(&srv)).unwrap();
        // SAFETY: `kv` outlives the connector and is not touched meanwhile.
        unsafe { c.register_kv_caches(kv.layout()).unwrap() };
        // 8 puts in one batch: the 4th finds every byte reserved.
        save(&mut c, 1, 0..8);
        let s = c.stats();
        assert_eq!(s.pressure.full_saves, 1, "{s:?}");
        assert!(s.save_failed_keys >= 5, "{s:?}");
        assert!(srv.stats().full > 0);
        // A save that fits clears it.
        save(&mut c, 2, 8..10);
        let s = c.stats();
        assert_eq!(s.pressure.clears, 1, "{s:?}");
        assert_eq!(s.saved_keys, 3 + 2, "{s:?}");
    }

    #[test]
    fn a_128k_token_lookup_at_tp_8_is_one_round_trip() {
        let kv = Buffer::new(16, 256, 0);
        let srv = server(1 << 20);
        let mut c = StoreConnector::new(config(8, 128), remote(&srv)).unwrap();
        let mut layout = kv.layout();
        layout.tp_size = 8;
        layout.regions[0].kv_block_len = 256;
        // SAFETY: as above.
        unsafe { c.register_kv_caches(layout).unwrap() };
        let hashes: Vec<BlockHash> = (0..8192u64).map(BlockHash::from_u64).collect();
        assert_eq!(
            c.lookup(8192 * BLOCK_TOKENS, std::slice::from_ref(&hashes))
                .unwrap(),
            0
        );
        let before = srv.stats().requests;
        assert_eq!(c.lookup(8192 * BLOCK_TOKENS, &[hashes]).unwrap(), 0);
        assert_eq!(
            srv.stats().requests - before,
            1,
            "one request to the server"
        );
        assert_eq!(
            c.stats().lookup_keys,
            2 * 8192 * 8,
            "every rank's key of every block"
        );
    }
}

#[test]
fn a_hello_naming_an_endpoint_at_another_ip_is_refused() {
    let srv = server(1 << 20);
    let mut a = std::net::TcpStream::connect(srv.local_addr()).unwrap();
    for endpoint in ["tcp://127.0.0.2:7000", "tcp://[::1]:7000", "local://1"] {
        let hello = Request::Hello {
            endpoint: endpoint.into(),
            removed_from: None,
        };
        let answer = raw_call(&mut a, &proto::encode(1, &hello).unwrap());
        assert_eq!(answer, Answer::Refused(Refusal::NoHello), "{endpoint}");
    }
}

#[test]
fn removals_while_an_engine_was_disconnected_are_told_when_it_comes_back() {
    let srv = server(512);
    let kv = Buffer::new(4, 256, 1);
    let mut a = remote(&srv);
    let mut b = remote(&srv);
    a.register(&kv.layout()).unwrap();
    b.register(&kv.layout()).unwrap();
    let put = |e: &mut RemoteStore, k: &str, block: u64| {
        let items = [PutItem {
            key: key(k),
            from: kv.scatter(block),
        }];
        assert_eq!(e.put(&items, far()).unwrap(), [Ok(PutOutcome::Stored)]);
    };
    put(&mut a, "a1", 0);
    // Registering again drops a's connection; b's puts evict a1 meanwhile.
    a.register(&kv.layout()).unwrap();
    put(&mut b, "b1", 1);
    put(&mut b, "b2", 2);
    assert!(b.take_removed(16).contains(&key("a1")));
    // a's next call reconnects from where it left off in the log.
    assert_eq!(a.exists(&[key("a1")], far()).unwrap(), [false]);
    assert_eq!(a.take_removed(16), [key("a1")]);
}

#[test]
fn a_prefix_removes_its_keys_and_no_others() {
    let srv = server(1 << 20);
    let mut r = remote(&srv);
    let kv = Buffer::new(4, 64, 0);
    r.register(&kv.layout()).unwrap();
    check_remove_prefix(&mut r, &kv);
}
