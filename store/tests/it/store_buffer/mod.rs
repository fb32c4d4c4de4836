//! One heap buffer standing for an engine's whole KV cache, for the
//! store tests that call a backend directly (`mod store_buffer;`), and
//! a connector over it ([`connector`]).

#[allow(dead_code)] // Only the tests that go through a connector use it.
pub(crate) mod connector;

use std::time::{Duration, Instant};

use kvferry_machines::internal::store::ChunkKey;
use kvferry_machines::{RankLayout, Region, Stage};
use kvferry_store::{GetItem, PutItem, Scatter, Segment};

/// One heap buffer as an engine's whole KV cache: `blocks` blocks of
/// `block` bytes.
pub(crate) struct Buffer {
    pub bytes: Vec<u8>,
    pub block: u64,
}

impl Buffer {
    pub(crate) fn new(blocks: u64, block: u64, fill: u8) -> Buffer {
        Buffer {
            bytes: vec![fill; (blocks * block) as usize],
            block,
        }
    }

    pub(crate) fn layout(&self) -> RankLayout {
        RankLayout {
            tp_size: 1,
            tp_rank: 0,
            num_blocks: self.bytes.len() as u64 / self.block,
            regions: vec![Region {
                base: self.bytes.as_ptr() as u64,
                block_len: self.block,
                kv_block_len: self.block,
            }],
            stage: Stage::SINGLE,
            pools: Vec::new(),
        }
    }

    pub(crate) fn scatter(&self, block: u64) -> Scatter {
        let addr = self.bytes.as_ptr() as u64 + block * self.block;
        // SAFETY: inside `bytes`, which outlives every call of the test.
        unsafe {
            Scatter::from_raw(vec![Segment {
                addr,
                len: self.block,
            }])
        }
    }
}

/// What the tests that call a backend's put and get ask of a buffer.
#[allow(dead_code)] // Not every store test puts and gets through these.
impl Buffer {
    pub(crate) fn block(&self, b: u64) -> &[u8] {
        &self.bytes[(b * self.block) as usize..((b + 1) * self.block) as usize]
    }

    pub(crate) fn put(&self, k: &str, b: u64) -> PutItem {
        PutItem {
            key: key(k),
            from: self.scatter(b),
        }
    }

    pub(crate) fn get(&self, k: &str, b: u64) -> GetItem {
        GetItem {
            key: key(k),
            into: self.scatter(b),
        }
    }
}

/// A key of any text a store takes.
pub(crate) fn key(s: &str) -> ChunkKey {
    ChunkKey::from_stored(s.to_string()).unwrap()
}

/// A deadline no call of a test reaches.
pub(crate) fn far() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

/// `remove_prefix` of `store`: the keys under the prefix go, others stay,
/// the glob bytes in the prefix matched as themselves (`mQx` would match
/// `m*[x]` as a pattern). Values come from the first 4 blocks of `kv`.
pub(crate) fn check_remove_prefix(store: &mut dyn kvferry_store::StoreBackend, kv: &Buffer) {
    let names = ["kvf1:m*[x]:a", "kvf1:m*[x]:b", "kvf1:mQx:c", "kvf1:n:d"];
    let items: Vec<PutItem> = (names.iter().zip(0..)).map(|(k, b)| kv.put(k, b)).collect();
    assert!(store.put(&items, far()).unwrap().iter().all(Result::is_ok));
    assert_eq!(store.remove_prefix("kvf1:m*[x]:", far()), Ok(2));
    let keys: Vec<ChunkKey> = names.iter().map(|k| key(k)).collect();
    assert_eq!(
        store.exists(&keys, far()),
        Ok(vec![false, false, true, true])
    );
    assert_eq!(store.remove_prefix("kvf1:m*[x]:", far()), Ok(0));
}
