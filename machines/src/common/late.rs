//! What a driver answers to a message for a transfer whose machine is gone.

use super::{Mode, Msg, Phase};

/// The answer a driver sends for `msg` when the transfer's machine has
/// ended (`outcome`, if still remembered) or is unknown (`None`), so the
/// peer does not wait out its deadline. `mode` is the transfer's mode.
///
/// * An `Abort` is acknowledged.
/// * After a success, a resent request is answered with what the ended
///   machine had said last: push-mode P answers a `Pull` with
///   `Status{ok: true}` (every D rank's KV landed), D answers a `Ready`
///   with `Done{ok: true}` (every chunk was read). A pull-mode `Pull` after
///   P's success needs nothing: every D rank had already returned its lease.
/// * Otherwise whoever still wants to touch blocks of the transfer (`Pull`,
///   `Ready`, `LeaseRequest`) is told to stop (`Abort`): the request failed
///   here or was never known.
/// * Final words, lease returns and grants need no answer.
pub fn late_answer(msg: &Msg, mode: Mode, outcome: Option<Phase>) -> Option<Msg> {
    let succeeded = outcome == Some(Phase::Success);
    match msg {
        Msg::Abort => Some(Msg::AbortAck),
        Msg::Pull { .. } if succeeded => match mode {
            Mode::Push => Some(Msg::Status { ok: true }),
            Mode::Pull => None,
        },
        Msg::Ready { .. } if succeeded => Some(Msg::Done { ok: true }),
        Msg::Pull { .. } | Msg::Ready { .. } | Msg::LeaseRequest { .. } => Some(Msg::Abort),
        Msg::AbortAck
        | Msg::Status { .. }
        | Msg::Done { .. }
        | Msg::LeaseGrant { .. }
        | Msg::Unneeded
        | Msg::NotPaired => None,
    }
}
