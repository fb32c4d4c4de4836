//! Cross-thread wake-ups of a sleeping glommio executor are never lost.
//!
//! kvferry carries glommio with a patch (`vendor/glommio.md`):
//! a parking executor orders its "I am going to sleep" flag against remote
//! wake-ups with two `SeqCst` fences instead of a process-wide
//! `membarrier`. A mistake there loses a wake-up: the executor sleeps with
//! work queued. This executor has no timer, so a lost wake-up would leave
//! it asleep for good and the round trip would time out.

#![cfg(not(kvferry_loom))]

use std::future::Future;
use std::time::Duration;

/// Runs the future `make` builds on a glommio executor of its own thread.
fn on_executor<T, Fut>(make: impl FnOnce() -> Fut + Send + 'static) -> std::thread::JoinHandle<T>
where
    T: Send + 'static,
    Fut: Future<Output = T> + 'static,
{
    std::thread::spawn(move || {
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .make()
            .expect("executor")
            .run(make())
    })
}

/// Round trips between this thread and an executor that parks in between
/// (every third one after a short pause, so it is asleep when woken). With
/// `far_timer`, a task of the executor sleeps for an hour meanwhile, so the
/// executor always parks with a timer armed (the patched glommio keeps an
/// armed timer across parks when it fires no later than the one wanted).
fn round_trips(n: u64, pause_every: u64, far_timer: bool) -> Duration {
    let (to_ex, ex_rx) = flume::bounded::<u64>(1);
    let (to_main, main_rx) = std::sync::mpsc::channel::<u64>();
    let executor = on_executor(move || async move {
        // Dropping the task at the end cancels it.
        let far = far_timer
            .then(|| glommio::spawn_local(glommio::timer::sleep(Duration::from_secs(3600))));
        while let Ok(x) = ex_rx.recv_async().await {
            if to_main.send(x).is_err() {
                break;
            }
        }
        drop(far);
    });
    let mut worst = Duration::ZERO;
    for i in 0..n {
        let t = std::time::Instant::now();
        to_ex.send(i).expect("executor alive");
        let got = main_rx
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("round trip {i}: no answer in 10 s (lost wake-up)"));
        assert_eq!(got, i);
        worst = worst.max(t.elapsed());
        if i % pause_every == 0 {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    drop(to_ex);
    executor.join().expect("executor thread");
    worst
}

/// Two stress runs at once, so that both cores park and wake executors.
fn two_at_once(far_timer: bool) {
    let other = std::thread::spawn(move || round_trips(20_000, 3, far_timer));
    let worst = round_trips(20_000, 2, far_timer);
    let other_worst = other.join().expect("second stress thread");
    // Generous: the point is that none waits for a wake-up that never comes.
    assert!(
        worst.max(other_worst) < Duration::from_secs(5),
        "worst round trip {:?}",
        worst.max(other_worst)
    );
}

#[test]
fn no_wake_up_is_lost_by_a_parking_executor() {
    two_at_once(false);
}

#[test]
fn no_wake_up_is_lost_by_an_executor_parking_with_a_timer() {
    two_at_once(true);
}

/// An idle executor whose only work is a timer wakes when it expires: the
/// patched glommio sleeps with the timer as the wait's own timeout
/// (`IORING_ENTER_EXT_ARG`) instead of a TIMEOUT request on a ring.
#[test]
fn a_sleeping_executor_wakes_for_its_timers() {
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Duration>();
    let executor = on_executor(move || async move {
        let mut late = Duration::ZERO;
        for _ in 0..200 {
            let t = std::time::Instant::now();
            glommio::timer::sleep(Duration::from_millis(2)).await;
            let slept = t.elapsed();
            assert!(slept >= Duration::from_millis(2), "woke early: {slept:?}");
            late = late.max(slept - Duration::from_millis(2));
        }
        done_tx.send(late).expect("test thread alive");
    });
    let late = done_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("200 timers of 2 ms did not all fire within 20 s");
    executor.join().expect("executor thread");
    // Generous for shared cores; a timer that never armed would hang above.
    assert!(late < Duration::from_secs(1), "a timer fired {late:?} late");
}

/// A busy stretch that begins right after a wake-up, when the patched
/// glommio runs without a preemption timer for a while, still yields to
/// the reactor after that while: a timer due meanwhile fires long before
/// the busy task ends.
#[test]
fn a_busy_run_right_after_a_wake_up_still_fires_timers() {
    const BUSY: Duration = Duration::from_millis(400);
    let (go_tx, go_rx) = flume::bounded::<()>(1);
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Duration>();
    let executor = on_executor(move || async move {
        // Parks here until the message comes: the run below starts right
        // after a wake-up.
        go_rx.recv_async().await.expect("test thread alive");
        let t0 = std::time::Instant::now();
        let timer = glommio::spawn_local(async move {
            glommio::timer::sleep(Duration::from_millis(2)).await;
            t0.elapsed()
        });
        let busy = glommio::spawn_local(async move {
            while t0.elapsed() < BUSY {
                futures_lite::future::yield_now().await;
            }
        });
        let fired = timer.await;
        busy.await;
        done_tx.send(fired).expect("test thread alive");
    });
    // Gives the executor time to park (not a synchronisation: the check
    // below holds either way, this only makes the run start from a sleep).
    std::thread::sleep(Duration::from_millis(50));
    go_tx.send(()).expect("executor alive");
    let fired = done_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the executor never finished");
    executor.join().expect("executor thread");
    assert!(
        fired < BUSY / 2,
        "a 2 ms timer fired after {fired:?}, behind a busy task"
    );
}
