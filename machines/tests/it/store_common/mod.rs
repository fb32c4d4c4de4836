//! What the store tests share: a keyspace of a small model.

use kvferry_machines::internal::store::{GroupSpec, Keyspace, KeyspaceSpec};
use kvferry_machines::LayoutKind;

use crate::model::{self, ModelSpecExt};

/// The keyspace of model "m" (bf16, 16-token blocks, 128-byte heads) with
/// `heads` KV heads over TP `tp` and PP `pp`, and `groups`.
pub(crate) fn keyspace(
    layout: LayoutKind,
    heads: u32,
    tp: u32,
    pp: u32,
    groups: Vec<GroupSpec>,
) -> Keyspace {
    let m = model::medium().with_layout(layout).with_heads(heads);
    Keyspace::new(&KeyspaceSpec {
        tp_size: tp,
        pp_size: pp,
        groups,
        ..model::keyspace("m", m)
    })
    .unwrap()
}
