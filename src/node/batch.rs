//! The vLLM-style batch API: the scheduler hands the worker a
//! [`LoadMeta`] each step, the worker starts it and collects what finished.

use kvferry_machines::duplex::Direction;
use kvferry_machines::{BlockId, BlockLists, TransferId};
use kvferry_reactor::lock;
use serde::{Deserialize, Serialize};

use super::{Node, NodeError, PrefillTarget};

/// One load of a [`LoadMeta`] (decode).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadRequest {
    /// The transfer.
    pub transfer_id: TransferId,
    /// The string request id the transfer was named by, if any; it travels
    /// in the `Pull` (see [`Node::receiver_named`]).
    pub request_id: Option<String>,
    /// Where its prefill ranks are.
    pub prefill: PrefillTarget,
    /// Destination blocks per group.
    pub dst_blocks: BlockLists,
    /// Per group, leading prefill blocks already held locally.
    pub prefix_blocks: Vec<u32>,
}

/// One send of a [`LoadMeta`] (prefill).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendRequest {
    /// The transfer.
    pub transfer_id: TransferId,
    /// The string request id the transfer was named by, if any (see
    /// [`Node::sender_named`]).
    pub request_id: Option<String>,
    /// Source blocks per group of this chunk.
    pub src_blocks: BlockLists,
    /// True on the request's last chunk.
    pub is_last: bool,
}

/// What the scheduler hands the worker each step (vLLM's connector metadata).
/// It crosses processes (vLLM pickles it to its workers) as
/// [`LoadMeta::encode`]'s bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadMeta {
    /// Loads to start (decode).
    pub loads: Vec<LoadRequest>,
    /// Chunks to send (prefill).
    pub sends: Vec<SendRequest>,
}

impl LoadMeta {
    /// The largest encoding [`LoadMeta::decode`] accepts: far above a
    /// step's worth (a block id is at most 5 bytes), far below what would
    /// hurt a worker that was handed garbage.
    pub const MAX_ENCODED_BYTES: usize = 64 << 20;

    /// Compact bytes (postcard) for crossing a process boundary.
    pub fn encode(&self) -> Vec<u8> {
        // Serializing owned plain data into a Vec cannot fail.
        postcard::to_allocvec(self).expect("a LoadMeta always serializes")
    }

    /// The same loads and sends in blocks `per_block` times smaller: an
    /// engine whose attention kernel splits each of its scheduler's blocks
    /// into `per_block` dense kernel blocks (vLLM's kernel block size)
    /// registers kernel blocks, and block `b` becomes kernel blocks
    /// `b·per_block ..`. A block id past `u32` saturates, and the node
    /// refuses it as out of range.
    pub fn in_kernel_blocks(&self, per_block: u32) -> LoadMeta {
        let split = |lists: &BlockLists| -> BlockLists {
            let kernel = |b: &BlockId| {
                let first = b.0.saturating_mul(per_block);
                (0..per_block).map(move |i| BlockId(first.saturating_add(i)))
            };
            lists
                .iter()
                .map(|g| g.iter().flat_map(kernel).collect())
                .collect()
        };
        LoadMeta {
            loads: (self.loads.iter())
                .map(|l| LoadRequest {
                    dst_blocks: split(&l.dst_blocks),
                    prefix_blocks: l
                        .prefix_blocks
                        .iter()
                        .map(|n| n.saturating_mul(per_block))
                        .collect(),
                    ..l.clone()
                })
                .collect(),
            sends: (self.sends.iter())
                .map(|s| SendRequest {
                    src_blocks: split(&s.src_blocks),
                    ..s.clone()
                })
                .collect(),
        }
    }

    /// The inverse of [`LoadMeta::encode`]; bytes over
    /// [`LoadMeta::MAX_ENCODED_BYTES`] or not a `LoadMeta` are refused.
    pub fn decode(bytes: &[u8]) -> Result<Self, MetaDecodeError> {
        if bytes.len() > Self::MAX_ENCODED_BYTES {
            return Err(MetaDecodeError::TooLarge { len: bytes.len() });
        }
        match postcard::take_from_bytes::<Self>(bytes) {
            Ok((meta, [])) => Ok(meta),
            Ok((_, rest)) => Err(MetaDecodeError::Trailing { bytes: rest.len() }),
            Err(e) => Err(MetaDecodeError::Malformed(e)),
        }
    }
}

/// What [`Node::get_finished_loads`] reports: each transfer that ended
/// since the last call, in exactly one list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FinishedLoads {
    /// Sends that ended, however they ended.
    pub sent: Vec<TransferId>,
    /// Loads that succeeded: every destination block holds its KV.
    pub received: Vec<TransferId>,
    /// Loads that ended without success; their blocks are also in
    /// [`Node::block_ids_with_load_errors`].
    pub failed_loads: Vec<TransferId>,
}

/// The loads and sends [`Node::start_load_kv_each`] could not start.
#[derive(Debug, Default)]
pub struct StartFailures {
    /// Loads refused, with why.
    pub loads: Vec<(TransferId, NodeError)>,
    /// Sends refused, with why.
    pub sends: Vec<(TransferId, NodeError)>,
}

fn failures<T>(
    items: &[T],
    start: impl Fn(&T) -> (TransferId, Result<(), NodeError>),
) -> Vec<(TransferId, NodeError)> {
    items
        .iter()
        .filter_map(|item| match start(item) {
            (tid, Err(e)) => Some((tid, e)),
            (_, Ok(())) => None,
        })
        .collect()
}

/// Why [`LoadMeta::decode`] refused its bytes.
#[derive(Debug, thiserror::Error)]
pub enum MetaDecodeError {
    /// Over [`LoadMeta::MAX_ENCODED_BYTES`].
    #[error(
        "connector metadata of {len} bytes is over the bound of {} bytes",
        LoadMeta::MAX_ENCODED_BYTES
    )]
    TooLarge {
        /// Its length.
        len: usize,
    },
    /// Not the encoding of a `LoadMeta`.
    #[error("malformed connector metadata: {0}")]
    Malformed(postcard::Error),
    /// A `LoadMeta` followed by bytes that belong to none.
    #[error("connector metadata followed by {bytes} stray bytes")]
    Trailing {
        /// How many.
        bytes: usize,
    },
}

impl Node {
    /// vLLM-style batch call: starts every load (decode) and send (prefill)
    /// of `meta`. Returns the first error; the requests before it started.
    /// Each executor is woken once for the whole batch (see
    /// [`Node::batch`]).
    pub fn start_load_kv(&self, meta: &LoadMeta) -> Result<(), NodeError> {
        Node::batch(|| {
            meta.loads.iter().try_for_each(|l| self.start_load(l))?;
            meta.sends.iter().try_for_each(|s| self.start_send(s))
        })
    }

    /// [`Node::start_load_kv`] for an engine that must not lose a step to
    /// one bad request: every load and send is tried, and the ones refused
    /// come back with their errors. A refused load has no machine, so it
    /// appears in neither [`Node::get_finished`] nor the load errors: the
    /// engine reports it itself.
    pub fn start_load_kv_each(&self, meta: &LoadMeta) -> StartFailures {
        Node::batch(|| StartFailures {
            loads: failures(&meta.loads, |l| (l.transfer_id, self.start_load(l))),
            sends: failures(&meta.sends, |s| (s.transfer_id, self.start_send(s))),
        })
    }

    fn start_load(&self, l: &LoadRequest) -> Result<(), NodeError> {
        self.request_as(
            l.transfer_id,
            l.request_id.as_deref(),
            &l.prefill,
            l.dst_blocks.clone(),
            l.prefix_blocks.clone(),
        )
    }

    fn start_send(&self, s: &SendRequest) -> Result<(), NodeError> {
        self.sender_as(s.transfer_id, s.request_id.as_deref())?
            .send(s.src_blocks.clone(), s.is_last)
    }

    /// vLLM-style: the transfers that finished since the last call, as
    /// `(finished sending, finished receiving)` (one of them is empty
    /// unless the role is [`Role::Both`](super::Role::Both)). Every terminal outcome counts; failed loads also appear
    /// in [`Node::block_ids_with_load_errors`].
    pub fn get_finished(&self) -> (Vec<TransferId>, Vec<TransferId>) {
        let f = self.get_finished_loads();
        let mut received = f.received;
        received.extend(f.failed_loads);
        (f.sent, received)
    }

    /// [`Node::get_finished`] with the loads that did not succeed apart:
    /// an engine with several KV-cache groups must be told failed loads
    /// per request (vLLM's `failed_recving`), not only by block.
    pub fn get_finished_loads(&self) -> FinishedLoads {
        self.collect();
        let mut r = lock(&self.inner.shared.records);
        let mut out = FinishedLoads::default();
        for (tid, direction, ok) in r.finished.drain(..) {
            match (direction, ok) {
                (Direction::Send, _) => out.sent.push(tid),
                (Direction::Recv, true) => out.received.push(tid),
                (Direction::Recv, false) => out.failed_loads.push(tid),
            }
        }
        out
    }

    /// vLLM-style: destination blocks whose load failed since the last call.
    pub fn block_ids_with_load_errors(&self) -> Vec<BlockId> {
        let mut r = lock(&self.inner.shared.records);
        std::mem::take(&mut r.load_errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lists() -> impl Strategy<Value = BlockLists> {
        prop::collection::vec(
            prop::collection::vec(any::<u32>().prop_map(BlockId), 0..40),
            0..3,
        )
    }

    fn target() -> impl Strategy<Value = PrefillTarget> {
        prop_oneof![
            ("[a-z0-9.:]{0,30}", "[ -~]{0,20}", any::<Option<u32>>()).prop_map(
                |(addr, engine_id, dp_rank)| PrefillTarget::Bootstrap {
                    addr,
                    engine_id,
                    dp_rank
                }
            ),
            (
                any::<u32>(),
                any::<u32>(),
                prop::collection::vec("tcp://[a-z0-9.:]{0,20}", 0..4)
            )
                .prop_map(|(tp_size, pp_size, side_channels)| PrefillTarget::Direct {
                    tp_size,
                    pp_size,
                    side_channels
                }),
        ]
    }

    fn meta() -> impl Strategy<Value = LoadMeta> {
        let id = prop::option::of("[ -~]{0,40}");
        let load = (
            any::<u64>(),
            id.clone(),
            target(),
            lists(),
            prop::collection::vec(any::<u32>(), 0..3),
        )
            .prop_map(
                |(t, request_id, prefill, dst_blocks, prefix_blocks)| LoadRequest {
                    transfer_id: TransferId(t),
                    request_id,
                    prefill,
                    dst_blocks,
                    prefix_blocks,
                },
            );
        let send = (any::<u64>(), id, lists(), any::<bool>()).prop_map(
            |(t, request_id, src_blocks, is_last)| SendRequest {
                transfer_id: TransferId(t),
                request_id,
                src_blocks,
                is_last,
            },
        );
        (
            prop::collection::vec(load, 0..5),
            prop::collection::vec(send, 0..5),
        )
            .prop_map(|(loads, sends)| LoadMeta { loads, sends })
    }

    proptest! {
        #[test]
        fn a_meta_decodes_to_itself(m in meta()) {
            prop_assert_eq!(LoadMeta::decode(&m.encode()).unwrap(), m);
        }

        #[test]
        fn a_cut_or_extended_encoding_is_refused_not_misread(m in meta(), cut in any::<prop::sample::Index>()) {
            let bytes = m.encode();
            let mut longer = bytes.clone();
            longer.push(0);
            let trailing = matches!(LoadMeta::decode(&longer), Err(MetaDecodeError::Trailing { bytes: 1 }));
            prop_assert!(trailing, "one byte too many is not refused as trailing");
            let short = &bytes[..cut.index(bytes.len())];
            prop_assert!(LoadMeta::decode(short).is_err());
        }
    }

    #[test]
    fn kernel_blocks_split_each_block_in_order() {
        let meta = LoadMeta {
            loads: vec![LoadRequest {
                transfer_id: TransferId(1),
                request_id: None,
                prefill: PrefillTarget::Direct {
                    tp_size: 1,
                    pp_size: 1,
                    side_channels: vec![],
                },
                dst_blocks: vec![vec![BlockId(3), BlockId(0)], vec![BlockId(7)]],
                prefix_blocks: vec![1, 0],
            }],
            sends: vec![SendRequest {
                transfer_id: TransferId(2),
                request_id: None,
                src_blocks: vec![vec![BlockId(u32::MAX / 2)]],
                is_last: true,
            }],
        };
        let k = meta.in_kernel_blocks(2);
        let ids = |v: &[BlockId]| v.iter().map(|b| b.0).collect::<Vec<_>>();
        assert_eq!(ids(&k.loads[0].dst_blocks[0]), [6, 7, 0, 1]);
        assert_eq!(ids(&k.loads[0].dst_blocks[1]), [14, 15]);
        assert_eq!(k.loads[0].prefix_blocks, [2, 0]);
        assert_eq!(ids(&k.sends[0].src_blocks[0]), [u32::MAX - 1, u32::MAX]);
        assert_eq!(meta.in_kernel_blocks(1), meta);
    }

    #[test]
    fn bytes_over_the_bound_are_refused_before_decoding() {
        let big = vec![0u8; LoadMeta::MAX_ENCODED_BYTES + 1];
        assert!(matches!(
            LoadMeta::decode(&big),
            Err(MetaDecodeError::TooLarge { .. })
        ));
    }
}
