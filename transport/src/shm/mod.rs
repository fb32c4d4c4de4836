//! Same-host shared memory under the tcp transport: an initiator on the
//! target's host, running as the target's user, maps the target's
//! shareable regions and copies straight between them and its own memory,
//! one `memcpy` per byte instead of two socket copies through the kernel.
//!
//! * **Shareable memory** is a sealed `memfd` mapped shared ([`SharedMem`],
//!   or any such mapping whose file this process holds open: a plain
//!   registration finds it in `/proc/self/maps`): its size is sealed, so a
//!   peer that mapped it never faults on a shrink. Only
//!   the *target's* memory needs to be shareable; the initiator copies
//!   from or into any of its registered memory.
//! * **The shm hello** (`OP_SHM` on a tcp connection) exchanges host
//!   identities (boot id, network namespace, user); a target that shares
//!   answers with the name of an abstract Unix socket and a one-time token.
//!   Over that socket the target checks the caller's kernel credentials
//!   (`SO_PEERCRED`: same user) and the token, the initiator checks the
//!   target's (the pid of the hello), and the target passes its region
//!   files and its control file with `SCM_RIGHTS` (the messages:
//!   `hello.rs`).
//! * **The fence** reaches the peer through the control file
//!   (`ctl`): no copy into or out of a block after its request ended.
//! * **Selection**: [`ShmMode::Auto`] uses the link for every batch whose
//!   target ranges all lie in shared regions and tcp frames otherwise;
//!   [`ShmMode::Require`] fails a session that cannot share.

mod ctl;
mod detect;
pub(crate) mod hello;
mod host;
mod link;
mod mem;
pub(crate) mod protocol;
mod target;

use std::time::Duration;

pub(crate) use ctl::CtlOwner;
pub(crate) use detect::shared_pieces;
pub(crate) use hello::Answer;
pub(crate) use host::{HostId, HOST_ID_LEN};
pub(crate) use link::{CopyFail, ShmLink};
pub use mem::share_pages;
pub use mem::SharedMem;
pub(crate) use target::ShmTarget;

/// Whether a tcp endpoint moves bytes through shared memory with peers on
/// its host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ShmMode {
    /// Sockets only.
    Off,
    /// Shared memory whenever the peer is on this host, runs as this user
    /// and shares the target memory of a batch; tcp frames otherwise.
    #[default]
    Auto,
    /// Shared memory only: a session to a peer that cannot share fails to
    /// open, and a batch outside the peer's shared memory fails.
    Require,
}

/// Settings of the shared-memory path of a tcp endpoint.
#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// When to use it.
    pub mode: ShmMode,
    /// Most peers copying into this endpoint's memory at once (one lane
    /// of the control file each); more are served over tcp.
    pub lanes: usize,
    /// Longest a fence close waits for a live peer's copy in progress (one
    /// chunk of [`SHM_CHUNK_BYTES`]): past it the wait is logged and
    /// counted (`drain_overruns`).
    pub drain_max: Duration,
    /// Bound on the handshake over the Unix socket.
    pub handshake_timeout: Duration,
    /// Claims another boot id in the hello (tests of the host check).
    #[doc(hidden)]
    pub boot_id_override: Option<[u8; 36]>,
}

impl Default for ShmConfig {
    fn default() -> ShmConfig {
        ShmConfig {
            mode: ShmMode::Auto,
            lanes: 64,
            drain_max: Duration::from_secs(1),
            handshake_timeout: Duration::from_secs(2),
            boot_id_override: None,
        }
    }
}

/// Most bytes one guarded copy moves: a fence close waits at most for one.
pub const SHM_CHUNK_BYTES: u64 = 1 << 20;

static COPIED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Bytes this process copied through peers' shared memory, by every
/// endpoint together (a process-wide count: an engine process runs one
/// node).
pub fn shm_copied_bytes() -> u64 {
    COPIED.load(std::sync::atomic::Ordering::Relaxed)
}

pub(crate) fn count_copied(bytes: u64) {
    COPIED.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
}

/// Counters of an endpoint's shared-memory path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShmStats {
    /// Links handed to peers (target side).
    pub links_served: u64,
    /// Peers refused over the Unix socket: another user, a bad token, or
    /// no lane free.
    pub refused: u64,
    /// Peers that live-hold a lane now.
    pub peers: u64,
    /// Copies a fence close or a retire waited for.
    pub drain_waits: u64,
    /// Waits cut short because the copying peer was gone.
    pub drain_peer_gone: u64,
    /// Waits past [`ShmConfig::drain_max`].
    pub drain_overruns: u64,
}

/// Why two endpoints do not share memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShmRefusal {
    /// The peer's endpoint does not speak the shm hello, or shares nothing.
    #[error("the peer shares no memory")]
    NotOffered,
    /// Another host, boot or network namespace.
    #[error("the peer is not on this host")]
    NotSameHost,
    /// Another user (by the hello, or by the socket's credentials).
    #[error("the peer runs as another user")]
    NotSameUser,
    /// The socket's owner is not the process that said hello.
    #[error("the shm socket belongs to another process")]
    WrongProcess,
    /// A shared file whose size is not sealed.
    #[error("a shared file's size is not sealed")]
    NotSealed,
    /// A shared file smaller than the region it should hold.
    #[error("a shared file of {file_len} bytes cannot hold {len} bytes at offset {offset}")]
    SizeMismatch {
        /// Offset of the region in the file.
        offset: u64,
        /// Length of the region.
        len: u64,
        /// The file's size.
        file_len: u64,
    },
    /// An offer that breaks the format.
    #[error("malformed shm offer ({0})")]
    Malformed(&'static str),
    /// Every lane of the target is held.
    #[error("the peer serves no more shared-memory peers")]
    NoLane,
    /// The handshake failed at the OS level.
    #[error("shm handshake: {0}")]
    Io(String),
    /// The operating system gave no randomness for a token or a socket
    /// name: the hello fails rather than hand out a guessable one.
    #[error("no randomness from the operating system for the shm hello")]
    NoRandomness,
}

impl ShmRefusal {
    pub(crate) fn io(e: std::io::Error) -> ShmRefusal {
        ShmRefusal::Io(e.to_string())
    }
}
