//! A connector over one [`super::Buffer`] of 256 KiB blocks, for the
//! store tests that go through `StoreConnector`.

use std::time::Instant;

use kvferry_machines::internal::common::{BlockId, TransferId};
use kvferry_machines::internal::store::events::Medium;
use kvferry_machines::internal::store::{BlockHash, StoreConfig};
use kvferry_store::{
    ConnectorConfig, ConnectorLimits, StoreConnector, StoreLoadMeta, StoreRequest, StoreSaveMeta,
};
use kvferry_testkit::model::{self, ModelSpecExt};

pub(crate) const BLOCK_TOKENS: u32 = 16;
/// 8 heads x 16 tokens x 2 KiB: 256 KiB blocks.
pub(crate) const HEAD_BYTES: u64 = 2048;
/// Bytes of one block.
pub(crate) const BLOCK_BYTES: u64 = 8 * BLOCK_TOKENS as u64 * HEAD_BYTES;

pub(crate) fn config() -> ConnectorConfig {
    ConnectorConfig {
        store: StoreConfig {
            max_keys_per_batch: 32,
            ..StoreConfig::default()
        },
        keyspace: model::keyspace(
            "redis/model",
            model::medium()
                .with_block_tokens(BLOCK_TOKENS)
                .with_head_bytes(HEAD_BYTES),
        ),
        medium: Medium::Cpu,
        limits: ConnectorLimits::default(),
    }
}

/// Block `blocks[i]` of the request holds hash `hashes[i]`'s KV.
pub(crate) fn request(id: u64, hashes: &[u32], blocks: &[u32]) -> StoreRequest {
    StoreRequest {
        id: TransferId(id),
        block_hashes: vec![(hashes.iter())
            .map(|&h| BlockHash::from_u64(h.into()))
            .collect()],
        block_ids: vec![blocks.iter().map(|&b| BlockId(b)).collect()],
        lora: None,
        extra_keys: Vec::new(),
    }
}

/// Saves hash `b`'s KV from block `b` for each `b` of `blocks`.
pub(crate) fn save(c: &mut StoreConnector, id: u64, blocks: std::ops::Range<u32>) {
    let ids: Vec<u32> = blocks.collect();
    save_as(c, id, &ids, &ids);
}

/// Saves hash `hashes[i]`'s KV from block `blocks[i]`, and waits for it.
pub(crate) fn save_as(c: &mut StoreConnector, id: u64, hashes: &[u32], blocks: &[u32]) {
    let meta = StoreSaveMeta {
        request: request(id, hashes, blocks),
        token_len: blocks.len() as u32 * BLOCK_TOKENS,
        token_ids: None,
    };
    c.start_save(Instant::now(), meta).unwrap();
    c.wait_for_save();
    assert_eq!(c.get_finished().0, [TransferId(id)]);
}

/// The corrupt-value check of every backend: hashes 0..4 were saved from
/// blocks 0..4 (block `b` filled with `b + 1`), then the value of hash 2
/// was spoilt in the store. Looked up (all four hit) and loaded into
/// blocks 4..8 (filled with 0xEE): the load reports exactly block 6, which
/// keeps its 0xEE, and the other three hold their bytes.
pub(crate) fn load_with_block_6_spoilt(c: &mut StoreConnector, kv: &super::Buffer) {
    let ask = vec![(0..4).map(BlockHash::from_u64).collect::<Vec<_>>()];
    let hit = {
        let scope = c.keyspace().scope(None, &[]).unwrap();
        c.lookup_hit(&scope, 4 * BLOCK_TOKENS, &ask).unwrap()
    };
    assert_eq!(hit.tokens, 4 * BLOCK_TOKENS);
    let meta = StoreLoadMeta {
        request: request(2, &[0, 1, 2, 3], &[4, 5, 6, 7]),
        hit,
        local_tokens: 0,
    };
    c.start_load_kv(Instant::now(), meta).unwrap();
    c.wait_for_load();
    assert_eq!(c.get_finished().1, [TransferId(2)]);
    assert_eq!(c.block_ids_with_load_errors(), [BlockId(6)]);
    for (b, fill) in [(4, 1), (5, 2), (6, 0xEE), (7, 4)] {
        assert!(kv.block(b).iter().all(|&x| x == fill), "block {b}");
    }
}
