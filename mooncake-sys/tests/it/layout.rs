//! The `#[repr(C)]` structs and constants of `mooncake_sys::ffi` against
//! the vendored headers: a C file compiled here prints `sizeof`, `offsetof`
//! and the constants as the C compiler sees them.

use std::collections::HashMap;
use std::mem::{offset_of, size_of};
use std::path::PathBuf;
use std::process::Command;

use mooncake_sys::ffi::*;

fn c_layout() -> HashMap<String, usize> {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mooncake-layout");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("layout");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc)
        .arg(here.join("tests/layout.c"))
        .arg(format!("-I{}", here.join("include").display()))
        .arg("-o")
        .arg(&exe)
        .status()
        .expect("a C compiler");
    assert!(built.success(), "{cc} failed on tests/layout.c");
    let out = Command::new(&exe).output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect()
}

#[test]
fn structs_and_constants_match_the_headers() {
    let c = c_layout();
    let rust: Vec<(&str, usize)> = vec![
        ("transfer_request", size_of::<TransferRequest>()),
        (
            "transfer_request.opcode",
            offset_of!(TransferRequest, opcode),
        ),
        (
            "transfer_request.source",
            offset_of!(TransferRequest, source),
        ),
        (
            "transfer_request.target_id",
            offset_of!(TransferRequest, target_id),
        ),
        (
            "transfer_request.target_offset",
            offset_of!(TransferRequest, target_offset),
        ),
        (
            "transfer_request.length",
            offset_of!(TransferRequest, length),
        ),
        ("transfer_status", size_of::<TransferStatus>()),
        ("transfer_status.status", offset_of!(TransferStatus, status)),
        (
            "transfer_status.transferred_bytes",
            offset_of!(TransferStatus, transferred_bytes),
        ),
        ("notify_msg", size_of::<NotifyMsg>()),
        ("notify_msg.name", offset_of!(NotifyMsg, name)),
        ("notify_msg.msg", offset_of!(NotifyMsg, msg)),
        ("buffer_entry", size_of::<BufferEntry>()),
        ("buffer_entry.addr", offset_of!(BufferEntry, addr)),
        ("buffer_entry.length", offset_of!(BufferEntry, length)),
        ("replicate_config", size_of::<ReplicateConfig>()),
        (
            "replicate_config.replica_num",
            offset_of!(ReplicateConfig, replica_num),
        ),
        (
            "replicate_config.with_soft_pin",
            offset_of!(ReplicateConfig, with_soft_pin),
        ),
        (
            "replicate_config.with_hard_pin",
            offset_of!(ReplicateConfig, with_hard_pin),
        ),
        (
            "replicate_config.preferred_segments",
            offset_of!(ReplicateConfig, preferred_segments),
        ),
        (
            "replicate_config.preferred_segments_count",
            offset_of!(ReplicateConfig, preferred_segments_count),
        ),
        ("segment_id_t", size_of::<SegmentId>()),
        ("batch_id_t", size_of::<BatchId>()),
        (
            "INVALID_BATCH_is_max",
            usize::from(INVALID_BATCH == u64::MAX),
        ),
        ("OPCODE_READ", OPCODE_READ as usize),
        ("OPCODE_WRITE", OPCODE_WRITE as usize),
        ("STATUS_WAITING", STATUS_WAITING as usize),
        ("STATUS_PENDING", STATUS_PENDING as usize),
        ("STATUS_INVALID", STATUS_INVALID as usize),
        ("STATUS_CANCELED", STATUS_CANCELED as usize),
        ("STATUS_COMPLETED", STATUS_COMPLETED as usize),
        ("STATUS_TIMEOUT", STATUS_TIMEOUT as usize),
        ("STATUS_FAILED", STATUS_FAILED as usize),
    ];
    assert_eq!(rust.len(), c.len(), "every line of layout.c is checked");
    for (name, value) in rust {
        assert_eq!(Some(&value), c.get(name), "{name}");
    }
}
