//! The `mooncake` transport on its own, over the fake engine library
//! (`mooncake-sys/csrc/fake_te.c`): both-ends bounds checks before anything
//! is submitted, random batches both ways with every byte checked, and a
//! submit path that allocates nothing per descriptor (a counting global
//! allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use glommio::{LocalExecutorBuilder, Placement};
use kvferry::transport::{
    Desc, MisuseError, Op, RangeFault, RegionInfo, Session, Transport, TransportError,
};
use kvferry::transport::{MooncakeConfig, MooncakeTransport};
use mooncake_sys::fake;

/// Counts allocations, per thread.
struct Counting;

thread_local! {
    /// Allocations made by this thread: the tests of this binary run in
    /// parallel, and only the submitting thread's count is the measure.
    static ALLOCS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Allocations made by this thread so far.
fn allocs() -> u64 {
    ALLOCS.with(std::cell::Cell::get)
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // A const-initialised `Cell` has no destructor: always accessible.
        let _ = ALLOCS.try_with(|a| a.set(a.get() + 1));
        // SAFETY: forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|a| a.set(a.get() + 1));
        // SAFETY: forwarded. The system's zeroed allocation leaves large
        // blocks' pages untouched until written (the stores' arenas).
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

type Fake = fake::Shared;

fn fake() -> (&'static Fake, std::sync::MutexGuard<'static, ()>) {
    fake::shared(&PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mooncake-fake-transport"))
}

fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    LocalExecutorBuilder::new(Placement::Unbound)
        .make()
        .expect("executor")
        .run(f)
}

fn endpoint(f: &Fake) -> MooncakeTransport {
    let cfg = MooncakeConfig {
        library: Some(f.path.clone()),
        ..MooncakeConfig::default()
    };
    MooncakeTransport::new("127.0.0.1".parse().unwrap(), cfg).unwrap()
}

const LEN: usize = 1 << 20;

/// Two endpoints, `a` knowing `b`'s buffer as its peer's memory.
struct Pair {
    a: MooncakeTransport,
    b: MooncakeTransport,
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Pair {
    fn new(f: &Fake) -> Pair {
        let (a, b) = (endpoint(f), endpoint(f));
        let mut src = vec![0u8; LEN];
        fastrand::Rng::with_seed(7).fill(&mut src);
        let mut p = Pair {
            a,
            b,
            src,
            dst: vec![0u8; LEN],
        };
        // SAFETY: the buffers outlive the endpoints (fields drop in order:
        // the endpoints first).
        unsafe {
            p.a.register(p.src.as_mut_ptr(), LEN).unwrap();
            p.b.register(p.dst.as_mut_ptr(), LEN).unwrap();
        }
        let peer = RegionInfo {
            addr: p.dst.as_ptr() as u64,
            len_bytes: LEN as u64,
        };
        p.a.learn_peer(&p.b.endpoint_addr(), vec![peer]);
        p
    }

    fn desc(&self, off: u64, len: u64) -> Desc {
        Desc {
            local_addr: self.src.as_ptr() as u64 + off,
            remote_addr: self.dst.as_ptr() as u64 + off,
            len_bytes: len,
        }
    }
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

#[test]
fn ranges_outside_registered_memory_are_refused_before_submit() {
    let (f, _one) = fake();
    let before = f.control.stats();
    block_on(async {
        let p = Pair::new(f);
        let s = p.a.open(&p.b.endpoint_addr()).await.unwrap();
        let past_end = p.desc(LEN as u64 - 8, 16);
        let mut local_out = p.desc(0, 8);
        local_out.local_addr -= 1;
        let empty = p.desc(0, 0);
        // Past both buffers' ends, before the local one, empty.
        for d in [past_end, local_out, empty] {
            let r = s
                .transfer_until(Op::Write, &[p.desc(0, 8), d], None, deadline())
                .await;
            match r {
                Err(TransportError::Misuse(
                    MisuseError::LocalDescriptor { index: 1, fault }
                    | MisuseError::RemoteDescriptor { index: 1, fault },
                )) => assert!(matches!(fault, RangeFault::OutOfRegion | RangeFault::Empty)),
                other => panic!("{d:?}: {other:?}"),
            }
        }
        // Remote only: the local side is fine, the peer's memory is not.
        let mut remote_out = p.desc(0, 8);
        remote_out.remote_addr += LEN as u64;
        let r = s
            .transfer_until(Op::Read, &[remote_out], None, deadline())
            .await;
        assert!(
            matches!(
                r,
                Err(TransportError::Misuse(MisuseError::RemoteDescriptor {
                    index: 0,
                    ..
                }))
            ),
            "{r:?}"
        );
        // A peer whose memory was never announced: every range is refused.
        let c = endpoint(f);
        let s2 = p.a.open(&c.endpoint_addr()).await.unwrap();
        let r = s2
            .transfer_until(Op::Write, &[p.desc(0, 8)], None, deadline())
            .await;
        assert!(matches!(
            r,
            Err(TransportError::Misuse(MisuseError::RemoteDescriptor { .. }))
        ));
    });
    let now = f.control.stats();
    assert_eq!(now.tasks, before.tasks, "nothing reached the library");
    assert_eq!(now.submits_refused, before.submits_refused);
}

#[test]
fn random_batches_move_every_byte_both_ways() {
    let (f, _one) = fake();
    let before = f.control.stats();
    block_on(async {
        let mut p = Pair::new(f);
        let s = p.a.open(&p.b.endpoint_addr()).await.unwrap();
        let mut rng = fastrand::Rng::with_seed(3);
        let mut descs = Vec::new();
        let mut off = 0u64;
        while off < LEN as u64 - 4096 {
            let len = rng.u64(1..2048);
            descs.push(p.desc(off, len));
            off += len + rng.u64(0..3);
        }
        s.transfer_until(Op::Write, &descs, None, deadline())
            .await
            .unwrap();
        for d in &descs {
            let at = (d.local_addr - p.src.as_ptr() as u64) as usize;
            let n = d.len_bytes as usize;
            assert_eq!(p.dst[at..at + n], p.src[at..at + n], "write at {at}");
        }
        let want = p.src.clone();
        p.src.fill(0);
        s.transfer_until(Op::Read, &descs, None, deadline())
            .await
            .unwrap();
        for d in &descs {
            let at = (d.local_addr - p.src.as_ptr() as u64) as usize;
            let n = d.len_bytes as usize;
            assert_eq!(p.src[at..at + n], want[at..at + n], "read at {at}");
        }
    });
    let now = f.control.stats();
    assert_eq!(now.allocated - before.allocated, now.freed - before.freed);
    assert_eq!(now.tasks_refused, before.tasks_refused);
}

/// Allocations of one warm batch of `n` descriptors (the fake library
/// allocates one block per batch, as the real one does).
async fn allocs_of(p: &Pair, s: &impl Session, n: u64) -> u64 {
    let descs: Vec<Desc> = (0..n).map(|i| p.desc(i * 64, 32)).collect();
    // Warm: the reused request buffer grows to this size once.
    s.transfer_until(Op::Write, &descs, None, deadline())
        .await
        .unwrap();
    let before = allocs();
    s.transfer_until(Op::Write, &descs, None, deadline())
        .await
        .unwrap();
    allocs() - before
}

#[test]
fn the_submit_path_allocates_nothing_per_descriptor() {
    let (f, _one) = fake();
    block_on(async {
        let p = Pair::new(f);
        let s = p.a.open(&p.b.endpoint_addr()).await.unwrap();
        let few = allocs_of(&p, &s, 8).await;
        let many = allocs_of(&p, &s, 8192).await;
        assert_eq!(few, many, "allocations of 8 and of 8192 descriptors");
    });
}
