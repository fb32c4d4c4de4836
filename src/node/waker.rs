//! Wakes the bridge thread out of `zmq_poll` through an eventfd, at most once
//! per burst of commands: a burst of sends costs one `write` syscall.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

pub(crate) struct Waker {
    fd: OwnedFd,
    pending: AtomicBool,
}

impl Waker {
    pub(crate) fn new() -> std::io::Result<Waker> {
        // SAFETY: eventfd has no memory-safety preconditions; the result is
        // checked and then owned by `OwnedFd`.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Waker {
            // SAFETY: a fresh descriptor nobody else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            pending: AtomicBool::new(false),
        })
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Called after queuing a command. AcqRel pairs with `reset`, so a
    /// skipped write is always covered by a drain that sees our command.
    pub(crate) fn wake(&self) {
        if !self.pending.swap(true, Ordering::AcqRel) {
            self.force();
        }
    }

    /// Writes the eventfd whatever the flag says (shutdown).
    pub(crate) fn force(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our own eventfd; EAGAIN
        // (saturated counter) still leaves it readable.
        unsafe {
            libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8);
        }
    }

    /// Called by the bridge before it drains its commands.
    pub(crate) fn reset(&self) {
        let mut buf: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from our nonblocking eventfd.
        unsafe {
            libc::read(self.fd.as_raw_fd(), (&mut buf as *mut u64).cast(), 8);
        }
        self.pending.store(false, Ordering::Release);
    }
}
