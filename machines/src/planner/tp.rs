//! The tensor-parallel geometry of a P/D pair: which prefill rank sends
//! which heads to which decode rank.

use crate::layout::{LayoutKind, ModelSpec, Side};

use super::error::PlanError;

/// What one prefill rank sends to one decode rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Share {
    /// Heads `first .. first + count` (model-wide head indices).
    Heads {
        /// First head sent.
        first: u32,
        /// Number of consecutive heads sent.
        count: u32,
    },
    /// The whole MLA latent cache.
    Latent,
}

/// The tensor-parallel geometry of a P/D pair: who holds which heads, and
/// which P rank sends each head to each D rank.
///
/// A rank of a TP group of size `tp` holds `max(1, H / tp)` heads; for
/// `tp <= H` rank `r` holds heads `r·H/tp ..`, for `tp > H` heads are
/// replicated and rank `r` holds head `r / (tp/H)`. Head `h` of decode rank
/// `rd` comes from its only holder when `Tp <= H`, and from replica
/// `h·(Tp/H) + rd % (Tp/H)` when `Tp > H`. For MLA, decode rank `rd` is fed
/// by prefill rank `rd % Tp` alone. Every head of every decode rank thus
/// comes from exactly one prefill rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TpPair {
    pub(super) kind: LayoutKind,
    pub(super) heads: u32,
    pub(super) prefill_tp: u32,
    pub(super) decode_tp: u32,
}

impl TpPair {
    /// Checks that both TP sizes fit the model.
    pub fn new(model: &ModelSpec, prefill_tp: u32, decode_tp: u32) -> Result<TpPair, PlanError> {
        validate_model(model)?;
        check_tp(model, Side::Prefill, prefill_tp)?;
        check_tp(model, Side::Decode, decode_tp)?;
        Ok(TpPair {
            kind: model.layout,
            heads: model.total_kv_heads,
            prefill_tp,
            decode_tp,
        })
    }

    /// Heads `(first, count)` held by `rank` of a group of `tp` ranks.
    pub(super) fn heads_of(&self, tp: u32, rank: u32) -> (u32, u32) {
        let h = self.heads;
        if tp <= h {
            (rank * (h / tp), h / tp)
        } else {
            (rank / (tp / h), 1)
        }
    }

    /// What `prefill_rank` sends to `decode_rank`, or `None` if the pair
    /// transfers nothing (or a rank is out of range).
    pub fn share(&self, prefill_rank: u32, decode_rank: u32) -> Option<Share> {
        if prefill_rank >= self.prefill_tp || decode_rank >= self.decode_tp {
            return None;
        }
        match self.kind {
            LayoutKind::Mla => {
                (prefill_rank == decode_rank % self.prefill_tp).then_some(Share::Latent)
            }
            LayoutKind::Hnd | LayoutKind::Nhd => {
                let (pf, pn) = self.heads_of(self.prefill_tp, prefill_rank);
                let (df, dn) = self.heads_of(self.decode_tp, decode_rank);
                let first = pf.max(df);
                let end = (pf + pn).min(df + dn);
                if first >= end {
                    return None;
                }
                if self.prefill_tp > self.heads {
                    // Several P ranks hold this head; the replica index picks
                    // one per decode rank so the load spreads over replicas.
                    let replicas = self.prefill_tp / self.heads;
                    if prefill_rank % replicas != decode_rank % replicas {
                        return None;
                    }
                }
                Some(Share::Heads {
                    first,
                    count: end - first,
                })
            }
        }
    }

    /// The prefill ranks `decode_rank` receives from, with what each sends,
    /// in increasing head order.
    pub fn sources_of(&self, decode_rank: u32) -> Peers {
        let empty = Peers::empty(*self, decode_rank, Side::Decode);
        if decode_rank >= self.decode_tp {
            return empty;
        }
        let (next, step, remaining) = match self.kind {
            LayoutKind::Mla => (u64::from(decode_rank % self.prefill_tp), 1, 1),
            LayoutKind::Hnd | LayoutKind::Nhd => {
                let (df, dn) = self.heads_of(self.decode_tp, decode_rank);
                if self.prefill_tp <= self.heads {
                    let per = self.heads / self.prefill_tp;
                    let lo = df / per;
                    let hi = (df + dn - 1) / per;
                    (u64::from(lo), 1, u64::from(hi - lo) + 1)
                } else {
                    let replicas = self.prefill_tp / self.heads;
                    let start =
                        u64::from(df) * u64::from(replicas) + u64::from(decode_rank % replicas);
                    (start, u64::from(replicas), u64::from(dn))
                }
            }
        };
        Peers {
            next,
            step,
            remaining,
            ..empty
        }
    }

    /// The prefill ranks no decode rank receives from (their KV heads are
    /// replicas another prefill rank sends) that `decode_rank` tells so:
    /// rank `u` is told by decode rank `u % decode TP`. Every decode rank
    /// computes the same rule, so each unpaired prefill rank is told
    /// exactly once, by a decode rank that exists.
    pub fn unpaired_told_by(&self, decode_rank: u32) -> impl Iterator<Item = u32> + '_ {
        let d_tp = self.decode_tp;
        (0..self.prefill_tp)
            .filter(move |&u| u % d_tp == decode_rank && self.targets_of(u).count() == 0)
    }

    /// The decode ranks `prefill_rank` sends to, with what each receives.
    pub fn targets_of(&self, prefill_rank: u32) -> Peers {
        let empty = Peers::empty(*self, prefill_rank, Side::Prefill);
        if prefill_rank >= self.prefill_tp {
            return empty;
        }
        let (next, step, remaining) = match self.kind {
            LayoutKind::Mla => {
                let count = if prefill_rank < self.decode_tp {
                    u64::from((self.decode_tp - 1 - prefill_rank) / self.prefill_tp) + 1
                } else {
                    0
                };
                (u64::from(prefill_rank), u64::from(self.prefill_tp), count)
            }
            LayoutKind::Hnd | LayoutKind::Nhd => {
                let (pf, pn) = self.heads_of(self.prefill_tp, prefill_rank);
                if self.decode_tp <= self.heads {
                    let per = self.heads / self.decode_tp;
                    let lo = pf / per;
                    let hi = (pf + pn - 1) / per;
                    (u64::from(lo), 1, u64::from(hi - lo) + 1)
                } else {
                    let replicas = u64::from(self.decode_tp / self.heads);
                    (u64::from(pf) * replicas, 1, u64::from(pn) * replicas)
                }
            }
        };
        Peers {
            next,
            step,
            remaining,
            ..empty
        }
    }
}

/// Iterator over the peers of one rank: `(peer rank, what is transferred)`.
/// It visits at most one candidate per peer rank, so it is bounded by the
/// peer's TP size.
#[derive(Clone, Debug)]
pub struct Peers {
    pub(super) pair: TpPair,
    pub(super) rank: u32,
    pub(super) side: Side,
    pub(super) next: u64,
    pub(super) step: u64,
    pub(super) remaining: u64,
}

impl Peers {
    pub(super) fn empty(pair: TpPair, rank: u32, side: Side) -> Peers {
        Peers {
            pair,
            rank,
            side,
            next: 0,
            step: 1,
            remaining: 0,
        }
    }
}

impl Iterator for Peers {
    type Item = (u32, Share);

    fn next(&mut self) -> Option<(u32, Share)> {
        while self.remaining > 0 {
            let candidate = self.next;
            self.remaining -= 1;
            self.next = self.next.saturating_add(self.step);
            let Ok(peer) = u32::try_from(candidate) else {
                self.remaining = 0;
                break;
            };
            let share = match self.side {
                Side::Decode => self.pair.share(peer, self.rank),
                Side::Prefill => self.pair.share(self.rank, peer),
            };
            if let Some(share) = share {
                return Some((peer, share));
            }
        }
        None
    }
}

pub(super) fn validate_model(model: &ModelSpec) -> Result<(), PlanError> {
    match model.layout {
        // The latent cache is opaque: only its length matters.
        LayoutKind::Mla => Ok(()),
        LayoutKind::Hnd | LayoutKind::Nhd => {
            if model.total_kv_heads == 0 {
                return Err(PlanError::Model("total_kv_heads must be at least 1"));
            }
            if model.block_tokens == 0 {
                return Err(PlanError::Model("block_tokens must be at least 1"));
            }
            if model.head_bytes == 0 {
                return Err(PlanError::Model("head_bytes must be at least 1"));
            }
            Ok(())
        }
    }
}

pub(super) fn check_tp(model: &ModelSpec, side: Side, tp_size: u32) -> Result<(), PlanError> {
    let heads = model.total_kv_heads;
    let fits = match model.layout {
        LayoutKind::Mla => tp_size > 0,
        LayoutKind::Hnd | LayoutKind::Nhd => {
            tp_size > 0
                && if tp_size <= heads {
                    heads.is_multiple_of(tp_size)
                } else {
                    tp_size.is_multiple_of(heads)
                }
        }
    };
    if fits {
        Ok(())
    } else {
        Err(PlanError::TpSize {
            side,
            tp_size,
            heads,
        })
    }
}
