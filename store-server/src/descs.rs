//! An item's segments as data-plane descriptors against the arena: the
//! value's length once every segment is inside the engine's regions, one
//! descriptor per segment, the bytes a batch moves.

use kvferry_store::internal::proto::{Item, KeyAnswer};
use kvferry_transport::internal::registry::check_remote;
use kvferry_transport::Desc;

/// The value's length, once every segment is inside the engine's regions.
pub(crate) fn value_len(
    regions: &[kvferry_transport::RegionInfo],
    it: &Item,
) -> Result<u64, KeyAnswer> {
    let spans = it.segments.iter().map(|s| (s.addr, s.len));
    check_remote(regions, spans).map_err(|_| KeyAnswer::OutOfBounds)?;
    (it.segments.iter())
        .try_fold(0u64, |sum, s| sum.checked_add(s.len))
        .ok_or(KeyAnswer::OutOfBounds)
}

/// One descriptor per engine segment, the value laid out in order from
/// `local` in the arena.
pub(crate) fn push_descs(descs: &mut Vec<Desc>, local: u64, it: &Item) {
    let mut at = local;
    for s in &it.segments {
        descs.push(Desc {
            local_addr: at,
            remote_addr: s.addr,
            len_bytes: s.len,
        });
        at += s.len;
    }
}

pub(crate) fn total_bytes(descs: &[Desc]) -> u64 {
    descs.iter().map(|d| d.len_bytes).sum()
}
