//! `kvferry::node::proto::decode` on arbitrary bytes: never panics, a frame
//! that decodes passes `check_limits` and round-trips through `encode`.

#![no_main]

use kvferry::node::proto::{self, FrameLimits};
use libfuzzer_sys::fuzz_target;

/// Small enough that short fuzz inputs hit every bound.
const TIGHT: FrameLimits = FrameLimits {
    max_frame_bytes: 512,
    max_groups: 3,
    max_blocks_per_group: 5,
    max_string_bytes: 8,
};

fuzz_target!(|bytes: &[u8]| {
    for limits in [FrameLimits::default(), TIGHT] {
        let Ok(frame) = proto::decode(bytes, &limits) else {
            continue;
        };
        proto::check_limits(&frame, &limits)
            .expect("a decoded frame passes check_limits with the decode limits");
        let again = proto::encode(&frame);
        assert_eq!(
            proto::decode(&again, &limits).as_ref(),
            Ok(&frame),
            "decode(encode(f)) != f"
        );
    }
});
