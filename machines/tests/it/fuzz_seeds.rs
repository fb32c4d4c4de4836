//! Replays the wire fuzz targets' inputs through the same properties the
//! fuzzer checks (`fuzz/fuzz_targets/wire_oracle.rs`), so the ordinary test
//! command exercises them: every committed seed under `fuzz/seeds/` must
//! decode and round-trip, and a sample of a local `fuzz/corpus/` (ignored
//! by git; skipped when absent) must keep every property.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use kvferry_machines::internal::wire::{self, Frame, Limits};

#[path = "../../../fuzz/fuzz_targets/wire_oracle.rs"]
mod wire_oracle;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The files of `dir`, sorted by name. Panics on anything unreadable: a
/// replay that silently read nothing would pass for the wrong reason.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|entry| {
            entry
                .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
                .path()
        })
        .collect();
    out.sort();
    out
}

fn read(path: &Path) -> Vec<u8> {
    fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// At most `max` of `files`, spread evenly over them.
fn sample(files: Vec<PathBuf>, max: usize) -> Vec<PathBuf> {
    let step = files.len().div_ceil(max).max(1);
    files.into_iter().step_by(step).collect()
}

/// Seeds per `Frame` variant and `Msg` variant, named by `Frame::kind`.
const EVERY_KIND: [&str; 15] = [
    "refuse",
    "hello",
    "pull",
    "ready",
    "lease_request",
    "lease_grant",
    "status",
    "done",
    "abort",
    "abort_ack",
    "unneeded",
    "not_paired",
    "heartbeat",
    "heartbeat_ack",
    "id_collision",
];

#[test]
fn wire_seeds_decode_and_round_trip() {
    let mut kinds = BTreeSet::new();
    for path in files(&fuzz_dir().join("seeds/wire_decode")) {
        let bytes = read(&path);
        let frame = wire_oracle::check_frame(&bytes)
            .unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
        // Seeds are what `encode_versioned` writes, byte for byte.
        let version = u16::from_le_bytes([bytes[2], bytes[3]]);
        let mut again = Vec::new();
        wire::encode_versioned(&frame, version, &mut again);
        assert_eq!(again, bytes, "{}", path.display());
        kinds.insert(frame.kind());
    }
    assert_eq!(
        kinds,
        EVERY_KIND.into_iter().collect(),
        "a variant has no seed"
    );
}

#[test]
fn notify_seeds_unpack_and_their_frames_decode() {
    let seeds = files(&fuzz_dir().join("seeds/node_notify_decode"));
    assert!(!seeds.is_empty());
    for path in seeds {
        let bytes = read(&path);
        let (_, frames) = wire_oracle::check_notify(&bytes)
            .unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
        for f in frames {
            let frame: Frame = wire::decode(f, &Limits::default())
                .unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
            assert_eq!(wire::encode(&frame), f, "{}", path.display());
        }
    }
}

/// A target's oracle; it panics on a broken property.
type Check = fn(&[u8]);

/// Most files replayed per corpus directory; the fuzzer keeps thousands.
const CORPUS_SAMPLE: usize = 512;

#[test]
fn corpus_sample_keeps_the_properties() {
    let corpus = fuzz_dir().join("corpus");
    if !corpus.exists() {
        return;
    }
    let targets: [(&str, Check); 2] = [
        ("wire_decode", |b| {
            let _ = wire_oracle::check_frame(b);
        }),
        ("node_notify_decode", |b| {
            let _ = wire_oracle::check_notify(b);
        }),
    ];
    for (target, check) in targets {
        let dir = corpus.join(target);
        if !dir.exists() {
            continue;
        }
        for path in sample(files(&dir), CORPUS_SAMPLE) {
            let bytes = read(&path);
            // A panic names the file, for `cargo fuzz run <target> <file>`.
            let outcome = std::panic::catch_unwind(|| check(&bytes));
            assert!(outcome.is_ok(), "{target}: {} fails", path.display());
        }
    }
}

#[test]
fn sample_spreads_over_the_whole_list() {
    let list: Vec<PathBuf> = (0..10).map(|i| PathBuf::from(i.to_string())).collect();
    let picked = sample(list.clone(), 4);
    assert_eq!(picked, ["0", "3", "6", "9"].map(PathBuf::from));
    assert_eq!(sample(list.clone(), 100), list);
    assert!(sample(Vec::new(), 4).is_empty());
}
