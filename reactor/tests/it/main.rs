//! The integration tests of kvferry-reactor, one binary (each module was a test
//! binary of its own; one link instead of many).

mod common;
mod driver;
mod driver_props;
mod memlock;
mod reactor;
mod wake_stress;
