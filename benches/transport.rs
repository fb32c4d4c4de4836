//! Per-batch overhead of small (4 KiB) descriptors: one-descriptor and
//! 64-descriptor batches over `local` and `tcp` (loopback, both endpoints on
//! one executor, spin polling).

use std::time::{Duration, Instant};

use glommio::{LocalExecutor, LocalExecutorBuilder, Placement};
use kvferry::transport::LocalTransport;
use kvferry::transport::{Desc, Op, Session, Transport};
use kvferry::transport::{TcpConfig, TcpTransport};
use kvferry_testkit::bench::{self, Throughput};

const BLOCK: u64 = 4096;
const MAX_DESCS: u64 = 64;

fn executor() -> LocalExecutor {
    LocalExecutorBuilder::new(Placement::Unbound)
        .make()
        .expect("executor")
}

fn batch(src: u64, dst: u64, n: u64) -> Vec<Desc> {
    (0..n)
        .map(|i| Desc {
            local_addr: src + i * BLOCK,
            remote_addr: dst + i * BLOCK,
            len_bytes: BLOCK,
        })
        .collect()
}

/// Times `iters` batches of `descs` on `session`.
async fn time_batches(session: &impl Session, descs: &[Desc], iters: u64) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        session.transfer(Op::Write, descs).await.expect("transfer");
    }
    start.elapsed()
}

fn main() {
    let mut src = vec![7u8; (BLOCK * MAX_DESCS) as usize];
    let mut dst = vec![0u8; (BLOCK * MAX_DESCS) as usize];
    let (s, d) = (src.as_mut_ptr(), dst.as_mut_ptr());
    let ex = executor();
    let mut group = bench::group("transport_4k");
    for n in [1, MAX_DESCS] {
        group.throughput(Throughput::Bytes(n * BLOCK));
        let descs = batch(s as u64, d as u64, n);
        group.bench(&format!("local/{n}x4KiB"), |b| {
            b.iter_custom(|iters| {
                ex.run(async {
                    let a = LocalTransport::default();
                    let t = LocalTransport::default();
                    // SAFETY: the buffers outlive the endpoints; nothing else
                    // touches them while the bench runs.
                    unsafe {
                        a.register(s, src.len()).unwrap();
                        t.register(d, dst.len()).unwrap();
                    }
                    let session = a.open(&t.endpoint_addr()).await.unwrap();
                    time_batches(&session, &descs, iters).await
                })
            })
        });
        group.bench(&format!("tcp/{n}x4KiB"), |b| {
            b.iter_custom(|iters| {
                ex.run(async {
                    let config = TcpConfig {
                        streams: 1,
                        ..TcpConfig::default()
                    };
                    let any = "127.0.0.1:0".parse().unwrap();
                    let target = TcpTransport::bind(any, config.clone()).unwrap();
                    let initiator = TcpTransport::bind(any, config).unwrap();
                    // SAFETY: as above.
                    unsafe {
                        initiator.register(s, src.len()).unwrap();
                        target.register(d, dst.len()).unwrap();
                    }
                    let session = initiator.open(&target.endpoint_addr()).await.unwrap();
                    session.transfer(Op::Write, &descs).await.unwrap();
                    let elapsed = time_batches(&session, &descs, iters).await;
                    session.close().await;
                    elapsed
                })
            })
        });
    }
    assert!(dst.iter().all(|&x| x == 7));
}
