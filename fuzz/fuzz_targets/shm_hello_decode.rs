//! The shared-memory hello's decoders (`kvferry::transport::internal::
//! shm_hello`) on arbitrary bytes, as an offer and as an answer. The
//! properties live beside the decoders (`check_offer`, `check_answer`: the
//! messages are crate-private there), and panic when broken: what decodes
//! is within the bounds and decodes the same after re-encoding.

#![no_main]

use kvferry::transport::internal::shm_hello::{check_answer, check_offer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check_offer(data);
    check_answer(data);
});
