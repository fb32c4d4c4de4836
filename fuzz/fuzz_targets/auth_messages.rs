//! Authentication messages on arbitrary bytes: handshakes, signed
//! requests and sealed tcp headers, with the properties of
//! `auth_oracle::check_auth`.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "auth_oracle.rs"]
mod auth_oracle;

fuzz_target!(|data: &[u8]| {
    let _ = auth_oracle::check_auth(data);
});
