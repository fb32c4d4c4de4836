//! `kvferry::node::proto::decode_notify` (the side-channel frames a peer
//! sends over the data plane) on arbitrary bytes: never panics, what it
//! accepts is within the limits, and re-packing what it accepted gives the
//! same bytes back (the format has one encoding).

#![no_main]

use kvferry::node::proto::{self, FrameLimits, MAX_NOTIFY_FRAMES};
use libfuzzer_sys::fuzz_target;

/// Small enough that short fuzz inputs hit every bound.
const TIGHT: FrameLimits = FrameLimits {
    max_frame_bytes: 16,
    max_groups: 3,
    max_blocks_per_group: 5,
    max_string_bytes: 8,
};

fuzz_target!(|bytes: &[u8]| {
    for limits in [FrameLimits::default(), TIGHT] {
        let Ok((endpoint, frames)) = proto::decode_notify(bytes, &limits) else {
            continue;
        };
        assert!(endpoint.len() <= limits.max_string_bytes);
        assert!(frames.len() <= MAX_NOTIFY_FRAMES);
        assert!(frames.iter().all(|f| f.len() <= limits.max_frame_bytes));
        let again = proto::encode_notify(endpoint, frames.iter().copied());
        assert_eq!(again, bytes, "encode_notify(decode_notify(b)) != b");
        // Each frame goes on to the ordinary decoder, which must not panic.
        for f in frames {
            let _ = proto::decode(f, &limits);
        }
    }
});
