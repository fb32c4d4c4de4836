//! The safe wrapper against the fake `libtransfer_engine.so`
//! (`csrc/fake_te.c`), compiled here and loaded by path as the real one
//! is: bytes moved both ways, every fault's effect on a batch, and batch
//! ids always freed (allocated = freed after each test, error paths
//! included).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use mooncake_sys::fake::{self, Control, Fault, Stats};
use mooncake_sys::ffi::{TransferRequest, OPCODE_READ, OPCODE_WRITE};
use mooncake_sys::{Engine, EngineConfig, Error, Registration, Segment, TaskState, TeLib};

const LEN: usize = 64 << 10;

struct Fake {
    path: PathBuf,
    lib: Arc<TeLib>,
    control: Control,
}

/// The fake library, built once; its faults and counters are process-wide,
/// so each test holds the lock for its whole run.
fn fake() -> (&'static Fake, MutexGuard<'static, ()>) {
    static FAKE: OnceLock<Fake> = OnceLock::new();
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let f = FAKE.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mooncake-fake");
        let path = fake::build(&dir).expect("the fake library builds");
        let lib = Arc::new(TeLib::open(&path).expect("the fake library loads"));
        let control = Control::open(&path).unwrap();
        Fake { path, lib, control }
    });
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    f.control.disarm();
    (f, guard)
}

fn engine(f: &Fake) -> Engine {
    let cfg = EngineConfig::p2p("127.0.0.1", "tcp");
    Engine::new(f.lib.clone(), &cfg).unwrap()
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// Two engines, each with one registered buffer, the second's segment
/// open on the first, and requests from the first to the second. Fields
/// drop in order: the segment and registrations before the buffers.
struct Pair {
    seg: Segment,
    _regs: [Registration; 2],
    a: Engine,
    /// Kept alive for its segment (the registrations hold it too).
    _b: Engine,
    abuf: Vec<u8>,
    bbuf: Vec<u8>,
}

impl Pair {
    fn new(f: &Fake) -> Pair {
        let (a, b) = (engine(f), engine(f));
        let (mut abuf, mut bbuf) = (pattern(1), vec![0; LEN]);
        // SAFETY: the buffers outlive the registrations (see the fields'
        // order); moving a `Vec` does not move its heap buffer.
        let regs = unsafe {
            [
                a.register(abuf.as_mut_ptr(), LEN, "cpu:0").unwrap(),
                b.register(bbuf.as_mut_ptr(), LEN, "cpu:0").unwrap(),
            ]
        };
        let seg = a.open_segment(&b.local_addr().unwrap()).unwrap();
        Pair {
            seg,
            _regs: regs,
            a,
            _b: b,
            abuf,
            bbuf,
        }
    }

    fn request(&self, opcode: i32) -> TransferRequest {
        TransferRequest {
            opcode,
            source: self.abuf.as_ptr() as *mut _,
            target_id: self.seg.id(),
            target_offset: self.bbuf.as_ptr() as u64,
            length: LEN as u64,
        }
    }
}

/// Waits (polling) until task 0 finishes; the fake finishes in a bounded
/// number of polls unless a task is armed `Never`.
fn finish(batch: &mooncake_sys::Batch, polls: usize) -> TaskState {
    for _ in 0..polls {
        let s = batch.status(0).unwrap();
        if s.is_finished() {
            return s;
        }
    }
    batch.status(0).unwrap()
}

fn balanced(c: &Control, before: Stats) {
    let now = c.stats();
    assert_eq!(
        now.allocated - before.allocated,
        now.freed - before.freed,
        "every batch allocated was freed"
    );
}

#[test]
fn a_write_and_a_read_move_every_byte() {
    let (f, _one) = fake();
    let before = f.control.stats();
    let mut p = Pair::new(f);
    let mut w = p.a.batch(1).unwrap();
    // SAFETY: both ranges are registered and outlive the batch.
    unsafe { w.submit(&[p.request(OPCODE_WRITE)]) }.unwrap();
    let done = finish(&w, 1);
    assert_eq!(done, TaskState::Completed { bytes: LEN as u64 });
    w.try_free().map_err(|(_, e)| e).unwrap();
    assert_eq!(p.bbuf, pattern(1), "the write landed");
    // Read it back over a cleared source.
    p.abuf.fill(0);
    let mut r = p.a.batch(1).unwrap();
    // SAFETY: as above.
    unsafe { r.submit(&[p.request(OPCODE_READ)]) }.unwrap();
    assert_eq!(finish(&r, 1), TaskState::Completed { bytes: LEN as u64 });
    drop(r);
    assert_eq!(p.abuf, pattern(1), "the read landed");
    drop(p);
    balanced(&f.control, before);
    assert_eq!(f.control.stats().submits_refused, before.submits_refused);
}

#[test]
fn faults_end_tasks_as_the_library_reports_them() {
    let (f, _one) = fake();
    let before = f.control.stats();
    let p = Pair::new(f);
    let run = |fault: Fault| {
        f.control.arm(fault, 1);
        let mut b = p.a.batch(1).unwrap();
        // SAFETY: registered ranges that outlive the batch.
        let submitted = unsafe { b.submit(&[p.request(OPCODE_WRITE)]) };
        submitted.map(|()| finish(&b, 4))
    };
    assert!(matches!(
        run(Fault::SubmitFail),
        Err(Error::Call {
            call: "submitTransfer",
            ..
        })
    ));
    assert!(matches!(run(Fault::TaskFailed), Ok(TaskState::Failed(6))));
    assert!(matches!(run(Fault::TaskTimeout), Ok(TaskState::Failed(5))));
    // A task that never finishes is still pending after its polls (its
    // batch kept by the engine until it ends); one a millisecond late
    // completes once polled past its time.
    assert_eq!(run(Fault::Never), Ok(TaskState::Pending));
    f.control.finish_never();
    assert_eq!(p.a.reap(), 0);
    f.control.arm(Fault::Late(1), 1);
    let mut b = p.a.batch(1).unwrap();
    // SAFETY: registered ranges that outlive the batch.
    unsafe { b.submit(&[p.request(OPCODE_WRITE)]) }.unwrap();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut state = b.status(0).unwrap();
    while !state.is_finished() && std::time::Instant::now() < until {
        state = b.status(0).unwrap();
    }
    assert_eq!(state, TaskState::Completed { bytes: LEN as u64 });
    drop(b);
    let short = LEN as u64 - 1;
    assert_eq!(
        run(Fault::WrongBytes),
        Ok(TaskState::Completed { bytes: short })
    );
    balanced(&f.control, before);
}

#[test]
fn a_batch_dropped_unfinished_is_freed_once_its_task_finishes() {
    let (f, _one) = fake();
    let before = f.control.stats();
    let p = Pair::new(f);
    f.control.arm(Fault::Never, 1);
    let mut b = p.a.batch(1).unwrap();
    // SAFETY: registered ranges that outlive the batch.
    unsafe { b.submit(&[p.request(OPCODE_WRITE)]) }.unwrap();
    assert_eq!(b.status(0).unwrap(), TaskState::Pending);
    let (b, e) = b.try_free().expect_err("an unfinished batch is not freed");
    assert_eq!(e, Error::BatchBusy);
    drop(b);
    assert_eq!(p.a.reap(), 1, "kept by the engine while unfinished");
    assert_eq!(f.control.stats().freed, before.freed);
    f.control.finish_never();
    assert_eq!(p.a.reap(), 0, "freed once finished");
    assert_eq!(p.bbuf, vec![0; LEN], "a never-finished task moved nothing");
    balanced(&f.control, before);
}

#[test]
fn a_batch_takes_no_more_tasks_than_it_was_allocated_for() {
    let (f, _one) = fake();
    let before = f.control.stats();
    let p = Pair::new(f);
    let mut b = p.a.batch(1).unwrap();
    let req = p.request(OPCODE_WRITE);
    // SAFETY: registered ranges that outlive the batch.
    let over = unsafe { b.submit(&[req, req]) };
    assert_eq!(
        over,
        Err(Error::BatchOverflow {
            capacity: 1,
            asked: 2
        })
    );
    assert!(matches!(b.status(0), Err(Error::BatchOverflow { .. })));
    drop(b);
    balanced(&f.control, before);
    assert_eq!(
        f.control.stats().tasks,
        before.tasks,
        "nothing was submitted"
    );
}

#[test]
fn a_missing_library_and_a_missing_symbol_are_typed_errors() {
    let (f, _one) = fake();
    let missing = PathBuf::from("/nonexistent/libtransfer_engine.so");
    match TeLib::open(&missing) {
        Err(Error::LibraryNotFound { tried }) => {
            assert_eq!(tried.len(), 1);
            assert!(
                tried[0].starts_with("/nonexistent/libtransfer_engine.so: "),
                "{tried:?}"
            );
        }
        other => panic!("{:?}", other.err()),
    }
    // The fake transfer engine is not a store library.
    match mooncake_sys::StoreLib::open(&f.path) {
        Err(Error::MissingSymbol { symbol, library }) => {
            assert_eq!(symbol, "mooncake_store_create");
            assert_eq!(library, f.path.to_string_lossy());
        }
        other => panic!("{:?}", other.err()),
    }
}
