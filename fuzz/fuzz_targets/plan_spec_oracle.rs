//! The properties the `plan_spec` target checks on every input, shared with
//! the test that replays its seeds and corpus (`tests/it/fuzz_seeds.rs`).
//! Every property failure panics.

use kvferry_machines::internal::planner::Plan;

#[path = "check.rs"]
mod check;

// `kvferry plan`'s spec, compiled here as the CLI compiles it; the CLI's
// own file error is never built from here.
#[allow(dead_code)]
#[path = "../../cli/src/plan/spec.rs"]
mod spec;

/// `parse_spec` and `plan_from_json` on `data`, as
/// `kvferry plan` reads a spec file. A spec that plans yields a plan that
/// stays inside the requested blocks (see `check.rs`) and that
/// `write_plan_json` turns into valid JSON; `plan_from_json` and
/// `PlanSpec::plan` agree. Returns the plan when one is made.
pub(super) fn check_spec(data: &[u8]) -> Option<Plan> {
    let text = std::str::from_utf8(data).ok()?;
    let parsed = spec::parse_spec(text);
    let planned = spec::plan_from_json(text);
    let spec = match parsed {
        Ok(spec) => spec,
        Err(_) => {
            assert!(
                planned.is_err(),
                "plan_from_json accepts what parse_spec rejects"
            );
            return None;
        }
    };
    // A spec may ask for billions of descriptors; its own `descriptors_max`
    // must turn that into an error quickly (libFuzzer's -timeout and
    // -rss_limit_mb catch a planner that does not).
    let by_spec = spec.plan();
    match (&planned, &by_spec) {
        (Ok(a), Ok(b)) => assert_eq!(a.descriptors, b.descriptors),
        (Err(_), Err(_)) => {}
        _ => panic!("plan_from_json and PlanSpec::plan disagree"),
    }
    let plan = by_spec.ok()?;
    check::check_plan(
        &plan,
        &spec.prefill,
        &spec.decode,
        &spec.prefill_blocks,
        &spec.decode_blocks,
        &spec.limits(),
    );
    let mut out = Vec::new();
    spec::write_plan_json(&plan, &mut out).expect("writing to a Vec cannot fail");
    let v: serde_json::Value = serde_json::from_slice(&out).expect("write_plan_json emits JSON");
    assert_eq!(
        v["descriptors"].as_array().map(Vec::len),
        Some(plan.descriptors.len())
    );
    Some(plan)
}
