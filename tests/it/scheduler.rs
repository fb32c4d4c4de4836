//! The scheduler side of the connector: vLLM's Mooncake connector semantics
//! case by case, properties of the metas it builds, and an end-to-end run
//! where a prefill and a decode node are driven only through
//! `Scheduler → LoadMeta → start_load_kv / get_finished`.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kvferry::machines::internal::common::{BlockId, Config, Mode};
use kvferry::node::{LoadMeta, PrefillTarget};
use kvferry::scheduler::{
    Blame, FinishDecision, FinishStatus, KvRole, KvTransferParams, SchedError, SchedRequest,
    Scheduler, SchedulerConfig, TransferRef,
};
use kvferry::TransferId;
use kvferry_testkit::model::{self, ModelSpecExt};
use kvferry_testkit::synth::{Cluster, ClusterSpec};
use proptest::prelude::*;

const BS: u32 = 4;
const ADDR: &str = "http://10.0.0.1:8998";

fn ids(v: &[u32]) -> Vec<BlockId> {
    v.iter().map(|&b| BlockId(b)).collect()
}

fn decode() -> Scheduler {
    Scheduler::new(SchedulerConfig::new(KvRole::Consumer, "d", "unused", BS)).unwrap()
}

fn prefill() -> Scheduler {
    Scheduler::new(SchedulerConfig::new(KvRole::Producer, "p", ADDR, BS)).unwrap()
}

/// What a router hands the decode engine when it sends both halves at once.
fn d_params(tid: u64) -> KvTransferParams {
    KvTransferParams {
        do_remote_prefill: true,
        transfer_id: Some(TransferId(tid).into()),
        remote_engine_id: Some("p".into()),
        remote_bootstrap_addr: Some(ADDR.into()),
        ..KvTransferParams::default()
    }
}

fn p_params(tid: u64) -> KvTransferParams {
    KvTransferParams {
        do_remote_decode: true,
        transfer_id: Some(TransferId(tid).into()),
        ..KvTransferParams::default()
    }
}

fn req<'a>(
    id: &'a str,
    prompt: u64,
    computed: u64,
    blocks: &'a [Vec<BlockId>],
    params: &'a KvTransferParams,
) -> SchedRequest<'a> {
    SchedRequest {
        request_id: id,
        prompt_len_tokens: prompt,
        computed_len_tokens: computed,
        block_ids: blocks,
        params: Some(params),
    }
}

/// Where the decode side finds the prefill engine of `params()`, which
/// name no DP rank (as vllm-router's do): the engine's one rank.
fn target() -> PrefillTarget {
    PrefillTarget::Bootstrap {
        addr: ADDR.into(),
        engine_id: "p".into(),
        dp_rank: None,
    }
}

// ---- decode side ----

#[test]
fn requests_without_params_are_not_the_connectors() {
    let mut s = decode();
    let blocks = [ids(&[1, 2])];
    let r = SchedRequest {
        request_id: "r",
        prompt_len_tokens: 8,
        computed_len_tokens: 0,
        block_ids: &blocks,
        params: None,
    };
    assert_eq!(s.get_num_new_matched_tokens(&r).unwrap(), (0, false));
    s.update_state_after_alloc(&r, 0).unwrap();
    assert_eq!(
        s.request_finished(&r, FinishStatus::Stopped).unwrap(),
        FinishDecision {
            delay_free: false,
            params: None
        }
    );
    let plain = KvTransferParams::default();
    let r = SchedRequest {
        params: Some(&plain),
        ..r
    };
    assert_eq!(s.get_num_new_matched_tokens(&r).unwrap(), (0, false));
    s.update_state_after_alloc(&r, 0).unwrap();
    let meta = s.build_connector_meta();
    assert!(meta.loads.is_empty() && meta.sends.is_empty());
    assert_eq!(s.tracked_len(), 0);
}

#[test]
fn remote_prefill_loads_every_prompt_block_once() {
    let mut s = decode();
    let p = d_params(7);
    // 10 tokens fill 3 blocks of 4; the 4th block is the engine's decode slot.
    let blocks = [ids(&[40, 41, 45, 50])];
    let r = req("r", 10, 0, &blocks, &p);
    assert_eq!(s.get_num_new_matched_tokens(&r).unwrap(), (10, true));
    // Asking again (allocation failed, retried next step) changes nothing.
    assert_eq!(s.get_num_new_matched_tokens(&r).unwrap(), (10, true));
    assert_eq!(s.tracked_len(), 0);
    s.update_state_after_alloc(&r, 10).unwrap();
    let meta = s.build_connector_meta();
    assert_eq!(meta.loads.len(), 1);
    assert!(meta.sends.is_empty());
    let l = &meta.loads[0];
    assert_eq!(l.transfer_id, TransferId(7));
    assert_eq!(l.prefill, target());
    assert_eq!(l.dst_blocks, vec![ids(&[40, 41, 45])]);
    assert_eq!(l.prefix_blocks, vec![0]);
    // Drained: the next step carries nothing.
    let again = s.build_connector_meta();
    assert!(again.loads.is_empty());
    assert_eq!(s.request_id_of(TransferId(7)), Some("r"));
    // Loaded once: a resumed request is not loaded again.
    assert_eq!(s.get_num_new_matched_tokens(&r).unwrap(), (0, false));
    s.update_state_after_alloc(&r, 0).unwrap();
    let done = s.handle_finished(&[], &[TransferId(7)]);
    assert_eq!(done.finished_recving, vec!["r".to_string()]);
    assert!(done.untracked.is_empty());
    assert_eq!(s.get_num_new_matched_tokens(&r).unwrap(), (0, false));
    assert!(s.build_connector_meta().loads.is_empty());
    assert_eq!(
        s.request_finished(&r, FinishStatus::Stopped).unwrap(),
        FinishDecision {
            delay_free: false,
            params: None
        }
    );
    assert_eq!(s.tracked_len(), 0);
    assert_eq!(s.request_id_of(TransferId(7)), None);
}

#[test]
fn partial_prefix_hit_loads_only_the_tail() {
    let mut s = decode();
    let p = d_params(8);
    // 2 of the 4 prompt blocks (14 tokens) are cached locally.
    let blocks = [ids(&[3, 9, 20, 21, 22])];
    let r = req("r", 14, 8, &blocks, &p);
    assert_eq!(s.get_num_new_matched_tokens(&r).unwrap(), (6, true));
    s.update_state_after_alloc(&r, 6).unwrap();
    let l = &s.build_connector_meta().loads[0];
    assert_eq!(l.dst_blocks, vec![ids(&[20, 21])]);
    assert_eq!(l.prefix_blocks, vec![2]);
}

#[test]
fn groups_share_the_prefix_and_load_their_own_blocks() {
    let mut c = SchedulerConfig::new(KvRole::Consumer, "d", "", BS);
    c.num_groups = 2;
    let mut s = Scheduler::new(c).unwrap();
    let p = d_params(9);
    let blocks = [ids(&[1, 2, 3]), ids(&[11, 12, 13])];
    let r = req("r", 12, 4, &blocks, &p);
    s.update_state_after_alloc(&r, 8).unwrap();
    let l = &s.build_connector_meta().loads[0];
    assert_eq!(l.dst_blocks, vec![ids(&[2, 3]), ids(&[12, 13])]);
    assert_eq!(l.prefix_blocks, vec![1, 1]);
    // One group given for two configured.
    let one = [ids(&[1, 2, 3])];
    let e = s
        .update_state_after_alloc(&req("q", 12, 0, &one, &d_params(10)), 12)
        .unwrap_err();
    assert_eq!(
        e,
        SchedError::GroupCountMismatch {
            request_id: "q".into(),
            expected: 2,
            found: 1
        }
    );
}

#[test]
fn nothing_to_load_still_releases_the_prefill_blocks() {
    let mut s = decode();
    let p = d_params(11);
    let blocks = [ids(&[5, 6])];
    // The whole prompt (8 tokens, 2 blocks) is cached locally.
    let r = req("r", 8, 8, &blocks, &p);
    assert_eq!(s.get_num_new_matched_tokens(&r).unwrap(), (0, false));
    s.update_state_after_alloc(&r, 0).unwrap();
    let meta = s.build_connector_meta();
    assert_eq!(meta.loads.len(), 1);
    assert_eq!(meta.loads[0].dst_blocks, vec![Vec::<BlockId>::new()]);
    assert_eq!(meta.loads[0].prefix_blocks, vec![2]);
    // The request runs now and is never loaded again.
    assert_eq!(s.get_num_new_matched_tokens(&r).unwrap(), (0, false));
    assert_eq!(
        s.handle_finished(&[], &[TransferId(11)]).untracked,
        vec![TransferId(11)]
    );
    assert!(
        !s.request_finished(&r, FinishStatus::Stopped)
            .unwrap()
            .delay_free
    );
    assert_eq!(s.tracked_len(), 0);
}

#[test]
fn aborted_before_allocation_releases_the_prefill_blocks() {
    let mut s = decode();
    let p = d_params(12);
    let r = req("r", 9, 0, &[], &p);
    let d = s.request_finished(&r, FinishStatus::Aborted).unwrap();
    assert!(!d.delay_free && d.params.is_none());
    let meta = s.build_connector_meta();
    assert_eq!(meta.loads.len(), 1);
    let l = &meta.loads[0];
    assert_eq!((l.transfer_id, &l.prefill), (TransferId(12), &target()));
    // Nothing lands on decode; all 3 prefill blocks count as held.
    assert_eq!(l.dst_blocks, vec![Vec::<BlockId>::new()]);
    assert_eq!(l.prefix_blocks, vec![3]);
    assert_eq!(s.tracked_len(), 0);
}

#[test]
fn finished_before_the_step_ends_frees_now_and_releases() {
    let mut s = decode();
    let p = d_params(13);
    let blocks = [ids(&[30, 31, 32])];
    let r = req("r", 12, 4, &blocks, &p);
    s.update_state_after_alloc(&r, 8).unwrap();
    // No worker saw the blocks yet: free at once.
    let d = s.request_finished(&r, FinishStatus::Aborted).unwrap();
    assert!(!d.delay_free);
    let meta = s.build_connector_meta();
    assert_eq!(meta.loads.len(), 1);
    assert_eq!(meta.loads[0].dst_blocks, vec![Vec::<BlockId>::new()]);
    assert_eq!(meta.loads[0].prefix_blocks, vec![3]);
    assert_eq!(s.tracked_len(), 0);
}

#[test]
fn a_one_token_stand_in_releases_what_the_prefill_side_holds() {
    // vLLM finishes a request it rejected as a one-token prompt without
    // blocks, only to hand the connector its parameters: the release names
    // the prefill side's blocks from `remote_block_ids`.
    let mut s = decode();
    let mut p = d_params(15);
    p.remote_block_ids = Some(vec![ids(&[3, 4, 5])]);
    let none = [Vec::new()];
    let stand_in = req("rejected", 1, 0, &none, &p);
    let d = s
        .request_finished(&stand_in, FinishStatus::Aborted)
        .unwrap();
    assert!(!d.delay_free);
    let meta = s.build_connector_meta();
    assert_eq!(meta.loads.len(), 1);
    assert_eq!(meta.loads[0].transfer_id, TransferId(15));
    assert_eq!(meta.loads[0].dst_blocks, vec![Vec::<BlockId>::new()]);
    assert_eq!(meta.loads[0].prefix_blocks, vec![3]);
    // A load is still checked against its own prompt.
    let e = s.get_num_new_matched_tokens(&stand_in).unwrap_err();
    assert!(matches!(e, SchedError::InvalidParams { .. }), "{e}");
}

#[test]
fn finished_during_the_load_holds_the_blocks_until_it_ends() {
    let mut s = decode();
    let p = d_params(14);
    let blocks = [ids(&[1, 2])];
    let r = req("r", 8, 0, &blocks, &p);
    s.update_state_after_alloc(&r, 8).unwrap();
    assert_eq!(s.build_connector_meta().loads.len(), 1);
    assert_eq!(s.poll_abort(), None);
    let d = s.request_finished(&r, FinishStatus::Aborted).unwrap();
    assert!(d.delay_free, "prefill may still write the blocks");
    assert_eq!(s.poll_abort(), Some(TransferId(14)));
    assert_eq!(s.poll_abort(), None);
    // Finishing twice is misuse.
    let e = s.request_finished(&r, FinishStatus::Aborted).unwrap_err();
    assert!(matches!(e, SchedError::WrongState { .. }), "{e}");
    let done = s.handle_finished(&[], &[TransferId(14)]);
    assert_eq!(done.freed, vec!["r".to_string()]);
    assert!(done.finished_recving.is_empty());
    assert_eq!(s.tracked_len(), 0);
    // Reported once: a second report is not ours anymore.
    assert_eq!(
        s.handle_finished(&[], &[TransferId(14)]).untracked,
        vec![TransferId(14)]
    );
}

#[test]
fn decode_misuse_is_refused_and_records_nothing() {
    let mut s = decode();
    let p = d_params(20);
    let two = [ids(&[1, 2])];
    // 12 tokens need 3 blocks.
    let e = s
        .update_state_after_alloc(&req("r", 12, 0, &two, &p), 12)
        .unwrap_err();
    assert_eq!(
        e,
        SchedError::TooFewBlocks {
            request_id: "r".into(),
            group: 0,
            have: 2,
            need: 3
        }
    );
    let e = s
        .get_num_new_matched_tokens(&req("r", 12, 5, &two, &p))
        .unwrap_err();
    assert!(
        matches!(e, SchedError::UnalignedComputedTokens { .. }),
        "{e}"
    );
    let e = s
        .update_state_after_alloc(&req("r", 8, 0, &two, &p), 5)
        .unwrap_err();
    assert_eq!(
        e,
        SchedError::TokenCountMismatch {
            request_id: "r".into(),
            promised: 8,
            allocated: 5
        }
    );
    let dup = [ids(&[4, 4])];
    let e = s
        .update_state_after_alloc(&req("r", 8, 0, &dup, &p), 8)
        .unwrap_err();
    assert_eq!(
        e,
        SchedError::DuplicateBlock {
            request_id: "r".into(),
            block: BlockId(4)
        }
    );
    let e = s
        .get_num_new_matched_tokens(&req("r", 0, 0, &two, &p))
        .unwrap_err();
    assert!(matches!(e, SchedError::PromptOutOfRange { .. }), "{e}");
    assert_eq!((s.tracked_len(), s.pending_len()), (0, 0));
    assert!(s.build_connector_meta().loads.is_empty());

    s.update_state_after_alloc(&req("r", 8, 0, &two, &p), 8)
        .unwrap();
    let e = s
        .update_state_after_alloc(&req("r", 8, 0, &two, &p), 8)
        .unwrap_err();
    assert_eq!(
        e,
        SchedError::DuplicateRequest {
            request_id: "r".into()
        }
    );
    let other = [ids(&[7, 8])];
    // Refused before any token is promised: the engine computes it.
    let e = s
        .get_num_new_matched_tokens(&req("q", 8, 0, &other, &p))
        .unwrap_err();
    assert!(matches!(e, SchedError::DuplicateTransfer { .. }), "{e}");
    let e = s
        .update_state_after_alloc(&req("q", 8, 0, &other, &p), 8)
        .unwrap_err();
    assert_eq!(
        e,
        SchedError::DuplicateTransfer {
            transfer_id: TransferId(20),
            request_id: "q".into(),
            other: "r".into()
        }
    );
    assert_eq!(s.build_connector_meta().loads.len(), 1);
}

#[test]
fn malformed_params_are_the_routers_fault() {
    let s = decode();
    let blocks = [ids(&[1, 2])];
    let mut cases = Vec::new();
    let mut p = d_params(1);
    p.transfer_id = None;
    cases.push(p);
    let mut p = d_params(1);
    p.remote_engine_id = None;
    cases.push(p);
    let mut p = d_params(1);
    p.remote_bootstrap_addr = None;
    cases.push(p);
    let mut p = d_params(1);
    p.do_remote_decode = true;
    cases.push(p);
    let mut p = d_params(1);
    // Prefill holds 3 blocks but an 8-token prompt fills 2.
    p.remote_block_ids = Some(vec![ids(&[1, 2, 3])]);
    cases.push(p);
    for p in &cases {
        let e = s
            .get_num_new_matched_tokens(&req("r", 8, 0, &blocks, p))
            .unwrap_err();
        assert!(matches!(e, SchedError::InvalidParams { .. }), "{p:?}: {e}");
        assert_eq!(e.blame(), Blame::Router);
    }
}

#[test]
fn roles_are_enforced() {
    let blocks = [ids(&[1, 2])];
    let e = prefill()
        .get_num_new_matched_tokens(&req("r", 8, 0, &blocks, &d_params(1)))
        .unwrap_err();
    assert!(matches!(e, SchedError::WrongRole { .. }), "{e}");
    let e = decode()
        .update_state_after_alloc(&req("r", 8, 0, &blocks, &p_params(1)), 0)
        .unwrap_err();
    assert!(matches!(e, SchedError::WrongRole { .. }), "{e}");
    // An engine playing both sides serves both kinds.
    let mut both = Scheduler::new(SchedulerConfig::new(KvRole::Both, "b", ADDR, BS)).unwrap();
    both.update_state_after_alloc(&req("d", 8, 0, &blocks, &d_params(1)), 8)
        .unwrap();
    let other = [ids(&[3, 4])];
    both.update_state_after_alloc(&req("p", 8, 0, &other, &p_params(2)), 0)
        .unwrap();
    both.request_finished(
        &req("p", 8, 0, &other, &p_params(2)),
        FinishStatus::LengthCapped,
    )
    .unwrap();
    let meta = both.build_connector_meta();
    assert_eq!((meta.loads.len(), meta.sends.len()), (1, 1));
}

#[test]
fn params_parse_from_router_json() {
    let p: KvTransferParams = serde_json::from_str(
        r#"{"do_remote_prefill": true, "transfer_id": 5, "remote_engine_id": "p",
            "remote_bootstrap_addr": "http://h:8998", "extra": 1}"#,
    )
    .unwrap();
    assert_eq!(
        p,
        KvTransferParams {
            do_remote_prefill: true,
            transfer_id: Some(TransferId(5).into()),
            remote_engine_id: Some("p".into()),
            remote_bootstrap_addr: Some("http://h:8998".into()),
            ..KvTransferParams::default()
        }
    );
    // Not a transfer id nor a request id of 1 to 256 bytes.
    let long = format!(r#"{{"transfer_id": "{}"}}"#, "x".repeat(257));
    for bad in [
        r#"{"transfer_id": ""}"#,
        r#"{"transfer_id": -1}"#,
        r#"{"transfer_id": 1.5}"#,
        r#"{"transfer_id": true}"#,
        &long,
    ] {
        assert!(
            serde_json::from_str::<KvTransferParams>(bad).is_err(),
            "{bad}"
        );
    }
}

/// vLLM routers send string ids: the router's `"transfer_id": "cmpl-…"`
/// is keyed by its hash, and the string goes on to the node (in the meta)
/// and to decode (in the params prefill hands back), as the router wrote it.
#[test]
fn string_transfer_ids_from_router_json_travel_to_both_metas() {
    let id = "cmpl-6f2c0e1a9b7d4c3e8f2a1b0c9d8e7f6a-0";
    let at_limit = "é".repeat(128);
    for name in [id, at_limit.as_str()] {
        let json = format!(r#"{{"do_remote_decode": true, "transfer_id": "{name}"}}"#);
        let pp: KvTransferParams = serde_json::from_str(&json).unwrap();
        assert_eq!(pp.transfer_id, Some(TransferRef::Name(name.into())));
        let tid = TransferId::of_request_id(name);
        let mut p = prefill();
        let blocks = [ids(&[1, 2])];
        let r = req("p-1", 8, 0, &blocks, &pp);
        p.update_state_after_alloc(&r, 0).unwrap();
        assert_eq!(p.transfer_id_of("p-1"), Some(tid));
        let d_params = p
            .request_finished(&r, FinishStatus::LengthCapped)
            .unwrap()
            .params
            .expect("params for decode");
        let send = &p.build_connector_meta().sends[0];
        assert_eq!(
            (send.transfer_id, send.request_id.as_deref()),
            (tid, Some(name))
        );
        let json = serde_json::to_string(&d_params).unwrap();
        assert!(
            json.contains(&format!(r#""transfer_id":"{name}""#)),
            "{json}"
        );
        let d_params: KvTransferParams = serde_json::from_str(&json).unwrap();
        let mut d = decode();
        let d_blocks = [ids(&[7, 8])];
        let r = req("d-1", 8, 0, &d_blocks, &d_params);
        let (tokens, _) = d.get_num_new_matched_tokens(&r).unwrap();
        d.update_state_after_alloc(&r, tokens).unwrap();
        let load = &d.build_connector_meta().loads[0];
        assert_eq!(
            (load.transfer_id, load.request_id.as_deref()),
            (tid, Some(name))
        );
        assert_eq!(d.handle_finished(&[], &[tid]).finished_recving, ["d-1"]);
        assert_eq!(p.handle_finished(&[tid], &[]).finished_sending, ["p-1"]);
    }
    // The integer form stays a number, with no string.
    let pp: KvTransferParams = serde_json::from_str(r#"{"transfer_id": 9}"#).unwrap();
    assert_eq!(pp.transfer_id, Some(TransferRef::Id(TransferId(9))));
    assert_eq!(serde_json::to_string(&pp.transfer_id).unwrap(), "9");
}

/// A string id whose transfer id another tracked request holds (here by
/// the integer form of the same hash) is refused like any transfer id in
/// use, and nothing changes.
#[test]
fn a_string_id_of_a_transfer_id_in_use_is_refused_by_the_scheduler() {
    let name = "cmpl-a";
    let by_number = KvTransferParams {
        do_remote_decode: true,
        transfer_id: Some(TransferId::of_request_id(name).into()),
        ..KvTransferParams::default()
    };
    let by_name = KvTransferParams {
        transfer_id: Some(TransferRef::Name(name.into())),
        ..by_number.clone()
    };
    let mut p = prefill();
    let blocks = [ids(&[1])];
    p.update_state_after_alloc(&req("p-a", 4, 0, &blocks, &by_number), 0)
        .unwrap();
    let e = p
        .update_state_after_alloc(&req("p-b", 4, 0, &blocks, &by_name), 0)
        .unwrap_err();
    assert!(matches!(e, SchedError::DuplicateTransfer { .. }), "{e}");
    assert_eq!(p.tracked_len(), 1);
}

/// A prefill engine on a data-parallel rank hands its rank to decode, and
/// decode's load asks the bootstrap service for that rank's workers.
#[test]
fn the_prefill_dp_rank_travels_to_the_decode_load() {
    let mut cfg = SchedulerConfig::new(KvRole::Producer, "p", ADDR, BS);
    cfg.dp_rank = 3;
    let mut p = Scheduler::new(cfg).unwrap();
    let pp = p_params(40);
    let blocks = [ids(&[1, 2])];
    let r = req("p-1", 8, 0, &blocks, &pp);
    p.update_state_after_alloc(&r, 0).unwrap();
    let d_params = p
        .request_finished(&r, FinishStatus::LengthCapped)
        .unwrap()
        .params
        .expect("params for decode");
    assert_eq!(d_params.remote_dp_rank, Some(3));
    let json = serde_json::to_string(&d_params).unwrap();
    let d_params: KvTransferParams = serde_json::from_str(&json).unwrap();
    let mut d = decode();
    let d_blocks = [ids(&[7, 8])];
    let r = req("d-1", 8, 0, &d_blocks, &d_params);
    let (tokens, _) = d.get_num_new_matched_tokens(&r).unwrap();
    d.update_state_after_alloc(&r, tokens).unwrap();
    let load = &d.build_connector_meta().loads[0];
    let want = PrefillTarget::Bootstrap {
        addr: ADDR.into(),
        engine_id: "p".into(),
        dp_rank: Some(3),
    };
    assert_eq!(load.prefill, want);
}

// ---- prefill side ----

#[test]
fn length_capped_prefill_delays_the_free_and_sends_the_prompt_blocks() {
    let mut s = prefill();
    let p = p_params(30);
    // 10 tokens in 3 blocks; the 4th holds the sampled token, not sent.
    let blocks = [ids(&[3, 4, 5, 6])];
    let r = req("p-r", 10, 0, &blocks, &p);
    assert_eq!(s.get_num_new_matched_tokens(&r).unwrap(), (0, false));
    s.update_state_after_alloc(&r, 0).unwrap();
    let early = s.build_connector_meta();
    assert!(early.loads.is_empty() && early.sends.is_empty());
    let d = s.request_finished(&r, FinishStatus::LengthCapped).unwrap();
    assert!(d.delay_free);
    assert_eq!(
        d.params,
        Some(KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            transfer_id: Some(TransferId(30).into()),
            remote_engine_id: Some("p".into()),
            remote_dp_rank: Some(0),
            remote_bootstrap_addr: Some(ADDR.into()),
            remote_block_ids: Some(vec![ids(&[3, 4, 5])]),
        })
    );
    let e = s
        .request_finished(&r, FinishStatus::LengthCapped)
        .unwrap_err();
    assert!(matches!(e, SchedError::WrongState { .. }), "{e}");
    let meta = s.build_connector_meta();
    assert!(meta.loads.is_empty());
    assert_eq!(meta.sends.len(), 1);
    assert_eq!(meta.sends[0].transfer_id, TransferId(30));
    assert_eq!(meta.sends[0].src_blocks, vec![ids(&[3, 4, 5])]);
    assert!(meta.sends[0].is_last);
    assert!(s.build_connector_meta().sends.is_empty());
    let e = s
        .request_finished(&r, FinishStatus::LengthCapped)
        .unwrap_err();
    assert!(matches!(e, SchedError::WrongState { .. }), "{e}");
    // A decode-side report of the transfer is not a finished send, and an
    // unknown transfer is nobody's.
    let done = s.handle_finished(&[], &[TransferId(30), TransferId(99)]);
    assert_eq!(done.untracked, vec![TransferId(30), TransferId(99)]);
    assert!(done.finished_sending.is_empty());
    assert_eq!(s.tracked_len(), 1);
    let done = s.handle_finished(&[TransferId(30)], &[]);
    assert_eq!(done.finished_sending, vec!["p-r".to_string()]);
    assert_eq!(s.tracked_len(), 0);

    // The params are what the decode side consumes.
    let json = serde_json::to_string(&d.params.unwrap()).unwrap();
    let back: KvTransferParams = serde_json::from_str(&json).unwrap();
    let mut dsched = decode();
    let dblocks = [ids(&[60, 61, 62])];
    let dr = req("d-r", 10, 0, &dblocks, &back);
    assert_eq!(dsched.get_num_new_matched_tokens(&dr).unwrap(), (10, true));
    dsched.update_state_after_alloc(&dr, 10).unwrap();
    let l = &dsched.build_connector_meta().loads[0];
    assert_eq!(l.transfer_id, TransferId(30));
    assert_eq!(l.dst_blocks[0].len() as u32 + l.prefix_blocks[0], 3);
}

#[test]
fn other_finish_statuses_free_at_once_and_send_no_kv() {
    for (i, status) in [
        FinishStatus::Stopped,
        FinishStatus::Aborted,
        FinishStatus::Ignored,
        FinishStatus::Error,
    ]
    .into_iter()
    .enumerate()
    {
        let mut s = prefill();
        let tid = 40 + i as u64;
        let p = p_params(tid);
        let blocks = [ids(&[1, 2, 3])];
        let r = req("r", 12, 0, &blocks, &p);
        s.update_state_after_alloc(&r, 0).unwrap();
        let d = s.request_finished(&r, status).unwrap();
        assert_eq!(
            d,
            FinishDecision {
                delay_free: false,
                params: None
            },
            "{status:?}"
        );
        assert_eq!(s.tracked_len(), 0);
        let meta = s.build_connector_meta();
        // Only an empty last chunk: "no KV for this transfer".
        assert_eq!(meta.sends.len(), 1, "{status:?}");
        assert_eq!(meta.sends[0].transfer_id, TransferId(tid));
        assert_eq!(meta.sends[0].src_blocks, vec![Vec::<BlockId>::new()]);
        assert!(meta.sends[0].is_last);
    }
}

#[test]
fn prefill_misuse_is_refused() {
    let mut s = prefill();
    let blocks = [ids(&[1, 2])];
    let mut p = p_params(50);
    p.transfer_id = None;
    let e = s
        .update_state_after_alloc(&req("r", 8, 0, &blocks, &p), 0)
        .unwrap_err();
    assert!(matches!(e, SchedError::InvalidParams { .. }), "{e}");
    // Without a transfer id it is not the connector's request at finish.
    assert!(
        !s.request_finished(&req("r", 8, 0, &blocks, &p), FinishStatus::LengthCapped)
            .unwrap()
            .delay_free
    );
    let p = p_params(50);
    // Finished length-capped without ever being allocated.
    let e = s
        .request_finished(&req("r", 8, 0, &blocks, &p), FinishStatus::LengthCapped)
        .unwrap_err();
    assert_eq!(
        e,
        SchedError::UnknownRequest {
            request_id: "r".into()
        }
    );
    // Aborted before it was scheduled: free now, cancel the transfer.
    let d = s
        .request_finished(&req("r", 8, 0, &blocks, &p), FinishStatus::Aborted)
        .unwrap();
    assert!(!d.delay_free);
    assert_eq!(s.build_connector_meta().sends[0].src_blocks, vec![vec![]]);

    s.update_state_after_alloc(&req("r", 8, 0, &blocks, &p), 0)
        .unwrap();
    // vLLM allocates again, with no external tokens, once a load another
    // connector ran for the request (a store's prefix) ended: a no-op.
    s.update_state_after_alloc(&req("r", 8, 0, &blocks, &p), 0)
        .unwrap();
    assert_eq!(s.tracked_len(), 1);
    let e = s
        .update_state_after_alloc(&req("r", 8, 0, &blocks, &p), 4)
        .unwrap_err();
    assert!(matches!(e, SchedError::DuplicateRequest { .. }), "{e}");
    let e = s
        .update_state_after_alloc(&req("q", 8, 0, &blocks, &p), 0)
        .unwrap_err();
    assert!(matches!(e, SchedError::DuplicateTransfer { .. }), "{e}");
    // 9 tokens need 3 blocks; the request holds 2.
    let e = s
        .request_finished(&req("r", 9, 0, &blocks, &p), FinishStatus::LengthCapped)
        .unwrap_err();
    assert!(matches!(e, SchedError::TooFewBlocks { need: 3, .. }), "{e}");
    // Refused without a change: the right call still works.
    let d = s
        .request_finished(&req("r", 8, 0, &blocks, &p), FinishStatus::LengthCapped)
        .unwrap();
    assert!(d.delay_free);
}

// ---- properties ----

/// A request's shape: prompt tokens, block size, locally cached blocks,
/// groups, extra blocks past the prompt, and a seed for block placement.
fn shape() -> impl Strategy<Value = (u64, u32, u32, usize, usize, u64)> {
    (1u32..64).prop_flat_map(|bs| {
        (1u64..2_000).prop_flat_map(move |prompt| {
            let blocks = prompt.div_ceil(u64::from(bs)) as u32;
            (
                Just(prompt),
                Just(bs),
                0..=blocks + 1,
                1usize..4,
                0usize..3,
                any::<u64>(),
            )
        })
    })
}

/// `n` distinct block ids in a shuffled order.
fn distinct_blocks(n: usize, seed: u64) -> Vec<BlockId> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut v: Vec<u32> = (0..(n as u32) * 3).collect();
    rng.shuffle(&mut v);
    v.truncate(n);
    ids(&v)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Through prefill and decode schedulers, the decode meta loads exactly
    /// the blocks the missing tokens need, each once, none of the locally
    /// cached or spare ones, and prefill sends exactly as many blocks as
    /// decode counts (prefix + destination).
    #[test]
    fn meta_loads_exactly_the_blocks_the_tokens_need(
        (prompt, bs, cached, groups, extra, seed) in shape()
    ) {
        let need = prompt.div_ceil(u64::from(bs)) as usize;
        let computed = u64::from(cached) * u64::from(bs);
        let mut pc = SchedulerConfig::new(KvRole::Producer, "p", ADDR, bs);
        pc.num_groups = groups;
        let mut dc = SchedulerConfig::new(KvRole::Consumer, "d", "", bs);
        dc.num_groups = groups;
        let mut ps = Scheduler::new(pc).unwrap();
        let mut ds = Scheduler::new(dc).unwrap();

        let all = distinct_blocks(2 * groups * (need + extra + 2), seed);
        let (p_all, d_all) = all.split_at(groups * (need + extra + 2));
        let p_blocks: Vec<Vec<BlockId>> =
            p_all.chunks(need + extra + 2).map(|c| c[..need + extra].to_vec()).collect();
        let d_len = need.max(cached as usize) + extra;
        let d_blocks: Vec<Vec<BlockId>> =
            d_all.chunks(need + extra + 2).map(|c| c[..d_len].to_vec()).collect();

        let pp = p_params(1);
        ps.update_state_after_alloc(&req("p", prompt, 0, &p_blocks, &pp), 0).unwrap();
        let dparams = ps
            .request_finished(&req("p", prompt, 0, &p_blocks, &pp), FinishStatus::LengthCapped)
            .unwrap()
            .params
            .unwrap();
        let pmeta = ps.build_connector_meta();
        prop_assert_eq!(pmeta.sends.len(), 1);
        let src = &pmeta.sends[0].src_blocks;

        let dr = req("d", prompt, computed, &d_blocks, &dparams);
        let (tokens, is_async) = ds.get_num_new_matched_tokens(&dr).unwrap();
        prop_assert_eq!(tokens, prompt.saturating_sub(computed));
        prop_assert_eq!(is_async, tokens > 0);
        ds.update_state_after_alloc(&dr, tokens).unwrap();
        let meta = ds.build_connector_meta();
        prop_assert_eq!(meta.loads.len(), 1);
        prop_assert!(ds.build_connector_meta().loads.is_empty());
        let l = &meta.loads[0];
        let prefix = (cached as usize).min(need);
        let mut seen = HashSet::new();
        for g in 0..groups {
            prop_assert_eq!(src[g].len(), need);
            prop_assert_eq!(&src[g][..], &p_blocks[g][..need]);
            prop_assert_eq!(l.prefix_blocks[g] as usize, prefix);
            prop_assert_eq!(l.prefix_blocks[g] as usize + l.dst_blocks[g].len(), src[g].len());
            if tokens > 0 {
                prop_assert_eq!(&l.dst_blocks[g][..], &d_blocks[g][prefix..need]);
                // The loaded positions cover every missing token.
                let first_tok = prefix as u64 * u64::from(bs);
                let end_tok = need as u64 * u64::from(bs);
                prop_assert!(first_tok <= computed.min(prompt) && end_tok >= prompt);
                prop_assert!(end_tok < prompt + u64::from(bs));
            } else {
                prop_assert!(l.dst_blocks[g].is_empty());
            }
            for b in &l.dst_blocks[g] {
                prop_assert!(seen.insert(*b), "block {:?} loaded twice", b);
                prop_assert!(!d_blocks[g][..prefix].contains(b));
                prop_assert!(!d_blocks[g][need.min(d_len)..].contains(b));
            }
        }
    }

    /// Any order of the engine's calls on a few decode requests: a
    /// transfer's blocks are handed to the worker at most once, a request
    /// whose free was not delayed never has its blocks handed over later,
    /// and every delayed free is reported exactly once, only for requests
    /// whose free was delayed.
    #[test]
    fn any_call_order_loads_once_and_frees_once(
        ops in proptest::collection::vec((0u8..5, 0usize..4), 1..60)
    ) {
        let mut s = decode();
        let params: Vec<KvTransferParams> = (0..4).map(|i| d_params(100 + i)).collect();
        let blocks: Vec<[Vec<BlockId>; 1]> =
            (0..4u32).map(|i| [ids(&[10 * i, 10 * i + 1, 10 * i + 2])]).collect();
        let names = ["a", "b", "c", "d"];
        let mut handed: HashSet<u64> = HashSet::new();
        let mut freed_now: HashSet<usize> = HashSet::new();
        let mut delayed: HashSet<usize> = HashSet::new();
        let mut reported: HashSet<usize> = HashSet::new();
        let mut in_flight: Vec<TransferId> = Vec::new();
        for (op, i) in ops {
            let r = req(names[i], 10, 0, &blocks[i], &params[i]);
            // vLLM never reuses a request id: a finished request gets no
            // more calls, except finishing a delayed one again (misuse,
            // refused below).
            if (op <= 1 && freed_now.contains(&i)) || (op == 0 && delayed.contains(&i)) {
                continue;
            }
            match op {
                0 => {
                    let (t, _) = s.get_num_new_matched_tokens(&r).unwrap();
                    let _ = s.update_state_after_alloc(&r, t);
                }
                1 => match s.request_finished(&r, FinishStatus::Aborted) {
                    Ok(d) if d.delay_free => {
                        prop_assert!(delayed.insert(i));
                    }
                    Ok(_) => {
                        freed_now.insert(i);
                    }
                    Err(e) => prop_assert!(matches!(e, SchedError::WrongState { .. }), "{}", e),
                },
                2 => {
                    for l in s.build_connector_meta().loads {
                        let k = (l.transfer_id.0 - 100) as usize;
                        if l.dst_blocks[0].is_empty() {
                            continue;
                        }
                        prop_assert!(handed.insert(l.transfer_id.0), "loaded twice");
                        prop_assert!(!freed_now.contains(&k), "blocks freed before their load");
                        in_flight.push(l.transfer_id);
                    }
                }
                _ => {
                    let done = s.handle_finished(&[], &in_flight);
                    in_flight.clear();
                    for r in done.freed {
                        let k = names.iter().position(|n| *n == r).unwrap();
                        prop_assert!(delayed.contains(&k));
                        prop_assert!(reported.insert(k), "freed twice");
                    }
                }
            }
            prop_assert!(s.tracked_len() <= 4);
        }
        // Every load handed over ends: each delayed free is reported.
        for l in s.build_connector_meta().loads {
            if !l.dst_blocks[0].is_empty() {
                prop_assert!(handed.insert(l.transfer_id.0), "loaded twice");
                in_flight.push(l.transfer_id);
            }
        }
        for r in s.handle_finished(&[], &in_flight).freed {
            let k = names.iter().position(|n| *n == r).unwrap();
            prop_assert!(reported.insert(k), "freed twice");
        }
        prop_assert_eq!(&reported, &delayed);
    }
}

// ---- end to end ----

fn e2e_spec() -> ClusterSpec {
    ClusterSpec {
        prefill_blocks: 128,
        decode_blocks: 128,
        timeouts: Config {
            bootstrap_timeout: Duration::from_secs(5),
            waiting_timeout: Duration::from_secs(5),
            claim_timeout: Duration::from_secs(5),
            lease: Duration::from_millis(2000),
            hold_limit: Duration::from_secs(10),
            transfer_bound: Duration::from_secs(2),
            fence_margin: Duration::from_millis(100),
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_misses: 3,
            ..Config::default()
        },
        bootstrap: Some("127.0.0.1:0".into()),
        ..ClusterSpec::new(model::small().with_block_tokens(BS), Mode::Push)
    }
}

/// Both engines' schedulers around a running cluster.
struct Engines {
    c: Cluster,
    p: Scheduler,
    d: Scheduler,
}

impl Engines {
    fn start() -> Engines {
        let c = Cluster::start(&e2e_spec()).expect("cluster starts");
        let addr = c.prefill[0]
            .node
            .bootstrap_addr()
            .expect("bootstrap served");
        // The cluster registers its prefill engine as "prefill".
        let p =
            Scheduler::new(SchedulerConfig::new(KvRole::Producer, "prefill", addr, BS)).unwrap();
        let d = Scheduler::new(SchedulerConfig::new(KvRole::Consumer, "decode", "", BS)).unwrap();
        Engines { c, p, d }
    }

    fn step_prefill(&mut self) {
        let meta: LoadMeta = self.p.build_connector_meta();
        self.c.prefill[0].node.start_load_kv(&meta).unwrap();
    }

    fn step_decode(&mut self) {
        let meta = self.d.build_connector_meta();
        self.c.decode[0].node.start_load_kv(&meta).unwrap();
    }

    /// Feeds both nodes' `get_finished` to the schedulers until `done`
    /// holds for what they reported, waiting on the nodes' terminal
    /// notifications in between.
    fn drive_until(&mut self, done: impl Fn(&Reported) -> bool) -> Reported {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut out = Reported::default();
        loop {
            let (p_sent, _) = self.c.prefill[0].node.get_finished();
            let (_, d_recv) = self.c.decode[0].node.get_finished();
            let pd = self.p.handle_finished(&p_sent, &[]);
            let dd = self.d.handle_finished(&[], &d_recv);
            out.sent.extend(pd.finished_sending);
            out.recv.extend(dd.finished_recving);
            out.freed.extend(dd.freed);
            out.p_untracked.extend(pd.untracked);
            out.d_untracked.extend(dd.untracked);
            if done(&out) {
                return out;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "timed out: {out:?}");
            // Sleep until some node reports a terminal phase.
            let _ = self
                .c
                .decode_events
                .recv_timeout(left.min(Duration::from_millis(200)));
            while self.c.prefill_events.try_recv().is_ok() {}
        }
    }
}

/// What the schedulers reported while driving.
#[derive(Debug, Default)]
struct Reported {
    recv: Vec<String>,
    sent: Vec<String>,
    freed: Vec<String>,
    p_untracked: Vec<TransferId>,
    d_untracked: Vec<TransferId>,
}

#[test]
fn e2e_scheduler_drives_prefill_and_decode_nodes() {
    let mut e = Engines::start();
    // (prompt tokens, tokens cached on decode): whole blocks, partial last
    // block, partial prefix hits.
    let shapes: [(u64, u64); 6] = [(1, 0), (4, 0), (5, 4), (13, 8), (16, 0), (23, 12)];
    let mut p_next = 3u32;
    let mut d_next = 90u32;
    let mut reqs = Vec::new();
    for (i, &(prompt, cached)) in shapes.iter().enumerate() {
        let tid = 500 + i as u64;
        let n = prompt.div_ceil(u64::from(BS)) as u32;
        // Prefill blocks ascending with gaps, decode blocks descending, one
        // spare block each (the engine's slot for the next token).
        let p_blocks: Vec<u32> = (0..=n).map(|k| p_next + 2 * k).collect();
        p_next += 2 * (n + 1) + 1;
        let d_blocks: Vec<u32> = (0..=n).map(|k| d_next - k).collect();
        d_next -= n + 2;
        reqs.push((tid, prompt, cached, p_blocks, d_blocks));
    }

    // Half the requests: the router sends both halves at once, so decode
    // asks before prefill has finished.
    for (tid, prompt, cached, _, d_blocks) in reqs.iter().filter(|r| r.0 % 2 == 0) {
        let held = (*cached / u64::from(BS)) as usize;
        e.c.decode[0]
            .kv
            .fill(TransferId(*tid), &d_blocks[..held], 0);
        e.c.decode[0].kv.clear(&d_blocks[held..]);
        let p = d_params_for(*tid, &e.p.config().bootstrap_addr);
        let blocks = [ids(d_blocks)];
        let id = format!("d{tid}");
        let r = SchedRequest {
            request_id: &id,
            ..req("", *prompt, *cached, &blocks, &p)
        };
        let (t, is_async) = e.d.get_num_new_matched_tokens(&r).unwrap();
        assert!(is_async && t == prompt - cached);
        e.d.update_state_after_alloc(&r, t).unwrap();
    }
    e.step_decode();

    // Prefill runs every request (its KV is the synthetic pattern), then
    // finishes it length-capped.
    let mut late = Vec::new();
    for (tid, prompt, _, p_blocks, _) in &reqs {
        let p = p_params(*tid);
        let blocks = [ids(p_blocks)];
        let id = format!("p{tid}");
        let r = SchedRequest {
            request_id: &id,
            ..req("", *prompt, 0, &blocks, &p)
        };
        e.p.update_state_after_alloc(&r, 0).unwrap();
        e.step_prefill();
        let n = prompt.div_ceil(u64::from(BS)) as usize;
        e.c.prefill[0].kv.fill(TransferId(*tid), &p_blocks[..n], 0);
        let d =
            e.p.request_finished(&r, FinishStatus::LengthCapped)
                .unwrap();
        assert!(d.delay_free);
        let params = d.params.unwrap();
        // The params travel to decode as JSON, through the router.
        late.push((*tid, serde_json::to_string(&params).unwrap()));
    }
    e.step_prefill();

    // The other half: decode gets prefill's params afterwards.
    for (tid, json) in late.iter().filter(|(t, _)| t % 2 == 1) {
        let (_, prompt, cached, _, d_blocks) = reqs.iter().find(|r| r.0 == *tid).unwrap();
        let held = (*cached / u64::from(BS)) as usize;
        e.c.decode[0]
            .kv
            .fill(TransferId(*tid), &d_blocks[..held], 0);
        e.c.decode[0].kv.clear(&d_blocks[held..]);
        let p: KvTransferParams = serde_json::from_str(json).unwrap();
        let blocks = [ids(d_blocks)];
        let id = format!("d{tid}");
        let r = SchedRequest {
            request_id: &id,
            ..req("", *prompt, *cached, &blocks, &p)
        };
        let (t, _) = e.d.get_num_new_matched_tokens(&r).unwrap();
        e.d.update_state_after_alloc(&r, t).unwrap();
    }
    e.step_decode();

    let n = reqs.len();
    let got = e.drive_until(|r| r.recv.len() >= n && r.sent.len() >= n);
    let (mut recv, mut sent) = (got.recv, got.sent);
    recv.sort();
    sent.sort();
    let mut want_recv: Vec<String> = reqs.iter().map(|r| format!("d{}", r.0)).collect();
    let mut want_sent: Vec<String> = reqs.iter().map(|r| format!("p{}", r.0)).collect();
    want_recv.sort();
    want_sent.sort();
    assert_eq!(recv, want_recv);
    assert_eq!(sent, want_sent);
    assert!(got.freed.is_empty() && got.p_untracked.is_empty() && got.d_untracked.is_empty());
    assert!(e.c.decode[0].node.block_ids_with_load_errors().is_empty());

    // Every prompt block on decode holds its position's bytes: the cached
    // prefix untouched, the rest loaded (positions not shifted).
    for (tid, prompt, cached, _, d_blocks) in &reqs {
        let n = prompt.div_ceil(u64::from(BS)) as usize;
        e.c.decode[0]
            .kv
            .verify(TransferId(*tid), &d_blocks[..n], 0)
            .unwrap_or_else(|err| panic!("transfer {tid} (cached {cached}): {err:?}"));
        // The spare block got nothing.
        assert!(e.c.decode[0]
            .kv
            .verify(TransferId(*tid), &d_blocks[n..], n as u64)
            .is_err());
    }

    // Decode finishes normally: nothing left anywhere.
    for (tid, prompt, cached, _, d_blocks) in &reqs {
        let p = d_params_for(*tid, &e.p.config().bootstrap_addr);
        let blocks = [ids(d_blocks)];
        let id = format!("d{tid}");
        let r = SchedRequest {
            request_id: &id,
            ..req("", *prompt, *cached, &blocks, &p)
        };
        assert!(
            !e.d.request_finished(&r, FinishStatus::Stopped)
                .unwrap()
                .delay_free
        );
    }
    assert_eq!((e.p.tracked_len(), e.d.tracked_len()), (0, 0));
}

/// What the router gives decode up front in the e2e runs.
fn d_params_for(tid: u64, bootstrap_addr: &str) -> KvTransferParams {
    KvTransferParams {
        do_remote_prefill: true,
        transfer_id: Some(TransferId(tid).into()),
        remote_engine_id: Some("prefill".into()),
        remote_bootstrap_addr: Some(bootstrap_addr.into()),
        ..KvTransferParams::default()
    }
}

/// One prefill request, run and finished length-capped; returns the
/// params for decode and the prefill blocks holding the prompt.
fn prefill_one(e: &mut Engines, tid: u64, prompt: u64, first_block: u32) -> KvTransferParams {
    let n = prompt.div_ceil(u64::from(BS)) as u32;
    let p_blocks: Vec<u32> = (first_block..first_block + n).collect();
    let p = p_params(tid);
    let blocks = [ids(&p_blocks)];
    let id = format!("p{tid}");
    let r = SchedRequest {
        request_id: &id,
        ..req("", prompt, 0, &blocks, &p)
    };
    e.p.update_state_after_alloc(&r, 0).unwrap();
    e.c.prefill[0].kv.fill(TransferId(tid), &p_blocks, 0);
    let d =
        e.p.request_finished(&r, FinishStatus::LengthCapped)
            .unwrap();
    assert!(d.delay_free);
    e.step_prefill();
    d.params.unwrap()
}

#[test]
fn e2e_decode_gone_before_allocation_releases_the_prefill_blocks() {
    let mut e = Engines::start();
    let params = prefill_one(&mut e, 600, 10, 20);
    // The decode request is aborted before it ever got blocks.
    let r = req("d600", 10, 0, &[], &params);
    assert!(
        !e.d.request_finished(&r, FinishStatus::Aborted)
            .unwrap()
            .delay_free
    );
    e.step_decode();
    let got = e.drive_until(|r| !r.sent.is_empty() && !r.d_untracked.is_empty());
    // Prefill's delayed free ends: its blocks go back to its engine.
    assert_eq!(got.sent, vec!["p600".to_string()]);
    assert_eq!(got.d_untracked, vec![TransferId(600)]);
    assert!(got.recv.is_empty());
    assert_eq!(
        e.c.prefill[0].node.phase(TransferId(600)),
        Some(kvferry::machines::Phase::Success)
    );
    assert!(e.c.decode[0].node.block_ids_with_load_errors().is_empty());
    assert_eq!((e.p.tracked_len(), e.d.tracked_len()), (0, 0));
}

#[test]
fn e2e_prefill_abort_fails_the_waiting_decode_load() {
    let mut e = Engines::start();
    let addr = e.p.config().bootstrap_addr.clone();
    let tid = 700;
    // Decode asks first (router sent both halves at once).
    let p = d_params_for(tid, &addr);
    let d_blocks = [ids(&[40, 41, 42])];
    let r = req("d700", 12, 0, &d_blocks, &p);
    let (t, _) = e.d.get_num_new_matched_tokens(&r).unwrap();
    e.d.update_state_after_alloc(&r, t).unwrap();
    e.step_decode();
    // Prefill's request is aborted: free now, no KV for decode.
    let pp = p_params(tid);
    let p_blocks = [ids(&[1, 2, 3])];
    let pr = req("p700", 12, 0, &p_blocks, &pp);
    e.p.update_state_after_alloc(&pr, 0).unwrap();
    let d = e.p.request_finished(&pr, FinishStatus::Aborted).unwrap();
    assert!(!d.delay_free && d.params.is_none());
    e.step_prefill();
    let got = e.drive_until(|r| !r.recv.is_empty());
    assert_eq!(got.recv, vec!["d700".to_string()]);
    // The load failed because prefill said so, not by waiting out a deadline.
    let phase = e.c.decode[0].node.phase(TransferId(tid)).unwrap();
    assert!(
        matches!(phase, kvferry::machines::Phase::Failed(_)),
        "{phase:?}"
    );
    let mut errs = e.c.decode[0].node.block_ids_with_load_errors();
    errs.sort();
    assert_eq!(errs, ids(&[40, 41, 42]));
}

#[test]
fn e2e_decode_abort_during_the_load_frees_after_it_ends() {
    let mut e = Engines::start();
    let addr = e.p.config().bootstrap_addr.clone();
    let tid = 800;
    let p = d_params_for(tid, &addr);
    let d_blocks = [ids(&[50, 51])];
    let r = req("d800", 8, 0, &d_blocks, &p);
    let (t, _) = e.d.get_num_new_matched_tokens(&r).unwrap();
    e.d.update_state_after_alloc(&r, t).unwrap();
    e.step_decode();
    // Prefill has not finished; decode's client goes away mid-load.
    let d = e.d.request_finished(&r, FinishStatus::Aborted).unwrap();
    assert!(d.delay_free);
    let abort = e.d.poll_abort().expect("an abort to issue");
    assert_eq!(abort, TransferId(tid));
    e.c.decode[0].node.abort(abort).unwrap();
    let got = e.drive_until(|r| !r.freed.is_empty());
    assert_eq!(got.freed, vec!["d800".to_string()]);
    assert!(got.recv.is_empty());
    assert_eq!(e.d.tracked_len(), 0);
    // Prefill finishing afterwards still ends its own delayed free.
    let _ = prefill_one(&mut e, tid, 8, 10);
    let got = e.drive_until(|r| !r.sent.is_empty());
    assert_eq!(got.sent, vec!["p800".to_string()]);
    assert_eq!(e.p.tracked_len(), 0);
    // Decode gave up before its `Pull` left (the abort came while it was
    // still resolving the prefill ranks), so prefill never heard of the
    // request and its send waits out the bootstrap deadline (5 s here), as
    // vLLM's prefill waits out its abort timeout: the delayed free still
    // ends, just late. (When prefill did hear of it, the recorded outcome is
    // reported at once: `e2e_faults::prefill_sender_after_decode_abort_ends_at_once`.)
    assert!(e.c.prefill[0]
        .node
        .phase(TransferId(tid))
        .is_some_and(|p| p.is_terminal()));
}

/// Two KV-cache groups, the second with a sliding window of 2 blocks'
/// tokens (so 3 blocks move): both schedulers clip by the same rule,
/// prefill sends only the window's blocks of group 1, decode loads them
/// into its last blocks, with a prefix hit inside and outside the window.
#[test]
fn e2e_a_sliding_window_group_moves_only_its_window() {
    use kvferry_testkit::synth::GROUP_POSITIONS;
    let c = Cluster::start(&e2e_spec()).expect("cluster starts");
    let addr = c.prefill[0]
        .node
        .bootstrap_addr()
        .expect("bootstrap served");
    let config = |role, id: &str, addr: &str| {
        let mut cfg = SchedulerConfig::new(role, id, addr, BS);
        cfg.num_groups = 2;
        cfg.window_tokens = vec![0, u64::from(2 * BS)];
        Scheduler::new(cfg).unwrap()
    };
    let mut p = config(KvRole::Producer, "prefill", &addr);
    let mut d = config(KvRole::Consumer, "decode", "");
    let (prompt, n) = (10 * u64::from(BS), 10usize);
    for (i, cached_blocks) in [(0u64, 0usize), (1, 2), (2, 8)] {
        let tid = 700 + i;
        let p_blocks = [
            (0..n as u32).collect::<Vec<_>>(),
            (20..20 + n as u32).collect::<Vec<_>>(),
        ];
        let d_blocks = [
            (40..40 + n as u32).collect::<Vec<_>>(),
            (60..60 + n as u32).collect::<Vec<_>>(),
        ];
        c.fill_groups(TransferId(tid), &p_blocks);
        c.decode[0].kv.clear(&d_blocks.concat());
        // Prefill computes the request and finishes it length-capped.
        let pp = p_params(tid);
        let blocks = [ids(&p_blocks[0]), ids(&p_blocks[1])];
        let p_id = format!("p{tid}");
        let r = req(&p_id, prompt, 0, &blocks, &pp);
        p.update_state_after_alloc(&r, 0).unwrap();
        let params = p
            .request_finished(&r, FinishStatus::LengthCapped)
            .unwrap()
            .params
            .unwrap();
        let sends = p.build_connector_meta();
        // Only the window's 3 blocks of group 1 are sent.
        assert_eq!(sends.sends[0].src_blocks[1], ids(&p_blocks[1][7..]));
        c.prefill[0].node.start_load_kv(&sends).unwrap();
        // Decode, with `cached_blocks` of the prompt held locally.
        let blocks = [ids(&d_blocks[0]), ids(&d_blocks[1])];
        let cached = cached_blocks as u64 * u64::from(BS);
        let d_id = format!("d{tid}");
        let r = req(&d_id, prompt, cached, &blocks, &params);
        let (t, _) = d.get_num_new_matched_tokens(&r).unwrap();
        d.update_state_after_alloc(&r, t).unwrap();
        let loads = d.build_connector_meta();
        let first = [cached_blocks, cached_blocks.max(7)];
        for g in 0..2 {
            assert_eq!(
                loads.loads[0].dst_blocks[g],
                ids(&d_blocks[g][first[g]..]),
                "group {g}"
            );
        }
        c.decode[0].node.start_load_kv(&loads).unwrap();
        let phases = c.wait_decode(TransferId(tid), Duration::from_secs(10));
        assert_eq!(phases, vec![kvferry::Phase::Success], "request {tid}");
        let landed = [
            d_blocks[0][first[0]..].to_vec(),
            d_blocks[1][first[1]..].to_vec(),
        ];
        let offsets = [first[0] as u32, first[1] as u32];
        assert_eq!(
            c.verify_groups(TransferId(tid), &landed, &offsets),
            0,
            "request {tid}"
        );
        // Group 1's blocks before the window were not written.
        let before = &d_blocks[1][..first[1]];
        let untouched = c.decode[0]
            .kv
            .verify(TransferId(tid), before, GROUP_POSITIONS);
        assert!(before.is_empty() || untouched.is_err(), "request {tid}");
    }
}

/// vLLM's hybrid allocator leaves its null block (id 0) at every position
/// of a sliding-window group before the window: those blocks do not move,
/// so they may repeat; a repeat among the blocks that move is refused.
#[test]
fn blocks_before_a_window_may_repeat_and_moving_ones_may_not() {
    let prefill = || {
        let mut cfg = SchedulerConfig::new(KvRole::Producer, "p", ADDR, BS);
        cfg.num_groups = 2;
        cfg.window_tokens = vec![0, u64::from(2 * BS)]; // 3 blocks move
        Scheduler::new(cfg).unwrap()
    };
    let pp = p_params(9);
    let prompt = 7 * u64::from(BS);
    let null_first = [ids(&[1, 2, 3, 4, 5, 6, 7]), ids(&[0, 0, 0, 0, 11, 12, 13])];
    let mut p = prefill();
    let r = req("r", prompt, 0, &null_first, &pp);
    p.update_state_after_alloc(&r, 0).unwrap();
    assert!(
        p.request_finished(&r, FinishStatus::LengthCapped)
            .unwrap()
            .delay_free
    );
    let sends = p.build_connector_meta().sends;
    assert_eq!(sends[0].src_blocks[1], ids(&[11, 12, 13]));
    let in_window = [ids(&[1, 2, 3, 4, 5, 6, 7]), ids(&[0, 0, 0, 0, 11, 11, 13])];
    let mut p = prefill();
    let e = p
        .update_state_after_alloc(&req("r", prompt, 0, &in_window, &pp), 0)
        .and_then(|()| {
            p.request_finished(
                &req("r", prompt, 0, &in_window, &pp),
                FinishStatus::LengthCapped,
            )
            .map(|_| ())
        })
        .unwrap_err();
    assert_eq!(
        e,
        SchedError::DuplicateBlock {
            request_id: "r".into(),
            block: BlockId(11)
        }
    );
}
