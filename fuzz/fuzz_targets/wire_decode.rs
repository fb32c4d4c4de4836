//! `kvferry::wire::decode` on arbitrary bytes.
//!
//! Besides "never panics", it checks three properties of every frame that
//! decodes: re-encoding round-trips (`decode(encode(m)) == m`), the decoded
//! message passes `Message::check_limits` with the limits it was decoded
//! under (a receiver never accepts what a sender would refuse to send), and
//! a decode under tight limits agrees with `check_limits` under those limits,
//! so the two implementations of the bounds cannot drift apart.

#![no_main]

use kvferry::wire::{self, Limits, WireError};
use libfuzzer_sys::fuzz_target;

/// Small enough that short fuzz inputs hit every bound.
const TIGHT: Limits = Limits {
    max_frame_bytes: 512,
    max_groups: 3,
    max_blocks_per_group: 5,
    max_total_blocks: 8,
    max_regions: 2,
    max_string_bytes: 8,
    max_ids: 4,
};

fuzz_target!(|frame: &[u8]| {
    let default = Limits::default();
    let decoded = wire::decode(frame, &default);
    let tight = wire::decode(frame, &TIGHT);
    let msg = match decoded {
        Ok(msg) => msg,
        Err(_) => {
            // Tighter limits never turn a rejected frame into an accepted one.
            assert!(
                tight.is_err(),
                "accepted under tight limits only: {tight:?}"
            );
            return;
        }
    };
    msg.check_limits(&default)
        .expect("a decoded message passes check_limits with the decode limits");

    let again = wire::encode(&msg);
    assert_eq!(
        wire::decode(&again, &default).as_ref(),
        Ok(&msg),
        "decode(encode(m)) != m"
    );

    let sendable_tight = msg.check_limits(&TIGHT).is_ok() && frame.len() <= TIGHT.max_frame_bytes;
    match &tight {
        Ok(m) => {
            assert_eq!(m, &msg, "tight and default decodes differ");
            assert!(
                sendable_tight,
                "decoded under tight limits but check_limits refuses: {msg:?}"
            );
        }
        Err(WireError::LimitExceeded { .. }) | Err(WireError::FrameTooLarge { .. }) => {
            assert!(
                !sendable_tight,
                "decode rejected a frame check_limits accepts: {tight:?}"
            );
        }
        Err(other) => {
            panic!("a frame valid under default limits fails under tight ones with {other:?}")
        }
    }
});
