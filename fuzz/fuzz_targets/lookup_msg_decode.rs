//! The store lookup server's messages (`kvferry_store::internal::lookup::wire`)
//! on arbitrary bytes: the request and the reply decoder, with the
//! properties of `lookup_msg_oracle::check_lookup_msg`.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "lookup_msg_oracle.rs"]
mod lookup_msg_oracle;

fuzz_target!(|data: &[u8]| {
    let _ = lookup_msg_oracle::check_lookup_msg(data);
});
