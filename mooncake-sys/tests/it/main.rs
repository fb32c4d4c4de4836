//! The integration tests of mooncake-sys, one binary (each module was a test
//! binary of its own; one link instead of many).

mod fake_engine;
mod layout;
