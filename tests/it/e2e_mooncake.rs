//! End-to-end over the `mooncake` transport: prefill and decode nodes in
//! one process, real side channel, the fake `libtransfer_engine.so`
//! (`mooncake-sys/csrc/fake_te.c`, compiled here and loaded by path as the
//! real library is) moving the bytes. Every byte is verified; every batch
//! id the library handed out is freed, also after faults; a task the
//! library finishes late keeps its request's blocks until it finished; a
//! task that never finishes ends its request at the transfer bound.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvferry::machines::internal::common::{Config, FailReason, Mode};
use kvferry::machines::Phase;
use kvferry::node::TransportKind;
use kvferry::transport::{Cadence, MooncakeConfig};
use kvferry::TransferId;
use kvferry_testkit::e2e_timeouts;
use kvferry_testkit::model;
use kvferry_testkit::synth::{Cluster, ClusterSpec};
use mooncake_sys::fake::{self, Control, Fault, Stats};

/// The transfer bound of these tests; a batch must finish `LINGER` before it.
const BOUND: Duration = Duration::from_secs(3);
const LINGER: Duration = Duration::from_secs(2);
/// How late a late task completes: after its batch failed (`BOUND -
/// LINGER`), well before the bound.
const LATE_MS: i64 = 1_500;

type Fake = fake::Shared;

fn fake() -> (&'static Fake, std::sync::MutexGuard<'static, ()>) {
    fake::shared(&PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mooncake-fake-e2e"))
}

fn timeouts() -> Config {
    Config {
        transfer_bound: BOUND,
        ..e2e_timeouts()
    }
}

fn spec(f: &Fake, mode: Mode, p_tp: u32, d_tp: u32) -> ClusterSpec {
    ClusterSpec {
        mooncake: MooncakeConfig {
            library: Some(f.path.clone()),
            linger: LINGER,
            cadence: Cadence::Timer(Duration::from_micros(200)),
            ..MooncakeConfig::default()
        },
        prefill_tp: p_tp,
        decode_tp: d_tp,
        transport: TransportKind::Mooncake,
        timeouts: timeouts(),
        ..ClusterSpec::new(model::small(), mode)
    }
}

const SRC: [u32; 3] = [1, 4, 9];
const DST: [u32; 3] = [30, 2, 17];

/// Starts request `tid` (filled on prefill, cleared on decode).
fn start(c: &Cluster, tid: u64) {
    c.fill(TransferId(tid), &SRC);
    for r in &c.decode {
        r.kv.clear(&DST);
    }
    c.start_request(TransferId(tid), &SRC, &DST, 0).unwrap();
}

/// Runs request `tid` to its end on every rank; the decode phases.
fn run(c: &Cluster, tid: u64) -> Vec<Phase> {
    start(c, tid);
    let d = c.wait_decode(TransferId(tid), Duration::from_secs(20));
    let p = c.wait_prefill(TransferId(tid), Duration::from_secs(20));
    assert!(p.iter().all(Phase::is_terminal), "prefill of {tid}: {p:?}");
    d
}

fn assert_balanced(control: &Control, before: Stats, what: &str) {
    let now = control.stats();
    assert_eq!(
        now.allocated - before.allocated,
        now.freed - before.freed,
        "{what}: every batch id allocated was freed"
    );
    assert!(
        now.allocated > before.allocated,
        "{what}: the engine moved the bytes"
    );
}

fn assert_in_bounds(control: &Control, before: Stats) {
    let now = control.stats();
    assert_eq!(
        now.submits_refused, before.submits_refused,
        "no local range outside registered memory"
    );
    assert_eq!(
        now.tasks_refused, before.tasks_refused,
        "no remote range outside registered memory"
    );
}

fn moves_every_byte(mode: Mode, p_tp: u32, d_tp: u32) {
    let (f, _one) = fake();
    let before = f.control.stats();
    let c = Cluster::start(&spec(f, mode, p_tp, d_tp)).expect("cluster starts");
    for tid in 1..=4 {
        let phases = run(&c, tid);
        assert!(
            phases.iter().all(|p| *p == Phase::Success),
            "{tid}: {phases:?}"
        );
        assert_eq!(
            c.verify(TransferId(tid), &DST, 0),
            0,
            "{tid}: bytes on decode"
        );
    }
    drop(c);
    assert_balanced(&f.control, before, "clean run");
    assert_in_bounds(&f.control, before);
}

#[test]
fn device_kv_is_registered_at_the_devices_location() {
    // Decode's KV in a stand-in device's memory: the node registers it
    // with the engine at the device's location (`host:0` here, `cuda:N`
    // on a GPU), where the engine moves device memory itself.
    let (f, _one) = fake();
    let before = f.control.stats();
    let dev = kvferry::transport::HostDevice::new(0, Duration::ZERO);
    let c = Cluster::start_on(&spec(f, Mode::Push, 1, 1), [None, Some(dev)]).expect("cluster");
    let phases = run(&c, 77);
    assert!(phases.iter().all(|p| *p == Phase::Success), "{phases:?}");
    assert_eq!(c.verify(TransferId(77), &DST, 0), 0, "bytes on decode");
    drop(c);
    let now = f.control.stats();
    assert!(now.device_regions > before.device_regions, "{now:?}");
    assert_balanced(&f.control, before, "device run");
    assert_in_bounds(&f.control, before);
}

#[test]
fn push_moves_every_byte() {
    moves_every_byte(Mode::Push, 1, 1);
}

#[test]
fn pull_moves_every_byte() {
    moves_every_byte(Mode::Pull, 1, 1);
}

#[test]
fn push_between_tp_sizes_moves_every_byte() {
    moves_every_byte(Mode::Push, 2, 1);
}

#[test]
fn pull_between_tp_sizes_moves_every_byte() {
    moves_every_byte(Mode::Pull, 1, 2);
}

/// Submit failures and failed, timed-out and short tasks each fail their
/// request; the next request succeeds, and every batch id was freed.
#[test]
fn library_faults_fail_the_request_and_free_every_batch() {
    let (f, _one) = fake();
    let before = f.control.stats();
    let c = Cluster::start(&spec(f, Mode::Push, 1, 1)).expect("cluster starts");
    let faults = [
        Fault::SubmitFail,
        Fault::TaskFailed,
        Fault::TaskTimeout,
        Fault::WrongBytes,
    ];
    for (i, fault) in faults.into_iter().enumerate() {
        let tid = 10 + i as u64;
        f.control.arm(fault, 1);
        let phases = run(&c, tid);
        assert!(
            phases.iter().all(|p| matches!(p, Phase::Failed(_))),
            "{fault:?}: {phases:?}"
        );
        f.control.disarm();
        let phases = run(&c, tid + 100);
        assert!(
            phases.iter().all(|p| *p == Phase::Success),
            "after {fault:?}: {phases:?}"
        );
        assert_eq!(c.verify(TransferId(tid + 100), &DST, 0), 0);
    }
    drop(c);
    assert_balanced(&f.control, before, "faults");
    assert_in_bounds(&f.control, before);
}

/// A task the library finishes after its batch failed: prefill releases
/// its request only once the library let go of the memory (the batch id
/// is freed by then), and decode's blocks hold the late bytes, not a
/// later request's.
#[test]
fn a_late_task_keeps_its_blocks_until_it_finished() {
    let (f, _one) = fake();
    let before = f.control.stats();
    let c = Cluster::start(&spec(f, Mode::Push, 1, 1)).expect("cluster starts");
    f.control.arm(Fault::Late(LATE_MS), 1);
    let started = Instant::now();
    start(&c, 20);
    let p = c.wait_prefill(TransferId(20), Duration::from_secs(20));
    let released = started.elapsed();
    let now = f.control.stats();
    assert_eq!(p, vec![Phase::Failed(FailReason::Transport)], "prefill");
    assert_eq!(
        now.allocated - before.allocated,
        now.freed - before.freed,
        "finished before release"
    );
    assert!(
        released >= Duration::from_millis(LATE_MS as u64),
        "released after {released:?}"
    );
    let d = c.wait_decode(TransferId(20), Duration::from_secs(20));
    assert!(
        d.iter().all(|p| matches!(p, Phase::Failed(_))),
        "decode: {d:?}"
    );
    drop(c);
    assert_balanced(&f.control, before, "late");
}

/// A task that never finishes: its request fails by the transfer bound
/// (nothing hangs), the batch id is kept, and freed once the library
/// finishes the task.
#[test]
fn a_task_that_never_finishes_ends_its_request_at_the_bound() {
    let (f, _one) = fake();
    let before = f.control.stats();
    let c = Cluster::start(&spec(f, Mode::Pull, 1, 1)).expect("cluster starts");
    f.control.arm(Fault::Never, 1);
    let started = Instant::now();
    let phases = run(&c, 30);
    assert!(
        phases.iter().all(|p| matches!(p, Phase::Failed(_))),
        "{phases:?}"
    );
    assert!(
        started.elapsed() < BOUND + Duration::from_secs(5),
        "ended by the bound"
    );
    let now = f.control.stats();
    assert_eq!(
        now.allocated - now.freed,
        before.allocated - before.freed + 1,
        "one batch held"
    );
    f.control.finish_never();
    // The next transfer frees what the library finished meanwhile.
    let phases = run(&c, 31);
    assert!(phases.iter().all(|p| *p == Phase::Success), "{phases:?}");
    assert_eq!(c.verify(TransferId(31), &DST, 0), 0);
    drop(c);
    assert_balanced(&f.control, before, "never");
}

/// An abort while a task is late: the request ends aborted, and only once
/// the library let go of the memory.
#[test]
fn an_abort_mid_transfer_waits_for_the_library() {
    let (f, _one) = fake();
    let before = f.control.stats();
    let c = Cluster::start(&spec(f, Mode::Push, 1, 1)).expect("cluster starts");
    f.control.arm(Fault::Late(LATE_MS), 1);
    start(&c, 40);
    // The batch is out (allocated) before the abort.
    let until = Instant::now() + Duration::from_secs(10);
    while f.control.stats().allocated == before.allocated && Instant::now() < until {
        std::thread::yield_now();
    }
    c.prefill[0]
        .node
        .sender(TransferId(40))
        .unwrap()
        .abort()
        .unwrap();
    let p = c.wait_prefill(TransferId(40), Duration::from_secs(20));
    let now = f.control.stats();
    assert!(matches!(p[..], [Phase::Failed(_)]), "prefill: {p:?}");
    assert_eq!(
        now.allocated - before.allocated,
        now.freed - before.freed,
        "finished before release"
    );
    let d = c.wait_decode(TransferId(40), Duration::from_secs(20));
    assert!(
        d.iter().all(|p| matches!(p, Phase::Failed(_))),
        "decode: {d:?}"
    );
    drop(c);
    assert_balanced(&f.control, before, "abort");
}
