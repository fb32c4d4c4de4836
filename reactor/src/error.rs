//! Why a reactor could not start or stop ([`ReactorError`]). A leaf: the
//! configuration's check ([`crate::ReactorConfig::validate`]) and the
//! executors both fail with it, so neither imports the other for it.

/// Why a reactor could not start or stop cleanly.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum ReactorError {
    /// Misuse: the configuration is invalid.
    #[error("invalid reactor config: {0}")]
    Config(&'static str),
    /// glommio could not create an executor (bad core, io_uring setup).
    #[error("executor {executor} failed to start: {message}")]
    Start {
        /// Executor index.
        executor: usize,
        /// glommio's error.
        message: String,
    },
    /// The process may lock less memory than io_uring's rings need, so no
    /// executor can start; the message says how to raise the limit.
    #[error(
        "the locked-memory limit (RLIMIT_MEMLOCK) is {have} bytes, and io_uring needs at least \
         {need}: raise it (`ulimit -l unlimited`; Docker `--ulimit memlock=-1`; systemd \
         `LimitMEMLOCK=infinity`; in Kubernetes, the container runtime's memlock default)"
    )]
    MemLock {
        /// The process's soft limit, in bytes.
        have: u64,
        /// What glommio requires, [`crate::MIN_MEMLOCK_BYTES`].
        need: u64,
    },
    /// An executor thread panicked or returned an error when joined.
    #[error("executor {executor} failed: {message}")]
    Join {
        /// Executor index.
        executor: usize,
        /// The panic or error.
        message: String,
    },
}
