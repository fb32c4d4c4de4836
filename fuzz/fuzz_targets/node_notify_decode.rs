//! `kvferry_machines::internal::wire::decode_notify` (the side-channel frames a peer
//! packs behind a data-plane write) on arbitrary bytes: never panics, what
//! it accepts is within the limits and re-packs to the same bytes, and
//! every frame it unpacks keeps the properties of `wire_decode` (see
//! `wire_oracle.rs`).

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "wire_oracle.rs"]
mod wire_oracle;

fuzz_target!(|bytes: &[u8]| {
    let _ = wire_oracle::check_notify(bytes);
});
