//! SIGINT and SIGTERM, caught one way by every command that outlives them
//! (`bootstrap`, `store serve`, `prefill`, `decode`): blocked before the
//! command starts any thread, so every thread inherits the mask, and
//! received synchronously with `sigwait`. No handler runs inside arbitrary
//! code. A command that waits for nothing else waits for them
//! ([`ShutdownSignals::wait`]); one whose loop polls between events reads
//! a flag a thread of this module sets ([`stop_on_signal`]).

use std::sync::atomic::{AtomicBool, Ordering};

/// SIGINT and SIGTERM, blocked in this thread (and so in every thread it
/// spawns afterwards), to be received synchronously with `sigwait`.
pub(crate) struct ShutdownSignals {
    set: libc::sigset_t,
}

impl ShutdownSignals {
    /// Blocks SIGINT and SIGTERM in the calling thread: call it before the
    /// command starts any other thread.
    pub(crate) fn block() -> std::io::Result<ShutdownSignals> {
        // SAFETY: sigset_t is plain data that sigemptyset initialises; the
        // calls only read and write the set we own and this thread's mask.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            if rc != 0 {
                return Err(std::io::Error::from_raw_os_error(rc));
            }
            Ok(ShutdownSignals { set })
        }
    }

    /// Blocks until SIGINT or SIGTERM arrives; returns its number.
    pub(crate) fn wait(&self) -> i32 {
        loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: `self.set` was initialised in `block`; `sig` is a valid
            // out-pointer.
            let rc = unsafe { libc::sigwait(&self.set, &mut sig) };
            if rc == 0 {
                return sig;
            }
            // sigwait only fails with EINVAL for a bad set, which ours is
            // not; retry rather than exit without a signal.
        }
    }
}

/// Set once SIGINT or SIGTERM arrived, with [`stop_on_signal`].
static STOP: AtomicBool = AtomicBool::new(false);

/// Blocks SIGINT and SIGTERM (call it before the command starts any
/// thread) and waits for them on a thread of its own, which sets the flag
/// [`stop_requested`] reads.
pub(crate) fn stop_on_signal() -> std::io::Result<()> {
    let signals = ShutdownSignals::block()?;
    std::thread::Builder::new()
        .name("kvferry-signals".into())
        .spawn(move || {
            signals.wait();
            STOP.store(true, Ordering::SeqCst);
        })?;
    Ok(())
}

/// Whether SIGINT or SIGTERM arrived since [`stop_on_signal`].
pub(crate) fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}
