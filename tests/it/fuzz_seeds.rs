//! Replays the inputs of the fuzz targets over the node's own decoders
//! through the same properties the fuzzer checks (`fuzz/fuzz_targets/
//! {tcp_header,plan_spec,store_proto,lookup_msg}_oracle.rs`, and the shm
//! hello's checks beside its decoders), so the
//! ordinary test command exercises them: every committed seed under
//! `fuzz/seeds/` must decode (a header, a store frame or a lookup message)
//! or plan (a spec), and a sample of a local `fuzz/corpus/` (ignored by
//! git; skipped when absent) must keep every property. The wire seeds are
//! replayed by `machines/tests/it/fuzz_seeds.rs`.

use std::fs;
use std::path::{Path, PathBuf};

use kvferry::transport::internal::shm_hello;

#[path = "../../fuzz/fuzz_targets/tcp_header_oracle.rs"]
mod tcp_header_oracle;

#[path = "../../fuzz/fuzz_targets/plan_spec_oracle.rs"]
mod plan_spec_oracle;

#[path = "../../fuzz/fuzz_targets/auth_oracle.rs"]
mod auth_oracle;
#[path = "../../fuzz/fuzz_targets/lookup_msg_oracle.rs"]
mod lookup_msg_oracle;
#[path = "../../fuzz/fuzz_targets/store_proto_oracle.rs"]
mod store_proto_oracle;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
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

fn seeds(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let seeds: Vec<_> = files(&fuzz_dir().join("seeds").join(target))
        .into_iter()
        .map(|path| {
            let bytes = fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            (path, bytes)
        })
        .collect();
    assert!(!seeds.is_empty(), "no seeds for {target}");
    seeds
}

#[test]
fn tcp_header_seeds_decode() {
    for (path, bytes) in seeds("tcp_header_decode") {
        let h = tcp_header_oracle::check_header(&bytes)
            .unwrap_or_else(|| panic!("{} does not decode", path.display()));
        // A request's descriptor table is all there (the oracle pads a
        // short one with zeros, which would leave its entries untested).
        if h.status == 0 {
            let table = h.count as usize * kvferry::transport::internal::wire::ENTRY_LEN;
            assert_eq!(
                bytes.len(),
                kvferry::transport::internal::wire::HEADER_LEN + table,
                "{}",
                path.display()
            );
        }
    }
}

#[test]
fn auth_seeds_are_accepted_and_their_mutants_keep_the_properties() {
    for (path, bytes) in seeds("auth_messages") {
        assert!(
            auth_oracle::check_auth(&bytes),
            "{} refused",
            path.display()
        );
        // Every one-byte mutant keeps the properties: what is accepted
        // is genuine (a HELLO with another nonce is one).
        for i in 1..bytes.len() {
            let mut m = bytes.clone();
            m[i] ^= 0x01;
            auth_oracle::check_auth(&m);
        }
    }
}

#[test]
fn plan_spec_seeds_plan_a_transfer() {
    for (path, bytes) in seeds("plan_spec") {
        let plan = plan_spec_oracle::check_spec(&bytes)
            .unwrap_or_else(|| panic!("{} plans nothing", path.display()));
        assert!(plan.is_transfer(), "{}", path.display());
    }
}

#[test]
fn store_proto_seeds_decode() {
    for (path, bytes) in seeds("store_proto_decode") {
        let decoded = store_proto_oracle::check_frame(&bytes)
            .unwrap_or_else(|| panic!("{} does not decode", path.display()));
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        // Each seed is named after what it holds.
        let kind = match decoded {
            store_proto_oracle::Decoded::Request(r) => format!("request_{r:?}"),
            store_proto_oracle::Decoded::Reply(r) => format!("reply_{:?}", r.answer),
        };
        let kind = kind.to_lowercase();
        assert!(kind.starts_with(&name), "{name} holds {kind}");
    }
}

#[test]
fn shm_hello_seeds_decode() {
    for (path, bytes) in seeds("shm_hello_decode") {
        assert!(
            shm_hello::check_offer(&bytes) || shm_hello::check_answer(&bytes),
            "{} does not decode",
            path.display()
        );
    }
}

#[test]
fn lookup_msg_seeds_decode() {
    use lookup_msg_oracle::Decoded;
    for (path, bytes) in seeds("lookup_msg_decode") {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let want = if name.starts_with("query") {
            Decoded::Query
        } else {
            Decoded::Reply
        };
        assert_eq!(
            lookup_msg_oracle::check_lookup_msg(&bytes),
            want,
            "{}",
            path.display()
        );
    }
}

/// A target's oracle; it panics on a broken property.
type Check = fn(&[u8]);

/// Most files replayed per corpus directory; the fuzzer keeps thousands.
const CORPUS_SAMPLE: usize = 256;

#[test]
fn corpus_sample_keeps_the_properties() {
    let corpus = fuzz_dir().join("corpus");
    if !corpus.exists() {
        return;
    }
    let targets: [(&str, Check); 6] = [
        ("auth_messages", |b| {
            let _ = auth_oracle::check_auth(b);
        }),
        ("store_proto_decode", |b| {
            let _ = store_proto_oracle::check_frame(b);
        }),
        ("tcp_header_decode", |b| {
            let _ = tcp_header_oracle::check_header(b);
        }),
        ("plan_spec", |b| {
            let _ = plan_spec_oracle::check_spec(b);
        }),
        ("lookup_msg_decode", |b| {
            let _ = lookup_msg_oracle::check_lookup_msg(b);
        }),
        ("shm_hello_decode", |b| {
            let _ = shm_hello::check_offer(b);
            let _ = shm_hello::check_answer(b);
        }),
    ];
    for (target, check) in targets {
        let dir = corpus.join(target);
        if !dir.exists() {
            continue;
        }
        let all = files(&dir);
        let step = all.len().div_ceil(CORPUS_SAMPLE).max(1);
        for path in all.into_iter().step_by(step) {
            let bytes = fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            // A panic names the file, for `cargo fuzz run <target> <file>`.
            let outcome = std::panic::catch_unwind(|| check(&bytes));
            assert!(outcome.is_ok(), "{target}: {} fails", path.display());
        }
    }
}
