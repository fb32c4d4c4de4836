//! The spec `kvferry plan` reads: a JSON spec in, the planner's
//! descriptors out. The fuzz target `plan_spec` and the tests that replay
//! its inputs compile this file too (`#[path]`), so it names only the
//! planner, serde and thiserror.
//!
//! The spec names both ranks' layouts, the block ids of one request and the
//! batch limits (see `examples/specs/`). Everything in it is untrusted: a
//! malformed or inconsistent spec is a [`SpecError`] with a one-line
//! message, never a panic.

use kvferry_machines::{BatchLimits, ModelSpec, RankLayout};
use kvferry_machines::{PairLayout, Plan, PlanError};
use serde::Deserialize;
use std::io::{self, Write};

/// A planner spec, as read from JSON.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PlanSpec {
    /// Model-wide parameters.
    pub(crate) model: ModelSpec,
    /// The sending rank.
    pub(crate) prefill: RankLayout,
    /// The receiving rank.
    pub(crate) decode: RankLayout,
    /// Prefill block ids, one list per KV-cache group.
    pub(crate) prefill_blocks: Vec<Vec<u64>>,
    /// Decode block ids, one list per KV-cache group.
    pub(crate) decode_blocks: Vec<Vec<u64>>,
    /// Most descriptors per batch (default 128).
    #[serde(default = "default_batch_descriptors_max")]
    pub(crate) batch_descriptors_max: usize,
    /// Most bytes per batch (default 128 MiB).
    #[serde(default = "default_batch_bytes_max")]
    pub(crate) batch_bytes_max: u64,
    /// Most descriptors in the whole plan (default 16 Mi).
    #[serde(default = "default_descriptors_max")]
    pub(crate) descriptors_max: usize,
}

fn default_batch_descriptors_max() -> usize {
    BatchLimits::default().batch_descriptors_max
}

fn default_batch_bytes_max() -> u64 {
    BatchLimits::default().batch_bytes_max
}

fn default_descriptors_max() -> usize {
    BatchLimits::DEFAULT_DESCRIPTORS_MAX
}

impl PlanSpec {
    /// The spec's batch limits.
    pub(crate) fn limits(&self) -> BatchLimits {
        BatchLimits {
            batch_descriptors_max: self.batch_descriptors_max,
            batch_bytes_max: self.batch_bytes_max,
            descriptors_max: self.descriptors_max,
        }
    }

    /// Validates the spec and plans it.
    pub(crate) fn plan(&self) -> Result<Plan, PlanError> {
        let pair = PairLayout::new(&self.model, &self.prefill, &self.decode)?;
        let mut plan = Plan::default();
        pair.plan_into(
            &self.prefill_blocks,
            &self.decode_blocks,
            &self.limits(),
            &mut plan,
        )?;
        Ok(plan)
    }
}

/// Why a spec could not be planned. Every message is one line.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub(crate) enum SpecError {
    /// The spec file could not be read.
    #[error("cannot read spec: {0}")]
    Io(#[from] io::Error),
    /// The text is not JSON of the spec's shape.
    #[error("malformed spec: {0}")]
    Json(#[from] serde_json::Error),
    /// The spec is well-formed but breaks a planner rule.
    #[error("invalid spec: {0}")]
    Invalid(#[from] PlanError),
}

/// Parses a spec from JSON text.
pub(crate) fn parse_spec(text: &str) -> Result<PlanSpec, SpecError> {
    Ok(serde_json::from_str(text)?)
}

/// Parses, validates and plans a spec given as JSON text.
pub(crate) fn plan_from_json(text: &str) -> Result<Plan, SpecError> {
    Ok(parse_spec(text)?.plan()?)
}

/// Writes `{"transfer": bool, "descriptors": [[src, dst, len], ...],
/// "batches": [[first, count], ...]}`, one descriptor per line so a person
/// can read it and `jq` can still parse it.
pub(crate) fn write_plan_json<W: Write>(plan: &Plan, w: &mut W) -> io::Result<()> {
    write!(
        w,
        "{{\"transfer\": {},\n \"descriptors\": [",
        plan.is_transfer()
    )?;
    for (i, d) in plan.descriptors.iter().enumerate() {
        let sep = if i == 0 { "\n  " } else { ",\n  " };
        write!(w, "{sep}[{}, {}, {}]", d.src, d.dst, d.len)?;
    }
    if plan.is_transfer() {
        w.write_all(b"\n ")?;
    }
    w.write_all(b"],\n \"batches\": [")?;
    for (i, b) in plan.batches.iter().enumerate() {
        let sep = if i == 0 { "" } else { ", " };
        write!(w, "{sep}[{}, {}]", b.first, b.count)?;
    }
    w.write_all(b"]}\n")
}
