//! `kvferry_machines::internal::wire::decode` on arbitrary bytes: never panics, and
//! the properties of `wire_oracle::check_frame` hold (round trip,
//! `check_limits` agreement under default and tight limits, tighter limits
//! never accept more).

#![no_main]

use libfuzzer_sys::fuzz_target;

// The notification half is the other target's.
#[allow(dead_code)]
#[path = "wire_oracle.rs"]
mod wire_oracle;

fuzz_target!(|bytes: &[u8]| {
    let _ = wire_oracle::check_frame(bytes);
});
