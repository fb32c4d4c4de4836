//! Arguments as Python hands them, checked and turned into the node's
//! types: seconds, block lists, layouts, regions, the calling process.

use std::time::Duration;

use kvferry::{BlockId, BlockLists, LayoutKind, Region};
use pyo3::prelude::*;
use pyo3::types::PyInt;

use crate::errors::misuse;

/// Longest wait or grace accepted, in seconds (a year: "forever", but a
/// `Duration` that cannot overflow an `Instant`).
const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// A non-negative, finite number of seconds.
pub(crate) fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    if !(0.0..=MAX_SECONDS).contains(&s) {
        return Err(misuse(format!(
            "{what} must be between 0 and {MAX_SECONDS} seconds, not {s}"
        )));
    }
    Ok(Duration::from_secs_f64(s))
}

/// Block ids per KV-cache group: a list of ints (one group) or a list of
/// lists of ints.
pub(crate) fn block_lists(blocks: &Bound<'_, PyAny>) -> PyResult<BlockLists> {
    let groups: Vec<Bound<'_, PyAny>> = blocks.extract()?;
    let one_group = groups.first().is_none_or(|g| g.is_instance_of::<PyInt>());
    if one_group {
        return Ok(vec![block_ids(blocks)?]);
    }
    groups.iter().map(block_ids).collect()
}

pub(crate) fn block_ids(list: &Bound<'_, PyAny>) -> PyResult<Vec<BlockId>> {
    let ids: Vec<i64> = list.extract()?;
    ids.into_iter()
        .map(|b| {
            u32::try_from(b)
                .map(BlockId)
                .map_err(|_| misuse(format!("block id {b} is not in 0..2**32")))
        })
        .collect()
}

pub(crate) fn layout_kind(name: &str) -> PyResult<LayoutKind> {
    match name.to_ascii_lowercase().as_str() {
        "hnd" => Ok(LayoutKind::Hnd),
        "nhd" => Ok(LayoutKind::Nhd),
        "mla" => Ok(LayoutKind::Mla),
        _ => Err(misuse(format!(
            "layout is \"hnd\", \"nhd\" or \"mla\", not {name:?}"
        ))),
    }
}

/// Regions `(base, block_len, kv_block_len)` as Python hands them.
pub(crate) fn regions_of(regions: Vec<(u64, u64, u64)>) -> Vec<Region> {
    (regions.into_iter())
        .map(|(base, block_len, kv_block_len)| Region {
            base,
            block_len,
            kv_block_len,
        })
        .collect()
}

/// A node's executors and bridge are threads of the process that started
/// it; after `fork()` the child has none of them (vLLM forks its workers:
/// nodes start in the workers). A call from the child is refused.
pub(crate) fn same_process(pid: u32) -> PyResult<()> {
    let here = std::process::id();
    if here == pid {
        return Ok(());
    }
    Err(misuse(format!(
        "this kvferry node was started in process {pid} and is used in process {here} \
         after fork(): its threads do not exist here; start nodes in the process that uses them"
    )))
}
