//! The `local` transport: memcpy between registered regions of two
//! in-process endpoints, with the same validation as `tcp`.

use glommio::{LocalExecutorBuilder, Placement};
use kvferry::transport::LocalTransport;
use kvferry::transport::{
    AnyTransport, Desc, EndpointAddr, MisuseError, Op, RangeFault, Session, Transport,
    TransportError,
};

fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    LocalExecutorBuilder::new(Placement::Unbound)
        .make()
        .expect("executor")
        .run(f)
}

fn random(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut v);
    v
}

#[test]
fn random_batches_both_directions() {
    block_on(async {
        let a = LocalTransport::default();
        let b = LocalTransport::default();
        let mut src = random(8 << 20, 1);
        let mut dst = vec![0xA5u8; 8 << 20];
        let mut back = vec![0u8; 8 << 20];
        // SAFETY: the buffers outlive both endpoints and are only read after
        // the transfers complete.
        unsafe {
            a.register(src.as_mut_ptr(), src.len()).unwrap();
            a.register(back.as_mut_ptr(), back.len()).unwrap();
            b.register(dst.as_mut_ptr(), dst.len()).unwrap();
        }
        let session = a.open(&b.endpoint_addr()).await.unwrap();
        let mut rng = fastrand::Rng::with_seed(2);
        // 3000 random disjoint pieces, 1 byte to ~2 KiB, plus one of 2 MiB.
        let mut descs = Vec::new();
        let mut off = 0u64;
        while descs.len() < 3000 {
            let len = rng.u64(1..2048);
            descs.push(Desc {
                local_addr: src.as_ptr() as u64 + off,
                remote_addr: dst.as_ptr() as u64 + off,
                len_bytes: len,
            });
            off += len + rng.u64(0..3);
        }
        descs.push(Desc {
            local_addr: src.as_ptr() as u64 + off,
            remote_addr: dst.as_ptr() as u64 + off,
            len_bytes: 2 << 20,
        });
        session.transfer(Op::Write, &descs).await.unwrap();
        let mut expected = vec![0xA5u8; dst.len()];
        for d in &descs {
            let o = (d.local_addr - src.as_ptr() as u64) as usize;
            expected[o..o + d.len_bytes as usize]
                .copy_from_slice(&src[o..o + d.len_bytes as usize]);
        }
        assert!(dst == expected);
        let reads: Vec<Desc> = descs
            .iter()
            .map(|d| Desc {
                local_addr: d.local_addr - src.as_ptr() as u64 + back.as_ptr() as u64,
                ..*d
            })
            .collect();
        session.transfer(Op::Read, &reads).await.unwrap();
        for d in &descs {
            let o = (d.local_addr - src.as_ptr() as u64) as usize;
            assert_eq!(
                &back[o..o + d.len_bytes as usize],
                &src[o..o + d.len_bytes as usize]
            );
        }
        session.close().await;
    });
}

#[test]
fn bad_descriptors_fail_typed_and_move_nothing() {
    block_on(async {
        let a = AnyTransport::Local(LocalTransport::default());
        let b = LocalTransport::default();
        let mut src = random(4096, 3);
        let mut dst = vec![0u8; 4096];
        // SAFETY: as above.
        let (_, dst_region) = unsafe {
            (
                a.register(src.as_mut_ptr(), 4096).unwrap(),
                b.register(dst.as_mut_ptr(), 4096).unwrap(),
            )
        };
        let session = a.open(&b.endpoint_addr()).await.unwrap();
        let base = |i: u64| Desc {
            local_addr: src.as_ptr() as u64 + i * 16,
            remote_addr: dst.as_ptr() as u64 + i * 16,
            len_bytes: 16,
        };
        let cases = [
            (
                Desc {
                    remote_addr: dst.as_ptr() as u64 + 4090,
                    ..base(0)
                },
                TransportError::Misuse(MisuseError::RemoteDescriptor {
                    index: 5,
                    fault: RangeFault::OutOfRegion,
                }),
            ),
            (
                Desc {
                    local_addr: src.as_ptr() as u64 - 1,
                    ..base(0)
                },
                TransportError::Misuse(MisuseError::LocalDescriptor {
                    index: 5,
                    fault: RangeFault::OutOfRegion,
                }),
            ),
            (
                Desc {
                    len_bytes: 0,
                    ..base(0)
                },
                TransportError::Misuse(MisuseError::LocalDescriptor {
                    index: 5,
                    fault: RangeFault::Empty,
                }),
            ),
            (
                Desc {
                    remote_addr: u64::MAX,
                    ..base(0)
                },
                TransportError::Misuse(MisuseError::RemoteDescriptor {
                    index: 5,
                    fault: RangeFault::Overflow,
                }),
            ),
        ];
        for (bad, want) in cases {
            let mut descs: Vec<Desc> = (0..10).map(base).collect();
            descs[5] = bad;
            for op in [Op::Write, Op::Read] {
                let err = session.transfer(op, &descs).await.unwrap_err();
                assert_eq!(format!("{err:?}"), format!("{want:?}"));
            }
            assert!(dst.iter().all(|&x| x == 0), "a rejected batch moved bytes");
        }
        assert!(src == random(4096, 3), "a rejected read moved bytes");
        // Unregistered memory is unreachable; a dropped peer is unreachable.
        b.unregister(dst_region).unwrap();
        let err = session.transfer(Op::Write, &[base(0)]).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Misuse(MisuseError::RemoteDescriptor { index: 0, .. })
            ),
            "{err:?}"
        );
        let gone = b.endpoint_addr();
        drop(b);
        let err = a
            .open(&gone)
            .await
            .err()
            .expect("open to a dropped endpoint");
        assert!(
            matches!(
                err,
                TransportError::Misuse(MisuseError::UnreachableEndpoint(_))
            ),
            "{err:?}"
        );
        let err = a
            .open(&EndpointAddr::Tcp("127.0.0.1:1".parse().unwrap()))
            .await
            .err()
            .unwrap();
        assert!(
            matches!(
                err,
                TransportError::Misuse(MisuseError::UnreachableEndpoint(_))
            ),
            "{err:?}"
        );
        assert_eq!(
            "local://7".parse::<EndpointAddr>().unwrap(),
            EndpointAddr::Local(7)
        );
        assert!("udp://x".parse::<EndpointAddr>().is_err());
    });
}
