//! Embedding kvferry: a prefill and a decode node in one process move one
//! request's KV cache, first with the per-request handles, then through the
//! vLLM-style step loop (scheduler → `start_load_kv` → `get_finished`).
//! Every byte that lands is checked.
//!
//! `cargo run --example embed`

use std::time::{Duration, Instant};

use kvferry::scheduler::{
    FinishStatus, KvRole, KvTransferParams, SchedRequest, Scheduler, SchedulerConfig,
};
use kvferry::{BlockId, KvLayout, LayoutKind, ModelSpec, Node, NodeConfig, Phase, TransferId};
use kvferry::{PrefillTarget, Region, Role};

const MODEL: ModelSpec = ModelSpec {
    layout: LayoutKind::Hnd,
    total_kv_heads: 8,
    block_tokens: 16,
    head_bytes: 128,
};
const LAYERS: usize = 4;
const BLOCKS: u64 = 32;

/// One rank's KV cache: a K and a V region per layer, `BLOCKS` blocks each.
struct Kv {
    regions: Vec<Vec<u8>>,
}

impl Kv {
    fn new(fill: u8) -> Kv {
        let block_len = MODEL.heads_per_rank(1) as usize
            * MODEL.block_tokens as usize
            * MODEL.head_bytes as usize;
        let len = block_len * BLOCKS as usize;
        Kv {
            regions: (0..LAYERS * 2).map(|_| vec![fill; len]).collect(),
        }
    }

    fn block_len(&self) -> usize {
        self.regions[0].len() / BLOCKS as usize
    }

    fn layout(&mut self) -> KvLayout {
        let block_len = self.block_len() as u64;
        KvLayout {
            model: MODEL,
            first_region: 0,
            pools: Vec::new(),
            num_blocks: BLOCKS,
            regions: self
                .regions
                .iter_mut()
                .map(|r| Region {
                    base: r.as_mut_ptr() as u64,
                    block_len,
                    kv_block_len: block_len,
                })
                .collect(),
        }
    }

    fn block(&self, region: usize, block: u32) -> &[u8] {
        let n = self.block_len();
        &self.regions[region][block as usize * n..][..n]
    }

    fn write_block(&mut self, block: u32, byte: u8) {
        let n = self.block_len();
        for r in &mut self.regions {
            r[block as usize * n..][..n].fill(byte);
        }
    }
}

fn ids(b: &[u32]) -> Vec<Vec<BlockId>> {
    vec![b.iter().copied().map(BlockId).collect()]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut pkv = Kv::new(0);
    let mut dkv = Kv::new(0xff);
    let mut pc = NodeConfig::new(Role::Prefill, "prefill-0");
    // The bootstrap service decode engines look prefill ranks up in.
    pc.serve_bootstrap = Some("127.0.0.1:0".into());
    let prefill = Node::start(pc)?;
    let decode = Node::start(NodeConfig::new(Role::Decode, "decode-0"))?;
    // SAFETY: both nodes are shut down below, before `pkv` and `dkv` drop,
    // and nothing touches the regions while a transfer may be in flight.
    unsafe {
        prefill.register_kv_caches(pkv.layout())?;
        decode.register_kv_caches(dkv.layout())?;
    }

    // 1. Handles: prefill sends blocks 3 and 4 into decode's blocks 10, 11.
    pkv.write_block(3, 3);
    pkv.write_block(4, 4);
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![prefill.side_channel_addr()],
    };
    let rx = decode.receiver(TransferId(1), &target)?;
    rx.request(ids(&[10, 11]))?;
    let tx = prefill.sender(TransferId(1))?;
    tx.send(ids(&[3, 4]), true)?;
    assert_eq!(rx.wait(Duration::from_secs(10)), Phase::Success);
    assert_eq!(tx.wait(Duration::from_secs(10)), Phase::Success);
    for region in 0..LAYERS * 2 {
        assert_eq!(dkv.block(region, 10), pkv.block(region, 3));
        assert_eq!(dkv.block(region, 11), pkv.block(region, 4));
    }
    println!("handles: 2 blocks x {} regions verified", LAYERS * 2);

    // 2. The vLLM step loop: the schedulers decide, the nodes move.
    let bootstrap = prefill.bootstrap_addr().expect("serve_bootstrap is set");
    let mut p_sched = Scheduler::new(SchedulerConfig::new(
        KvRole::Producer,
        "prefill-0",
        bootstrap,
        MODEL.block_tokens,
    ))?;
    let mut d_sched = Scheduler::new(SchedulerConfig::new(
        KvRole::Consumer,
        "decode-0",
        "",
        MODEL.block_tokens,
    ))?;
    // Prefill computed a 40-token prompt into blocks 5, 6, 7.
    for b in 5..8 {
        pkv.write_block(b, b as u8 * 10);
    }
    let p_blocks = ids(&[5, 6, 7]);
    let params = KvTransferParams {
        do_remote_decode: true,
        transfer_id: Some(TransferId(2).into()),
        ..Default::default()
    };
    let p_req = SchedRequest {
        request_id: "req-p",
        prompt_len_tokens: 40,
        computed_len_tokens: 0,
        block_ids: &p_blocks,
        params: Some(&params),
    };
    p_sched.update_state_after_alloc(&p_req, 0)?;
    let done = p_sched.request_finished(&p_req, FinishStatus::LengthCapped)?;
    prefill.start_load_kv(&p_sched.build_connector_meta())?;
    // The router hands prefill's parameters to decode.
    let d_params = done.params.expect("parameters for decode");
    let d_blocks = ids(&[20, 21, 22]);
    let d_req = SchedRequest {
        request_id: "req-d",
        prompt_len_tokens: 40,
        computed_len_tokens: 0,
        block_ids: &d_blocks,
        params: Some(&d_params),
    };
    let (tokens, _) = d_sched.get_num_new_matched_tokens(&d_req)?;
    d_sched.update_state_after_alloc(&d_req, tokens)?;
    decode.start_load_kv(&d_sched.build_connector_meta())?;
    // Engine steps: collect what finished until both requests are done.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut sent, mut received) = (false, false);
    while !(sent && received) {
        assert!(Instant::now() < deadline, "the request finished in time");
        let (s, _) = prefill.get_finished();
        sent |= !p_sched.handle_finished(&s, &[]).finished_sending.is_empty();
        let (_, r) = decode.get_finished();
        received |= !d_sched.handle_finished(&[], &r).finished_recving.is_empty();
        std::thread::yield_now();
    }
    assert!(decode.block_ids_with_load_errors().is_empty());
    for region in 0..LAYERS * 2 {
        for (p, d) in [(5, 20), (6, 21), (7, 22)] {
            assert_eq!(dkv.block(region, d), pkv.block(region, p));
        }
    }
    println!("step loop: 3 blocks x {} regions verified", LAYERS * 2);
    decode.shutdown(Duration::from_secs(1));
    prefill.shutdown(Duration::from_secs(1));
    Ok(())
}
