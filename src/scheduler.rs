//! The scheduler side of a vLLM KV connector: decides, per request, what the
//! worker-side [`Node`](crate::node::Node) must load or send, and hands it
//! over once per scheduler step as a [`LoadMeta`].
//!
//! It is pure: no IO, no clock, no threads, only `&mut self`. The engine's
//! scheduler calls it exactly where vLLM calls its connector:
//!
//! ```text
//!  engine scheduler                         Scheduler              worker (Node)
//!  ─────────────────                        ─────────              ─────────────
//!  waiting request ── get_num_new_matched_tokens ──▶ (tokens, async)
//!  blocks allocated ── update_state_after_alloc ──▶ records a load
//!  request ends ───── request_finished ──────────▶ (delay free?, params for D)
//!  end of step ────── build_connector_meta ──────▶ LoadMeta ──▶ start_load_kv
//!  next step ◀─────── handle_finished ◀──────────── get_finished ◀──┘
//! ```
//!
//! ```
//! use kvferry::node::{BlockId, TransferId};
//! use kvferry::scheduler::*;
//!
//! # fn main() -> Result<(), SchedError> {
//! let mut p = Scheduler::new(SchedulerConfig::new(KvRole::Producer, "p", "10.0.0.1:8998", 16))?;
//! let mut d = Scheduler::new(SchedulerConfig::new(KvRole::Consumer, "d", "", 16))?;
//! // Prefill: 40 prompt tokens in 3 blocks, the router's transfer id 7.
//! let p_params = KvTransferParams { do_remote_decode: true, transfer_id: Some(TransferId(7).into()), ..Default::default() };
//! let p_blocks = [vec![BlockId(3), BlockId(4), BlockId(5)]];
//! let p_req = SchedRequest { request_id: "p-1", prompt_len_tokens: 40, computed_len_tokens: 0,
//!                            block_ids: &p_blocks, params: Some(&p_params) };
//! p.update_state_after_alloc(&p_req, 0)?;
//! let done = p.request_finished(&p_req, FinishStatus::LengthCapped)?;
//! assert!(done.delay_free);
//! let p_meta = p.build_connector_meta();      // -> prefill Node::start_load_kv
//! assert_eq!(p_meta.sends[0].src_blocks, p_blocks.to_vec());
//!
//! // Decode: the first block is a local prefix hit.
//! let d_params = done.params.expect("params for decode");
//! let d_blocks = [vec![BlockId(8), BlockId(9), BlockId(12)]];
//! let d_req = SchedRequest { request_id: "d-1", prompt_len_tokens: 40, computed_len_tokens: 16,
//!                            block_ids: &d_blocks, params: Some(&d_params) };
//! let (tokens, is_async) = d.get_num_new_matched_tokens(&d_req)?;
//! assert_eq!((tokens, is_async), (24, true));
//! d.update_state_after_alloc(&d_req, tokens)?;
//! let d_meta = d.build_connector_meta();      // -> decode Node::start_load_kv
//! assert_eq!(d_meta.loads[0].dst_blocks, vec![vec![BlockId(9), BlockId(12)]]);
//! assert_eq!(d_meta.loads[0].prefix_blocks, vec![1]);
//!
//! // Later steps: the nodes' get_finished, back to request ids.
//! assert_eq!(d.handle_finished(&[], &[TransferId(7)]).finished_recving, ["d-1"]);
//! assert_eq!(p.handle_finished(&[TransferId(7)], &[]).finished_sending, ["p-1"]);
//! # Ok(()) }
//! ```
//!
//! # Decode side (`do_remote_prefill`)
//!
//! * [`Scheduler::get_num_new_matched_tokens`] promises the prompt tokens the
//!   engine does not hold locally (prompt length minus the locally computed
//!   prefix), loaded asynchronously.
//! * [`Scheduler::update_state_after_alloc`] records the load: the
//!   destination blocks are the request's blocks from the first one not
//!   computed locally up to the last one holding a prompt token; the locally
//!   computed blocks become [`LoadRequest::prefix_blocks`] (a partial prefix
//!   hit), so the prefill side skips them.
//! * [`Scheduler::build_connector_meta`] drains everything recorded since the
//!   last step into one [`LoadMeta`] and forgets it: a load is handed to the
//!   worker exactly once.
//! * A request that ends before its load was handed to the worker (aborted
//!   before allocation, or between allocation and the end of the step) frees
//!   its blocks at once, and the next meta carries a *release-only* load
//!   (no destination blocks, every prefill block counted as prefix): the
//!   prefill side then sends nothing and frees its blocks, as vLLM's empty
//!   `local_block_ids` do. A request that ends while its load is in flight
//!   keeps its blocks (`delay_free`) until the load ends, because the
//!   prefill side may still write them; [`Scheduler::poll_abort`] names the
//!   transfers worth aborting.
//!
//! # Prefill side (`do_remote_decode`)
//!
//! * [`Scheduler::update_state_after_alloc`] starts tracking the request.
//! * [`Scheduler::request_finished`] with [`FinishStatus::LengthCapped`] (the
//!   prefill produced its one token) delays the free of the blocks, queues a
//!   [`SendRequest`] of the blocks that hold prompt tokens, and returns the
//!   [`KvTransferParams`] the decode engine needs. Any other status frees at
//!   once and sends no KV; the next meta carries an empty last chunk for the
//!   transfer, which tells a decode rank that already asked that there is no
//!   KV for it (its load fails now instead of at its deadline), the way
//!   vLLM's `reqs_not_processed` drops the transfer on the worker.
//! * [`Scheduler::handle_finished`] reports the requests whose delayed free
//!   has ended.
//!
//! # Request ids and transfer ids
//!
//! vLLM names requests by string ids that differ between the prefill and the
//! decode engine (each engine names its own); the router gives both halves
//! one shared `transfer_id` in their `kv_transfer_params`, a number
//! (`"transfer_id": 7`) or a string of 1 to 256 bytes (`"transfer_id":
//! "cmpl-6f2c…-0"`): [`KvTransferParams::transfer_id`] is a
//! [`TransferRef`]. The node keys every transfer on both sides by a
//! [`TransferId`] (a `u64`): the number, or the string's
//! [`TransferId::of_request_id`] hash. A string travels on: in the params
//! prefill hands to decode, as the router wrote it, and in [`LoadMeta`]
//! (`request_id` of each load and send) to the node, which sends it in the
//! decode side's `Pull` and refuses a second string with the same hash
//! (`docs/design.md` §7). Two strings of one transfer id on one scheduler
//! are refused like any transfer id in use ([`SchedError::DuplicateTransfer`]).
//! The scheduler keeps the mapping request id ↔ transfer id of every
//! request it tracks, both ways, so the engine speaks request ids only:
//! [`LoadMeta`] carries transfer ids to the node, and
//! [`Scheduler::handle_finished`] turns the node's finished transfer ids
//! back into request ids.
//!
//! # Bounds
//!
//! At most [`SchedulerConfig::max_tracked_requests`] requests are tracked and
//! at most as many items wait for the next meta; past that the calls that
//! would add one fail with [`SchedError::Full`] and change nothing.
//!
//! # Not covered
//!
//! KV-cache groups of different block sizes: every group here uses one.
//! A sliding-window group moves only its window's blocks
//! ([`SchedulerConfig::window_tokens`]); its blocks before the window are
//! never looked at beyond their count (vLLM's hybrid allocator leaves its
//! null block there).

use std::collections::{HashMap, HashSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::node::{BlockId, BlockLists, LoadMeta, LoadRequest, PrefillTarget, SendRequest};
use kvferry_machines::{check_request_id, sliding_window_blocks, TransferId, REQUEST_ID_MAX_BYTES};

/// Which side(s) of disaggregated serving this engine plays (vLLM's
/// `kv_role`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvRole {
    /// Prefill only (`kv_producer`): serves `do_remote_decode` requests.
    Producer,
    /// Decode only (`kv_consumer`): serves `do_remote_prefill` requests.
    Consumer,
    /// Both (`kv_both`).
    Both,
}

impl KvRole {
    fn is_producer(self) -> bool {
        match self {
            KvRole::Producer | KvRole::Both => true,
            KvRole::Consumer => false,
        }
    }

    fn is_consumer(self) -> bool {
        match self {
            KvRole::Consumer | KvRole::Both => true,
            KvRole::Producer => false,
        }
    }
}

/// The per-request connector parameters (vLLM's `kv_transfer_params`), as
/// the router sends them in JSON. Absent fields read as `false` / `None`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvTransferParams {
    /// Decode: load the prompt's KV from a remote prefill engine.
    pub do_remote_prefill: bool,
    /// Prefill: keep the KV for a remote decode engine.
    pub do_remote_decode: bool,
    /// The transfer shared by the prefill and the decode half of a request,
    /// chosen by the router: a number or a string request id (see the
    /// module docs on id mapping).
    pub transfer_id: Option<TransferRef>,
    /// Decode: the prefill engine's id, as its bootstrap service lists it.
    pub remote_engine_id: Option<String>,
    /// Decode: the prefill engine's data-parallel rank (absent: 0).
    pub remote_dp_rank: Option<u32>,
    /// Decode: the prefill engine's bootstrap service, `host:port` or
    /// `http://host:port`.
    pub remote_bootstrap_addr: Option<String>,
    /// Decode: the prefill engine's blocks per group holding the prompt;
    /// when present their counts are checked against the prompt length.
    pub remote_block_ids: Option<BlockLists>,
}

/// A transfer as the router names it in `kv_transfer_params`: a number
/// (`"transfer_id": 7`) or a string request id (`"transfer_id":
/// "cmpl-6f2c…-0"`, 1 to [`REQUEST_ID_MAX_BYTES`] bytes), whose transfer id
/// is [`TransferId::of_request_id`]. It serializes back the way it came, so
/// the string reaches the decode side and travels in its `Pull`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TransferRef {
    /// A transfer id the router chose.
    Id(TransferId),
    /// A string request id.
    Name(String),
}

impl TransferRef {
    /// The transfer id the node keys the transfer by.
    pub fn transfer_id(&self) -> TransferId {
        match self {
            TransferRef::Id(id) => *id,
            TransferRef::Name(name) => TransferId::of_request_id(name),
        }
    }

    /// The string request id, if the router named the transfer by one.
    pub fn request_id(&self) -> Option<&str> {
        match self {
            TransferRef::Id(_) => None,
            TransferRef::Name(name) => Some(name),
        }
    }
}

impl From<TransferId> for TransferRef {
    fn from(id: TransferId) -> Self {
        TransferRef::Id(id)
    }
}

impl Serialize for TransferRef {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            TransferRef::Id(id) => s.serialize_u64(id.0),
            TransferRef::Name(name) => s.serialize_str(name),
        }
    }
}

impl<'de> Deserialize<'de> for TransferRef {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = TransferRef;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(
                    f,
                    "a transfer id (u64) or a request id of 1 to {REQUEST_ID_MAX_BYTES} bytes"
                )
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<TransferRef, E> {
                Ok(TransferRef::Id(TransferId(v)))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<TransferRef, E> {
                u64::try_from(v)
                    .map(|v| TransferRef::Id(TransferId(v)))
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<TransferRef, E> {
                check_request_id(v).map_err(E::custom)?;
                Ok(TransferRef::Name(v.to_owned()))
            }
        }
        d.deserialize_any(V)
    }
}

/// The scheduler's view of one request, borrowed from the engine.
#[derive(Clone, Copy, Debug)]
pub struct SchedRequest<'a> {
    /// The engine's request id.
    pub request_id: &'a str,
    /// Tokens in the prompt.
    pub prompt_len_tokens: u64,
    /// Tokens whose KV the engine holds locally (a prefix-cache hit; whole
    /// blocks, as vLLM's prefix cache hits are).
    pub computed_len_tokens: u64,
    /// Every block of the request per KV-cache group, in token order
    /// (locally computed blocks first). Ignored where a call does not need
    /// blocks.
    pub block_ids: &'a [Vec<BlockId>],
    /// The request's connector parameters.
    pub params: Option<&'a KvTransferParams>,
}

/// How a request ended (vLLM's finished `RequestStatus` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishStatus {
    /// Hit its token limit: a prefill-only request (`max_tokens = 1`) ends so.
    LengthCapped,
    /// Hit a stop condition.
    Stopped,
    /// Aborted (client gone, router cancel).
    Aborted,
    /// Ignored by the engine (prompt too long).
    Ignored,
    /// Failed in the engine.
    Error,
}

/// What [`Scheduler::request_finished`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FinishDecision {
    /// True when the engine must keep the request's blocks until
    /// [`Scheduler::handle_finished`] reports it (vLLM's `delay_free_blocks`).
    pub delay_free: bool,
    /// Prefill: the parameters to hand the decode engine.
    pub params: Option<KvTransferParams>,
}

impl FinishDecision {
    const FREE_NOW: FinishDecision = FinishDecision {
        delay_free: false,
        params: None,
    };
}

/// Requests whose transfers the node reported finished.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FinishedRequests {
    /// Prefill: requests whose delayed free ended; free their blocks now.
    pub finished_sending: Vec<String>,
    /// Decode: requests whose asynchronous load ended (succeeded or failed:
    /// failed blocks are in `Node::block_ids_with_load_errors`); schedule them.
    pub finished_recving: Vec<String>,
    /// Decode: requests that ended while their load was in flight; their
    /// blocks may be freed now.
    pub freed: Vec<String>,
    /// Transfers not tracked: release-only loads, cancelled sends, transfers
    /// started outside this scheduler. Nothing is left to do for them.
    pub untracked: Vec<TransferId>,
}

/// Who is to blame for a [`SchedError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Blame {
    /// The engine called the scheduler wrongly.
    Misuse,
    /// The router's `kv_transfer_params` are malformed.
    Router,
    /// The configured bound is reached; retry after requests finish.
    Capacity,
}

/// Why a scheduler call failed. A failed call changes no state.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    /// The configuration is unusable.
    #[error("bad scheduler config: {0}")]
    BadConfig(&'static str),
    /// The call needs a request the scheduler does not track.
    #[error("request {request_id:?} is not tracked")]
    UnknownRequest {
        /// The request.
        request_id: String,
    },
    /// The request is already tracked.
    #[error("request {request_id:?} is already tracked")]
    DuplicateRequest {
        /// The request.
        request_id: String,
    },
    /// Another tracked request uses this transfer id.
    #[error("transfer {transfer_id} of request {request_id:?} is used by request {other:?}")]
    DuplicateTransfer {
        /// The transfer id.
        transfer_id: TransferId,
        /// The request that asked for it.
        request_id: String,
        /// The request that holds it.
        other: String,
    },
    /// The call does not fit the request's state (finished twice, ...).
    #[error("request {request_id:?}: {call} not allowed while {state}")]
    WrongState {
        /// The request.
        request_id: String,
        /// The call.
        call: &'static str,
        /// The request's state.
        state: &'static str,
    },
    /// The request asks for a side this engine does not play.
    #[error("request {request_id:?} needs the {needs} role, this engine is {role:?}")]
    WrongRole {
        /// The request.
        request_id: String,
        /// `"producer"` or `"consumer"`.
        needs: &'static str,
        /// This engine's role.
        role: KvRole,
    },
    /// The request's `kv_transfer_params` are unusable.
    #[error("request {request_id:?}: invalid kv_transfer_params: {reason}")]
    InvalidParams {
        /// The request.
        request_id: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// The request has another number of block groups than configured.
    #[error("request {request_id:?} has {found} block groups, expected {expected}")]
    GroupCountMismatch {
        /// The request.
        request_id: String,
        /// Configured groups.
        expected: usize,
        /// Groups given.
        found: usize,
    },
    /// A group has fewer blocks than its tokens need.
    #[error("request {request_id:?} group {group}: {have} blocks, its tokens need {need}")]
    TooFewBlocks {
        /// The request.
        request_id: String,
        /// The group.
        group: usize,
        /// Blocks given.
        have: usize,
        /// Blocks needed.
        need: usize,
    },
    /// A block would be transferred twice in one request.
    #[error("request {request_id:?}: block {} listed twice", block.0)]
    DuplicateBlock {
        /// The request.
        request_id: String,
        /// The block.
        block: BlockId,
    },
    /// The locally computed tokens do not end on a block boundary.
    #[error("request {request_id:?}: {computed_len_tokens} computed tokens is not a multiple of the block size {block_size_tokens}")]
    UnalignedComputedTokens {
        /// The request.
        request_id: String,
        /// Computed tokens given.
        computed_len_tokens: u64,
        /// Configured block size.
        block_size_tokens: u32,
    },
    /// `num_external_tokens` is not what `get_num_new_matched_tokens` promised.
    #[error("request {request_id:?}: {allocated} external tokens allocated, {promised} promised")]
    TokenCountMismatch {
        /// The request.
        request_id: String,
        /// What the scheduler promised.
        promised: u64,
        /// What the engine allocated.
        allocated: u64,
    },
    /// The prompt is empty or too long to count in blocks.
    #[error("request {request_id:?}: prompt of {prompt_len_tokens} tokens out of range")]
    PromptOutOfRange {
        /// The request.
        request_id: String,
        /// Prompt length given.
        prompt_len_tokens: u64,
    },
    /// The scheduler tracks its maximum of requests.
    #[error("scheduler full: at most {max_tracked_requests} requests")]
    Full {
        /// The configured bound.
        max_tracked_requests: usize,
    },
}

impl SchedError {
    /// Who caused the error.
    pub fn blame(&self) -> Blame {
        match self {
            SchedError::InvalidParams { .. } => Blame::Router,
            SchedError::Full { .. } => Blame::Capacity,
            SchedError::BadConfig(_)
            | SchedError::UnknownRequest { .. }
            | SchedError::DuplicateRequest { .. }
            | SchedError::DuplicateTransfer { .. }
            | SchedError::WrongState { .. }
            | SchedError::WrongRole { .. }
            | SchedError::GroupCountMismatch { .. }
            | SchedError::TooFewBlocks { .. }
            | SchedError::DuplicateBlock { .. }
            | SchedError::UnalignedComputedTokens { .. }
            | SchedError::TokenCountMismatch { .. }
            | SchedError::PromptOutOfRange { .. } => Blame::Misuse,
        }
    }
}

/// What a [`Scheduler`] needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Which side(s) this engine plays.
    pub role: KvRole,
    /// Prefill: this engine's id, handed to decode as `remote_engine_id`.
    pub engine_id: String,
    /// Prefill: this engine's data-parallel rank, handed to decode as
    /// `remote_dp_rank`.
    pub dp_rank: u32,
    /// Prefill: this engine's bootstrap service, handed to decode as
    /// `remote_bootstrap_addr`.
    pub bootstrap_addr: String,
    /// Tokens per KV block (vLLM's `cache_config.block_size`), the same on
    /// the prefill and the decode engine.
    pub block_size_tokens: u32,
    /// KV-cache groups of the model (1 without a hybrid cache).
    pub num_groups: usize,
    /// Per group, the sliding window in tokens (0: full attention); empty
    /// means full attention everywhere. A windowed group moves only the
    /// prompt's last `sliding_window_blocks(window, block_size)` blocks
    /// (vLLM's `get_sw_clipped_blocks`), on both sides by the same rule, so
    /// prefill and decode agree on every group's block count.
    pub window_tokens: Vec<u64>,
    /// Most requests tracked at once, and most items queued for one meta.
    pub max_tracked_requests: usize,
}

impl SchedulerConfig {
    /// A config with one group and room for 65 536 requests.
    pub fn new(
        role: KvRole,
        engine_id: impl Into<String>,
        bootstrap_addr: impl Into<String>,
        block_size_tokens: u32,
    ) -> SchedulerConfig {
        SchedulerConfig {
            role,
            engine_id: engine_id.into(),
            dp_rank: 0,
            bootstrap_addr: bootstrap_addr.into(),
            block_size_tokens,
            num_groups: 1,
            window_tokens: Vec::new(),
            max_tracked_requests: 65_536,
        }
    }
}

/// Where a tracked request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Decode: load recorded, waiting for the next meta.
    LoadQueued,
    /// Decode: load handed to the worker, not finished.
    Loading,
    /// Decode: the request runs; its load ended or was never needed.
    Loaded,
    /// Decode: the request ended while its load was in flight; its blocks
    /// are held until the load ends.
    FinishedDuringLoad,
    /// Prefill: computing the prompt.
    Prefilling,
    /// Prefill: finished; its send waits for the next meta.
    SendQueued,
    /// Prefill: send handed to the worker; blocks held until it ends.
    Sending,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::LoadQueued => "its load is queued",
            State::Loading => "loading",
            State::Loaded => "loaded",
            State::FinishedDuringLoad => "finished during its load",
            State::Prefilling => "prefilling",
            State::SendQueued => "its send is queued",
            State::Sending => "sending",
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    transfer_id: TransferId,
    state: State,
}

/// One item for the next meta.
#[derive(Clone, Debug)]
enum Pending {
    /// The load of a tracked request (state `LoadQueued`).
    Load {
        request_id: String,
        load: LoadRequest,
    },
    /// A release-only load of a request that is gone.
    Release(LoadRequest),
    /// The send of a tracked request (state `SendQueued`).
    Send {
        request_id: String,
        send: SendRequest,
    },
    /// An empty last chunk of a prefill request that ended without KV.
    Cancel(SendRequest),
}

/// The scheduler side of the connector. See the module docs.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    entries: HashMap<String, Entry>,
    by_transfer: HashMap<TransferId, String>,
    pending: VecDeque<Pending>,
    aborts: VecDeque<TransferId>,
}

/// The blocks a prompt of `len` tokens fills, or `None` when that count
/// does not fit the node's `u32` block positions.
fn blocks_for(len_tokens: u64, block_size_tokens: u32) -> Option<u32> {
    u32::try_from(len_tokens.div_ceil(u64::from(block_size_tokens))).ok()
}

impl Scheduler {
    /// A scheduler with nothing tracked.
    pub fn new(config: SchedulerConfig) -> Result<Scheduler, SchedError> {
        if config.block_size_tokens == 0 {
            return Err(SchedError::BadConfig("block_size_tokens is 0"));
        }
        if config.num_groups == 0 {
            return Err(SchedError::BadConfig("num_groups is 0"));
        }
        if config.max_tracked_requests == 0 {
            return Err(SchedError::BadConfig("max_tracked_requests is 0"));
        }
        if !config.window_tokens.is_empty() && config.window_tokens.len() != config.num_groups {
            return Err(SchedError::BadConfig(
                "window_tokens has not one entry per group",
            ));
        }
        Ok(Scheduler {
            cfg: config,
            entries: HashMap::new(),
            by_transfer: HashMap::new(),
            pending: VecDeque::new(),
            aborts: VecDeque::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Requests tracked now.
    pub fn tracked_len(&self) -> usize {
        self.entries.len()
    }

    /// Items waiting for the next [`Scheduler::build_connector_meta`].
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// The request tracked under `transfer_id`.
    pub fn request_id_of(&self, transfer_id: TransferId) -> Option<&str> {
        self.by_transfer.get(&transfer_id).map(String::as_str)
    }

    /// The transfer id of a tracked request.
    pub fn transfer_id_of(&self, request_id: &str) -> Option<TransferId> {
        self.entries.get(request_id).map(|e| e.transfer_id)
    }

    /// Decode: how many prompt tokens beyond the locally computed ones the
    /// remote prefill provides, and whether they load asynchronously
    /// (always, when there are any). `(0, false)` for requests without
    /// `do_remote_prefill` and for requests already loaded (a resumed
    /// request loads once). Pure: calling it again changes nothing.
    pub fn get_num_new_matched_tokens(
        &self,
        req: &SchedRequest<'_>,
    ) -> Result<(u64, bool), SchedError> {
        let Some(params) = req.params else {
            return Ok((0, false));
        };
        if !params.do_remote_prefill || self.entries.contains_key(req.request_id) {
            return Ok((0, false));
        }
        // Validated now, so a request whose load could not be recorded
        // later is never promised tokens (the engine computes it locally):
        // its parameters, a transfer id another request holds (vLLM's
        // `n > 1` children share one), a full table.
        let plan = self.decode_plan(req, params)?;
        self.check_new(req.request_id, plan.transfer_id)?;
        let tokens = req
            .prompt_len_tokens
            .saturating_sub(req.computed_len_tokens);
        Ok((tokens, tokens > 0))
    }

    /// Records what the blocks just allocated for `req` need: on decode, the
    /// load of the `num_external_tokens` promised by
    /// [`Scheduler::get_num_new_matched_tokens`] (0 when it promised none:
    /// then only a release-only load frees the prefill side); on prefill,
    /// the start of tracking. Requests without transfer parameters are
    /// ignored; a resumed decode request (already tracked) with no external
    /// tokens is a no-op.
    pub fn update_state_after_alloc(
        &mut self,
        req: &SchedRequest<'_>,
        num_external_tokens: u64,
    ) -> Result<(), SchedError> {
        let Some(params) = req.params else {
            return Ok(());
        };
        if params.do_remote_prefill {
            self.record_load(req, params, num_external_tokens)
        } else if params.do_remote_decode {
            self.track_prefill(req, params, num_external_tokens)
        } else {
            Ok(())
        }
    }

    /// Decode, after allocation: queues the load of the
    /// `num_external_tokens` promised, or a release-only load when there
    /// are none.
    fn record_load(
        &mut self,
        req: &SchedRequest<'_>,
        params: &KvTransferParams,
        num_external_tokens: u64,
    ) -> Result<(), SchedError> {
        if self.entries.contains_key(req.request_id) {
            if num_external_tokens == 0 {
                return Ok(());
            }
            return Err(SchedError::DuplicateRequest {
                request_id: req.request_id.to_string(),
            });
        }
        let plan = self.decode_plan(req, params)?;
        let promised = req
            .prompt_len_tokens
            .saturating_sub(req.computed_len_tokens);
        if num_external_tokens != 0 && num_external_tokens != promised {
            return Err(SchedError::TokenCountMismatch {
                request_id: req.request_id.to_string(),
                promised,
                allocated: num_external_tokens,
            });
        }
        self.check_new(req.request_id, plan.transfer_id)?;
        if num_external_tokens == 0 {
            // Nothing to load (the engine holds or recomputes the
            // prompt), but the prefill side still holds the KV for us.
            self.insert(req.request_id, plan.transfer_id, State::Loaded);
            self.pending
                .push_back(Pending::Release(self.release_load(&plan)));
            return Ok(());
        }
        let transfer_id = plan.transfer_id;
        let load = self.load_of(req, plan)?;
        self.insert(req.request_id, transfer_id, State::LoadQueued);
        self.pending.push_back(Pending::Load {
            request_id: req.request_id.to_string(),
            load,
        });
        Ok(())
    }

    /// Prefill, after allocation: starts tracking the request under its
    /// transfer id.
    fn track_prefill(
        &mut self,
        req: &SchedRequest<'_>,
        params: &KvTransferParams,
        num_external_tokens: u64,
    ) -> Result<(), SchedError> {
        self.require_role(req.request_id, true)?;
        let Some(transfer_id) = params.transfer_id.as_ref().map(TransferRef::transfer_id) else {
            return Err(invalid(req, "do_remote_decode without transfer_id"));
        };
        if let Some(e) = self.entries.get(req.request_id) {
            // vLLM calls again, with no external tokens, once a load
            // another connector ran for it (a store's prefix) ended.
            if num_external_tokens == 0 && e.state == State::Prefilling {
                return Ok(());
            }
            return Err(SchedError::DuplicateRequest {
                request_id: req.request_id.to_string(),
            });
        }
        self.check_new(req.request_id, transfer_id)?;
        // Only the state: the node pairs a decode rank's early request
        // with the send that `request_finished` queues, whichever comes
        // first, so the worker needs nothing yet.
        self.insert(req.request_id, transfer_id, State::Prefilling);
        Ok(())
    }

    /// Decides what happens to the blocks of a request that ended. Requests
    /// without transfer parameters (or without a `transfer_id`) free at once.
    ///
    /// Prefill, [`FinishStatus::LengthCapped`]: the blocks holding the prompt
    /// (`req.block_ids`, the first ones per group) are queued for sending,
    /// the free is delayed, and the returned params tell the decode engine
    /// where to load from. Any other status: free now, no KV is sent.
    ///
    /// Decode: a queued load becomes release-only and the blocks free now; a
    /// load in flight delays the free until it ends; a request that never got
    /// its blocks queues a release-only load so the prefill side frees its
    /// blocks. A decode request is recognised by the scheduler's own
    /// tracking, so calling this twice for an untracked decode request
    /// queues a second release-only load (harmless: the node refuses it or
    /// it expires); finish each request once.
    pub fn request_finished(
        &mut self,
        req: &SchedRequest<'_>,
        status: FinishStatus,
    ) -> Result<FinishDecision, SchedError> {
        let Some(state) = self.entries.get(req.request_id).map(|e| e.state) else {
            return self.finish_untracked(req, status);
        };
        match state {
            State::LoadQueued => {
                self.release_queued_load(req.request_id);
                Ok(FinishDecision::FREE_NOW)
            }
            State::Loading => {
                let entry = self
                    .entries
                    .get_mut(req.request_id)
                    .expect("state read above");
                entry.state = State::FinishedDuringLoad;
                let tid = entry.transfer_id;
                // An abort only ends the load sooner (the delayed free is
                // correct without it), so a full queue drops its oldest.
                if self.aborts.len() >= self.cfg.max_tracked_requests {
                    self.aborts.pop_front();
                }
                self.aborts.push_back(tid);
                Ok(FinishDecision {
                    delay_free: true,
                    params: None,
                })
            }
            State::Loaded => {
                self.remove(req.request_id);
                Ok(FinishDecision::FREE_NOW)
            }
            State::Prefilling => self.finish_prefill(req, status),
            State::FinishedDuringLoad | State::SendQueued | State::Sending => {
                Err(SchedError::WrongState {
                    request_id: req.request_id.to_string(),
                    call: "request_finished",
                    state: state.name(),
                })
            }
        }
    }

    /// `request_finished` for a request never allocated (or never the
    /// connector's).
    fn finish_untracked(
        &mut self,
        req: &SchedRequest<'_>,
        status: FinishStatus,
    ) -> Result<FinishDecision, SchedError> {
        let Some(params) = req.params else {
            return Ok(FinishDecision::FREE_NOW);
        };
        let Some(transfer) = &params.transfer_id else {
            return Ok(FinishDecision::FREE_NOW);
        };
        if params.do_remote_prefill {
            // Ended before its blocks were allocated: the prefill side
            // holds the KV and waits for us; tell it to free. The request
            // may be a stand-in that only carries the parameters (vLLM
            // finishes a rejected request as a one-token prompt), so the
            // prefill side's block count comes from the parameters.
            let plan = self.release_plan(req, params)?;
            self.check_pending_room()?;
            self.pending
                .push_back(Pending::Release(self.release_load(&plan)));
        } else if params.do_remote_decode {
            self.require_role(req.request_id, true)?;
            if status == FinishStatus::LengthCapped {
                // A prefill cannot have run without an allocation.
                return Err(SchedError::UnknownRequest {
                    request_id: req.request_id.to_string(),
                });
            }
            // Aborted before it was scheduled: a decode rank may already
            // wait for this transfer.
            self.check_pending_room()?;
            self.pending
                .push_back(Pending::Cancel(self.cancel(transfer)));
        }
        Ok(FinishDecision::FREE_NOW)
    }

    /// Drains everything recorded since the last call into one meta for the
    /// worker's `Node::start_load_kv`, in the order it was recorded. Each
    /// load and send appears in exactly one meta.
    pub fn build_connector_meta(&mut self) -> LoadMeta {
        let mut meta = LoadMeta::default();
        while let Some(p) = self.pending.pop_front() {
            match p {
                Pending::Load { request_id, load } => {
                    self.set_state(&request_id, State::LoadQueued, State::Loading);
                    meta.loads.push(load);
                }
                Pending::Release(load) => meta.loads.push(load),
                Pending::Send { request_id, send } => {
                    self.set_state(&request_id, State::SendQueued, State::Sending);
                    meta.sends.push(send);
                }
                Pending::Cancel(send) => meta.sends.push(send),
            }
        }
        meta
    }

    /// Feeds what `Node::get_finished` returned (`(sent, received)`
    /// transfer ids) and returns the requests they finish.
    pub fn handle_finished(
        &mut self,
        sent: &[TransferId],
        received: &[TransferId],
    ) -> FinishedRequests {
        let mut out = FinishedRequests::default();
        let tagged = sent
            .iter()
            .map(|&t| (t, true))
            .chain(received.iter().map(|&t| (t, false)));
        for (tid, is_sent) in tagged {
            let Some(request_id) = self.by_transfer.get(&tid).cloned() else {
                out.untracked.push(tid);
                continue;
            };
            let state = self.entries.get(&request_id).map(|e| e.state);
            match (state, is_sent) {
                (Some(State::Sending), true) => {
                    self.remove(&request_id);
                    out.finished_sending.push(request_id);
                }
                (Some(State::Loading), false) => {
                    self.set_state(&request_id, State::Loading, State::Loaded);
                    out.finished_recving.push(request_id);
                }
                (Some(State::FinishedDuringLoad), false) => {
                    self.remove(&request_id);
                    out.freed.push(request_id);
                }
                // Not a transfer this scheduler handed to that side's worker
                // (or one already reported): it is not ours to finish.
                (Some(State::Sending), false)
                | (Some(State::Loading | State::FinishedDuringLoad), true)
                | (
                    Some(State::LoadQueued | State::Loaded | State::Prefilling | State::SendQueued),
                    _,
                )
                | (None, _) => out.untracked.push(tid),
            }
        }
        out
    }

    /// Decode: the next transfer of a request that ended during its load;
    /// aborting it (`Node::abort`) ends the load sooner. A transfer that
    /// ended meanwhile makes the node answer with a misuse error, which the
    /// worker can ignore.
    #[must_use]
    pub fn poll_abort(&mut self) -> Option<TransferId> {
        self.aborts.pop_front()
    }

    // ---- decode helpers ----

    /// [`Scheduler::decode_plan`] for a release only: what the prefill
    /// side holds is `remote_block_ids` when the parameters list them (the
    /// most blocks of any group), whatever the request's own prompt.
    fn release_plan(
        &self,
        req: &SchedRequest<'_>,
        params: &KvTransferParams,
    ) -> Result<DecodePlan, SchedError> {
        let Some(remote) = &params.remote_block_ids else {
            return self.decode_plan(req, params);
        };
        let held = remote.iter().map(Vec::len).max().unwrap_or(0);
        let held = u32::try_from(held).map_err(|_| invalid(req, "remote_block_ids too long"))?;
        let prompt_len_tokens = u64::from(held.max(1)) * u64::from(self.cfg.block_size_tokens);
        let stand_in = SchedRequest {
            prompt_len_tokens,
            computed_len_tokens: 0,
            ..*req
        };
        self.decode_plan(&stand_in, params)
    }

    /// Validates a decode request and computes where its load comes from
    /// and how many leading blocks it already holds.
    fn decode_plan(
        &self,
        req: &SchedRequest<'_>,
        params: &KvTransferParams,
    ) -> Result<DecodePlan, SchedError> {
        self.require_role(req.request_id, false)?;
        if params.do_remote_decode {
            return Err(invalid(req, "both do_remote_prefill and do_remote_decode"));
        }
        let Some(transfer) = &params.transfer_id else {
            return Err(invalid(req, "do_remote_prefill without transfer_id"));
        };
        let (Some(engine_id), Some(addr)) = (
            params.remote_engine_id.as_ref(),
            params.remote_bootstrap_addr.as_ref(),
        ) else {
            return Err(invalid(
                req,
                "do_remote_prefill without remote_engine_id and remote_bootstrap_addr",
            ));
        };
        let bs = self.cfg.block_size_tokens;
        let out_of_range = || SchedError::PromptOutOfRange {
            request_id: req.request_id.to_string(),
            prompt_len_tokens: req.prompt_len_tokens,
        };
        if req.prompt_len_tokens == 0 {
            return Err(out_of_range());
        }
        let prompt_blocks = blocks_for(req.prompt_len_tokens, bs).ok_or_else(out_of_range)?;
        if !req.computed_len_tokens.is_multiple_of(u64::from(bs)) {
            return Err(SchedError::UnalignedComputedTokens {
                request_id: req.request_id.to_string(),
                computed_len_tokens: req.computed_len_tokens,
                block_size_tokens: bs,
            });
        }
        // A local hit past the prompt (the engine computed more than the
        // prompt) still holds at most the prompt's blocks.
        let prefix_blocks = u32::try_from(req.computed_len_tokens / u64::from(bs))
            .unwrap_or(u32::MAX)
            .min(prompt_blocks);
        if let Some(remote) = &params.remote_block_ids {
            if remote.len() != self.cfg.num_groups {
                return Err(invalid(req, "remote_block_ids group count differs"));
            }
            let sent = |g: usize| (prompt_blocks - self.window_start(g, prompt_blocks)) as usize;
            if remote.iter().enumerate().any(|(g, l)| l.len() != sent(g)) {
                return Err(invalid(
                    req,
                    "remote_block_ids do not hold the prompt's block count",
                ));
            }
        }
        Ok(DecodePlan {
            transfer_id: transfer.transfer_id(),
            request_id: transfer.request_id().map(str::to_owned),
            target: PrefillTarget::Bootstrap {
                addr: addr.clone(),
                engine_id: engine_id.clone(),
                dp_rank: params.remote_dp_rank,
            },
            prompt_blocks,
            prefix_blocks,
        })
    }

    /// The request's blocks that receive KV: per group, positions from the
    /// first one not held locally to the last one holding a prompt token.
    fn destination_blocks(
        &self,
        req: &SchedRequest<'_>,
        plan: &DecodePlan,
    ) -> Result<BlockLists, SchedError> {
        let lists = self.prompt_blocks(req, plan.prompt_blocks)?;
        let skip = |g: usize| {
            plan.prefix_blocks
                .max(self.window_start(g, plan.prompt_blocks))
        };
        Ok((lists.into_iter().enumerate())
            .map(|(g, l)| l[skip(g) as usize..].to_vec())
            .collect())
    }

    /// The load of `plan`: per group, the destination blocks and the
    /// prefix hit counted in prefill's (window-clipped) block list.
    fn load_of(&self, req: &SchedRequest<'_>, plan: DecodePlan) -> Result<LoadRequest, SchedError> {
        let dst_blocks = self.destination_blocks(req, &plan)?;
        let prefix_blocks = (0..self.cfg.num_groups)
            .map(|g| {
                let start = self.window_start(g, plan.prompt_blocks);
                plan.prefix_blocks.max(start) - start
            })
            .collect();
        Ok(LoadRequest {
            transfer_id: plan.transfer_id,
            request_id: plan.request_id,
            prefill: plan.target,
            dst_blocks,
            prefix_blocks,
        })
    }

    /// The first of group `g`'s `prompt_blocks` prompt blocks that moves:
    /// 0 for full attention, the start of the window's blocks otherwise.
    fn window_start(&self, g: usize, prompt_blocks: u32) -> u32 {
        let window = self.cfg.window_tokens.get(g).copied().unwrap_or(0);
        let bs = u64::from(self.cfg.block_size_tokens);
        let keep = u32::try_from(sliding_window_blocks(window, bs)).unwrap_or(u32::MAX);
        match keep {
            0 => 0,
            keep => prompt_blocks.saturating_sub(keep),
        }
    }

    /// A load that moves nothing: every prefill block counts as held, so the
    /// prefill side sends nothing and frees its blocks.
    fn release_load(&self, plan: &DecodePlan) -> LoadRequest {
        LoadRequest {
            transfer_id: plan.transfer_id,
            request_id: plan.request_id.clone(),
            prefill: plan.target.clone(),
            dst_blocks: vec![Vec::new(); self.cfg.num_groups],
            prefix_blocks: (0..self.cfg.num_groups)
                .map(|g| plan.prompt_blocks - self.window_start(g, plan.prompt_blocks))
                .collect(),
        }
    }

    /// Turns the queued load of `request_id` into a release-only load and
    /// stops tracking the request.
    fn release_queued_load(&mut self, request_id: &str) {
        for p in self.pending.iter_mut() {
            let Pending::Load {
                request_id: r,
                load,
            } = p
            else {
                continue;
            };
            if r != request_id {
                continue;
            }
            let held: Vec<u32> = load
                .dst_blocks
                .iter()
                .zip(&load.prefix_blocks)
                .map(|(d, p)| p.saturating_add(d.len() as u32))
                .collect();
            let release = LoadRequest {
                transfer_id: load.transfer_id,
                request_id: load.request_id.clone(),
                prefill: load.prefill.clone(),
                dst_blocks: vec![Vec::new(); held.len()],
                prefix_blocks: held,
            };
            *p = Pending::Release(release);
            break;
        }
        self.remove(request_id);
    }

    // ---- prefill helpers ----

    fn finish_prefill(
        &mut self,
        req: &SchedRequest<'_>,
        status: FinishStatus,
    ) -> Result<FinishDecision, SchedError> {
        let transfer_id = self.entries[req.request_id].transfer_id;
        // The request's name as the router gave it, for the node and for decode.
        let transfer = match req.params.and_then(|p| p.transfer_id.as_ref()) {
            Some(TransferRef::Name(name)) => TransferRef::Name(name.clone()),
            Some(TransferRef::Id(_)) | None => TransferRef::Id(transfer_id),
        };
        match status {
            FinishStatus::LengthCapped => {}
            FinishStatus::Stopped
            | FinishStatus::Aborted
            | FinishStatus::Ignored
            | FinishStatus::Error => {
                self.check_pending_room()?;
                self.remove(req.request_id);
                self.pending
                    .push_back(Pending::Cancel(self.cancel(&transfer)));
                return Ok(FinishDecision::FREE_NOW);
            }
        }
        let bs = self.cfg.block_size_tokens;
        if req.prompt_len_tokens == 0 {
            return Err(SchedError::PromptOutOfRange {
                request_id: req.request_id.to_string(),
                prompt_len_tokens: req.prompt_len_tokens,
            });
        }
        let prompt_blocks =
            blocks_for(req.prompt_len_tokens, bs).ok_or_else(|| SchedError::PromptOutOfRange {
                request_id: req.request_id.to_string(),
                prompt_len_tokens: req.prompt_len_tokens,
            })?;
        let src_blocks: BlockLists = (self.prompt_blocks(req, prompt_blocks)?.into_iter())
            .enumerate()
            .map(|(g, l)| l[self.window_start(g, prompt_blocks) as usize..].to_vec())
            .collect();
        self.check_pending_room()?;
        let d_params = KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            transfer_id: Some(transfer.clone()),
            remote_engine_id: Some(self.cfg.engine_id.clone()),
            remote_dp_rank: Some(self.cfg.dp_rank),
            remote_bootstrap_addr: Some(self.cfg.bootstrap_addr.clone()),
            remote_block_ids: Some(src_blocks.clone()),
        };
        self.set_state(req.request_id, State::Prefilling, State::SendQueued);
        self.pending.push_back(Pending::Send {
            request_id: req.request_id.to_string(),
            send: SendRequest {
                transfer_id,
                request_id: transfer.request_id().map(str::to_owned),
                src_blocks,
                is_last: true,
            },
        });
        Ok(FinishDecision {
            delay_free: true,
            params: Some(d_params),
        })
    }

    /// An empty last chunk: "this prefill has no KV for the transfer".
    fn cancel(&self, transfer: &TransferRef) -> SendRequest {
        SendRequest {
            transfer_id: transfer.transfer_id(),
            request_id: transfer.request_id().map(str::to_owned),
            src_blocks: vec![Vec::new(); self.cfg.num_groups],
            is_last: true,
        }
    }

    // ---- shared helpers ----

    /// Per group, the first `n` blocks of the request (those holding prompt
    /// tokens), checked for count and duplicates.
    fn prompt_blocks(&self, req: &SchedRequest<'_>, n: u32) -> Result<BlockLists, SchedError> {
        if req.block_ids.len() != self.cfg.num_groups {
            return Err(SchedError::GroupCountMismatch {
                request_id: req.request_id.to_string(),
                expected: self.cfg.num_groups,
                found: req.block_ids.len(),
            });
        }
        let need = n as usize;
        for (group, g) in req.block_ids.iter().enumerate() {
            if g.len() < need {
                return Err(SchedError::TooFewBlocks {
                    request_id: req.request_id.to_string(),
                    group,
                    have: g.len(),
                    need,
                });
            }
        }
        // Groups share one block pool, so a block id that moves may appear
        // once in the whole request: a repeat would make two positions land
        // in one block. A sliding-window group's blocks before its window do
        // not move (vLLM leaves its null block there, once per position).
        let mut seen = HashSet::with_capacity(need * req.block_ids.len());
        for (group, g) in req.block_ids.iter().enumerate() {
            let start = self.window_start(group, n) as usize;
            for b in &g[start..need] {
                if !seen.insert(*b) {
                    return Err(SchedError::DuplicateBlock {
                        request_id: req.request_id.to_string(),
                        block: *b,
                    });
                }
            }
        }
        Ok(req.block_ids.iter().map(|g| g[..need].to_vec()).collect())
    }

    fn require_role(&self, request_id: &str, producer: bool) -> Result<(), SchedError> {
        let ok = if producer {
            self.cfg.role.is_producer()
        } else {
            self.cfg.role.is_consumer()
        };
        if ok {
            Ok(())
        } else {
            Err(SchedError::WrongRole {
                request_id: request_id.to_string(),
                needs: if producer { "producer" } else { "consumer" },
                role: self.cfg.role,
            })
        }
    }

    /// Checks that a new entry (and its one queued item) fits and that its
    /// transfer id is free.
    fn check_new(&self, request_id: &str, transfer_id: TransferId) -> Result<(), SchedError> {
        if let Some(other) = self.by_transfer.get(&transfer_id) {
            return Err(SchedError::DuplicateTransfer {
                transfer_id,
                request_id: request_id.to_string(),
                other: other.clone(),
            });
        }
        if self.entries.len() >= self.cfg.max_tracked_requests {
            return Err(SchedError::Full {
                max_tracked_requests: self.cfg.max_tracked_requests,
            });
        }
        self.check_pending_room()
    }

    fn check_pending_room(&self) -> Result<(), SchedError> {
        if self.pending.len() >= self.cfg.max_tracked_requests {
            return Err(SchedError::Full {
                max_tracked_requests: self.cfg.max_tracked_requests,
            });
        }
        Ok(())
    }

    fn insert(&mut self, request_id: &str, transfer_id: TransferId, state: State) {
        self.entries
            .insert(request_id.to_string(), Entry { transfer_id, state });
        self.by_transfer.insert(transfer_id, request_id.to_string());
    }

    fn remove(&mut self, request_id: &str) {
        if let Some(e) = self.entries.remove(request_id) {
            self.by_transfer.remove(&e.transfer_id);
        }
    }

    /// Moves a tracked request from `from` to `to`. Every caller has just
    /// seen it in `from`, so anything else is a broken invariant.
    fn set_state(&mut self, request_id: &str, from: State, to: State) {
        let e = self
            .entries
            .get_mut(request_id)
            .unwrap_or_else(|| panic!("request {request_id:?} left the table while queued"));
        assert_eq!(
            e.state, from,
            "request {request_id:?} in an unexpected state"
        );
        e.state = to;
    }
}

/// Where a decode request loads from and what it already holds.
#[derive(Clone, Debug)]
struct DecodePlan {
    transfer_id: TransferId,
    /// The router's string request id, if it named the transfer by one.
    request_id: Option<String>,
    target: PrefillTarget,
    /// Blocks holding the prompt (the prefill side has this many per group).
    prompt_blocks: u32,
    /// Leading blocks computed locally (same in every group).
    prefix_blocks: u32,
}

fn invalid(req: &SchedRequest<'_>, reason: &'static str) -> SchedError {
    SchedError::InvalidParams {
        request_id: req.request_id.to_string(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&b| BlockId(b)).collect()
    }

    fn decode_params(tid: u64) -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: true,
            transfer_id: Some(TransferId(tid).into()),
            remote_engine_id: Some("p".into()),
            remote_bootstrap_addr: Some("127.0.0.1:8998".into()),
            ..KvTransferParams::default()
        }
    }

    fn sched(role: KvRole, max: usize) -> Scheduler {
        let mut c = SchedulerConfig::new(role, "p", "127.0.0.1:8998", 4);
        c.max_tracked_requests = max;
        Scheduler::new(c).unwrap()
    }

    #[test]
    fn config_rejects_zero_bounds() {
        for (bs, groups, max) in [(0, 1, 1), (4, 0, 1), (4, 1, 0)] {
            let mut c = SchedulerConfig::new(KvRole::Both, "e", "a", bs);
            c.num_groups = groups;
            c.max_tracked_requests = max;
            let e = Scheduler::new(c).unwrap_err();
            assert!(matches!(e, SchedError::BadConfig(_)), "{e}");
            assert_eq!(e.blame(), Blame::Misuse);
        }
    }

    #[test]
    fn full_table_refuses_and_changes_nothing() {
        let mut s = sched(KvRole::Consumer, 2);
        let blocks = [ids(&[1, 2])];
        let params: Vec<KvTransferParams> = (0..3).map(decode_params).collect();
        let names = ["a", "b", "c"];
        for i in 0..2 {
            let r = SchedRequest {
                request_id: names[i],
                prompt_len_tokens: 8,
                computed_len_tokens: 0,
                block_ids: &blocks,
                params: Some(&params[i]),
            };
            s.update_state_after_alloc(&r, 8).unwrap();
        }
        let r = SchedRequest {
            request_id: "c",
            prompt_len_tokens: 8,
            computed_len_tokens: 0,
            block_ids: &blocks,
            params: Some(&params[2]),
        };
        // Refused before any token is promised, and when allocated.
        assert_eq!(
            s.get_num_new_matched_tokens(&r).unwrap_err(),
            SchedError::Full {
                max_tracked_requests: 2
            }
        );
        let e = s.update_state_after_alloc(&r, 8).unwrap_err();
        assert_eq!(
            e,
            SchedError::Full {
                max_tracked_requests: 2
            }
        );
        assert_eq!(e.blame(), Blame::Capacity);
        assert_eq!((s.tracked_len(), s.pending_len()), (2, 2));
        assert_eq!(s.request_id_of(TransferId(2)), None);
        // Once a request leaves, there is room again.
        let meta = s.build_connector_meta();
        assert_eq!(meta.loads.len(), 2);
        let done = s.handle_finished(&[], &[TransferId(0)]);
        assert_eq!(done.finished_recving, vec!["a".to_string()]);
        let a = SchedRequest {
            request_id: "a",
            params: Some(&params[0]),
            ..r
        };
        assert_eq!(
            s.request_finished(&a, FinishStatus::Stopped).unwrap(),
            FinishDecision::FREE_NOW
        );
        s.update_state_after_alloc(&r, 8).unwrap();
        assert_eq!(s.transfer_id_of("c"), Some(TransferId(2)));
    }

    #[test]
    fn pending_queue_is_bounded_for_release_only_loads() {
        let mut s = sched(KvRole::Consumer, 1);
        let p0 = decode_params(10);
        let p1 = decode_params(11);
        let r0 = SchedRequest {
            request_id: "a",
            prompt_len_tokens: 4,
            computed_len_tokens: 0,
            block_ids: &[],
            params: Some(&p0),
        };
        let r1 = SchedRequest {
            request_id: "b",
            params: Some(&p1),
            ..r0
        };
        // Both end before allocation: each needs a release-only load.
        s.request_finished(&r0, FinishStatus::Aborted).unwrap();
        let e = s.request_finished(&r1, FinishStatus::Aborted).unwrap_err();
        assert!(matches!(e, SchedError::Full { .. }), "{e}");
        assert_eq!(s.build_connector_meta().loads.len(), 1);
        s.request_finished(&r1, FinishStatus::Aborted).unwrap();
        assert_eq!(
            s.build_connector_meta().loads[0].transfer_id,
            TransferId(11)
        );
    }

    #[test]
    fn abort_queue_keeps_the_newest_when_full() {
        let mut s = sched(KvRole::Consumer, 1);
        let blocks = [ids(&[1])];
        for tid in 0..3u64 {
            let p = decode_params(tid);
            let r = SchedRequest {
                request_id: "a",
                prompt_len_tokens: 4,
                computed_len_tokens: 0,
                block_ids: &blocks,
                params: Some(&p),
            };
            s.update_state_after_alloc(&r, 4).unwrap();
            assert_eq!(s.build_connector_meta().loads.len(), 1);
            let d = s.request_finished(&r, FinishStatus::Aborted).unwrap();
            assert!(d.delay_free);
            assert_eq!(
                s.handle_finished(&[], &[TransferId(tid)]).freed,
                vec!["a".to_string()]
            );
        }
        // Never polled: only the newest abort is kept.
        assert_eq!(s.poll_abort(), Some(TransferId(2)));
        assert_eq!(s.poll_abort(), None);
    }

    #[test]
    fn errors_name_their_blame() {
        let p = KvTransferParams {
            do_remote_prefill: true,
            ..KvTransferParams::default()
        };
        let s = sched(KvRole::Consumer, 4);
        let r = SchedRequest {
            request_id: "x",
            prompt_len_tokens: 4,
            computed_len_tokens: 0,
            block_ids: &[],
            params: Some(&p),
        };
        let e = s.get_num_new_matched_tokens(&r).unwrap_err();
        assert_eq!(e.blame(), Blame::Router);
        let p = sched(KvRole::Producer, 4);
        let e = p
            .get_num_new_matched_tokens(&SchedRequest {
                params: Some(&decode_params(1)),
                ..r
            })
            .unwrap_err();
        assert!(matches!(e, SchedError::WrongRole { .. }), "{e}");
        assert_eq!(e.blame(), Blame::Misuse);
    }

    #[test]
    fn blocks_for_rounds_up_and_refuses_overflow() {
        assert_eq!(blocks_for(1, 4), Some(1));
        assert_eq!(blocks_for(4, 4), Some(1));
        assert_eq!(blocks_for(5, 4), Some(2));
        assert_eq!(blocks_for(u64::MAX, 1), None);
    }
}
