//! Device memory over the tcp transport: bytes staged through the pinned
//! buffer pool on both ends, with host memory standing in for a device
//! (`HostDevice`: its "device memory" is memory it allocated and checks
//! ranges against, its copies run asynchronously, in order, on a thread
//! per stream, each taking a set time). The same staging code runs
//! against `CudaDevice` on a GPU (`scripts/gpu-check.sh`).

use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use glommio::{LocalExecutorBuilder, Placement};
use kvferry::transport::{
    open_cuda, BlockFence, Desc, Device, DeviceError, HostDevice, Op, Session, ShmConfig, ShmMode,
    StagingConfig, TcpConfig, TcpTransport, Transport, TransportError,
};

fn block_on<T>(f: impl Future<Output = T>) -> T {
    LocalExecutorBuilder::new(Placement::Unbound)
        .make()
        .expect("executor")
        .run(f)
}

fn config(device: &Arc<HostDevice>, buffers: usize, buffer_bytes: usize) -> TcpConfig {
    TcpConfig {
        // Shared memory would skip the staging on the same host.
        shm: ShmConfig {
            mode: ShmMode::Off,
            ..ShmConfig::default()
        },
        device: Some(Arc::clone(device) as Arc<dyn Device>),
        staging: StagingConfig {
            buffers,
            buffer_bytes,
            ..StagingConfig::default()
        },
        ..TcpConfig::default()
    }
}

fn bind(config: TcpConfig) -> TcpTransport {
    TcpTransport::bind("127.0.0.1:0".parse().unwrap(), config).unwrap()
}

/// `len` bytes of the stand-in's device memory, registered, filled from
/// `seed` (0: zeros).
fn device_region(t: &TcpTransport, dev: &HostDevice, len: usize, seed: u64) -> u64 {
    let addr = dev.alloc(len);
    fill(addr, len, seed);
    // SAFETY: the stand-in's memory lives as long as the device.
    unsafe { t.register_device(addr, len).unwrap() };
    addr
}

fn fill(addr: u64, len: usize, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    // SAFETY: a live allocation of `len` bytes no transfer touches now.
    let s = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
    if seed != 0 {
        s.iter_mut().for_each(|b| *b = rng.u8(..));
    }
}

fn view(addr: u64, len: usize) -> Vec<u8> {
    // SAFETY: read between batches, while no copy runs.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec()
}

#[test]
fn device_bytes_move_exactly_both_ways_through_a_bounded_pool() {
    block_on(async {
        // Slow copies (1 ms each) and buffers smaller than a descriptor: a
        // send that did not wait for its copy, or a buffer leased again
        // while a copy used it, would show in the bytes.
        let a_dev = HostDevice::new(0, Duration::from_millis(1));
        let b_dev = HostDevice::new(1, Duration::from_millis(1));
        let a = bind(config(&a_dev, 4, 64 << 10));
        let b = bind(config(&b_dev, 4, 64 << 10));
        let len = 3 << 20;
        let src = device_region(&a, &a_dev, len, 11);
        let dst = device_region(&b, &b_dev, len, 0);
        let back = device_region(&a, &a_dev, len, 0);
        let session = a.open(&b.endpoint_addr()).await.unwrap();
        // Uneven descriptors, one crossing many buffers.
        let descs = [
            Desc {
                local_addr: src,
                remote_addr: dst,
                len_bytes: 1000,
            },
            Desc {
                local_addr: src + 1000,
                remote_addr: dst + 1000,
                len_bytes: (2 << 20) - 1000,
            },
            Desc {
                local_addr: src + (2 << 20),
                remote_addr: dst + (2 << 20),
                len_bytes: 1 << 20,
            },
        ];
        session.transfer(Op::Write, &descs).await.unwrap();
        let (got, want) = (view(dst, len), view(src, len));
        let first = got.iter().zip(&want).position(|(g, w)| g != w);
        assert!(
            first.is_none(),
            "write: device bytes differ from {first:?}: {:?} {:?} {:?} {:?}",
            &got[..8],
            &want[..8],
            a.staging_stats(),
            b.staging_stats()
        );
        let pull: Vec<Desc> = descs
            .iter()
            .map(|d| Desc {
                local_addr: back + (d.local_addr - src),
                ..*d
            })
            .collect();
        session.transfer(Op::Read, &pull).await.unwrap();
        assert!(
            view(back, len) == view(src, len),
            "read: device bytes differ"
        );
        for t in [&a, &b] {
            let pool = t.staging_stats().pool;
            assert!(pool.allocated <= 4 && pool.high_water <= 4, "{pool:?}");
            assert!(
                pool.allocated >= 2,
                "the pipeline used one buffer: {pool:?}"
            );
            assert_eq!(pool.leased, 0, "{pool:?}");
        }
        assert!(a_dev.pinned_live() <= 4 && b_dev.pinned_live() <= 4);
    });
}

#[test]
fn a_batch_mixing_host_and_device_memory_moves_both() {
    block_on(async {
        let a_dev = HostDevice::new(0, Duration::ZERO);
        let b_dev = HostDevice::new(1, Duration::ZERO);
        let a = bind(config(&a_dev, 2, 16 << 10));
        let b = bind(config(&b_dev, 2, 16 << 10));
        let len = 256 << 10;
        let on_device = device_region(&a, &a_dev, len, 5);
        let mut host: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        // SAFETY: `host` outlives the endpoint.
        unsafe { a.register(host.as_mut_ptr(), len).unwrap() };
        let there_dev = device_region(&b, &b_dev, len, 0);
        let mut there_host = vec![0u8; len];
        // SAFETY: as above.
        unsafe { b.register(there_host.as_mut_ptr(), len).unwrap() };
        let session = a.open(&b.endpoint_addr()).await.unwrap();
        let h = host.as_ptr() as u64;
        let th = there_host.as_ptr() as u64;
        // Every pairing: device to host, host to device, both kinds in one
        // frame on the target.
        let descs = [
            Desc {
                local_addr: on_device,
                remote_addr: th,
                len_bytes: 1 << 10,
            },
            Desc {
                local_addr: h,
                remote_addr: there_dev,
                len_bytes: 100 << 10,
            },
            Desc {
                local_addr: on_device + (1 << 10),
                remote_addr: there_dev + (100 << 10),
                len_bytes: 50 << 10,
            },
            Desc {
                local_addr: h + (100 << 10),
                remote_addr: th + (1 << 10),
                len_bytes: 3,
            },
        ];
        session.transfer(Op::Write, &descs).await.unwrap();
        assert_eq!(&there_host[..1 << 10], &view(on_device, 1 << 10)[..]);
        assert_eq!(&view(there_dev, 100 << 10)[..], &host[..100 << 10]);
        assert_eq!(
            view(there_dev + (100 << 10), 50 << 10),
            view(on_device + (1 << 10), 50 << 10)
        );
        assert_eq!(
            &there_host[1 << 10..(1 << 10) + 3],
            &host[100 << 10..(100 << 10) + 3]
        );
        drop(there_host);
        drop(host);
    });
}

#[test]
fn a_peer_dying_mid_pipeline_leaves_no_buffer_leased() {
    block_on(async {
        let a_dev = HostDevice::new(0, Duration::from_millis(2));
        let b_dev = HostDevice::new(1, Duration::from_millis(2));
        let a = bind(config(&a_dev, 4, 64 << 10));
        let mut b = bind(config(&b_dev, 4, 64 << 10));
        let len = 8 << 20;
        let src = device_region(&a, &a_dev, len, 3);
        let dst = device_region(&b, &b_dev, len, 0);
        let session = a.open(&b.endpoint_addr()).await.unwrap();
        let batch = [Desc {
            local_addr: src,
            remote_addr: dst,
            len_bytes: len as u64,
        }];
        let moving = session.transfer(Op::Write, &batch);
        // The peer goes away once both ends have copies running (each copy
        // takes 2 ms, so 8 MiB takes hundreds of them).
        let kill = async {
            while a.staging_stats().copies_in_flight == 0 || b.staging_stats().pool.leased == 0 {
                futures_lite::future::yield_now().await;
            }
            b.shutdown();
        };
        let (moved, ()) = futures::future::join(moving, kill).await;
        assert!(moved.is_err(), "the batch cannot succeed without its peer");
        // The batch's leases went back as it ended, any under a running
        // copy once that copy ended: none is leased, none was lost.
        let stats = a.staging_stats();
        assert_eq!((stats.pool.leased, stats.pool.lost), (0, 0), "{stats:?}");
        assert!(stats.pool.allocated <= 4, "{stats:?}");
        // The dead peer's served connection ends too, and gives back its
        // buffers once its task sees the socket closed.
        let drained = glommio::timer::timeout(Duration::from_secs(10), async {
            while b.staging_stats().pool.leased != 0 || b.connections() != 0 {
                futures_lite::future::yield_now().await;
            }
            Ok(())
        })
        .await;
        assert!(drained.is_ok(), "{:?}", b.staging_stats());
        assert_eq!(b.staging_stats().pool.lost, 0);
    });
}

#[test]
fn device_registration_is_checked_with_the_device() {
    block_on(async {
        let dev = HostDevice::new(0, Duration::ZERO);
        let t = bind(config(&dev, 2, 4096));
        let addr = dev.alloc(4096);
        let mut host = vec![0u8; 4096];
        // SAFETY: refused, so nothing is registered.
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
        // SAFETY: past the allocation's end: refused.
        let past = unsafe { t.register_device(addr + 1, 4096) };
        assert!(past.is_err());
        // SAFETY: the stand-in's memory lives as long as the device.
        unsafe { t.register_device(addr, 4096).unwrap() };
        let plain = bind(TcpConfig::default());
        // SAFETY: refused: no device on this endpoint.
        let none = unsafe { plain.register_device(addr, 4096) };
        assert!(
            matches!(
                none,
                Err(TransportError::Device {
                    source: DeviceError::NoDriver { .. },
                    ..
                })
            ),
            "{none:?}"
        );
    });
}

#[test]
fn a_close_waits_for_a_device_copy_into_its_block() {
    block_on(async {
        // The target's copies take 200 ms: the close of the block lands
        // while the copy into it runs, and must not return before it ends.
        let a_dev = HostDevice::new(0, Duration::ZERO);
        let b_dev = HostDevice::new(1, Duration::from_millis(200));
        let a = bind(config(&a_dev, 2, 64 << 10));
        let b = bind(config(&b_dev, 2, 64 << 10));
        let block = 64 << 10;
        let src = device_region(&a, &a_dev, block, 9);
        let dst = device_region(&b, &b_dev, 2 * block, 0);
        let fence = Rc::new(BlockFence::new(&[(dst, block as u64)], 2));
        fence.open([0u32]);
        b.set_fence(Some(Rc::clone(&fence)));
        let session = a.open(&b.endpoint_addr()).await.unwrap();
        let batch = [Desc {
            local_addr: src,
            remote_addr: dst,
            len_bytes: block as u64,
        }];
        let moving = session.transfer(Op::Write, &batch);
        let close = async {
            // Wait until the copy onto the device runs, then close.
            while b.staging_stats().copies_in_flight == 0 {
                futures_lite::future::yield_now().await;
            }
            fence.close([0u32]);
            // The close returned only once the copy had ended.
            assert_eq!(b.staging_stats().copies_in_flight, 0);
        };
        let (moved, ()) = futures::future::join(moving, close).await;
        let stats = b.staging_stats();
        assert_eq!(
            (stats.drain_waits, stats.drain_overruns),
            (1, 0),
            "{stats:?}"
        );
        // The copy was enqueued while the block was open: the batch
        // succeeded, or it failed after its bytes landed.
        if moved.is_ok() {
            assert!(view(dst, block) == view(src, block));
        }
    });
}

#[test]
fn cuda_without_a_driver_is_one_clear_error() {
    // With the `cuda` feature the driver is looked for and not found,
    // without it the build says so. (A GPU host runs the GPU tests instead.)
    if std::env::var_os("KVFERRY_GPU_TESTS").is_some() {
        return;
    }
    match open_cuda(0) {
        Err(DeviceError::NoDriver { detail }) => {
            assert!(detail.contains("cuda:0"), "{detail}");
        }
        other => panic!("expected NoDriver, got {other:?}"),
    }
}

/// `config` with shared memory on: peers on this host open each other's
/// device regions by IPC handle.
fn config_ipc(device: Option<&Arc<HostDevice>>) -> TcpConfig {
    TcpConfig {
        shm: ShmConfig {
            mode: ShmMode::Auto,
            ..ShmConfig::default()
        },
        device: device.map(|d| Arc::clone(d) as Arc<dyn Device>),
        staging: StagingConfig {
            buffers: 4,
            buffer_bytes: 64 << 10,
            ..StagingConfig::default()
        },
        ..TcpConfig::default()
    }
}

#[test]
fn on_one_host_device_memory_moves_device_to_device_through_ipc() {
    block_on(async {
        let a_dev = HostDevice::new(0, Duration::from_micros(100));
        let b_dev = HostDevice::new(1, Duration::from_micros(100));
        let a = bind(config_ipc(Some(&a_dev)));
        let b = bind(config_ipc(Some(&b_dev)));
        let len = 3 << 20;
        let src = device_region(&a, &a_dev, len, 21);
        let back = device_region(&a, &a_dev, len, 0);
        let dst = device_region(&b, &b_dev, len, 0);
        let mut host: Vec<u8> = (0..4096).map(|i| (i % 253) as u8).collect();
        // SAFETY: `host` outlives the endpoint.
        unsafe { a.register(host.as_mut_ptr(), host.len()).unwrap() };
        let session = a.open(&b.endpoint_addr()).await.unwrap();
        assert!(session.uses_shm(), "the peer offers its device regions");
        let descs = [
            Desc {
                local_addr: src,
                remote_addr: dst,
                len_bytes: (2 << 20) + 5,
            },
            Desc {
                local_addr: src + (2 << 20) + 5,
                remote_addr: dst + (2 << 20) + 5,
                len_bytes: (1 << 20) - 5 - 4096,
            },
            // Host memory here into the peer's device memory.
            Desc {
                local_addr: host.as_ptr() as u64,
                remote_addr: dst + len as u64 - 4096,
                len_bytes: 4096,
            },
        ];
        session.transfer(Op::Write, &descs).await.unwrap();
        let (got, want) = (view(dst, len - 4096), view(src, len - 4096));
        assert!(got == want, "device to device: bytes differ");
        assert_eq!(view(dst + len as u64 - 4096, 4096), host);
        let pull = [Desc {
            local_addr: back,
            remote_addr: dst,
            len_bytes: len as u64,
        }];
        session.transfer(Op::Read, &pull).await.unwrap();
        assert!(view(back, len) == view(dst, len), "read back: bytes differ");
        // Every byte went through the opened allocation: none was staged.
        assert_eq!(session.shm_copied_bytes(), 2 * len as u64);
        assert_eq!(a.staging_stats().pool.allocated, 0);
        assert_eq!(b.staging_stats().pool.allocated, 0);
        drop(host);
    });
}

#[test]
fn a_device_copy_into_a_closed_block_of_the_peer_is_refused() {
    block_on(async {
        let a_dev = HostDevice::new(0, Duration::ZERO);
        let b_dev = HostDevice::new(1, Duration::ZERO);
        let a = bind(config_ipc(Some(&a_dev)));
        let b = bind(config_ipc(Some(&b_dev)));
        let block = 64 << 10;
        let src = device_region(&a, &a_dev, block, 4);
        let dst = device_region(&b, &b_dev, 2 * block, 0);
        let fence = Rc::new(BlockFence::new(&[(dst, block as u64)], 2));
        b.set_fence(Some(Rc::clone(&fence)));
        let session = a.open(&b.endpoint_addr()).await.unwrap();
        assert!(session.uses_shm());
        let batch = [Desc {
            local_addr: src,
            remote_addr: dst + block as u64,
            len_bytes: block as u64,
        }];
        // Block 1 is closed: nothing lands, neither through the opened
        // allocation nor through tcp.
        let refused = session.transfer(Op::Write, &batch).await;
        assert!(
            matches!(refused, Err(TransportError::Fenced { .. })),
            "{refused:?}"
        );
        assert!(view(dst + block as u64, block).iter().all(|&x| x == 0));
        fence.open([1u32]);
        session.transfer(Op::Write, &batch).await.unwrap();
        assert!(view(dst + block as u64, block) == view(src, block));
        assert_eq!(session.shm_copied_bytes(), block as u64);
    });
}

#[test]
fn a_peer_without_a_device_moves_into_device_memory_staged_by_the_target() {
    block_on(async {
        let b_dev = HostDevice::new(1, Duration::ZERO);
        let a = bind(config_ipc(None));
        let b = bind(config_ipc(Some(&b_dev)));
        let len = 1 << 20;
        let mut src: Vec<u8> = (0..len).map(|i| (i % 241) as u8).collect();
        // SAFETY: `src` outlives the endpoint.
        unsafe { a.register(src.as_mut_ptr(), len).unwrap() };
        let dst = device_region(&b, &b_dev, len, 0);
        let session = a.open(&b.endpoint_addr()).await.unwrap();
        let batch = [Desc {
            local_addr: src.as_ptr() as u64,
            remote_addr: dst,
            len_bytes: len as u64,
        }];
        session.transfer(Op::Write, &batch).await.unwrap();
        assert_eq!(view(dst, len), src);
        // No device here to open the peer's allocation with: tcp frames,
        // staged onto the device by the target.
        assert_eq!(session.shm_copied_bytes(), 0);
        assert!(b.staging_stats().pool.allocated > 0);
        drop(src);
    });
}
