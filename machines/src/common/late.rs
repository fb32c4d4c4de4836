//! What a driver answers to a message for a transfer whose machine is gone.

use super::{BlockLists, Mode, Msg, PeerId, Phase};

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

/// A fingerprint of the destination blocks `dst_blocks` (per group) of
/// peer `peer`: the wrapping sum of one mixed value per (group, block), so
/// the writes of a transfer, chunk by chunk in any order, sum to the
/// fingerprint of the `Pull` that named the blocks.
///
/// A push-mode prefill node keeps it for each peer of a successful
/// transfer, and answers a late `Pull` with `Status{ok: true}` only when
/// the `Pull` names the same blocks from the same peer: a request that
/// reuses an ended transfer's id (a restarted decode engine, say) gets an
/// `Abort`, never a success for bytes nobody wrote.
pub fn blocks_fingerprint(peer: PeerId, dst_blocks: &BlockLists) -> u64 {
    let mut sum = 0u64;
    for (g, group) in dst_blocks.iter().enumerate() {
        for b in group {
            let key = (u64::from(peer.0) << 40) ^ ((g as u64) << 32) ^ u64::from(b.0);
            sum = sum.wrapping_add(mix(key));
        }
    }
    sum
}

/// splitmix64's finaliser: every input bit moves every output bit.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::BlockId;

    fn lists(groups: &[&[u32]]) -> BlockLists {
        (groups.iter())
            .map(|g| g.iter().map(|&b| BlockId(b)).collect())
            .collect()
    }

    #[test]
    fn chunks_sum_to_the_fingerprint_of_the_whole_list() {
        let p = PeerId(3);
        let whole = blocks_fingerprint(p, &lists(&[&[1, 2, 3], &[9]]));
        let chunks = [lists(&[&[2], &[]]), lists(&[&[3, 1], &[9]])];
        let sum = (chunks.iter()).fold(0u64, |s, c| s.wrapping_add(blocks_fingerprint(p, c)));
        assert_eq!(sum, whole);
        // Another peer, group or block changes it.
        assert_ne!(
            blocks_fingerprint(PeerId(4), &lists(&[&[1, 2, 3], &[9]])),
            whole
        );
        assert_ne!(blocks_fingerprint(p, &lists(&[&[1, 2, 3, 9], &[]])), whole);
        assert_ne!(blocks_fingerprint(p, &lists(&[&[1, 2, 4], &[9]])), whole);
    }
}
