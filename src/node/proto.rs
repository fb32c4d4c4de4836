//! The node's side-channel frames, carried in the project's versioned wire
//! envelope ([`crate::wire`]: `KF` magic, version, postcard body).
//!
//! [`Frame`] is what the bridge works with: the machines' [`Msg`] for one
//! transfer, plus the per-peer hello and heartbeat. [`encode`] and
//! [`decode`] map it one to one onto [`wire::Message`]; the decoder first
//! applies the wire format's own checks (version, truncation, bounded
//! lengths) and then the node's (ranges the machines' types need, region
//! shapes). Nothing a peer sends can panic here.

use kvferry_machines::common::{BlockId, BlockLists, Mode, Msg};
use kvferry_machines::layout::{LayoutKind, ModelSpec, RankLayout, Region};
use kvferry_machines::planner::REGIONS_MAX;

use crate::wire::{self, Message};

/// Bounds the decoder enforces (a subset of [`wire::Limits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// Whole frame, header included (also ZeroMQ's `MAXMSGSIZE`).
    pub max_frame_bytes: usize,
    /// KV-cache groups in one block list.
    pub max_groups: usize,
    /// Blocks in one group.
    pub max_blocks_per_group: usize,
    /// Bytes of the engine id and endpoint strings.
    pub max_string_bytes: usize,
}

impl Default for FrameLimits {
    fn default() -> Self {
        FrameLimits {
            max_frame_bytes: 16 << 20,
            max_groups: 64,
            max_blocks_per_group: 1 << 20,
            max_string_bytes: 1024,
        }
    }
}

impl FrameLimits {
    fn wire(&self) -> wire::Limits {
        wire::Limits {
            max_frame_bytes: self.max_frame_bytes,
            max_groups: self.max_groups,
            max_blocks_per_group: self.max_blocks_per_group,
            max_total_blocks: self.max_blocks_per_group.saturating_mul(self.max_groups),
            max_regions: REGIONS_MAX,
            max_string_bytes: self.max_string_bytes,
            ..wire::Limits::default()
        }
    }
}

/// A rank introduces itself; sent by D when it connects (and as its probe
/// while the peer is not answering) and answered by P.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The sender's engine.
    pub engine_id: String,
    /// Push or pull; both sides must agree.
    pub mode: Mode,
    /// Model facts; both sides must agree.
    pub model: ModelSpec,
    /// The sender's TP place and registered KV regions.
    pub layout: RankLayout,
    /// The sender's data-plane endpoint (`tcp://..`, `local://..`).
    pub endpoint: String,
}

/// Every frame of the node protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Per peer, once per connection (and again after a reconnect).
    Hello(Hello),
    /// A machine message for one transfer.
    Transfer {
        /// The transfer.
        transfer_id: u64,
        /// The machines' message, unchanged.
        msg: Msg,
    },
    /// Liveness probe; answered with `HeartbeatAck` carrying the same `seq`.
    Heartbeat { seq: u64 },
    /// Answer to `Heartbeat`.
    HeartbeatAck { seq: u64 },
}

/// Why a frame was rejected. Every variant blames the peer that sent it.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The wire envelope refused it (version, truncation, bounds, syntax).
    #[error("{0}")]
    Wire(#[from] wire::WireError),
    /// A field is out of the range the node accepts.
    #[error("{field}: {why}")]
    Invalid {
        /// Which field.
        field: &'static str,
        /// What is wrong with it.
        why: &'static str,
    },
}

fn invalid(field: &'static str, why: &'static str) -> FrameError {
    FrameError::Invalid { field, why }
}

fn ids_of(lists: &BlockLists) -> Vec<Vec<u32>> {
    lists
        .iter()
        .map(|g| g.iter().map(|b| b.0).collect())
        .collect()
}

fn lists_of(ids: Vec<Vec<u32>>) -> BlockLists {
    ids.into_iter()
        .map(|g| g.into_iter().map(BlockId).collect())
        .collect()
}

fn to_wire_layout(kind: LayoutKind) -> wire::LayoutKind {
    match kind {
        LayoutKind::Hnd => wire::LayoutKind::Hnd,
        LayoutKind::Nhd => wire::LayoutKind::Nhd,
        LayoutKind::Mla => wire::LayoutKind::Mla,
    }
}

fn from_wire_layout(kind: wire::LayoutKind) -> LayoutKind {
    match kind {
        wire::LayoutKind::Hnd => LayoutKind::Hnd,
        wire::LayoutKind::Nhd => LayoutKind::Nhd,
        wire::LayoutKind::Mla => LayoutKind::Mla,
    }
}

fn to_message(frame: &Frame) -> Message {
    match frame {
        Frame::Hello(h) => Message::Hello(wire::Hello {
            engine_id: h.engine_id.clone(),
            dp_rank: 0,
            tp_rank: h.layout.tp_rank,
            pp_rank: 0,
            tp_size: h.layout.tp_size,
            total_kv_heads: h.model.total_kv_heads,
            block_tokens: h.model.block_tokens,
            num_blocks: u32::try_from(h.layout.num_blocks).unwrap_or(u32::MAX),
            layout: to_wire_layout(h.model.layout),
            mode: match h.mode {
                Mode::Push => wire::TransferMode::Push,
                Mode::Pull => wire::TransferMode::Pull,
            },
            regions: h
                .layout
                .regions
                .iter()
                .enumerate()
                .map(|(i, r)| wire::RegionInfo {
                    base: r.base,
                    len_bytes: r.block_len.saturating_mul(h.layout.num_blocks),
                    block_len_bytes: r.block_len,
                    kv_block_len_bytes: r.kv_block_len,
                    group: 0,
                    layer: i as u32,
                })
                .collect(),
            transport_endpoint: h.endpoint.clone(),
        }),
        Frame::Heartbeat { seq } => Message::Heartbeat(wire::Heartbeat {
            seq: *seq,
            renew: Vec::new(),
            lease_ms: 0,
        }),
        Frame::HeartbeatAck { seq } => Message::HeartbeatAck(wire::HeartbeatAck {
            seq: *seq,
            unknown: Vec::new(),
        }),
        Frame::Transfer { transfer_id, msg } => {
            let transfer_id = *transfer_id;
            match msg {
                Msg::Pull {
                    receivers_expected,
                    dst_blocks,
                    prefix_blocks,
                    lease_seq,
                } => Message::Pull(wire::Pull {
                    transfer_id,
                    dst_blocks: ids_of(dst_blocks),
                    prefix_blocks: prefix_blocks.clone(),
                    expected_senders: 0,
                    receivers_expected: u32::from(*receivers_expected),
                    lease_seq: *lease_seq,
                    deadline_ms: 0,
                    lease_ms: 0,
                }),
                Msg::Ready {
                    chunk,
                    start_blocks,
                    src_blocks,
                    is_last,
                } => Message::Ready(wire::Ready {
                    transfer_id,
                    chunk: *chunk,
                    start_blocks: start_blocks.clone(),
                    src_blocks: ids_of(src_blocks),
                    is_last: *is_last,
                }),
                Msg::LeaseRequest { seq } => Message::LeaseRequest(wire::LeaseRequest {
                    transfer_id,
                    seq: *seq,
                }),
                Msg::LeaseGrant { seq, duration_ms } => Message::LeaseGrant(wire::LeaseGrant {
                    transfer_id,
                    seq: *seq,
                    duration_ms: *duration_ms,
                }),
                Msg::Status { ok } => Message::Status(wire::Status {
                    transfer_id,
                    result: if *ok {
                        Ok(())
                    } else {
                        Err(wire::ErrorCode::Transport)
                    },
                }),
                Msg::Done { ok } => Message::Done(wire::Done {
                    transfer_id,
                    ok: *ok,
                }),
                Msg::Abort => Message::Abort(wire::Abort {
                    transfer_id,
                    reason: wire::AbortCode::Engine,
                }),
                Msg::AbortAck => Message::AbortAck(wire::AbortAck { transfer_id }),
            }
        }
    }
}

fn from_message(msg: Message) -> Result<Frame, FrameError> {
    let transfer = |transfer_id: u64, msg: Msg| Ok(Frame::Transfer { transfer_id, msg });
    match msg {
        Message::Hello(h) => {
            let layout = from_wire_layout(h.layout);
            let first = h.regions.first().ok_or(invalid("regions", "no region"))?;
            let per_block_heads = match layout {
                LayoutKind::Mla => 1,
                LayoutKind::Hnd | LayoutKind::Nhd => {
                    let model = ModelSpec {
                        layout,
                        total_kv_heads: h.total_kv_heads,
                        block_tokens: h.block_tokens,
                        head_bytes: 1,
                    };
                    u64::from(model.heads_per_rank(h.tp_size))
                }
            };
            // Head bytes are implied by the first region; the planner checks
            // that every region agrees with them.
            let rows = per_block_heads.saturating_mul(u64::from(h.block_tokens));
            if rows == 0 || first.kv_block_len_bytes % rows != 0 {
                return Err(invalid(
                    "regions",
                    "kv_block_len is not a whole number of rows",
                ));
            }
            let model = ModelSpec {
                layout,
                total_kv_heads: h.total_kv_heads,
                block_tokens: h.block_tokens,
                head_bytes: first.kv_block_len_bytes / rows,
            };
            Ok(Frame::Hello(Hello {
                engine_id: h.engine_id,
                mode: match h.mode {
                    wire::TransferMode::Push => Mode::Push,
                    wire::TransferMode::Pull => Mode::Pull,
                },
                model,
                layout: RankLayout {
                    tp_size: h.tp_size,
                    tp_rank: h.tp_rank,
                    num_blocks: u64::from(h.num_blocks),
                    regions: h
                        .regions
                        .iter()
                        .map(|r| Region {
                            base: r.base,
                            block_len: r.block_len_bytes,
                            kv_block_len: r.kv_block_len_bytes,
                        })
                        .collect(),
                },
                endpoint: h.transport_endpoint,
            }))
        }
        Message::Heartbeat(h) => Ok(Frame::Heartbeat { seq: h.seq }),
        Message::HeartbeatAck(h) => Ok(Frame::HeartbeatAck { seq: h.seq }),
        Message::Pull(p) => {
            let receivers_expected = u16::try_from(p.receivers_expected)
                .map_err(|_| invalid("receivers_expected", "above 65535"))?;
            transfer(
                p.transfer_id,
                Msg::Pull {
                    receivers_expected,
                    dst_blocks: lists_of(p.dst_blocks),
                    prefix_blocks: p.prefix_blocks,
                    lease_seq: p.lease_seq,
                },
            )
        }
        Message::Ready(r) => transfer(
            r.transfer_id,
            Msg::Ready {
                chunk: r.chunk,
                start_blocks: r.start_blocks,
                src_blocks: lists_of(r.src_blocks),
                is_last: r.is_last,
            },
        ),
        Message::LeaseRequest(l) => transfer(l.transfer_id, Msg::LeaseRequest { seq: l.seq }),
        Message::LeaseGrant(l) => transfer(
            l.transfer_id,
            Msg::LeaseGrant {
                seq: l.seq,
                duration_ms: l.duration_ms,
            },
        ),
        Message::Status(st) => transfer(
            st.transfer_id,
            Msg::Status {
                ok: st.result.is_ok(),
            },
        ),
        Message::Done(d) => transfer(d.transfer_id, Msg::Done { ok: d.ok }),
        Message::Abort(a) => transfer(a.transfer_id, Msg::Abort),
        Message::AbortAck(a) => transfer(a.transfer_id, Msg::AbortAck),
    }
}

/// Encodes one frame.
pub fn encode(frame: &Frame) -> Vec<u8> {
    wire::encode(&to_message(frame))
}

/// Decodes one frame. Never panics, whatever the bytes.
pub fn decode(bytes: &[u8], limits: &FrameLimits) -> Result<Frame, FrameError> {
    from_message(wire::decode(bytes, &limits.wire())?)
}

/// Most frames one data-plane notification carries.
pub const MAX_NOTIFY_FRAMES: usize = 4096;

/// Packs side-channel frames for the data plane (a NOTIFY of the tcp
/// transport): the sender's data-plane endpoint, which the receiver knows
/// from the sender's hello and maps to the sender's side-channel slot,
/// then each frame with its length:
///
/// ```text
/// u16 LE endpoint length, endpoint (UTF-8), { u32 LE frame length, frame }*
/// ```
pub fn encode_notify<'a>(
    sender_endpoint: &str,
    frames: impl IntoIterator<Item = &'a [u8]>,
) -> Vec<u8> {
    let e = sender_endpoint.as_bytes();
    let mut out = Vec::with_capacity(2 + e.len() + 64);
    out.extend_from_slice(&(e.len().min(u16::MAX as usize) as u16).to_le_bytes());
    out.extend_from_slice(&e[..e.len().min(u16::MAX as usize)]);
    for f in frames {
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        out.extend_from_slice(f);
    }
    out
}

/// Bytes [`encode_notify`] spends on the sender's endpoint.
pub fn notify_endpoint_len(sender_endpoint: &str) -> u64 {
    2 + sender_endpoint.len().min(u16::MAX as usize) as u64
}

/// Bytes [`encode_notify`] spends on one frame.
pub fn notify_frame_len(frame: &[u8]) -> u64 {
    4 + frame.len() as u64
}

/// Unpacks [`encode_notify`]: the sender's endpoint and the frames, each
/// still to be decoded with [`decode`]. Never panics, whatever the bytes.
pub fn decode_notify<'a>(
    bytes: &'a [u8],
    limits: &FrameLimits,
) -> Result<(&'a str, Vec<&'a [u8]>), FrameError> {
    let bad = |why| invalid("notification", why);
    let (len, rest) = bytes
        .split_first_chunk::<2>()
        .ok_or(bad("truncated endpoint length"))?;
    let len = u16::from_le_bytes(*len) as usize;
    if len > limits.max_string_bytes {
        return Err(bad("endpoint too long"));
    }
    let (endpoint, mut rest) = rest
        .split_at_checked(len)
        .ok_or(bad("truncated endpoint"))?;
    let endpoint = std::str::from_utf8(endpoint).map_err(|_| bad("endpoint is not UTF-8"))?;
    let mut frames = Vec::new();
    while !rest.is_empty() {
        if frames.len() == MAX_NOTIFY_FRAMES {
            return Err(bad("too many frames"));
        }
        let (n, tail) = rest
            .split_first_chunk::<4>()
            .ok_or(bad("truncated frame length"))?;
        let n = u32::from_le_bytes(*n) as usize;
        if n > limits.max_frame_bytes {
            return Err(bad("frame too long"));
        }
        let (frame, tail) = tail.split_at_checked(n).ok_or(bad("truncated frame"))?;
        frames.push(frame);
        rest = tail;
    }
    Ok((endpoint, frames))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejections() {
        let f = Frame::Transfer {
            transfer_id: 9,
            msg: Msg::Pull {
                receivers_expected: 1,
                dst_blocks: vec![vec![BlockId(1), BlockId(2)]],
                prefix_blocks: vec![0],
                lease_seq: Some(3),
            },
        };
        let bytes = encode(&f);
        let l = FrameLimits::default();
        assert_eq!(decode(&bytes, &l).unwrap(), f);
        assert!(matches!(
            decode(&bytes[..bytes.len() - 1], &l),
            Err(FrameError::Wire(_))
        ));
        let mut v = bytes.clone();
        v[2] = 9;
        assert!(matches!(
            decode(&v, &l),
            Err(FrameError::Wire(wire::WireError::UnsupportedVersion(9)))
        ));
        let small = FrameLimits {
            max_blocks_per_group: 1,
            ..l
        };
        assert!(decode(&bytes, &small).is_err());
        for msg in [
            Msg::LeaseRequest { seq: 4 },
            Msg::LeaseGrant {
                seq: 4,
                duration_ms: 10,
            },
            Msg::Status { ok: true },
            Msg::Status { ok: false },
            Msg::Done { ok: false },
            Msg::Abort,
            Msg::AbortAck,
            Msg::Ready {
                chunk: 2,
                start_blocks: vec![4],
                src_blocks: vec![vec![BlockId(7)]],
                is_last: true,
            },
        ] {
            let f = Frame::Transfer {
                transfer_id: 1,
                msg,
            };
            assert_eq!(decode(&encode(&f), &l).unwrap(), f);
        }
    }

    #[test]
    fn hello_round_trips_through_the_wire_hello() {
        let model = ModelSpec {
            layout: LayoutKind::Nhd,
            total_kv_heads: 8,
            block_tokens: 16,
            head_bytes: 128,
        };
        let kv = 4 * 16 * 128;
        let h = Hello {
            engine_id: "p".into(),
            mode: Mode::Pull,
            model,
            layout: RankLayout {
                tp_size: 2,
                tp_rank: 1,
                num_blocks: 10,
                regions: vec![
                    Region {
                        base: 4096,
                        block_len: kv,
                        kv_block_len: kv
                    };
                    2
                ],
            },
            endpoint: "tcp://127.0.0.1:5".into(),
        };
        let l = FrameLimits::default();
        assert_eq!(
            decode(&encode(&Frame::Hello(h.clone())), &l).unwrap(),
            Frame::Hello(h)
        );
    }

    #[test]
    fn random_bytes_never_panic() {
        let l = FrameLimits::default();
        let mut rng = fastrand::Rng::with_seed(5);
        let base = encode(&Frame::Heartbeat { seq: 3 });
        for _ in 0..20_000 {
            let mut v: Vec<u8> = if rng.bool() {
                base.clone()
            } else {
                base[..4].to_vec()
            };
            let n = rng.usize(0..64);
            v.extend((0..n).map(|_| rng.u8(..)));
            if !v.is_empty() && rng.bool() {
                let i = rng.usize(..v.len());
                v[i] = rng.u8(..);
            }
            let _ = decode(&v, &l);
        }
    }
}
