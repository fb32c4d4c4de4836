//! The tcp transport's shared-memory path: a target's `memfd` regions
//! mapped by an initiator on the same host, copied with one `memcpy`,
//! under the same bounds checks and block fence as tcp frames.
//!
//! Both endpoints live in this process (the handshake still goes through
//! the abstract Unix socket and `SCM_RIGHTS`); `cli/tests/it/shm_kill.rs`
//! kills peer processes mid-copy.

use std::future::Future;
use std::rc::Rc;

use glommio::{LocalExecutorBuilder, Placement};
use kvferry::transport::{
    BlockFence, Desc, MisuseError, Op, PeerError, Session, SharedMem, ShmConfig, ShmMode,
    ShmRefusal, TcpConfig, TcpSession, TcpTransport, Transport, TransportError,
};

fn block_on<T>(f: impl Future<Output = T>) -> T {
    LocalExecutorBuilder::new(Placement::Unbound)
        .make()
        .expect("executor")
        .run(f)
}

fn config(mode: ShmMode) -> TcpConfig {
    TcpConfig {
        shm: ShmConfig {
            mode,
            ..ShmConfig::default()
        },
        ..TcpConfig::default()
    }
}

fn bind(config: TcpConfig) -> TcpTransport {
    TcpTransport::bind("127.0.0.1:0".parse().unwrap(), config).unwrap()
}

/// `len` bytes of shared memory registered with `t`, filled with `byte`.
fn shared(t: &TcpTransport, len: usize, byte: u8) -> SharedMem {
    let mem = SharedMem::new("kvferry-test", len).unwrap();
    // SAFETY: the test owns the fresh mapping; it outlives the endpoint.
    unsafe {
        std::ptr::write_bytes(mem.as_ptr(), byte, len);
        t.register_shared(mem.as_ptr(), len, mem.fd(), 0).unwrap();
    }
    mem
}

fn bytes(mem: &SharedMem) -> &[u8] {
    // SAFETY: read only while no transfer runs (between awaits of batches).
    unsafe { std::slice::from_raw_parts(mem.as_ptr(), mem.len()) }
}

fn private(t: &TcpTransport, data: &mut [u8]) {
    // SAFETY: the buffer outlives the endpoint in these tests.
    unsafe { t.register(data.as_mut_ptr(), data.len()).unwrap() };
}

async fn open(
    initiator: &TcpTransport,
    target: &TcpTransport,
) -> Result<TcpSession, TransportError> {
    initiator.open(&target.endpoint_addr()).await
}

#[test]
fn batches_move_through_shared_memory_byte_exact_both_ways() {
    block_on(async {
        let target = bind(config(ShmMode::Require));
        let initiator = bind(config(ShmMode::Require));
        let len = 3 << 20;
        let there = shared(&target, len, 0xA5);
        let mut rng = fastrand::Rng::with_seed(7);
        let mut src: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
        let mut back = vec![0u8; len];
        private(&initiator, &mut src);
        private(&initiator, &mut back);
        let session = open(&initiator, &target).await.unwrap();
        assert!(session.uses_shm());
        // Pieces of 1 byte to over a chunk, with gaps that must stay untouched.
        let base = there.as_ptr() as u64;
        let pieces = [
            (0u64, 1u64),
            (5, 4095),
            (8192, (1 << 20) + 3),
            (2 << 20, 9000),
        ];
        let descs: Vec<Desc> = pieces
            .iter()
            .map(|&(off, n)| Desc {
                local_addr: src.as_ptr() as u64 + off,
                remote_addr: base + off,
                len_bytes: n,
            })
            .collect();
        session.transfer(Op::Write, &descs).await.unwrap();
        let mut expected = vec![0xA5u8; len];
        for &(off, n) in &pieces {
            let r = off as usize..(off + n) as usize;
            expected[r.clone()].copy_from_slice(&src[r]);
        }
        assert!(
            bytes(&there) == expected,
            "the target's memory after the writes"
        );
        let reads: Vec<Desc> = descs
            .iter()
            .map(|d| Desc {
                local_addr: d.local_addr - src.as_ptr() as u64 + back.as_ptr() as u64,
                ..*d
            })
            .collect();
        session.transfer(Op::Read, &reads).await.unwrap();
        for &(off, n) in &pieces {
            let r = off as usize..(off + n) as usize;
            assert!(back[r.clone()] == src[r], "read back at {off}");
        }
        assert_eq!(target.shm_stats().links_served, 1);
        assert_eq!(target.shm_stats().peers, 1);
        session.close().await;
    });
}

#[test]
fn both_ends_check_bounds_on_the_shared_path() {
    block_on(async {
        let target = bind(config(ShmMode::Require));
        let initiator = bind(config(ShmMode::Require));
        let there = shared(&target, 1 << 16, 0);
        let mut src = vec![1u8; 1 << 16];
        private(&initiator, &mut src);
        let session = open(&initiator, &target).await.unwrap();
        let base = there.as_ptr() as u64;
        // Past the end of the target's region: refused, nothing moves.
        let over = [Desc {
            local_addr: src.as_ptr() as u64,
            remote_addr: base + (1 << 16) - 8,
            len_bytes: 16,
        }];
        let e = session.transfer(Op::Write, &over).await.unwrap_err();
        assert!(
            matches!(e, TransportError::Peer(PeerError::ShmRefused(_))),
            "{e}"
        );
        // Outside this side's registered memory.
        let local_bad = [Desc {
            local_addr: src.as_ptr() as u64 + (1 << 16),
            remote_addr: base,
            len_bytes: 1,
        }];
        let e = session.transfer(Op::Write, &local_bad).await.unwrap_err();
        assert!(
            matches!(
                e,
                TransportError::Misuse(MisuseError::LocalDescriptor { .. })
            ),
            "{e}"
        );
        assert!(bytes(&there).iter().all(|&b| b == 0), "no byte moved");
    });
}

#[test]
fn auto_uses_tcp_when_the_target_shares_nothing_and_require_refuses() {
    block_on(async {
        let target = bind(config(ShmMode::Auto));
        let mut dst = vec![0u8; 4096];
        private(&target, &mut dst);
        let initiator = bind(config(ShmMode::Auto));
        let mut src = vec![7u8; 4096];
        private(&initiator, &mut src);
        let session = open(&initiator, &target).await.unwrap();
        assert!(!session.uses_shm(), "private memory is not shared");
        let d = [Desc {
            local_addr: src.as_ptr() as u64,
            remote_addr: dst.as_ptr() as u64,
            len_bytes: 4096,
        }];
        session.transfer(Op::Write, &d).await.unwrap();
        assert!(dst.iter().all(|&b| b == 7), "moved over tcp");
        let strict = bind(config(ShmMode::Require));
        let e = open(&strict, &target).await.err().expect("refused");
        assert!(
            matches!(
                e,
                TransportError::Peer(PeerError::ShmRefused(ShmRefusal::NotOffered))
            ),
            "{e}"
        );
    });
}

#[test]
fn a_peer_claiming_another_host_gets_no_memory() {
    block_on(async {
        let target = bind(config(ShmMode::Auto));
        let there = shared(&target, 4096, 0);
        let mut elsewhere = config(ShmMode::Auto);
        elsewhere.shm.boot_id_override = Some(*b"00000000-0000-0000-0000-000000000000");
        let initiator = bind(elsewhere.clone());
        let mut src = vec![3u8; 4096];
        private(&initiator, &mut src);
        let session = open(&initiator, &target).await.unwrap();
        assert!(!session.uses_shm());
        assert_eq!(target.shm_stats().links_served, 0);
        assert_eq!(target.shm_stats().refused, 1, "the hello was refused");
        // Still served over tcp.
        let d = [Desc {
            local_addr: src.as_ptr() as u64,
            remote_addr: there.as_ptr() as u64,
            len_bytes: 4096,
        }];
        session.transfer(Op::Write, &d).await.unwrap();
        assert!(bytes(&there).iter().all(|&b| b == 3));
        elsewhere.shm.mode = ShmMode::Require;
        let strict = bind(elsewhere);
        assert!(open(&strict, &target).await.is_err());
    });
}

#[test]
fn a_region_larger_than_its_file_or_an_unsealed_file_is_refused() {
    let t = LocalExecutorBuilder::new(Placement::Unbound)
        .make()
        .unwrap()
        .run(async {
            let t = bind(config(ShmMode::Auto));
            let mem = SharedMem::new("kvferry-test", 8192).unwrap();
            // SAFETY: refused before anything uses the range.
            let e = unsafe { t.register_shared(mem.as_ptr(), 8192, mem.fd(), 4096) };
            let e = e.expect_err("past the file's end");
            assert!(e.to_string().contains("cannot hold"), "{e}");
            // A memfd without seals: a peer could be made to fault.
            // SAFETY: a fresh memfd nobody else owns.
            let raw = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
            assert!(raw >= 0);
            // SAFETY: `raw` is ours.
            let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
            std::fs::File::from(fd.try_clone().unwrap())
                .set_len(8192)
                .unwrap();
            let e =
                unsafe { t.register_shared(mem.as_ptr(), 4096, std::os::fd::AsFd::as_fd(&fd), 0) };
            let e = e.expect_err("unsealed");
            assert!(e.to_string().contains("not sealed"), "{e}");
            assert!(t.regions().is_empty(), "nothing stays registered");
            t
        });
    drop(t);
}

#[test]
fn a_late_copy_into_a_fenced_block_is_refused_and_the_block_untouched() {
    block_on(async {
        let target = bind(config(ShmMode::Require));
        let initiator = bind(config(ShmMode::Require));
        // 4 blocks of 64 KiB.
        let block = 64 << 10;
        let there = shared(&target, 4 * block, 0xEE);
        let fence = Rc::new(BlockFence::new(&[(there.as_ptr() as u64, block as u64)], 4));
        fence.open([0u32, 1, 2, 3]);
        target.set_fence(Some(Rc::clone(&fence)));
        let mut src = vec![9u8; block];
        private(&initiator, &mut src);
        let session = open(&initiator, &target).await.unwrap();
        let to = |b: u64| {
            [Desc {
                local_addr: src.as_ptr() as u64,
                remote_addr: there.as_ptr() as u64 + b * block as u64,
                len_bytes: block as u64,
            }]
        };
        session.transfer(Op::Write, &to(0)).await.unwrap();
        // Block 1's request ended: the target closed it.
        fence.close([1u32]);
        let e = session.transfer(Op::Write, &to(1)).await.unwrap_err();
        assert!(matches!(e, TransportError::Fenced { .. }), "{e}");
        session.transfer(Op::Write, &to(2)).await.unwrap();
        let mem = bytes(&there);
        assert!(mem[..block].iter().all(|&b| b == 9), "block 0 written");
        assert!(
            mem[block..2 * block].iter().all(|&b| b == 0xEE),
            "block 1 untouched after its close"
        );
        assert!(mem[2 * block..3 * block].iter().all(|&b| b == 9));
        // Reads are fenced alike.
        let mut back = vec![0u8; block];
        private(&initiator, &mut back);
        let read = [Desc {
            local_addr: back.as_ptr() as u64,
            remote_addr: there.as_ptr() as u64 + block as u64,
            len_bytes: 1,
        }];
        assert!(session.transfer(Op::Read, &read).await.is_err());
        assert_eq!(back[0], 0);
    });
}

#[test]
fn a_new_fence_or_region_retires_the_old_map_and_peers_map_again() {
    block_on(async {
        let target = bind(config(ShmMode::Require));
        let initiator = bind(config(ShmMode::Require));
        let a = shared(&target, 4096, 0);
        let mut src = vec![5u8; 4096];
        private(&initiator, &mut src);
        let session = open(&initiator, &target).await.unwrap();
        let d = |mem: &SharedMem| {
            [Desc {
                local_addr: src.as_ptr() as u64,
                remote_addr: mem.as_ptr() as u64,
                len_bytes: 4096,
            }]
        };
        session.transfer(Op::Write, &d(&a)).await.unwrap();
        // A second region: the old map does not know it; the link is made again.
        let b = shared(&target, 4096, 0);
        session.transfer(Op::Write, &d(&b)).await.unwrap();
        assert!(bytes(&b).iter().all(|&x| x == 5));
        assert_eq!(target.shm_stats().links_served, 2);
        // A fence with every block closed: the retired map is not used.
        let fence = Rc::new(BlockFence::new(&[(a.as_ptr() as u64, 4096)], 1));
        target.set_fence(Some(Rc::clone(&fence)));
        let e = session.transfer(Op::Write, &d(&a)).await.unwrap_err();
        assert!(matches!(e, TransportError::Fenced { .. }), "{e}");
        fence.open([0u32]);
        session.transfer(Op::Write, &d(&a)).await.unwrap();
        assert_eq!(target.shm_stats().links_served, 3);
    });
}

#[test]
fn a_fence_too_large_to_share_leaves_the_peer_on_tcp() {
    block_on(async {
        let target = bind(config(ShmMode::Auto));
        let there = shared(&target, 4096, 0);
        // 2^40 blocks of 16 bytes: more slots than a control file holds.
        let fence = Rc::new(BlockFence::new(&[(there.as_ptr() as u64, 16)], 1 << 40));
        fence.open([0u32]);
        target.set_fence(Some(Rc::clone(&fence)));
        let initiator = bind(config(ShmMode::Auto));
        let mut src = vec![4u8; 16];
        private(&initiator, &mut src);
        let session = open(&initiator, &target).await.unwrap();
        assert!(!session.uses_shm());
        let d = [Desc {
            local_addr: src.as_ptr() as u64,
            remote_addr: there.as_ptr() as u64,
            len_bytes: 16,
        }];
        session.transfer(Op::Write, &d).await.unwrap();
        assert!(
            bytes(&there)[..16].iter().all(|&b| b == 4),
            "moved over tcp"
        );
        let strict = bind(config(ShmMode::Require));
        assert!(open(&strict, &target).await.is_err());
    });
}

#[test]
fn a_batch_splits_between_shared_pages_and_private_edges() {
    block_on(async {
        // An engine's buffer, allocated by the engine (here an anonymous
        // mapping, unaligned inside it), its whole pages moved onto a file
        // in place: the edges stay private.
        let len = 6 * 4096;
        // SAFETY: a fresh anonymous mapping, unmapped at the end.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        let buf = (map as u64 + 100, len as u64 - 200);
        // SAFETY: inside our mapping, untouched meanwhile.
        let file = unsafe { kvferry::transport::share_pages(buf.0 as *mut u8, buf.1 as usize) };
        let _file = file.unwrap().expect("whole pages inside");
        let target = bind(config(ShmMode::Auto));
        // SAFETY: the mapping outlives the endpoint.
        unsafe { target.register(buf.0 as *mut u8, buf.1 as usize).unwrap() };
        let initiator = bind(config(ShmMode::Auto));
        let mut src: Vec<u8> = (0..buf.1).map(|i| (i % 253) as u8).collect();
        private(&initiator, &mut src);
        let session = open(&initiator, &target).await.unwrap();
        assert!(session.uses_shm());
        // The whole pages are the mapping's pages 1 to 4: from byte 3996
        // of the buffer to byte 20 380; the bytes around them are private.
        let cuts = [0u64, 3996, 10_000, 20_380, buf.1];
        let descs: Vec<Desc> = cuts
            .windows(2)
            .map(|w| Desc {
                local_addr: src.as_ptr() as u64 + w[0],
                remote_addr: buf.0 + w[0],
                len_bytes: w[1] - w[0],
            })
            .collect();
        session.transfer(Op::Write, &descs).await.unwrap();
        let copied = session.shm_copied_bytes();
        assert_eq!(copied, 4 * 4096, "the whole pages through shared memory");
        // SAFETY: no transfer runs now.
        let there = unsafe { std::slice::from_raw_parts(buf.0 as *const u8, buf.1 as usize) };
        assert!(there == &src[..], "every byte, edges over tcp");
        session.close().await;
        drop((target, initiator));
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(map, len) };
    });
}
