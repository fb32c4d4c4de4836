//! The `tcp` transport's frame parsing (`kvferry::transport::internal::wire`) on
//! arbitrary bytes: the header, the descriptor table and the status byte
//! mapping, with the properties of `tcp_header_oracle::check_header`.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "tcp_header_oracle.rs"]
mod tcp_header_oracle;

fuzz_target!(|data: &[u8]| {
    let _ = tcp_header_oracle::check_header(data);
});
