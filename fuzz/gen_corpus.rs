//! Writes seed corpora from valid encodings into `fuzz/seeds/<target>/`
//! (run from `fuzz/`: `cargo run --example gen_corpus`). libFuzzer mutates
//! from these, so it starts past the magic/version checks and the postcard
//! enum tags instead of having to discover them byte by byte.

use kvferry::node::proto;
use kvferry::transport::wire as tw;
use kvferry::wire::{self, *};
use kvferry_machines::common::{BlockId, Mode, Msg};
use kvferry_machines::layout::{LayoutKind as PlanLayout, ModelSpec, RankLayout, Region};
use std::fs;
use std::path::Path;

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new("seeds").join(target);
    fs::create_dir_all(&dir).expect("create seed dir");
    fs::write(dir.join(name), bytes).expect("write seed");
}

fn wire_seeds() {
    let region = RegionInfo {
        base: 0x1000,
        len_bytes: 4096,
        block_len_bytes: 1024,
        kv_block_len_bytes: 512,
        group: 0,
        layer: 3,
    };
    let msgs = [
        Message::Hello(Hello {
            engine_id: "p0".into(),
            dp_rank: 0,
            tp_rank: 1,
            pp_rank: 0,
            tp_size: 2,
            total_kv_heads: 8,
            block_tokens: 16,
            num_blocks: 4,
            layout: LayoutKind::Hnd,
            mode: TransferMode::Push,
            regions: vec![region, region],
            transport_endpoint: "127.0.0.1:7000".into(),
        }),
        Message::Pull(Pull {
            transfer_id: 42,
            dst_blocks: vec![vec![1, 2, 3], vec![7]],
            prefix_blocks: vec![0, 1],
            expected_senders: 2,
            receivers_expected: 1,
            lease_seq: Some(1),
            deadline_ms: 30_000,
            lease_ms: 5_000,
        }),
        Message::Ready(Ready {
            transfer_id: 42,
            chunk: 0,
            start_blocks: vec![0],
            src_blocks: vec![vec![9, 10]],
            is_last: true,
        }),
        Message::Done(Done {
            transfer_id: 42,
            ok: true,
        }),
        Message::Status(Status {
            transfer_id: 42,
            result: Err(ErrorCode::Expired),
        }),
        Message::Status(Status {
            transfer_id: 43,
            result: Ok(()),
        }),
        Message::Abort(Abort {
            transfer_id: 42,
            reason: AbortCode::PeerDead,
        }),
        Message::AbortAck(AbortAck { transfer_id: 42 }),
        Message::Heartbeat(Heartbeat {
            seq: 7,
            renew: vec![1, 2, 3],
            lease_ms: 5_000,
        }),
        Message::HeartbeatAck(HeartbeatAck {
            seq: 7,
            unknown: vec![2],
        }),
        Message::LeaseRequest(LeaseRequest {
            transfer_id: 42,
            seq: 2,
        }),
        Message::LeaseGrant(LeaseGrant {
            transfer_id: 42,
            seq: 2,
            duration_ms: 5_000,
        }),
    ];
    for (i, m) in msgs.iter().enumerate() {
        let frame = wire::encode(m);
        assert_eq!(wire::decode(&frame, &Limits::default()).as_ref(), Ok(m));
        write("wire_decode", &format!("{i:02}_{}", m.kind()), &frame);
    }
}

fn model() -> ModelSpec {
    ModelSpec {
        layout: PlanLayout::Hnd,
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
    }
}

fn proto_seeds() {
    let frames = [
        (
            "hello",
            proto::Frame::Hello(proto::Hello {
                engine_id: "d0".into(),
                mode: Mode::Push,
                model: model(),
                layout: rank(2, 1, 0x10000),
                endpoint: "tcp://127.0.0.1:7000".into(),
                is_reply: false,
            }),
        ),
        (
            "pull",
            proto::Frame::Transfer {
                transfer_id: 5,
                msg: Msg::Pull {
                    receivers_expected: 1,
                    dst_blocks: vec![vec![BlockId(1), BlockId(2)]],
                    prefix_blocks: vec![0],
                    lease_seq: Some(0),
                },
            },
        ),
        (
            "ready",
            proto::Frame::Transfer {
                transfer_id: 5,
                msg: Msg::Ready {
                    chunk: 1,
                    start_blocks: vec![2],
                    src_blocks: vec![vec![BlockId(4)]],
                    is_last: true,
                },
            },
        ),
        (
            "lease_request",
            proto::Frame::Transfer {
                transfer_id: 5,
                msg: Msg::LeaseRequest { seq: 3 },
            },
        ),
        (
            "lease_grant",
            proto::Frame::Transfer {
                transfer_id: 5,
                msg: Msg::LeaseGrant {
                    seq: 3,
                    duration_ms: 100,
                },
            },
        ),
        (
            "status",
            proto::Frame::Transfer {
                transfer_id: 5,
                msg: Msg::Status { ok: true },
            },
        ),
        (
            "done",
            proto::Frame::Transfer {
                transfer_id: 5,
                msg: Msg::Done { ok: false },
            },
        ),
        (
            "abort",
            proto::Frame::Transfer {
                transfer_id: 5,
                msg: Msg::Abort,
            },
        ),
        (
            "abort_ack",
            proto::Frame::Transfer {
                transfer_id: 5,
                msg: Msg::AbortAck,
            },
        ),
        ("heartbeat", proto::Frame::Heartbeat { seq: 9 }),
        ("heartbeat_ack", proto::Frame::HeartbeatAck { seq: 9 }),
    ];
    for (name, f) in &frames {
        let bytes = proto::encode(f);
        assert_eq!(
            proto::decode(&bytes, &proto::FrameLimits::default()).as_ref(),
            Ok(f)
        );
        write("node_proto_decode", name, &bytes);
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
    for (name, text) in [
        ("hetero_hnd.json", hetero),
        ("hetero_nhd.json", &nhd),
        ("mla.json", mla),
    ] {
        let plan = kvferry::plan::plan_from_json(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(plan.is_transfer(), "{name} plans nothing");
        write("plan_spec", name, text.as_bytes());
    }
}

fn main() {
    wire_seeds();
    proto_seeds();
    tcp_seeds();
    spec_seeds();
    println!("seeds written under fuzz/seeds/");
}
