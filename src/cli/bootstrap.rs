//! `kvferry bootstrap --listen ADDR`: the standalone bootstrap service.
//!
//! Runs until SIGINT or SIGTERM, then shuts the server down cleanly (joins
//! its threads) and exits 0.

use std::process::ExitCode;

use super::args::{Args, UsageError};
use crate::bootstrap::{BootstrapServer, DEFAULT_PORT};

const USAGE: &str = "usage: kvferry bootstrap [--listen ADDR]   (default 0.0.0.0:8998)";

pub fn main(argv: &[String]) -> ExitCode {
    match run(argv) {
        Ok(code) => code,
        Err(UsageError(msg)) => {
            eprintln!("kvferry bootstrap: {msg}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn run(argv: &[String]) -> Result<ExitCode, UsageError> {
    let args = Args::parse(argv, &["help"])?;
    if args.flag("help") {
        println!("{USAGE}");
        return Ok(ExitCode::SUCCESS);
    }
    args.reject_unknown(&["listen", "help"])?;
    if let Some(extra) = args.positional().first() {
        return Err(UsageError(format!("unexpected argument {extra:?}")));
    }
    let default_listen = format!("0.0.0.0:{DEFAULT_PORT}");
    let listen = args.get_str("listen").unwrap_or(&default_listen);

    // Block the signals before any thread exists so every thread inherits the
    // mask and only `sigwait` below ever sees them: no handler runs inside
    // arbitrary code, and no flag has to be polled.
    let signals = match ShutdownSignals::block() {
        Ok(s) => s,
        Err(err) => {
            eprintln!("kvferry bootstrap: cannot block signals: {err}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let server = match BootstrapServer::start(listen) {
        Ok(server) => server,
        Err(err) => {
            eprintln!("kvferry bootstrap: {err}");
            return Ok(ExitCode::FAILURE);
        }
    };
    println!("bootstrap service listening on {}", server.local_addr());
    let signal = signals.wait();
    eprintln!("kvferry bootstrap: signal {signal}, shutting down");
    server.shutdown();
    Ok(ExitCode::SUCCESS)
}

/// SIGINT and SIGTERM, blocked in this thread (and so in every thread it
/// spawns afterwards), to be received synchronously with `sigwait`.
pub(crate) struct ShutdownSignals {
    set: libc::sigset_t,
}

impl ShutdownSignals {
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
