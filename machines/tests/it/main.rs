//! The integration tests of kvferry-machines, one binary (each module was a test
//! binary of its own; one link instead of many).

mod duplex;
mod fuzz_seeds;
mod liveness;
mod machine_props;
mod machine_recv;
mod machine_send;
// The test kit's model shapes, compiled into these tests from its source:
// the test kit depends on this crate, so they cannot depend on it. Not
// every shape is used here.
#[allow(dead_code, unreachable_pub)]
#[path = "../../../testkit/src/model.rs"]
mod model;
mod planner_pools;
mod planner_prop;
mod planner_rules;
mod sim;
mod simulator;
mod store_common;
mod store_events;
mod store_key;
mod store_load;
mod store_lookup;
mod store_save;
mod wire;
