//! The `mooncake://` backend over the fake `libmooncake_store.so`
//! (`mooncake-sys/csrc/fake_store.c`, compiled here and loaded by path as
//! the real library is): values through the staging buffer both ways,
//! per-key answers (exists, not found, wrong size, too large, full,
//! corrupt), and the store connector's pressure path and load errors on
//! it. The fake's table is process-wide: one test at a time.

use crate::store_buffer;

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use kvferry_store::{
    GetItem, ItemError, MooncakeStore, MooncakeStoreConfig, MooncakeStoreError, PutItem,
    PutOutcome, Scatter, Segment, StoreBackend, StoreConnector,
};
use mooncake_sys::fake::{self, StoreControl};
use store_buffer::{far, key, Buffer};

struct Fake {
    path: PathBuf,
    control: StoreControl,
}

fn fake() -> (&'static Fake, MutexGuard<'static, ()>) {
    static FAKE: OnceLock<Fake> = OnceLock::new();
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let f = FAKE.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mooncake-fake-store");
        let path = fake::build_store(&dir).expect("the fake store builds");
        let control = StoreControl::open(&path).unwrap();
        Fake { path, control }
    });
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    f.control.clear();
    f.control.set_capacity(1 << 30);
    (f, guard)
}

fn config(f: &Fake, staging_bytes: usize) -> MooncakeStoreConfig {
    MooncakeStoreConfig {
        library: Some(f.path.clone()),
        staging_bytes,
        ..MooncakeStoreConfig::from_url("mooncake://127.0.0.1:50051").unwrap()
    }
}

/// Block `b` as two segments (its halves), as a value spread over two
/// regions is.
fn split(kv: &Buffer, b: u64) -> Scatter {
    let addr = kv.bytes.as_ptr() as u64 + b * kv.block;
    let half = kv.block / 2;
    let segs = vec![
        Segment { addr, len: half },
        Segment {
            addr: addr + half,
            len: kv.block - half,
        },
    ];
    // SAFETY: inside `kv`, which outlives every call of the test.
    unsafe { Scatter::from_raw(segs) }
}

#[test]
fn urls_are_parsed_and_bad_ones_refused() {
    let c = MooncakeStoreConfig::from_url(
        "mooncake://10.0.0.1:50051?protocol=rdma&segment_mb=64&device=mlx5_0",
    )
    .unwrap();
    assert_eq!(
        (c.master.as_str(), c.protocol.as_str(), c.device.as_str()),
        ("10.0.0.1:50051", "rdma", "mlx5_0")
    );
    assert_eq!(c.segment_bytes, 64 << 20);
    for bad in [
        "mooncake://",
        "mooncake://host",
        "redis://h:1",
        "mooncake://h:1?bogus=1",
        "mooncake://h:1?segment_mb=x",
    ] {
        assert!(
            matches!(
                MooncakeStoreConfig::from_url(bad),
                Err(MooncakeStoreError::BadUrl(_))
            ),
            "{bad}"
        );
    }
}

#[test]
fn a_missing_library_and_an_unreachable_master_are_typed_errors() {
    let (f, _one) = fake();
    let mut cfg = config(f, 1 << 20);
    cfg.library = Some("/nonexistent/libmooncake_store.so".into());
    let e = MooncakeStore::connect(&cfg).err().unwrap();
    assert!(
        matches!(
            e,
            MooncakeStoreError::Library(mooncake_sys::Error::LibraryNotFound { .. })
        ),
        "{e}"
    );
    let mut cfg = config(f, 1 << 20);
    cfg.master = "unreachable:1".into();
    let e = MooncakeStore::connect(&cfg).err().unwrap();
    assert!(
        matches!(
            e,
            MooncakeStoreError::Library(mooncake_sys::Error::Call {
                call: "mooncake_store_setup",
                ..
            })
        ),
        "{e}"
    );
}

#[test]
fn values_go_through_staging_both_ways_with_per_key_answers() {
    let (f, _one) = fake();
    // Staging for two blocks at a time: a batch of 5 takes three rounds.
    let mut s = MooncakeStore::connect(&config(f, 2 * 4096)).unwrap();
    let mut kv = Buffer::new(16, 4096, 0);
    for b in 0..5u64 {
        let at = (b * kv.block) as usize;
        for (i, x) in kv.bytes[at..at + 4096].iter_mut().enumerate() {
            *x = (i as u64 * 7 + b) as u8;
        }
    }
    let puts: Vec<PutItem> = (0..5u64)
        .map(|b| PutItem {
            key: key(&format!("k{b}")),
            from: split(&kv, b),
        })
        .collect();
    let stored = s.put(&puts, far()).unwrap();
    assert!(
        stored.iter().all(|r| *r == Ok(PutOutcome::Stored)),
        "{stored:?}"
    );
    assert_eq!(s.put(&puts[..1], far()).unwrap(), [Ok(PutOutcome::Exists)]);
    let ks = [key("k0"), key("k4"), key("nope")];
    assert_eq!(s.exists(&ks, far()).unwrap(), [true, true, false]);
    // Back into blocks 8..13, and a miss, a wrong length and a corrupt value.
    assert!(f.control.corrupt("k3"));
    let mut gets: Vec<GetItem> = (0..5u64)
        .map(|b| GetItem {
            key: key(&format!("k{b}")),
            into: split(&kv, 8 + b),
        })
        .collect();
    gets.push(GetItem {
        key: key("nope"),
        into: kv.scatter(14),
    });
    let short = Segment {
        addr: kv.bytes.as_ptr() as u64 + 15 * kv.block,
        len: 100,
    };
    // SAFETY: inside `kv`.
    gets.push(GetItem {
        key: key("k0"),
        into: unsafe { Scatter::from_raw(vec![short]) },
    });
    let got = s.get(&gets, far()).unwrap();
    assert_eq!(got[..3], [Ok(()), Ok(()), Ok(())]);
    assert_eq!(got[3], Err(ItemError::Corrupt));
    assert_eq!(got[4], Ok(()));
    assert_eq!(got[5], Err(ItemError::NotFound));
    assert!(
        matches!(
            got[6],
            Err(ItemError::Transport | ItemError::WrongSize { .. })
        ),
        "{:?}",
        got[6]
    );
    for b in [0u64, 1, 2, 4] {
        assert_eq!(kv.block(8 + b), kv.block(b), "block {b} loaded");
    }
    for b in [11u64, 14, 15] {
        assert!(kv.block(b).iter().all(|&x| x == 0), "block {b} untouched");
    }
    assert_eq!(
        f.control.stats().unregistered,
        0,
        "only registered memory was named"
    );
}

#[test]
fn a_value_larger_than_staging_is_too_large_and_a_full_store_is_full() {
    let (f, _one) = fake();
    let mut s = MooncakeStore::connect(&config(f, 4096)).unwrap();
    let kv = Buffer::new(4, 8192, 9);
    let big = PutItem {
        key: key("big"),
        from: kv.scatter(0),
    };
    assert_eq!(s.put(&[big], far()).unwrap(), [Err(ItemError::TooLarge)]);
    let mut s = MooncakeStore::connect(&config(f, 1 << 20)).unwrap();
    f.control.set_capacity(8192 + 100);
    let puts: Vec<PutItem> = (0..3u64)
        .map(|b| PutItem {
            key: key(&format!("f{b}")),
            from: kv.scatter(b),
        })
        .collect();
    let r = s.put(&puts, far()).unwrap();
    assert_eq!(
        r,
        [
            Ok(PutOutcome::Stored),
            Err(ItemError::Full),
            Err(ItemError::Full)
        ]
    );
}

#[test]
fn a_call_past_its_deadline_touches_no_block() {
    let (f, _one) = fake();
    let mut s = MooncakeStore::connect(&config(f, 1 << 20)).unwrap();
    let kv = Buffer::new(2, 4096, 5);
    let put = PutItem {
        key: key("d"),
        from: kv.scatter(0),
    };
    assert_eq!(
        s.put(std::slice::from_ref(&put), far()).unwrap(),
        [Ok(PutOutcome::Stored)]
    );
    let past = Instant::now();
    assert_eq!(s.put(&[put], past).unwrap(), [Err(ItemError::Timeout)]);
    let get = GetItem {
        key: key("d"),
        into: kv.scatter(1),
    };
    assert_eq!(s.get(&[get], past).unwrap(), [Err(ItemError::Timeout)]);
    assert!(s.exists(&[key("d")], past).is_err());
}

mod connector {
    //! The connector over the fake store: pressure, and a corrupt value.

    use super::*;
    use store_buffer::connector::{
        config as connector_config, load_with_block_6_spoilt, save, BLOCK_BYTES,
    };

    #[test]
    fn a_full_store_takes_the_pressure_path_until_a_save_succeeds() {
        let (f, _one) = fake();
        let kv = Buffer::new(40, BLOCK_BYTES, 4);
        let store = MooncakeStore::connect(&config(f, 1 << 20)).unwrap();
        let mut c = StoreConnector::new(connector_config(), store).unwrap();
        // SAFETY: `kv` outlives the connector and is not touched meanwhile.
        unsafe { c.register_kv_caches(kv.layout()).unwrap() };
        f.control.set_capacity(3 * BLOCK_BYTES);
        save(&mut c, 1, 0..8);
        let s = c.stats();
        assert_eq!(s.pressure.full_saves, 1, "{s:?}");
        f.control.set_capacity(1 << 30);
        save(&mut c, 2, 8..10);
        assert_eq!(c.stats().pressure.clears, 1);
    }

    #[test]
    fn a_corrupt_value_is_a_load_error_for_exactly_its_block() {
        let (f, _one) = fake();
        let mut kv = Buffer::new(8, BLOCK_BYTES, 0xEE);
        for b in 0..4 {
            let at = (b * kv.block) as usize;
            kv.bytes[at..at + kv.block as usize].fill(b as u8 + 1);
        }
        let store = MooncakeStore::connect(&config(f, 1 << 20)).unwrap();
        let mut c = StoreConnector::new(connector_config(), store).unwrap();
        // SAFETY: `kv` outlives the connector and is not touched meanwhile.
        unsafe { c.register_kv_caches(kv.layout()).unwrap() };
        save(&mut c, 1, 0..4);
        // Block 2's value, behind kvferry's back.
        assert_eq!(f.control.corrupt_starting_with(3), 1);
        load_with_block_6_spoilt(&mut c, &kv);
    }
}
