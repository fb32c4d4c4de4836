//! Socket I/O straight between a TCP connection and registered memory.
//!
//! The fast path calls `recvmsg`/`sendmsg` with `MSG_DONTWAIT` on the raw
//! descriptor with one `iovec` per descriptor, so payload bytes land in (or
//! leave from) registered memory without an intermediate buffer, and many
//! small descriptors cost one system call. When the socket is not ready the
//! [`PollPolicy`] decides: spin (let the executor poll its rings and run what
//! that woke, then try again) or park on glommio's io_uring readiness
//! through the glommio stream itself.
//!
//! Cancellation is safe for registered memory: glommio's stream waits for
//! readiness with io_uring and then copies with a plain non-blocking system
//! call, so no kernel operation keeps a pointer into the buffer after a
//! future is dropped (unlike an io_uring `recv` into the buffer would).

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use futures::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use glommio::net::TcpStream;
use slab::Slab;

use super::PollPolicy;

/// `IOV_MAX` on Linux: the most iovecs one `recvmsg`/`sendmsg` takes.
const IOV_MAX: usize = 1024;

/// One TCP connection, split so that a batch can send and receive at once.
pub(crate) struct Conn {
    pub rd: ReadHalf<TcpStream>,
    pub wr: WriteHalf<TcpStream>,
    pub fd: RawFd,
    /// Seals the headers this side sends, once the connection is
    /// authenticated (`tcp::auth`).
    pub seal: Option<kvferry_auth::seal::Sealer>,
    /// Opens the headers the peer sends, likewise.
    pub open: Option<kvferry_auth::seal::Opener>,
    /// Payloads carry a tag too (`TcpConfig::payload_mac`, agreed in the
    /// handshake).
    pub payload_mac: bool,
}

impl Conn {
    pub(crate) fn new(stream: TcpStream) -> Conn {
        use std::os::fd::AsRawFd;
        let fd = stream.as_raw_fd();
        let (rd, wr) = stream.split();
        Conn {
            rd,
            wr,
            fd,
            seal: None,
            open: None,
            payload_mac: false,
        }
    }

    /// True if the peer has closed (or reset) the connection, or sent bytes
    /// nobody asked for; such a connection must not carry a new batch.
    pub(crate) fn is_stale(&self) -> bool {
        let mut byte = 0u8;
        // SAFETY: `fd` is this connection's open socket and `byte` is a valid
        // one-byte buffer; MSG_PEEK leaves the data in the socket.
        let r = unsafe {
            libc::recv(
                self.fd,
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            )
        } else {
            true
        }
    }
}

/// Why a socket operation stopped.
#[derive(Debug)]
pub(crate) enum IoFail {
    /// The peer closed the connection (or reset it).
    Closed,
    /// The block fence closed the memory mid-operation: the request it
    /// belongs to ended here. The connection is out of step and must close.
    Fenced,
    /// Another OS error.
    Os(io::Error),
}

impl IoFail {
    fn from_os(e: io::Error) -> IoFail {
        match e.kind() {
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::NotConnected
            | io::ErrorKind::UnexpectedEof => IoFail::Closed,
            _ => IoFail::Os(e),
        }
    }
}

/// Decides between one more non-blocking try and parking.
struct Spinner {
    policy: PollPolicy,
    since: Option<Instant>,
    stalls: StallWatch,
}

impl Spinner {
    fn new(policy: PollPolicy) -> Spinner {
        Spinner {
            policy,
            since: None,
            stalls: StallWatch::default(),
        }
    }

    fn progress(&mut self) {
        self.since = None;
        self.stalls = StallWatch::default();
    }

    fn keep_spinning(&mut self) -> bool {
        let PollPolicy::Spin { spin } = self.policy else {
            return false;
        };
        if spin == Duration::MAX {
            return true;
        }
        let now = Instant::now();
        let since = *self.since.get_or_insert(now);
        now.duration_since(since) < spin
    }

    /// After a try that found nothing: `true` once the executor polled its
    /// rings (and ran what that woke), time for the next try; `false` when
    /// the spin is over and the caller parks.
    ///
    /// A plain `yield_now` would only let the other ready tasks run: the
    /// executor polls its rings only when a run of its task queues ends,
    /// so the tasks parked on other sockets of this executor would not be
    /// woken for their bytes until the spin gave up (or the executor's
    /// preemption timer fired), about a millisecond per batch.
    async fn try_again(&mut self) -> bool {
        if !self.keep_spinning() {
            return false;
        }
        self.stalls.tick();
        glommio::executor().yield_to_reactor().await;
        true
    }
}

/// Tries between two looks of a spinning task at the parked readers of its
/// executor (a look costs a `recv` per parked reader).
const STALL_LOOK_EVERY: u32 = 64;

/// A reader parked on socket readiness through glommio, as a spinning task
/// of the same executor sees it.
struct Parked {
    fd: RawFd,
    /// Unique per poll of the parked future, so that a reader woken (and
    /// polled) between two looks never looks the same, whatever its slab key.
    stamp: u64,
}

thread_local! {
    /// The readers parked on this executor thread.
    static PARKED: RefCell<Slab<Parked>> = const { RefCell::new(Slab::new()) };
    static NEXT_STAMP: Cell<u64> = const { Cell::new(0) };
    /// See [`spin_stalls`].
    static SPIN_STALLS: Cell<u64> = const { Cell::new(0) };
}

/// How many times, on the calling thread, a parked reader's bytes had
/// arrived and it was still not woken for them after a spinning task of
/// the same executor tried its own socket [`STALL_LOOK_EVERY`] more
/// times: a batch held up until the spin ran out.
pub(crate) fn spin_stalls() -> u64 {
    SPIN_STALLS.with(Cell::get)
}

/// What a spinning task saw of the parked readers.
#[derive(Default)]
struct StallWatch {
    tries: u32,
    /// `(slab key, stamp)` of the readers that had unread bytes at the last
    /// look.
    waiting: Vec<(usize, u64)>,
    /// Readers counted in this spin already.
    counted: Vec<usize>,
}

impl StallWatch {
    /// One more try; every [`STALL_LOOK_EVERY`] tries, counts the readers
    /// that had bytes at the last look and were not polled since.
    fn tick(&mut self) {
        self.tries = self.tries.wrapping_add(1);
        if !self.tries.is_multiple_of(STALL_LOOK_EVERY) {
            return;
        }
        let now: Vec<(usize, u64)> = PARKED.with(|p| {
            p.borrow()
                .iter()
                .filter(|(_, r)| has_bytes(r.fd))
                .map(|(key, r)| (key, r.stamp))
                .collect()
        });
        for &(key, stamp) in &now {
            if self.waiting.contains(&(key, stamp)) && !self.counted.contains(&key) {
                self.counted.push(key);
                SPIN_STALLS.with(|c| c.set(c.get() + 1));
            }
        }
        self.waiting = now;
    }
}

/// True if the socket has bytes to read (a `MSG_PEEK` of one byte).
fn has_bytes(fd: RawFd) -> bool {
    let mut byte = 0u8;
    // SAFETY: `fd` is an open socket of a parked reader on this thread and
    // `byte` a valid one-byte buffer; MSG_PEEK leaves the data in place.
    let r = unsafe {
        libc::recv(
            fd,
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    r > 0
}

/// Runs `wait` (a read parked on `fd`'s readiness) as a parked reader that
/// spinning tasks of this executor can see.
async fn parked<T>(fd: RawFd, wait: impl Future<Output = T>) -> T {
    struct Entry(usize);
    impl Drop for Entry {
        fn drop(&mut self) {
            PARKED.with(|p| p.borrow_mut().try_remove(self.0));
        }
    }
    let entry = Entry(PARKED.with(|p| p.borrow_mut().insert(Parked { fd, stamp: 0 })));
    let mut wait = std::pin::pin!(wait);
    std::future::poll_fn(|cx| {
        let stamp = NEXT_STAMP.with(|n| n.replace(n.get() + 1));
        PARKED.with(|p| {
            if let Some(r) = p.borrow_mut().get_mut(entry.0) {
                r.stamp = stamp;
            }
        });
        wait.as_mut().poll(cx)
    })
    .await
}

/// Skips `n` transferred bytes in `iovs[*idx..]`.
fn advance(iovs: &mut [libc::iovec], idx: &mut usize, mut n: usize) {
    while n > 0 && *idx < iovs.len() {
        let iov = &mut iovs[*idx];
        if n >= iov.iov_len {
            n -= iov.iov_len;
            *idx += 1;
        } else {
            // SAFETY: `n < iov_len`, so the new base stays inside the buffer.
            iov.iov_base = unsafe { iov.iov_base.cast::<u8>().add(n).cast() };
            iov.iov_len -= n;
            n = 0;
        }
    }
    while *idx < iovs.len() && iovs[*idx].iov_len == 0 {
        *idx += 1;
    }
}

/// An `iovec` for `len` bytes at `addr`.
pub(crate) fn iov(addr: u64, len: u64) -> libc::iovec {
    libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: len as usize,
    }
}

/// Fills every buffer of `iovs` from the socket.
///
/// The caller guarantees each iovec names writable memory it owns (a
/// validated, pinned registered range or a local buffer).
///
/// With a `guard`, it is asked right before every system call that writes
/// into the buffers; when it says no, nothing more is written and the call
/// fails with [`IoFail::Fenced`]. Parking then waits on a one-byte scratch
/// read, so no kernel call writes into the buffers unchecked.
pub(crate) async fn recv_exact(
    rd: &mut ReadHalf<TcpStream>,
    fd: RawFd,
    iovs: &mut [libc::iovec],
    policy: PollPolicy,
    guard: Option<&dyn Fn() -> bool>,
) -> Result<(), IoFail> {
    let mut idx = 0;
    advance(iovs, &mut idx, 0);
    let mut spin = Spinner::new(policy);
    // One unguarded buffer under `Park` (frame headers, answers): glommio's
    // read tries a non-blocking `recv` itself before it waits, so a try of
    // our own first would only add a failed system call whenever nothing
    // has arrived yet, which is the common case for a header.
    let glommio_first = guard.is_none() && matches!(policy, PollPolicy::Park);
    while idx < iovs.len() {
        if glommio_first && iovs.len() - idx == 1 {
            let n = parked(fd, read_into(rd, iovs[idx])).await?;
            advance(iovs, &mut idx, n);
            continue;
        }
        if guard.is_some_and(|g| !g()) {
            return Err(IoFail::Fenced);
        }
        match recvmsg_now(fd, &mut iovs[idx..]) {
            Ok(0) => return Err(IoFail::Closed),
            Ok(n) => {
                advance(iovs, &mut idx, n);
                spin.progress();
                continue;
            }
            Err(e) => match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {}
                _ => return Err(IoFail::from_os(e)),
            },
        }
        if spin.try_again().await {
            continue;
        }
        let n = match guard {
            Some(g) => parked(fd, park_scratch(rd, iovs[idx], g)).await?,
            // Park: let glommio wait for readiness and read into the first
            // buffer (glommio reads straight into the slice it is given).
            None => parked(fd, read_into(rd, iovs[idx])).await?,
        };
        advance(iovs, &mut idx, n);
        spin.progress();
    }
    Ok(())
}

/// One non-blocking `recvmsg` into `rest` (at most [`IOV_MAX`] of them):
/// the bytes read, `Ok(0)` once the peer closed, or the OS error.
fn recvmsg_now(fd: RawFd, rest: &mut [libc::iovec]) -> io::Result<usize> {
    // SAFETY: msghdr is plain data; every field we do not set is zero.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = rest.as_mut_ptr();
    msg.msg_iovlen = rest.len().min(IOV_MAX) as _;
    // SAFETY: the iovecs name writable memory (caller's guarantee) and
    // `fd` is an open socket.
    let r = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as usize)
}

/// Lets glommio wait for and read at least one byte straight into `iov`;
/// returns how many it read.
async fn read_into(rd: &mut ReadHalf<TcpStream>, iov: libc::iovec) -> Result<usize, IoFail> {
    // SAFETY: the iovec names writable memory of that length (caller's
    // guarantee).
    let buf = unsafe { std::slice::from_raw_parts_mut(iov.iov_base.cast::<u8>(), iov.iov_len) };
    match rd.read(buf).await {
        Ok(0) => Err(IoFail::Closed),
        Ok(n) => Ok(n),
        Err(e) => Err(IoFail::from_os(e)),
    }
}

/// Waits for one byte and, if `guard` still allows it, stores it at the
/// start of `iov` (non-empty); returns the one byte read.
async fn park_scratch(
    rd: &mut ReadHalf<TcpStream>,
    iov: libc::iovec,
    guard: &dyn Fn() -> bool,
) -> Result<usize, IoFail> {
    // Park on a scratch byte: the memory may be fenced by the time
    // the socket is readable.
    let mut one = [0u8; 1];
    match rd.read(&mut one).await {
        Ok(0) => Err(IoFail::Closed),
        Ok(_) => {
            if !guard() {
                return Err(IoFail::Fenced);
            }
            // SAFETY: the iovec names at least one writable byte
            // (caller's guarantee; `advance` skips empty ones).
            unsafe { *iov.iov_base.cast::<u8>() = one[0] };
            Ok(1)
        }
        Err(e) => Err(IoFail::from_os(e)),
    }
}

/// One non-blocking `recv` into `buf` (a local buffer): `Ok(Some(n))` with
/// `n > 0` bytes read, `Ok(None)` when nothing is there yet.
pub(crate) fn recv_now(fd: RawFd, buf: &mut [u8]) -> Result<Option<usize>, IoFail> {
    loop {
        // SAFETY: `buf` is a writable local buffer of that length and `fd`
        // is an open socket.
        let r = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if r > 0 {
            return Ok(Some(r as usize));
        }
        if r == 0 {
            return Err(IoFail::Closed);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(IoFail::from_os(e)),
        }
    }
}

/// Reads what is there (at least one byte, waiting for it) into `buf` (a
/// local buffer); returns how many bytes.
pub(crate) async fn recv_some(
    rd: &mut ReadHalf<TcpStream>,
    fd: RawFd,
    buf: &mut [u8],
    policy: PollPolicy,
) -> Result<usize, IoFail> {
    if matches!(policy, PollPolicy::Spin { .. }) {
        let mut spin = Spinner::new(policy);
        loop {
            match recv_now(fd, buf)? {
                Some(n) => return Ok(n),
                None if spin.try_again().await => {}
                None => break,
            }
        }
    }
    // glommio tries a non-blocking `recv` itself before it waits.
    match parked(fd, rd.read(buf)).await {
        Ok(0) => Err(IoFail::Closed),
        Ok(n) => Ok(n),
        Err(e) => Err(IoFail::from_os(e)),
    }
}

/// Copies `src` into the memory `iovs` name, in order, and advances them
/// past it (a written-out iovec is left empty). The caller guarantees the
/// iovecs name writable memory of at least `src.len()` bytes in all.
pub(crate) fn copy_into(iovs: &mut [libc::iovec], mut src: &[u8]) {
    for v in iovs.iter_mut() {
        if src.is_empty() {
            break;
        }
        let n = v.iov_len.min(src.len());
        // SAFETY: the iovec names writable memory of `iov_len` bytes
        // (caller's guarantee), `n` is within it and `src` is ours.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), v.iov_base.cast::<u8>(), n);
            v.iov_base = v.iov_base.cast::<u8>().add(n).cast();
        }
        v.iov_len -= n;
        src = &src[n..];
    }
}

/// Sends every buffer of `iovs` to the socket.
///
/// The caller guarantees each iovec names readable memory it owns.
///
/// With a `guard`, it is asked right before every system call that reads
/// the buffers, as in [`recv_exact`].
pub(crate) async fn send_all(
    wr: &mut WriteHalf<TcpStream>,
    fd: RawFd,
    iovs: &mut [libc::iovec],
    guard: Option<&dyn Fn() -> bool>,
) -> Result<(), IoFail> {
    let mut idx = 0;
    advance(iovs, &mut idx, 0);
    while idx < iovs.len() {
        if guard.is_some_and(|g| !g()) {
            return Err(IoFail::Fenced);
        }
        let rest = &mut iovs[idx..];
        // SAFETY: msghdr is plain data; every field we do not set is zero.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = rest.as_mut_ptr();
        msg.msg_iovlen = rest.len().min(IOV_MAX) as _;
        // SAFETY: the iovecs name readable memory (caller's guarantee).
        // MSG_NOSIGNAL turns a closed peer into EPIPE instead of SIGPIPE.
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if r >= 0 {
            advance(iovs, &mut idx, r as usize);
            continue;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => {}
            _ => return Err(IoFail::from_os(e)),
        }
        // A full send buffer drains at the receiver's pace (about a
        // millisecond for a few MiB), far longer than spinning pays off
        // for, so the sender parks whatever the policy; spinning here only
        // steals CPU from the receiver when both share cores.
        let first = iovs[idx];
        if guard.is_some() {
            // Park on a copy of one byte, taken now while the guard allows
            // it: a retried send inside glommio would read the memory later.
            // SAFETY: the iovec names at least one readable byte.
            let one = [unsafe { *first.iov_base.cast::<u8>() }];
            match wr.write(&one).await {
                Ok(0) => return Err(IoFail::Closed),
                Ok(n) => advance(iovs, &mut idx, n),
                Err(e) => return Err(IoFail::from_os(e)),
            }
            continue;
        }
        // SAFETY: as above, the iovec names readable memory of that length.
        let buf = unsafe { std::slice::from_raw_parts(first.iov_base.cast::<u8>(), first.iov_len) };
        match wr.write(buf).await {
            Ok(0) => return Err(IoFail::Closed),
            Ok(n) => advance(iovs, &mut idx, n),
            Err(e) => return Err(IoFail::from_os(e)),
        }
    }
    Ok(())
}

/// Reads and throws away `len` bytes (the payload of a rejected frame), so
/// the connection stays in step without touching registered memory.
pub(crate) async fn discard(
    rd: &mut ReadHalf<TcpStream>,
    fd: RawFd,
    mut len: u64,
    scratch: &mut [u8],
    policy: PollPolicy,
) -> Result<(), IoFail> {
    while len > 0 {
        let n = scratch.len().min(len as usize);
        let mut v = [iov(scratch.as_mut_ptr() as u64, n as u64)];
        recv_exact(rd, fd, &mut v, policy, None).await?;
        len -= n as u64;
    }
    Ok(())
}
