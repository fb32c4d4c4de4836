//! A process whose locked-memory limit is below what io_uring needs gets a
//! typed error that says how to raise it, before any executor starts. Its
//! own test binary: the limit it lowers is the whole process's.

use kvferry_machines::TransferId;
use kvferry_machines::{AbortReason, InputError, Machine, Phase};
use kvferry_reactor::{ActionSink, Reactor, ReactorConfig, ReactorError, MIN_MEMLOCK_BYTES};
use std::time::Instant;

struct Idle;

impl Machine for Idle {
    type Event = ();
    type Action = ();
    fn handle_event(&mut self, _: Instant, _: ()) -> Result<(), InputError> {
        Ok(())
    }
    fn handle_timeout(&mut self, _: Instant) {}
    fn abort(&mut self, _: Instant, _: AbortReason) {}
    fn poll_action(&mut self) -> Option<()> {
        None
    }
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }
    fn phase(&self) -> Phase {
        Phase::WaitingForInput
    }
}

struct Sink;

impl ActionSink<Idle> for Sink {
    fn execute(&mut self, _: TransferId, _: ()) {}
}

fn set_soft_limit(bytes: u64) -> u64 {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: get/setrlimit read and write one valid `rlimit`.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut l), 0);
        let old = l.rlim_cur;
        l.rlim_cur = bytes;
        assert_eq!(libc::setrlimit(libc::RLIMIT_MEMLOCK, &l), 0);
        old
    }
}

#[test]
fn a_memlock_limit_below_io_urings_need_is_a_typed_error_with_the_fix() {
    let old = set_soft_limit(64 * 1024);
    let r = Reactor::<Idle>::start(ReactorConfig::for_devices(1), |_| Sink);
    set_soft_limit(old);
    match r {
        Err(e @ ReactorError::MemLock { have, need }) => {
            assert_eq!((have, need), (64 * 1024, MIN_MEMLOCK_BYTES));
            assert!(e.to_string().contains("ulimit -l"), "{e}");
        }
        Err(other) => panic!("expected MemLock, got {other}"),
        Ok(_) => panic!("started below the memlock limit"),
    }
    // With the limit back, it starts.
    let r = Reactor::<Idle>::start(ReactorConfig::for_devices(1), |_| Sink).unwrap();
    drop(r.shutdown(kvferry_reactor::ShutdownPolicy::Abort {
        grace: std::time::Duration::from_millis(10),
    }));
}
