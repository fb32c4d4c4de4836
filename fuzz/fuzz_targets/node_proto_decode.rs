//! `kvferry::node::proto::decode` on arbitrary bytes: never panics, and a
//! frame that decodes round-trips through `encode` under the limits it was
//! decoded with (which also shows it is within them, since `decode`
//! enforces them). A frame the node rejects on its own range checks
//! (`FrameError::Invalid`) names one of the fields it range-checks.

#![no_main]

use kvferry::node::proto::{self, FrameError, FrameLimits};
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
        let frame = match proto::decode(bytes, &limits) {
            Ok(frame) => frame,
            Err(FrameError::Invalid { field, .. }) => {
                assert!(
                    matches!(field, "regions" | "receivers_expected"),
                    "unexpected invalid field {field}"
                );
                continue;
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                continue;
            }
        };
        let again = proto::encode(&frame);
        assert_eq!(
            proto::decode(&again, &limits).as_ref(),
            Ok(&frame),
            "decode(encode(f)) != f"
        );
    }
});
