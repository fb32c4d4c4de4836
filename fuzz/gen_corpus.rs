//! Writes seed corpora from valid encodings into `fuzz/seeds/<target>/`
//! (run from `fuzz/`: `cargo run --example gen_corpus`). libFuzzer mutates
//! from these, so it starts past the magic/version checks and the postcard
//! enum tags instead of having to discover them byte by byte.

use kvferry::transport::internal::wire as tw;
use kvferry_machines::internal::common::{BlockId, Mode, Msg, TransferId};
use kvferry_machines::internal::wire::{self, Frame, Hello, Limits, Refuse, RefuseReason, VERSION};
use kvferry_machines::{LayoutKind, ModelSpec, Pool, PoolKind, PoolRegion, RankLayout, Region};
use std::fs;
use std::path::Path;

#[allow(dead_code)]
#[path = "../cli/src/plan/spec.rs"]
mod spec;

/// Empties `seeds/<target>/`, so seeds of a renamed variant do not linger.
fn reset(target: &str) {
    let dir = Path::new("seeds").join(target);
    match fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("remove {}: {e}", dir.display()),
    }
}

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new("seeds").join(target);
    fs::create_dir_all(&dir).expect("create seed dir");
    fs::write(dir.join(name), bytes).expect("write seed");
}

fn model() -> ModelSpec {
    ModelSpec {
        layout: LayoutKind::Hnd,
        total_kv_heads: 4,
        block_tokens: 2,
        head_bytes: 8,
    }
}

fn rank(tp_size: u32, tp_rank: u32, base: u64) -> RankLayout {
    let kv = (4 / tp_size) as u64 * 2 * 8;
    RankLayout {
        tp_size,
        tp_rank,
        num_blocks: 8,
        regions: vec![
            Region {
                base,
                block_len: kv,
                kv_block_len: kv,
            },
            Region {
                base: base + 8 * kv,
                block_len: kv,
                kv_block_len: kv,
            },
        ],
        stage: kvferry_machines::Stage::SINGLE,
        pools: Vec::new(),
    }
}

/// `layout` with an aux pool and a state pool, so the hello seed covers
/// pools too.
fn with_pools(layout: RankLayout) -> RankLayout {
    let pool = |kind, base, item_len| Pool {
        kind,
        items: 4,
        regions: vec![PoolRegion { base, item_len }],
    };
    RankLayout {
        pools: vec![
            pool(PoolKind::Aux, 0x90_0000, 24),
            pool(PoolKind::State, 0xa0_0000, 4096),
        ],
        ..layout
    }
}

/// One valid frame per `Frame` variant and per `Msg` variant, named by
/// `Frame::kind`.
fn frames() -> Vec<Frame> {
    let transfer = |msg| Frame::Transfer {
        transfer_id: TransferId(5),
        msg,
    };
    vec![
        Frame::Refuse(Refuse {
            version: VERSION,
            reason: RefuseReason::UnsupportedVersion,
        }),
        Frame::Hello(Hello {
            engine_id: "d0".into(),
            mode: Mode::Push,
            model: model(),
            layout: with_pools(rank(2, 1, 0x10000)),
            endpoint: "tcp://127.0.0.1:7000".into(),
        }),
        transfer(Msg::Pull {
            receivers_expected: 1,
            dst_blocks: vec![vec![BlockId(1), BlockId(2)], vec![BlockId(7)]],
            prefix_blocks: vec![0, 1],
            lease_seq: Some(0),
        }),
        transfer(Msg::Ready {
            chunk: 1,
            start_blocks: vec![2],
            src_blocks: vec![vec![BlockId(4)]],
            is_last: true,
        }),
        transfer(Msg::LeaseRequest { seq: 3 }),
        transfer(Msg::LeaseGrant {
            seq: 3,
            duration_ms: 100,
        }),
        transfer(Msg::Status { ok: true }),
        transfer(Msg::Done { ok: false }),
        transfer(Msg::Abort),
        transfer(Msg::AbortAck),
        transfer(Msg::Unneeded),
        transfer(Msg::NotPaired),
        Frame::Heartbeat { seq: 9 },
        Frame::HeartbeatAck { seq: 9 },
        Frame::NamedTransfer {
            transfer_id: TransferId(5),
            request_id: "cmpl-6f2c0e1a-0".into(),
            msg: Msg::Pull {
                receivers_expected: 1,
                dst_blocks: vec![vec![BlockId(1)]],
                prefix_blocks: vec![0],
                lease_seq: None,
            },
        },
        Frame::IdCollision {
            transfer_id: TransferId(5),
        },
    ]
}

/// A seed's file name: the frame's kind, but a named `Pull` is not the
/// plain one.
fn seed_name(f: &Frame) -> &'static str {
    match f {
        Frame::NamedTransfer { .. } => "named_pull",
        _ => f.kind(),
    }
}

fn wire_seeds() {
    reset("wire_decode");
    let frames = frames();
    for f in &frames {
        let bytes = wire::encode(f);
        assert_eq!(wire::decode(&bytes, &Limits::default()).as_ref(), Ok(f));
        write("wire_decode", seed_name(f), &bytes);
    }
    // A peer of another version refusing this one: read whatever the
    // version its header names.
    let mut refuse = Vec::new();
    wire::encode_versioned(&frames[0], VERSION + 1, &mut refuse);
    assert_eq!(
        wire::decode(&refuse, &Limits::default()).as_ref(),
        Ok(&frames[0])
    );
    write("wire_decode", "refuse_other_version", &refuse);

    reset("node_notify_decode");
    let endpoint = "tcp://127.0.0.1:7001";
    let last_word: Vec<Vec<u8>> = frames[6..8].iter().map(wire::encode).collect();
    let notifications = [
        ("empty", wire::encode_notify(endpoint, [])),
        (
            "status_and_done",
            wire::encode_notify(endpoint, last_word.iter().map(Vec::as_slice)),
        ),
    ];
    for (name, bytes) in notifications {
        let (e, got) = wire::decode_notify(&bytes, &Limits::default()).expect("notification");
        assert_eq!(e, endpoint);
        assert!(got
            .iter()
            .all(|f| wire::decode(f, &Limits::default()).is_ok()));
        write("node_notify_decode", name, &bytes);
    }
}

fn tcp_seeds() {
    let mut write_req = tw::Header {
        opcode: tw::OP_WRITE,
        status: 0,
        count: 2,
        detail: 0,
        req_id: 1,
        payload_len: 96,
    }
    .encode()
    .to_vec();
    tw::encode_entry(&mut write_req, 0x1000, 64);
    tw::encode_entry(&mut write_req, 0x2000, 32);
    write("tcp_header_decode", "write_request", &write_req);
    let mut read_req = tw::Header {
        opcode: tw::OP_READ,
        count: 1,
        req_id: 2,
        ..Default::default()
    }
    .encode()
    .to_vec();
    tw::encode_entry(&mut read_req, 0x1000, 4096);
    write("tcp_header_decode", "read_request", &read_req);
    let regions = tw::Header {
        opcode: tw::OP_REGIONS,
        req_id: 3,
        ..Default::default()
    };
    write("tcp_header_decode", "regions_request", &regions.encode());
    let reject = tw::Header {
        opcode: tw::OP_WRITE,
        status: tw::RejectReason::OutOfRegion.to_status(),
        detail: 1,
        req_id: 1,
        ..Default::default()
    };
    write("tcp_header_decode", "reject_response", &reject.encode());
}

fn spec_seeds() {
    reset("plan_spec");
    // Same shape as `kvferry plan` specs: heterogeneous TP (2 -> 4), and MLA.
    let hetero = r#"{
  "model": {"layout": "hnd", "total_kv_heads": 4, "block_tokens": 2, "head_bytes": 8},
  "prefill": {"tp_size": 2, "tp_rank": 0, "num_blocks": 8,
              "regions": [{"base": 4096, "block_len": 32, "kv_block_len": 32},
                          {"base": 8192, "block_len": 32, "kv_block_len": 32}]},
  "decode": {"tp_size": 4, "tp_rank": 1, "num_blocks": 8,
             "regions": [{"base": 65536, "block_len": 16, "kv_block_len": 16},
                         {"base": 131072, "block_len": 16, "kv_block_len": 16}]},
  "prefill_blocks": [[0, 1, 2]],
  "decode_blocks": [[5, 6, 7]],
  "batch_descriptors_max": 4,
  "batch_bytes_max": 64
}"#;
    let nhd = hetero.replace("\"hnd\"", "\"nhd\"");
    let mla = r#"{
  "model": {"layout": "mla", "total_kv_heads": 1, "block_tokens": 16, "head_bytes": 64},
  "prefill": {"tp_size": 1, "tp_rank": 0, "num_blocks": 4,
              "regions": [{"base": 0, "block_len": 1024, "kv_block_len": 1024}]},
  "decode": {"tp_size": 2, "tp_rank": 1, "num_blocks": 4,
             "regions": [{"base": 1048576, "block_len": 1024, "kv_block_len": 1024}]},
  "prefill_blocks": [[0, 1], [3]],
  "decode_blocks": [[2, 3], [0]],
  "descriptors_max": 100
}"#;
    // Equal TP with an aux pool (two buffers) and a state pool: the last
    // two lists are their indices.
    let pools = r#"{
  "model": {"layout": "hnd", "total_kv_heads": 2, "block_tokens": 2, "head_bytes": 8},
  "prefill": {"tp_size": 1, "tp_rank": 0, "num_blocks": 8,
              "regions": [{"base": 4096, "block_len": 32, "kv_block_len": 32}],
              "pools": [{"kind": "aux", "items": 4, "regions": [{"base": 65536, "item_len": 8},
                                                                {"base": 69632, "item_len": 12}]},
                        {"kind": "state", "items": 4, "regions": [{"base": 73728, "item_len": 64}]}]},
  "decode": {"tp_size": 1, "tp_rank": 0, "num_blocks": 8,
             "regions": [{"base": 1048576, "block_len": 32, "kv_block_len": 32}],
             "pools": [{"kind": "aux", "items": 4, "regions": [{"base": 2097152, "item_len": 8},
                                                               {"base": 2101248, "item_len": 12}]},
                       {"kind": "state", "items": 4, "regions": [{"base": 2105344, "item_len": 64}]}]},
  "prefill_blocks": [[0, 1], [2], [1, 2]],
  "decode_blocks": [[5, 6], [0], [3, 0]]
}"#;
    for (name, text) in [
        ("hetero_hnd.json", hetero),
        ("hetero_nhd.json", &nhd),
        ("mla.json", mla),
        ("aux_state_pools.json", pools),
    ] {
        let plan = spec::plan_from_json(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(plan.is_transfer(), "{name} plans nothing");
        write("plan_spec", name, text.as_bytes());
    }
}

/// Store lookup requests and replies (`kvferry_store::internal::lookup::wire`).
fn lookup_seeds() {
    use kvferry_machines::internal::store::lookup::LookupHit;
    use kvferry_machines::internal::store::BlockHash;
    use kvferry_store::internal::lookup::wire::{encode_query, encode_reply, ServerFault};
    use kvferry_store::LookupQuery;

    let target = "lookup_msg_decode";
    reset(target);
    let one = LookupQuery {
        token_len: 63,
        block_hashes: vec![(0..4).map(BlockHash::from_u64).collect()],
        lora: None,
        extra_keys: Vec::new(),
    };
    let two = LookupQuery {
        token_len: 127,
        block_hashes: vec![
            (0..8).map(BlockHash::from_u64).collect(),
            vec![BlockHash::from_bytes(&[0xab; 32]).expect("a 32-byte hash")],
        ],
        lora: Some("adapter".into()),
        extra_keys: vec!["mm:0".into()],
    };
    let hit = LookupHit {
        tokens: 48,
        load: vec![0..3, 1..3],
    };
    let seeds = [
        ("query_one_group", encode_query(1, &one)),
        ("query_two_groups_lora", encode_query(2, &two)),
        ("reply_hit", encode_reply(1, &Ok(hit))),
        (
            "reply_failed",
            encode_reply(2, &Err(ServerFault::StoreTimeout)),
        ),
    ];
    for (name, bytes) in seeds {
        write(target, name, &bytes.expect("a seed within the bounds"));
    }
}

fn main() {
    wire_seeds();
    reset("node_proto_decode");
    reset("tcp_header_decode");
    tcp_seeds();
    spec_seeds();
    store_proto_seeds();
    lookup_seeds();
    auth_seeds();
    shm_hello_seeds();
    println!("seeds written under fuzz/seeds/");
}

/// An answer and offers with and without regions, from the shm hello's
/// own encoders.
fn shm_hello_seeds() {
    reset("shm_hello_decode");
    for (name, bytes) in kvferry::transport::internal::shm_hello::seeds() {
        write("shm_hello_decode", name, &bytes);
    }
}

#[path = "fuzz_targets/auth_oracle.rs"]
mod auth_oracle;

/// One genuine message of each kind the auth oracle checks.
fn auth_seeds() {
    reset("auth_messages");
    for (name, bytes) in auth_oracle::genuine_messages() {
        assert!(auth_oracle::check_auth(&bytes), "{name} is not accepted");
        write("auth_messages", name, &bytes);
    }
}

/// One frame of each request and answer kind of the store server.
fn store_proto_seeds() {
    use kvferry_store::internal::proto::{
        self, Answer, Item, KeyAnswer, Refusal, Reply, Request, Span,
    };
    reset("store_proto_decode");
    let item = |key: &str| Item {
        key: key.into(),
        segments: vec![
            Span {
                addr: 0x10_0000,
                len: 4096,
            },
            Span {
                addr: 0x20_0000,
                len: 4096,
            },
        ],
    };
    let keys = vec!["kvf1:m:hnd:bf16:d8:h0+2:pp0of1::g0:b16:0a".to_string()];
    let requests = [
        (
            "hello",
            Request::Hello {
                endpoint: "tcp://127.0.0.1:7600".into(),
                removed_from: Some(12),
            },
        ),
        ("exists", Request::Exists { keys: keys.clone() }),
        (
            "put",
            Request::Put {
                budget_ms: 500,
                items: vec![item("a"), item("b")],
            },
        ),
        (
            "get",
            Request::Get {
                budget_ms: 500,
                items: vec![item("a")],
            },
        ),
        ("remove", Request::Remove { keys: keys.clone() }),
    ];
    for (i, (name, r)) in requests.iter().enumerate() {
        write(
            "store_proto_decode",
            &format!("request_{name}"),
            &proto::encode(i as u64, r).unwrap(),
        );
    }
    let reply = |answer| Reply {
        answer,
        removed: keys.clone(),
        removed_lost: 1,
        removed_next: 40,
    };
    let replies = [
        (
            "hello",
            reply(Answer::Hello {
                capacity_bytes: 1 << 30,
            }),
        ),
        ("exists", reply(Answer::Exists(vec![true, false]))),
        (
            "keys",
            reply(Answer::Keys(vec![
                KeyAnswer::Done,
                KeyAnswer::WrongSize { got_bytes: 9 },
                KeyAnswer::Full,
            ])),
        ),
        ("refused", reply(Answer::Refused(Refusal::NoHello))),
    ];
    for (i, (name, r)) in replies.iter().enumerate() {
        write(
            "store_proto_decode",
            &format!("reply_{name}"),
            &proto::encode(i as u64, r).unwrap(),
        );
    }
}
