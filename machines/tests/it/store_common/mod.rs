//! What the store tests share: a keyspace of a small model.

use kvferry_machines::internal::store::{GroupSpec, Keyspace, KeyspaceSpec};
use kvferry_machines::{LayoutKind, ModelSpec};

/// The keyspace of model "m" (bf16, 16-token blocks, 128-byte heads) with
/// `heads` KV heads over TP `tp` and PP `pp`, and `groups`.
pub(crate) fn keyspace(
    layout: LayoutKind,
    heads: u32,
    tp: u32,
    pp: u32,
    groups: Vec<GroupSpec>,
) -> Keyspace {
    Keyspace::new(&KeyspaceSpec {
        model_name: "m".into(),
        model: ModelSpec {
            layout,
            total_kv_heads: heads,
            block_tokens: 16,
            head_bytes: 128,
        },
        dtype: "bf16".into(),
        tp_size: tp,
        pp_size: pp,
        groups,
    })
    .unwrap()
}
