//! The properties the wire fuzz targets check on every input
//! (`kvferry_machines::internal::wire`), shared with the tests that replay the seeds
//! and corpora (`machines/tests/it/fuzz_seeds.rs`), so a replay checks exactly
//! what the fuzzer does. Every property failure panics.

use kvferry_machines::internal::wire::{self, Frame, Limits, WireError, MAX_NOTIFY_FRAMES};

/// Small enough that short fuzz inputs hit every bound.
pub(super) const TIGHT: Limits = Limits {
    max_frame_bytes: 512,
    max_groups: 3,
    max_blocks_per_group: 5,
    max_total_blocks: 8,
    max_regions: 2,
    max_string_bytes: 8,
};

/// `wire::decode` under the default and the tight limits. A frame that
/// decodes round-trips (`decode(encode(f)) == f`) and passes
/// `Frame::check_limits` with the limits it was decoded under (a receiver
/// never accepts what a sender would refuse to send); the decode under
/// tight limits agrees with `check_limits` under them, so the two
/// implementations of the bounds cannot drift apart; tighter limits never
/// accept more. Returns the decode under the default limits.
pub(super) fn check_frame(bytes: &[u8]) -> Result<Frame, WireError> {
    let default = Limits::default();
    let tight = wire::decode(bytes, &TIGHT);
    let frame = match wire::decode(bytes, &default) {
        Ok(frame) => frame,
        Err(e) => {
            assert!(
                tight.is_err(),
                "accepted under tight limits only: {tight:?}"
            );
            assert!(!e.to_string().is_empty());
            if let WireError::Invalid { field, .. } = e {
                assert!(
                    ["regions", "request id", "named transfer"].contains(&field),
                    "unexpected invalid field {field}"
                );
            }
            return Err(e);
        }
    };
    frame
        .check_limits(&default)
        .expect("a decoded frame passes check_limits with the decode limits");
    let again = wire::encode(&frame);
    assert_eq!(
        wire::decode(&again, &default).as_ref(),
        Ok(&frame),
        "decode(encode(f)) != f"
    );

    let sendable_tight = frame.check_limits(&TIGHT).is_ok() && bytes.len() <= TIGHT.max_frame_bytes;
    match &tight {
        Ok(f) => {
            assert_eq!(f, &frame, "tight and default decodes differ");
            assert!(
                sendable_tight,
                "decoded under tight limits but check_limits refuses: {frame:?}"
            );
        }
        Err(WireError::LimitExceeded { .. } | WireError::FrameTooLarge { .. }) => {
            assert!(
                !sendable_tight,
                "decode rejected a frame check_limits accepts: {tight:?}"
            );
        }
        Err(other) => {
            panic!("a frame valid under default limits fails under tight ones with {other:?}")
        }
    }
    Ok(frame)
}

/// `wire::decode_notify` (the frames a peer packs behind a data-plane
/// write) under the default and tight limits. What it accepts is within the
/// limits and re-packs to the same bytes (the format has one encoding); what
/// it refuses is a typed `Invalid`; each frame it unpacks goes through
/// [`check_frame`]. Returns the unpacking under the default limits.
pub(super) fn check_notify(bytes: &[u8]) -> Result<(&str, Vec<&[u8]>), WireError> {
    let tight = Limits {
        max_frame_bytes: 16,
        ..TIGHT
    };
    let mut outcome = None;
    for limits in [Limits::default(), tight] {
        let got = wire::decode_notify(bytes, &limits);
        match &got {
            Ok((endpoint, frames)) => {
                assert!(endpoint.len() <= limits.max_string_bytes);
                assert!(frames.len() <= MAX_NOTIFY_FRAMES);
                assert!(frames.iter().all(|f| f.len() <= limits.max_frame_bytes));
                let again = wire::encode_notify(endpoint, frames.iter().copied());
                assert_eq!(again, bytes, "encode_notify(decode_notify(b)) != b");
                for f in frames {
                    let _ = check_frame(f);
                }
            }
            Err(e) => assert!(
                matches!(
                    e,
                    WireError::Invalid {
                        field: "notification",
                        ..
                    }
                ),
                "untyped notification error {e:?}"
            ),
        }
        outcome.get_or_insert(got);
    }
    outcome.expect("the default limits ran")
}
