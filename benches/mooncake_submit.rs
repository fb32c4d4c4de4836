//! Descriptor submission cost of the `mooncake` transport: 100 000
//! descriptors (64 bytes each) submitted and polled, through
//! `MooncakeTransport` and, as the baseline in the same run, straight
//! through the C API with one reused request array. Over the fake engine
//! library (`mooncake-sys/csrc/fake_te.c`, a memcpy per task), so the
//! figure is kvferry's overhead per descriptor plus the fake's, and their
//! difference is kvferry's alone.
//!
//! `cargo bench --bench mooncake_submit` (prints one line per case).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use glommio::{LocalExecutorBuilder, Placement};
use kvferry::transport::{Desc, Op, RegionInfo, Session, Transport};
use kvferry::transport::{MooncakeConfig, MooncakeTransport};
use mooncake_sys::ffi::{TransferRequest, OPCODE_WRITE};
use mooncake_sys::{Engine, EngineConfig, TaskState, TeLib};

const DESCS: u64 = 100_000;
const LEN: u64 = 64;
const ROUNDS: u32 = 5;

fn fake_lib() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/mooncake-fake-bench");
    mooncake_sys::fake::build(&dir).expect("the fake library builds")
}

/// Best of `ROUNDS`, per descriptor.
fn best(mut f: impl FnMut() -> Duration) -> f64 {
    let t = (0..ROUNDS).map(|_| f()).min().unwrap();
    t.as_nanos() as f64 / DESCS as f64
}

fn raw(lib: &Path, src: &mut [u8], dst: &mut [u8]) -> f64 {
    let lib = Arc::new(TeLib::open(lib).unwrap());
    let cfg = EngineConfig::p2p("127.0.0.1", "tcp");
    let (a, b) = (
        Engine::new(lib.clone(), &cfg).unwrap(),
        Engine::new(lib, &cfg).unwrap(),
    );
    // SAFETY: the buffers outlive the registrations (dropped at return).
    let _ra = unsafe { a.register(src.as_mut_ptr(), src.len(), "cpu:0") }.unwrap();
    let _rb = unsafe { b.register(dst.as_mut_ptr(), dst.len(), "cpu:0") }.unwrap();
    let seg = a.open_segment(&b.local_addr().unwrap()).unwrap();
    let reqs: Vec<TransferRequest> = (0..DESCS)
        .map(|i| TransferRequest {
            opcode: OPCODE_WRITE,
            source: (src.as_ptr() as u64 + i * LEN) as usize as *mut _,
            target_id: seg.id(),
            target_offset: dst.as_ptr() as u64 + i * LEN,
            length: LEN,
        })
        .collect();
    best(|| {
        let start = Instant::now();
        let mut batch = a.batch(reqs.len()).unwrap();
        // SAFETY: registered ranges that outlive the batch.
        unsafe { batch.submit(&reqs) }.unwrap();
        for t in 0..reqs.len() {
            assert!(matches!(
                batch.status(t).unwrap(),
                TaskState::Completed { .. }
            ));
        }
        drop(batch);
        start.elapsed()
    })
}

fn kvferry(lib: &Path, src: &mut [u8], dst: &mut [u8]) -> f64 {
    let cfg = MooncakeConfig {
        library: Some(lib.to_path_buf()),
        max_descs: DESCS as usize,
        ..MooncakeConfig::default()
    };
    let ip = "127.0.0.1".parse().unwrap();
    LocalExecutorBuilder::new(Placement::Unbound)
        .make()
        .unwrap()
        .run(async move {
            let (a, b) = (
                MooncakeTransport::new(ip, cfg.clone()).unwrap(),
                MooncakeTransport::new(ip, cfg).unwrap(),
            );
            // SAFETY: the buffers outlive the endpoints (dropped at return).
            unsafe {
                a.register(src.as_mut_ptr(), src.len()).unwrap();
                b.register(dst.as_mut_ptr(), dst.len()).unwrap();
            }
            let peer = RegionInfo {
                addr: dst.as_ptr() as u64,
                len_bytes: dst.len() as u64,
            };
            a.learn_peer(&b.endpoint_addr(), vec![peer]);
            let s = a.open(&b.endpoint_addr()).await.unwrap();
            let descs: Vec<Desc> = (0..DESCS)
                .map(|i| Desc {
                    local_addr: src.as_ptr() as u64 + i * LEN,
                    remote_addr: dst.as_ptr() as u64 + i * LEN,
                    len_bytes: LEN,
                })
                .collect();
            let mut times = Vec::new();
            for _ in 0..ROUNDS {
                let deadline = Instant::now() + Duration::from_secs(60);
                let start = Instant::now();
                s.transfer_until(Op::Write, &descs, None, deadline)
                    .await
                    .unwrap();
                times.push(start.elapsed());
            }
            let t = times.into_iter().min().unwrap();
            t.as_nanos() as f64 / DESCS as f64
        })
}

fn main() {
    let lib = fake_lib();
    let mut src = vec![7u8; (DESCS * LEN) as usize];
    let mut dst = vec![0u8; (DESCS * LEN) as usize];
    let raw_ns = raw(&lib, &mut src, &mut dst);
    let kv_ns = kvferry(&lib, &mut src, &mut dst);
    assert!(dst.iter().all(|&b| b == 7), "every byte moved");
    println!("mooncake submit+poll, {DESCS} descriptors of {LEN} B, fake engine library:");
    println!("  C API directly        {raw_ns:8.1} ns/descriptor");
    println!("  MooncakeTransport     {kv_ns:8.1} ns/descriptor");
    println!(
        "  kvferry's own         {:8.1} ns/descriptor",
        kv_ns - raw_ns
    );
}
