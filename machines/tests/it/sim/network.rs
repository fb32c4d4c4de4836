//! Simulated control network: per-message delay (hence reordering), drop,
//! duplication and a long tail, plus partitions that cut node sets apart.
//! Messages travel as bytes in the node's real wire encoding: the side
//! channel's `Frame::Transfer` (`kvferry_machines::internal::wire`, the versioned `KF`
//! postcard envelope the node uses), decoded with the default limits.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use kvferry_machines::internal::common::{Msg, PeerId};
use kvferry_machines::internal::wire::{self, Frame, Limits};
use kvferry_machines::TransferId;

use super::rng::Rng;
use super::scenario::{NetParams, T};

/// What the node's wire envelope carries around a machine message: the
/// transfer and the sender's rank (which becomes the receiver's `PeerId`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Envelope {
    pub transfer: TransferId,
    pub from: PeerId,
    pub msg: Msg,
}

/// A partition with side `mask` loses what crosses it; a one-way one only
/// what leaves the masked side.
pub(crate) fn cut(mask: u64, one_way: bool, from: usize, to: usize) -> bool {
    let (f, t) = ((mask >> from) & 1 == 1, (mask >> to) & 1 == 1);
    if one_way {
        f && !t
    } else {
        f != t
    }
}

/// The frame as the node's bridge sends it, behind the sender's rank (which
/// the real side channel knows from the socket, not from the frame).
pub(crate) fn encode(env: &Envelope) -> Vec<u8> {
    let mut out = env.from.0.to_le_bytes().to_vec();
    out.extend(wire::encode(&Frame::Transfer {
        transfer_id: env.transfer,
        msg: env.msg.clone(),
    }));
    out
}

/// Decodes what [`encode`] made, through the node's own frame decoder.
pub(crate) fn decode(bytes: &[u8]) -> Result<Envelope, String> {
    if bytes.len() < 4 {
        return Err("no sender".into());
    }
    let (from, frame) = bytes.split_at(4);
    let from = u32::from_le_bytes([from[0], from[1], from[2], from[3]]);
    match wire::decode(frame, &Limits::default()) {
        Ok(Frame::Transfer { transfer_id, msg }) => Ok(Envelope {
            transfer: transfer_id,
            from: PeerId(from),
            msg,
        }),
        Ok(other) => Err(format!("not a transfer frame: {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct NetStats {
    pub sent: u64,
    pub dropped: u64,
    pub duplicated: u64,
    pub cut: u64,
    pub bytes: u64,
}

#[derive(Clone, Debug)]
pub(crate) struct Network {
    params: NetParams,
    /// Partitions in force: id, side mask, one-way.
    active: Vec<(usize, u64, bool)>,
    /// FIFO links: the latest delivery time planned per `(from, to)`.
    last: BTreeMap<(usize, usize), T>,
    pub stats: NetStats,
}

impl Network {
    pub(crate) fn new(params: NetParams) -> Self {
        Network {
            params,
            active: Vec::new(),
            last: BTreeMap::new(),
            stats: NetStats::default(),
        }
    }

    pub(crate) fn partition(&mut self, id: usize, side_mask: u64, one_way: bool) {
        self.active.push((id, side_mask, one_way));
    }

    pub(crate) fn heal(&mut self, id: usize) {
        self.active.retain(|(i, _, _)| *i != id);
    }

    /// True when a partition in force loses messages from `from` to `to`.
    pub(crate) fn blocked(&self, from: usize, to: usize) -> bool {
        self.active
            .iter()
            .any(|&(_, m, one_way)| cut(m, one_way, from, to))
    }

    /// Delivery times of one message sent at `now` from `from` to `to`:
    /// none (lost), one, or two (duplicated). Every copy has its own delay,
    /// so copies and later messages overtake each other, unless links are
    /// FIFO (as a TCP connection is): then nothing overtakes what was sent
    /// before it on the same link.
    pub(crate) fn plan(
        &mut self,
        rng: &mut Rng,
        now: T,
        from: usize,
        to: usize,
        len: usize,
    ) -> Vec<T> {
        self.stats.sent += 1;
        self.stats.bytes += len as u64;
        if self.blocked(from, to) {
            self.stats.cut += 1;
            return Vec::new();
        }
        if rng.chance(self.params.drop_ppm) {
            self.stats.dropped += 1;
            return Vec::new();
        }
        let mut out = vec![now + self.delay(rng)];
        if rng.chance(self.params.dup_ppm) {
            self.stats.duplicated += 1;
            out.push(now + self.delay(rng));
        }
        if self.params.fifo {
            let last = self.last.entry((from, to)).or_insert(0);
            for t in &mut out {
                *t = (*t).max(*last + 1);
                *last = *t;
            }
        }
        out
    }

    fn delay(&self, rng: &mut Rng) -> T {
        if rng.chance(self.params.tail_ppm) {
            rng.range(
                self.params.delay_max,
                self.params.delay_max + self.params.tail_max,
            )
        } else {
            rng.range(self.params.delay_min, self.params.delay_max)
        }
    }
}
