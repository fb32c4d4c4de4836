//! The store tier's KV events over ZeroMQ (`kvferry_store::internal::publish`): a
//! real subscriber on 127.0.0.1 gets vLLM's three frames with consecutive
//! sequence numbers, the replay socket answers from its bounded buffer,
//! and vLLM's own definitions decode the payloads field for field
//! (`vllm_decodes_published_batches`, run by scripts/test-vllm.sh).

use std::io::Write as _;
use std::process::{Command, Stdio};

use kvferry_machines::internal::store::events::{BlockStored, KvEvent, Medium};
use kvferry_machines::internal::store::BlockHash;
use kvferry_store::internal::publish::REPLAY_END_SEQ;
use kvferry_store::{HashEncoding, KvEventBatch, KvEventPublisher, PublisherConfig};

/// Publish attempts before a subscriber that never joined fails the test.
const JOIN_ATTEMPTS: u32 = 2000;
/// Each attempt waits this long for the subscriber's first message.
const JOIN_POLL_MS: i64 = 5;
/// A receive that takes longer fails the test instead of hanging it.
const RECV_BOUND_MS: i32 = 20_000;

fn local(topic: &str) -> PublisherConfig {
    PublisherConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        topic: topic.into(),
        ..PublisherConfig::default()
    }
}

fn subscriber(ctx: &zmq::Context, p: &KvEventPublisher, topic: &str) -> zmq::Socket {
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_rcvtimeo(RECV_BOUND_MS).unwrap();
    sub.set_subscribe(topic.as_bytes()).unwrap();
    sub.connect(p.endpoint()).unwrap();
    sub
}

fn seq_of(frame: &[u8]) -> u64 {
    u64::from_be_bytes(frame.try_into().expect("an 8-byte sequence frame"))
}

/// Publishes `events`, stamped `stamp(seq)`, until `sub` has a message:
/// PUB drops what it sends before a subscription arrives.
fn join(p: &mut KvEventPublisher, sub: &zmq::Socket, events: &[KvEvent], stamp: fn(u64) -> f64) {
    for _ in 0..JOIN_ATTEMPTS {
        p.publish(stamp(p.next_seq()), events).unwrap();
        if sub.poll(zmq::POLLIN, JOIN_POLL_MS).unwrap() > 0 {
            return;
        }
    }
    panic!("the subscriber got nothing after {JOIN_ATTEMPTS} batches");
}

/// The payload a publisher of the default configuration sends: rank 0,
/// int hashes.
fn payload(ts: f64, events: &[KvEvent]) -> Vec<u8> {
    let b = KvEventBatch {
        ts,
        events,
        data_parallel_rank: Some(0),
    };
    b.encode(HashEncoding::Int).unwrap()
}

#[test]
fn a_subscriber_gets_three_frames_with_consecutive_sequence_numbers() {
    let ctx = zmq::Context::new();
    let mut p = KvEventPublisher::bind(&local("kv")).unwrap();
    assert_eq!(p.next_seq(), 0);
    let sub = subscriber(&ctx, &p, "kv");
    let events = [KvEvent::AllBlocksCleared];
    join(&mut p, &sub, &events, |seq| seq as f64);
    let last = p.publish(p.next_seq() as f64, &events).unwrap();
    assert_eq!(p.publish(p.next_seq() as f64, &events).unwrap(), last + 1);
    let mut expect: Option<u64> = None;
    loop {
        let frames = sub.recv_multipart(0).expect("a message");
        let [topic, seq, body] = frames.as_slice() else {
            panic!("{} frames, not 3", frames.len());
        };
        assert_eq!(topic.as_slice(), b"kv");
        let seq = seq_of(seq);
        if let Some(e) = expect {
            assert_eq!(seq, e, "sequence numbers go up by one");
        }
        assert_eq!(*body, payload(seq as f64, &events), "batch {seq}");
        if seq == last + 1 {
            break;
        }
        expect = Some(seq + 1);
    }
    assert_eq!(p.dropped(), 0);
}

/// Sends a replay request for batches from `start`; returns the
/// `(seq, payload)` of each answer, up to and without the end marker.
fn replay(dealer: &zmq::Socket, start: u64, topic: &[u8]) -> Vec<(u64, Vec<u8>)> {
    let request: [&[u8]; 2] = [b"", &start.to_be_bytes()];
    dealer.send_multipart(request, 0).unwrap();
    let mut got = Vec::new();
    loop {
        let frames = dealer.recv_multipart(0).expect("a replay answer");
        let [empty, t, seq, body] = frames.as_slice() else {
            panic!("{} frames, not 4", frames.len());
        };
        assert!(empty.is_empty());
        if seq.as_slice() == REPLAY_END_SEQ {
            assert!(t.is_empty() && body.is_empty(), "the end marker");
            return got;
        }
        assert_eq!(t.as_slice(), topic);
        got.push((seq_of(seq), body.clone()));
    }
}

#[test]
fn the_replay_socket_answers_from_its_bounded_buffer() {
    let config = PublisherConfig {
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        replay_batches: 2,
        ..local("replayed")
    };
    let mut p = KvEventPublisher::bind(&config).unwrap();
    let events = [KvEvent::AllBlocksCleared];
    for seq in 0..4 {
        assert_eq!(p.publish(seq as f64, &events).unwrap(), seq);
    }
    let ctx = zmq::Context::new();
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    dealer.set_rcvtimeo(RECV_BOUND_MS).unwrap();
    dealer.connect(p.replay_endpoint().unwrap()).unwrap();
    let batch = |seq: u64| (seq, payload(seq as f64, &events));
    assert_eq!(replay(&dealer, 0, b"replayed"), vec![batch(2), batch(3)]);
    assert_eq!(replay(&dealer, 3, b"replayed"), vec![batch(3)]);
    assert_eq!(replay(&dealer, 4, b"replayed"), vec![]);
    assert_eq!(p.publish(4.0, &events).unwrap(), 4);
    assert_eq!(replay(&dealer, 0, b"replayed"), vec![batch(3), batch(4)]);
}

/// A sha256-sized hash of block `i` of a chain.
fn hash(chain: u8, i: u8) -> BlockHash {
    let bytes: Vec<u8> = (0..32u8)
        .map(|b| b.wrapping_mul(37) ^ chain ^ (i << 4))
        .collect();
    BlockHash::from_bytes(&bytes).unwrap()
}

fn hex(h: &BlockHash) -> String {
    h.as_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

/// Every variant, a parent chain, tokens past u16, a LoRA adapter,
/// each medium, a group known and not.
fn realistic_events() -> Vec<KvEvent> {
    let chain: Vec<BlockHash> = (0..4).map(|i| hash(1, i)).collect();
    vec![
        KvEvent::BlockStored(BlockStored {
            block_hashes: chain[1..].to_vec(),
            parent_block_hash: Some(chain[0]),
            token_ids: (0..12).map(|t| 151_000 + t * 7).collect(),
            block_size: 4,
            medium: Medium::Cpu,
            group: 1,
            lora_name: Some("adapter-a".into()),
        }),
        KvEvent::BlockStored(BlockStored {
            block_hashes: vec![hash(2, 0)],
            parent_block_hash: None,
            token_ids: vec![],
            block_size: 16,
            medium: Medium::Storage,
            group: 0,
            lora_name: None,
        }),
        KvEvent::BlockRemoved {
            block_hashes: vec![chain[3], BlockHash::from_u64(7)],
            medium: Medium::Cpu,
            group: Some(1),
        },
        KvEvent::BlockRemoved {
            block_hashes: vec![hash(3, 9)],
            medium: Medium::Gpu,
            group: None,
        },
        KvEvent::AllBlocksCleared,
    ]
}

/// The same events as plain data for the Python side (written here by
/// hand, not by the encoder under test).
fn realistic_json() -> serde_json::Value {
    let chain: Vec<String> = (0..4).map(|i| hex(&hash(1, i))).collect();
    serde_json::json!([
        {"type": "BlockStored", "block_hashes": &chain[1..], "parent_block_hash": chain[0],
         "token_ids": (0..12).map(|t| 151_000 + t * 7).collect::<Vec<u32>>(), "block_size": 4,
         "medium": "CPU", "group_idx": 1, "lora_name": "adapter-a"},
        {"type": "BlockStored", "block_hashes": [hex(&hash(2, 0))], "parent_block_hash": null,
         "token_ids": [], "block_size": 16, "medium": "STORAGE", "group_idx": 0, "lora_name": null},
        {"type": "BlockRemoved", "block_hashes": [chain[3], "0000000000000007"],
         "medium": "CPU", "group_idx": 1},
        {"type": "BlockRemoved", "block_hashes": [hex(&hash(3, 9))], "medium": "GPU",
         "group_idx": null},
        {"type": "AllBlocksCleared"},
    ])
}

/// One message as published, with the batch it must hold.
fn case(hashes: HashEncoding, rank: Option<u32>, topic: &str) -> serde_json::Value {
    const TS: f64 = 1_764_620_000.125;
    let config = PublisherConfig {
        hashes,
        data_parallel_rank: rank,
        ..local(topic)
    };
    let mut p = KvEventPublisher::bind(&config).unwrap();
    let ctx = zmq::Context::new();
    let sub = subscriber(&ctx, &p, topic);
    join(&mut p, &sub, &realistic_events(), |_| TS);
    let frames = sub.recv_multipart(0).expect("a message");
    let [t, seq, body] = frames.as_slice() else {
        panic!("{} frames, not 3", frames.len());
    };
    let hexed = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    serde_json::json!({
        "frames": [hexed(t), hexed(seq), hexed(body)],
        "topic": topic,
        "seq": seq_of(seq),
        "int_hashes": hashes == HashEncoding::Int,
        "batch": {"ts": TS, "events": realistic_json(), "data_parallel_rank": rank},
    })
}

#[test]
#[ignore = "needs vLLM's venv: scripts/test-vllm.sh runs it"]
fn vllm_decodes_published_batches() {
    let venv = std::env::var("KVFERRY_VLLM_VENV").expect("KVFERRY_VLLM_VENV: a venv with vLLM");
    let cases = serde_json::json!([
        case(HashEncoding::Int, Some(2), "kv-events"),
        case(HashEncoding::Bytes, None, ""),
    ]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/store_kv_events_vllm.py");
    let mut child = Command::new(format!("{venv}/bin/python"))
        .arg(script)
        .stdin(Stdio::piped())
        .spawn()
        .expect("vLLM's python");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(cases.to_string().as_bytes()).unwrap();
    drop(stdin);
    let status = child.wait().unwrap();
    assert!(status.success(), "vLLM's decoder disagrees: {status}");
}
