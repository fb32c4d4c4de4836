//! `parse_spec` (`cli/src/plan/spec.rs`) and `plan_from_json` on arbitrary text, as
//! `kvferry plan` reads a spec file: never panics, and the properties of
//! `plan_spec_oracle::check_spec` hold (the plan stays inside the requested
//! blocks, see `check.rs`, and `write_plan_json` emits valid JSON).

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "plan_spec_oracle.rs"]
mod plan_spec_oracle;

fuzz_target!(|data: &[u8]| {
    let _ = plan_spec_oracle::check_spec(data);
});
