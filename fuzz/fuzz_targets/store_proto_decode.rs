//! The store server's control frames (`kvferry_store::internal::proto`) on
//! arbitrary bytes, with the properties of `store_proto_oracle::check_frame`.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "store_proto_oracle.rs"]
mod store_proto_oracle;

fuzz_target!(|data: &[u8]| {
    let _ = store_proto_oracle::check_frame(data);
});
