//! Device memory on a real GPU: the tcp transport's staging and the
//! driver's checks against CUDA device 0. Ignored by default; a machine
//! with an NVIDIA driver runs them with `KVFERRY_GPU_TESTS=1` and
//! `--ignored` (`scripts/gpu-check.sh`, which also runs the cross-process
//! IPC and staged-tcp benchmark). The same code runs against the host
//! stand-in in `transport_device` everywhere.

use std::future::Future;
use std::sync::Arc;

use glommio::{LocalExecutorBuilder, Placement};
use kvferry::transport::{
    open_cuda, Desc, Device, DeviceAlloc, DeviceError, Dir, Op, Session, ShmConfig, ShmMode,
    StagingConfig, TcpConfig, TcpTransport, Transport, TransportError,
};

/// CUDA device 0.
fn gpu() -> Arc<dyn Device> {
    open_cuda(0).expect("CUDA device 0 (these tests run on a GPU: scripts/gpu-check.sh)")
}

fn block_on<T>(f: impl Future<Output = T>) -> T {
    LocalExecutorBuilder::new(Placement::Unbound)
        .make()
        .expect("executor")
        .run(f)
}

fn bind(device: &Arc<dyn Device>, shm: ShmMode) -> TcpTransport {
    let config = TcpConfig {
        shm: ShmConfig {
            mode: shm,
            ..ShmConfig::default()
        },
        device: Some(Arc::clone(device)),
        staging: StagingConfig {
            buffers: 4,
            buffer_bytes: 1 << 20,
            ..StagingConfig::default()
        },
        ..TcpConfig::default()
    };
    TcpTransport::bind("127.0.0.1:0".parse().unwrap(), config).unwrap()
}

/// `len` bytes of device memory, registered with `t`, filled from `seed`.
fn region(t: &TcpTransport, dev: &Arc<dyn Device>, len: usize, seed: u64) -> DeviceAlloc {
    let mem = dev.alloc_device(len).unwrap();
    let mut rng = fastrand::Rng::with_seed(seed);
    let bytes: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
    // SAFETY: a fresh allocation of `len` bytes; nothing else touches it.
    unsafe {
        dev.memcpy_sync(Dir::ToDevice, mem.addr(), bytes.as_ptr() as u64, len)
            .unwrap();
        t.register_device(mem.addr(), len).unwrap();
    }
    mem
}

fn read(dev: &Arc<dyn Device>, addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: read between batches, while no copy runs.
    unsafe { dev.memcpy_sync(Dir::ToHost, out.as_mut_ptr() as u64, addr, len) }.unwrap();
    out
}

fn roundtrip(shm: ShmMode) {
    let dev = gpu();
    block_on(async move {
        let a = bind(&dev, shm);
        let b = bind(&dev, shm);
        let len = 48 << 20;
        let src = region(&a, &dev, len, 1);
        let dst = region(&b, &dev, len, 0);
        let back = region(&a, &dev, len, 0);
        let session = a.open(&b.endpoint_addr()).await.unwrap();
        let (s, d) = (src.addr(), dst.addr());
        let descs = [
            Desc {
                local_addr: s,
                remote_addr: d,
                len_bytes: 4097,
            },
            Desc {
                local_addr: s + 4097,
                remote_addr: d + 4097,
                len_bytes: len as u64 - 4097,
            },
        ];
        session.transfer(Op::Write, &descs).await.unwrap();
        assert!(
            read(&dev, d, len) == read(&dev, s, len),
            "write: bytes differ"
        );
        let pull = [Desc {
            local_addr: back.addr(),
            remote_addr: d,
            len_bytes: len as u64,
        }];
        session.transfer(Op::Read, &pull).await.unwrap();
        assert!(
            read(&dev, back.addr(), len) == read(&dev, s, len),
            "read: bytes differ"
        );
        let pool = a.staging_stats().pool;
        assert!(pool.allocated <= 4 && pool.leased == 0, "{pool:?}");
        session.close().await;
    });
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_device_bytes_move_staged_over_tcp_both_ways() {
    roundtrip(ShmMode::Off);
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_in_one_process_ipc_handles_do_not_open_and_bytes_go_staged() {
    // CUDA opens no handle in the process that exported it: the link
    // finds no device region and tcp moves them, staged.
    roundtrip(ShmMode::Auto);
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_registration_is_checked_by_the_driver() {
    let dev = gpu();
    block_on(async move {
        let t = bind(&dev, ShmMode::Off);
        let mem = dev.alloc_device(1 << 20).unwrap();
        let mut host = vec![0u8; 4096];
        // SAFETY: refused: host memory is no device allocation.
        let refused = unsafe { t.register_device(host.as_mut_ptr() as u64, 4096) };
        assert!(
            matches!(
                refused,
                Err(TransportError::Device {
                    source: DeviceError::NotDeviceMemory { .. },
                    ..
                })
            ),
            "{refused:?}"
        );
        // SAFETY: refused: past the allocation's end.
        assert!(unsafe { t.register_device(mem.addr() + 4096, 1 << 20) }.is_err());
        // SAFETY: `mem` outlives the endpoint.
        unsafe { t.register_device(mem.addr(), 1 << 20).unwrap() };
        drop(t);
    });
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_host_memory_and_device_memory_mix_in_one_batch() {
    let dev = gpu();
    block_on(async move {
        let a = bind(&dev, ShmMode::Off);
        let b = bind(&dev, ShmMode::Off);
        let len = 4 << 20;
        let on_device = region(&a, &dev, len, 7);
        let mut host: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        // SAFETY: `host` outlives the endpoint.
        unsafe { a.register(host.as_mut_ptr(), len).unwrap() };
        let there = region(&b, &dev, 2 * len, 0);
        let session = a.open(&b.endpoint_addr()).await.unwrap();
        let descs = [
            Desc {
                local_addr: on_device.addr(),
                remote_addr: there.addr(),
                len_bytes: len as u64,
            },
            Desc {
                local_addr: host.as_ptr() as u64,
                remote_addr: there.addr() + len as u64,
                len_bytes: len as u64,
            },
        ];
        session.transfer(Op::Write, &descs).await.unwrap();
        assert!(read(&dev, there.addr(), len) == read(&dev, on_device.addr(), len));
        assert!(read(&dev, there.addr() + len as u64, len) == host);
        session.close().await;
        drop(host);
    });
}
