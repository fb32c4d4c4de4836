//! The `tcp` transport: glommio (io_uring) sockets, several streams per peer.
//!
//! Each [`TcpTransport`] is both a target (it listens, and serves the frames
//! peers send against its own registered memory) and an initiator (its
//! [`TcpSession`]s push and pull batches). The frame format is in
//! [`super::wire`].
//!
//! A batch is cut into frames of at most [`TcpConfig::frame_max_bytes`] and
//! [`TcpConfig::frame_max_descs`]; frames are dealt round-robin to the
//! session's streams and pipelined: on each stream one half sends frames
//! while the other half reads the in-order responses, and the sender stops
//! when the stream's share of [`TcpConfig::inflight_max_bytes`] is unacked.
//! Payload bytes go between the socket and registered memory with
//! `recvmsg`/`sendmsg` over one iovec per descriptor: no staging copy.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use futures::lock::{Mutex, MutexGuard};
use glommio::net::{TcpListener, TcpStream};
use glommio::sync::Semaphore;
use glommio::Task;
use slab::Slab;

use super::fdio::{self, iov, Conn, IoFail};
use super::fence::{BlockFence, Guard};
use super::registry::{self, Registry};
use super::turns::Turns;
use super::wire::{self, Header, RejectReason};
use super::{
    Desc, EndpointAddr, MisuseError, Op, PeerError, PollPolicy, RegionId, RegionInfo, Session,
    Transport, TransportError,
};

/// Settings of a TCP endpoint (both its target and its initiator side).
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Connections per session; large batches are spread over them.
    pub streams: usize,
    /// Most payload bytes per frame (at most [`wire::MAX_FRAME_BYTES`]);
    /// longer descriptors are split.
    pub frame_max_bytes: u64,
    /// Most descriptors per frame (at most [`wire::MAX_FRAME_DESCS`]).
    pub frame_max_descs: u32,
    /// Most unacknowledged payload bytes per session, shared evenly by the
    /// streams a batch uses; must be at least `streams * frame_max_bytes`.
    pub inflight_max_bytes: u64,
    /// Most descriptors in one batch.
    pub max_batch_descs: usize,
    /// How both sides wait for sockets.
    pub poll: PollPolicy,
    /// Bound on one batch, from submission to completion.
    pub batch_timeout_ms: u64,
    /// Bound on establishing one connection.
    pub connect_timeout_ms: u64,
    /// Most connections the target side serves at once.
    pub max_connections: usize,
    /// Most registered regions.
    pub max_regions: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            streams: 2,
            frame_max_bytes: 4 << 20,
            frame_max_descs: 1024,
            inflight_max_bytes: 64 << 20,
            max_batch_descs: 1 << 20,
            poll: PollPolicy::default(),
            batch_timeout_ms: 60_000,
            connect_timeout_ms: 5_000,
            max_connections: 1024,
            max_regions: registry::DEFAULT_MAX_REGIONS,
        }
    }
}

impl TcpConfig {
    /// Checks the ranges documented on the fields.
    pub fn validate(&self) -> Result<(), MisuseError> {
        let bad = |s: String| Err(MisuseError::BadConfig(s));
        if !(1..=64).contains(&self.streams) {
            return bad(format!("streams must be 1..=64, not {}", self.streams));
        }
        if !(1..=wire::MAX_FRAME_BYTES).contains(&self.frame_max_bytes) {
            return bad(format!(
                "frame_max_bytes must be 1..={}",
                wire::MAX_FRAME_BYTES
            ));
        }
        if !(1..=wire::MAX_FRAME_DESCS).contains(&self.frame_max_descs) {
            return bad(format!(
                "frame_max_descs must be 1..={}",
                wire::MAX_FRAME_DESCS
            ));
        }
        if self.inflight_max_bytes < self.frame_max_bytes.saturating_mul(self.streams as u64) {
            return bad("inflight_max_bytes must be at least streams * frame_max_bytes".into());
        }
        if self.batch_timeout_ms == 0 || self.connect_timeout_ms == 0 {
            return bad("timeouts must be positive".into());
        }
        if self.max_regions as u64 > u64::from(wire::MAX_REGIONS) {
            return bad(format!("max_regions must be at most {}", wire::MAX_REGIONS));
        }
        if self.max_batch_descs == 0 || self.max_connections == 0 || self.max_regions == 0 {
            return bad("limits must be positive".into());
        }
        Ok(())
    }
}

fn conv(during: &'static str) -> impl Fn(IoFail) -> TransportError {
    move |f| match f {
        IoFail::Closed => TransportError::Disconnected { during },
        IoFail::Fenced => TransportError::Fenced { during },
        IoFail::Os(source) => TransportError::Io { during, source },
    }
}

fn protocol(msg: impl Into<String>) -> TransportError {
    TransportError::Peer(PeerError::Protocol(msg.into()))
}

// ---------------------------------------------------------------------------
// Target side
// ---------------------------------------------------------------------------

type FenceCell = Rc<RefCell<Option<Rc<BlockFence>>>>;

/// Takes the bytes of a NOTIFY frame on the target's executor; returns
/// whether it took them (a refusal tells the sender to use another path).
pub type NotifyHandler = Rc<dyn Fn(&[u8]) -> bool>;

/// State shared by the acceptor and the connection tasks of one endpoint.
struct Target {
    registry: Arc<Registry>,
    /// The node's block fence, shared with the sessions this endpoint opens.
    fence: FenceCell,
    config: TcpConfig,
    /// Where NOTIFY frames go; without one they are refused.
    notify: RefCell<Option<NotifyHandler>>,
    /// Sockets of the live connections, so shutdown can close them at once.
    conns: RefCell<Slab<RawFd>>,
    shutting_down: Cell<bool>,
}

/// A TCP endpoint. Create it inside the glommio executor that will own it.
pub struct TcpTransport {
    target: Rc<Target>,
    local_addr: SocketAddr,
    listener_fd: RawFd,
    acceptor: Option<Task<()>>,
}

impl TcpTransport {
    /// Listens on `addr` (port 0 picks a free port) and starts serving peers
    /// on the current glommio executor.
    ///
    /// # Panics
    ///
    /// Outside a glommio executor.
    pub fn bind(addr: SocketAddr, config: TcpConfig) -> Result<TcpTransport, TransportError> {
        config.validate()?;
        // std's listener sets SO_REUSEADDR but not SO_REUSEPORT (glommio's
        // own bind sets the latter), so a restarted endpoint can rebind the
        // port but two live endpoints can never share it.
        let std_listener =
            std::net::TcpListener::bind(addr).map_err(|e| TransportError::io("bind", e))?;
        let local_addr = std_listener
            .local_addr()
            .map_err(|e| TransportError::io("bind", e))?;
        let listener_fd = std_listener.into_raw_fd();
        // SAFETY: `listener_fd` is a bound, listening socket we own; the
        // glommio listener takes ownership of it.
        let listener = unsafe { <TcpListener as std::os::fd::FromRawFd>::from_raw_fd(listener_fd) };
        let target = Rc::new(Target {
            registry: Registry::new(config.max_regions),
            fence: Rc::new(RefCell::new(None)),
            config,
            notify: RefCell::new(None),
            conns: RefCell::new(Slab::new()),
            shutting_down: Cell::new(false),
        });
        let acceptor = glommio::spawn_local(accept_loop(Rc::clone(&target), listener));
        Ok(TcpTransport {
            target,
            local_addr,
            listener_fd,
            acceptor: Some(acceptor),
        })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Puts registered memory under `fence`: from now on both ends of this
    /// endpoint (the served connections and every session it opened or
    /// opens) touch KV blocks only while the fence has them open.
    pub fn set_fence(&self, fence: Option<Rc<BlockFence>>) {
        *self.target.fence.borrow_mut() = fence;
    }

    /// Sets where NOTIFY frames from peers go (see [`TcpSession::notify`]).
    pub fn set_notify_handler(&self, handler: Option<NotifyHandler>) {
        *self.target.notify.borrow_mut() = handler;
    }

    /// The block fence set by [`TcpTransport::set_fence`].
    pub fn fence(&self) -> Option<Rc<BlockFence>> {
        self.target.fence.borrow().clone()
    }

    /// The endpoint's configuration.
    pub fn config(&self) -> &TcpConfig {
        &self.target.config
    }

    /// Connections being served now.
    pub fn connections(&self) -> usize {
        self.target.conns.borrow().len()
    }

    /// Stops serving: the listener stops accepting and every served
    /// connection is shut down at once, so peers see the close immediately
    /// and the port can be bound again. Also done on drop.
    pub fn shutdown(&mut self) {
        if self.target.shutting_down.replace(true) {
            return;
        }
        // SAFETY: shutting down sockets we own; the fds stay open until their
        // owners (acceptor, connection tasks) drop them, so they are not
        // reused underneath us.
        unsafe {
            libc::shutdown(self.listener_fd, libc::SHUT_RDWR);
            for (_, &fd) in self.target.conns.borrow().iter() {
                libc::shutdown(fd, libc::SHUT_RDWR);
            }
        }
        // Dropping the task cancels the acceptor and closes the listener.
        self.acceptor.take();
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

async fn accept_loop(target: Rc<Target>, listener: TcpListener) {
    loop {
        let accepted = listener.accept().await;
        if target.shutting_down.get() {
            break;
        }
        match accepted {
            Ok(stream) => {
                if target.conns.borrow().len() >= target.config.max_connections {
                    tracing::warn!(
                        max = target.config.max_connections,
                        "tcp transport: connection limit reached, refusing a peer"
                    );
                    continue;
                }
                let _ = stream.set_nodelay(true);
                let key = target.conns.borrow_mut().insert(stream.as_raw_fd());
                glommio::spawn_local(serve_conn(Rc::clone(&target), stream, key)).detach();
            }
            Err(e) => {
                // Typically EMFILE: back off instead of spinning on the error.
                tracing::warn!(error = %e, "tcp transport: accept failed");
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn serve_conn(target: Rc<Target>, stream: TcpStream, key: usize) {
    let mut conn = Conn::new(stream);
    if let Err(e) = serve_frames(&target, &mut conn).await {
        tracing::debug!(error = %e, "tcp transport: closing a served connection");
    }
    // Forget the fd before closing it, so shutdown never touches a reused fd.
    target.conns.borrow_mut().try_remove(key);
    drop(conn);
}

/// Most answers a served connection holds back before it sends them anyway.
const MAX_HELD_ANSWERS: usize = 64;

/// Answers of a served connection not sent yet, in request order.
///
/// A connection answers what it has read only when the next request is not
/// there yet, after one pass of the executor's other ready tasks. Answers
/// to frames that arrive together (a WRITE and the notification riding
/// behind it, a run of WRITEs) then leave in one `sendmsg` and wake the
/// peer once, and a notification's handler gets to run first: on a decode
/// rank the request completes and its engine hears of it before the
/// prefill rank is woken to read the acknowledgements (on a shared core,
/// that wake-up otherwise runs on the critical path).
#[derive(Default)]
struct Answers {
    bytes: Vec<u8>,
}

impl Answers {
    fn hold(&mut self, h: Header) {
        self.bytes.extend_from_slice(&h.encode());
    }

    fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    fn is_full(&self) -> bool {
        self.bytes.len() >= MAX_HELD_ANSWERS * wire::HEADER_LEN
    }

    async fn flush(&mut self, conn: &mut Conn) -> Result<(), TransportError> {
        if self.bytes.is_empty() {
            return Ok(());
        }
        let mut v = [iov(self.bytes.as_ptr() as u64, self.bytes.len() as u64)];
        fdio::send_all(&mut conn.wr, conn.fd, &mut v, None)
            .await
            .map_err(conv("answering"))?;
        self.bytes.clear();
        Ok(())
    }

    /// Sends the held answers and then `h` (a refusal before the
    /// connection closes, so the peer learns why).
    async fn respond(&mut self, conn: &mut Conn, h: Header) -> Result<(), TransportError> {
        self.hold(h);
        self.flush(conn).await
    }
}

/// Checks the answer to notification `req_id` (a NOTIFY or a
/// NOTIFY_AFTER_WRITE, `opcode`): `None` when the peer's handler took it,
/// else why the peer refused it.
fn notification_answer(
    answer: &[u8; wire::HEADER_LEN],
    opcode: u8,
    req_id: u64,
) -> Result<Option<RejectReason>, TransportError> {
    let h = Header::decode(answer).map_err(|_| protocol("bad notification answer header"))?;
    if h.opcode != opcode || h.req_id != req_id || h.payload_len != 0 {
        return Err(protocol("unexpected notification answer"));
    }
    Ok((h.status != wire::STATUS_OK).then(|| RejectReason::from_status(h.status)))
}

/// What a served connection reads at a time when it reads for itself.
const IN_BUF_BYTES: usize = 4096;

/// Bytes read from a served connection and not parsed yet.
///
/// Headers, descriptor tables and notification payloads are read a buffer
/// at a time, so the frames that arrive together (a WRITE with a small
/// payload and the notification riding behind it) cost one `recv` instead
/// of one per piece. Payload bytes that came along are copied into their
/// registered ranges (under the block fence, like a `recv` into them);
/// the rest of a payload is read straight into registered memory.
struct InBuf {
    bytes: Vec<u8>,
    start: usize,
    end: usize,
}

impl InBuf {
    fn new() -> InBuf {
        InBuf {
            bytes: vec![0; IN_BUF_BYTES],
            start: 0,
            end: 0,
        }
    }

    fn len(&self) -> usize {
        self.end - self.start
    }

    /// Room at the end for the next read, moving what is left to the front.
    fn spare(&mut self) -> &mut [u8] {
        if self.start > 0 {
            self.bytes.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        &mut self.bytes[self.end..]
    }

    /// One non-blocking read: `Ok(false)` when nothing was there.
    fn try_fill(&mut self, fd: RawFd) -> Result<bool, IoFail> {
        let n = fdio::recv_now(fd, self.spare())?;
        self.end += n.unwrap_or(0);
        Ok(n.is_some())
    }

    /// Reads at least one byte, waiting for it.
    async fn fill(&mut self, conn: &mut Conn, poll: PollPolicy) -> Result<(), IoFail> {
        let n = fdio::recv_some(&mut conn.rd, conn.fd, self.spare(), poll).await?;
        self.end += n;
        Ok(())
    }

    /// Drops up to `max` buffered bytes; returns how many.
    fn skip(&mut self, max: u64) -> u64 {
        let n = (self.len() as u64).min(max);
        self.start += n as usize;
        n
    }

    /// Takes up to `dst.len()` buffered bytes into `dst`; returns how many.
    fn drain(&mut self, dst: &mut [u8]) -> usize {
        let n = self.len().min(dst.len());
        dst[..n].copy_from_slice(&self.bytes[self.start..self.start + n]);
        self.start += n;
        n
    }

    /// Takes up to `max` buffered bytes into the memory `iovs` name,
    /// advancing them past what was written; returns how many.
    fn drain_into(&mut self, iovs: &mut [libc::iovec], max: u64) -> usize {
        let n = (self.len() as u64).min(max) as usize;
        fdio::copy_into(iovs, &self.bytes[self.start..self.start + n]);
        self.start += n;
        n
    }

    /// Fills `dst` from the buffer, then from the socket.
    async fn read_exact(
        &mut self,
        conn: &mut Conn,
        dst: &mut [u8],
        poll: PollPolicy,
    ) -> Result<(), IoFail> {
        let got = self.drain(dst);
        if got < dst.len() {
            let rest = &mut dst[got..];
            let mut v = [iov(rest.as_mut_ptr() as u64, rest.len() as u64)];
            fdio::recv_exact(&mut conn.rd, conn.fd, &mut v, poll, None).await?;
        }
        Ok(())
    }
}

fn reject(opcode: u8, req_id: u64, reason: RejectReason, detail: u32) -> Header {
    Header {
        opcode,
        status: reason.to_status(),
        count: 0,
        detail,
        req_id,
        payload_len: 0,
    }
}

/// Serves frames until the peer closes or breaks the framing. Every frame is
/// validated completely (header, table, lengths, regions) before any byte
/// of registered memory is touched.
async fn serve_frames(target: &Target, conn: &mut Conn) -> Result<(), TransportError> {
    let poll = target.config.poll;
    let fd = conn.fd;
    let mut hb = [0u8; wire::HEADER_LEN];
    let mut table: Vec<u8> = Vec::new();
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    let mut iovs: Vec<libc::iovec> = Vec::new();
    let mut scratch: Vec<u8> = Vec::new();
    // WRITE frames that landed in full right before the current frame.
    let mut landed_run: u32 = 0;
    let mut answers = Answers::default();
    let mut inbuf = InBuf::new();
    loop {
        let run_before = std::mem::take(&mut landed_run);
        if answers.is_full() {
            answers.flush(conn).await?;
        }
        if inbuf.len() < hb.len() && !answers.is_empty() {
            // Another request already here is read first; otherwise the
            // tasks the delivered requests woke run once, then the answers go.
            match inbuf.try_fill(fd) {
                Ok(true) => {}
                Ok(false) => futures_lite::future::yield_now().await,
                // A close between frames is the normal end of a connection.
                Err(IoFail::Closed) if inbuf.len() == 0 => return Ok(()),
                Err(e) => return Err(conv("reading a header")(e)),
            }
        }
        if inbuf.len() < hb.len() {
            answers.flush(conn).await?;
            while inbuf.len() < hb.len() {
                match inbuf.fill(conn, poll).await {
                    Ok(()) => {}
                    Err(IoFail::Closed) if inbuf.len() == 0 => return Ok(()),
                    Err(e) => return Err(conv("reading a header")(e)),
                }
            }
        }
        inbuf.drain(&mut hb);
        let h = match Header::decode(&hb) {
            Ok(h) if h.status == wire::STATUS_OK => h,
            Ok(h) => {
                answers
                    .respond(conn, reject(h.opcode, h.req_id, RejectReason::BadHeader, 0))
                    .await?;
                return Err(protocol("request with a status byte"));
            }
            Err(reason) => {
                answers.respond(conn, reject(hb[4], 0, reason, 0)).await?;
                return Err(protocol("bad request header"));
            }
        };
        let (op, opcode) = match h.opcode {
            wire::OP_WRITE => (Op::Write, h.opcode),
            wire::OP_READ => (Op::Read, h.opcode),
            wire::OP_REGIONS => {
                if h.count != 0 || h.payload_len != 0 {
                    answers
                        .respond(conn, reject(h.opcode, h.req_id, RejectReason::BadHeader, 0))
                        .await?;
                    return Err(protocol("REGIONS request with a body"));
                }
                answers.flush(conn).await?;
                send_regions(target, conn, h.req_id).await?;
                continue;
            }
            wire::OP_NOTIFY | wire::OP_NOTIFY_AFTER_WRITE => {
                if h.count != 0 || h.payload_len > wire::MAX_NOTIFY_BYTES {
                    answers
                        .respond(conn, reject(h.opcode, h.req_id, RejectReason::TooLarge, 0))
                        .await?;
                    return Err(protocol("NOTIFY with descriptors or too long"));
                }
                // Bounded by MAX_NOTIFY_BYTES; never registered memory.
                scratch.resize(h.payload_len as usize, 0);
                inbuf
                    .read_exact(conn, &mut scratch, poll)
                    .await
                    .map_err(conv("reading a notification"))?;
                // A conditional notification says what its sender learns
                // only from the WRITEs before it: deliver it only if they
                // all landed (a fenced one closed the connection already).
                let deliverable =
                    h.opcode == wire::OP_NOTIFY || (h.detail >= 1 && h.detail <= run_before);
                let handler = target.notify.borrow().clone();
                let taken = deliverable && handler.is_some_and(|f| f(&scratch));
                let answer = if taken {
                    Header {
                        opcode: h.opcode,
                        req_id: h.req_id,
                        ..Header::default()
                    }
                } else {
                    reject(h.opcode, h.req_id, RejectReason::Undeliverable, 0)
                };
                answers.hold(answer);
                continue;
            }
            other => {
                answers
                    .respond(
                        conn,
                        reject(other, h.req_id, RejectReason::UnknownOpcode, 0),
                    )
                    .await?;
                return Err(protocol(format!("unknown opcode {other}")));
            }
        };
        if h.count == 0 || h.count > wire::MAX_FRAME_DESCS {
            answers
                .respond(conn, reject(opcode, h.req_id, RejectReason::TooLarge, 0))
                .await?;
            return Err(protocol("descriptor count out of range"));
        }
        // The table is bounded by MAX_FRAME_DESCS entries (64 KiB).
        table.resize(h.count as usize * wire::ENTRY_LEN, 0);
        inbuf
            .read_exact(conn, &mut table, poll)
            .await
            .map_err(conv("reading a descriptor table"))?;
        ranges.clear();
        let mut total: u64 = 0;
        for i in 0..h.count as usize {
            let (addr, len) = wire::decode_entry(&table, i);
            total = total.saturating_add(len);
            ranges.push((addr, len));
        }
        if total > wire::MAX_FRAME_BYTES {
            answers
                .respond(conn, reject(opcode, h.req_id, RejectReason::TooLarge, 0))
                .await?;
            return Err(protocol("frame payload too large"));
        }
        let expected_payload = match op {
            Op::Write => total,
            Op::Read => 0,
        };
        if h.payload_len != expected_payload {
            answers
                .respond(
                    conn,
                    reject(opcode, h.req_id, RejectReason::LengthMismatch, 0),
                )
                .await?;
            return Err(protocol("payload length does not match the descriptors"));
        }
        let pins = match target.registry.pin(ranges.iter().copied()) {
            Ok(pins) => pins,
            Err((index, fault)) => {
                // The framing is sound, so skip the payload without touching
                // registered memory and keep serving this connection.
                if op == Op::Write {
                    scratch.resize(64 << 10, 0);
                    let buffered = inbuf.skip(h.payload_len);
                    fdio::discard(
                        &mut conn.rd,
                        fd,
                        h.payload_len - buffered,
                        &mut scratch,
                        poll,
                    )
                    .await
                    .map_err(conv("discarding a rejected payload"))?;
                }
                let reason = match fault {
                    registry::RangeFault::Empty => RejectReason::EmptyDescriptor,
                    registry::RangeFault::Overflow => RejectReason::Overflow,
                    registry::RangeFault::OutOfRegion => RejectReason::OutOfRegion,
                };
                answers.hold(reject(opcode, h.req_id, reason, index as u32));
                continue;
            }
        };
        iovs.clear();
        match op {
            Op::Write => {
                iovs.extend(ranges.iter().map(|&(a, l)| iov(a, l)));
                let fence = target.fence.borrow().clone();
                let guard = Guard::new(fence.as_deref());
                let allowed = || guard.check(ranges.iter().copied());
                // What came along with the header goes in first, under the
                // fence like any read into these ranges.
                if inbuf.len() > 0 {
                    if !allowed() {
                        return Err(conv("receiving a payload")(IoFail::Fenced));
                    }
                    inbuf.drain_into(&mut iovs, h.payload_len);
                }
                // The payload follows its header at once or streams in at
                // bulk pace; either way spinning buys nothing, and on shared
                // cores it slows the sender, so payloads always park. A
                // fenced payload closes the connection: the peer's batch
                // fails and the rest of its bytes are never read.
                fdio::recv_exact(
                    &mut conn.rd,
                    fd,
                    &mut iovs,
                    PollPolicy::Park,
                    Some(&allowed),
                )
                .await
                .map_err(conv("receiving a payload"))?;
                drop(pins);
                let ok = Header {
                    opcode,
                    req_id: h.req_id,
                    ..Header::default()
                };
                answers.hold(ok);
                landed_run = run_before.saturating_add(1);
            }
            Op::Read => {
                answers.flush(conn).await?;
                let ok = Header {
                    opcode,
                    req_id: h.req_id,
                    payload_len: total,
                    ..Header::default()
                };
                let ob = ok.encode();
                iovs.push(iov(ob.as_ptr() as u64, ob.len() as u64));
                iovs.extend(ranges.iter().map(|&(a, l)| iov(a, l)));
                let fence = target.fence.borrow().clone();
                let guard = Guard::new(fence.as_deref());
                let allowed = || guard.check(ranges.iter().copied());
                fdio::send_all(&mut conn.wr, fd, &mut iovs, Some(&allowed))
                    .await
                    .map_err(conv("sending a payload"))?;
                drop(pins);
            }
        }
    }
}

async fn send_regions(target: &Target, conn: &mut Conn, req_id: u64) -> Result<(), TransportError> {
    let regions = target.registry.regions();
    let h = Header {
        opcode: wire::OP_REGIONS,
        count: regions.len() as u32,
        req_id,
        payload_len: (regions.len() * wire::ENTRY_LEN) as u64,
        ..Header::default()
    };
    let mut body = Vec::with_capacity(wire::HEADER_LEN + regions.len() * wire::ENTRY_LEN);
    body.extend_from_slice(&h.encode());
    for r in &regions {
        wire::encode_entry(&mut body, r.addr, r.len_bytes);
    }
    let mut v = [iov(body.as_ptr() as u64, body.len() as u64)];
    fdio::send_all(&mut conn.wr, conn.fd, &mut v, None)
        .await
        .map_err(conv("sending regions"))
}

// ---------------------------------------------------------------------------
// Initiator side
// ---------------------------------------------------------------------------

struct SessionInner {
    peer: SocketAddr,
    config: TcpConfig,
    local: Arc<Registry>,
    /// The endpoint's block fence, read at each batch.
    fence: FenceCell,
    /// One slot per stream; `None` until connected or after a failure.
    slots: Vec<Mutex<Option<Conn>>>,
    /// One unit per stream; a batch of `k` streams waits for `k` units,
    /// strictly in arrival order (see [`Turns`]).
    turns: Turns,
    /// A connection of its own for NOTIFY frames, taken in arrival order
    /// (one unit): a notification never queues behind bulk batches. Those
    /// that must follow data (a `Status` after the writes it reports) are
    /// sent once the data's acknowledgement is back, so no ordering between
    /// connections is needed.
    note_slot: Mutex<Option<Conn>>,
    note_turn: Turns,
    /// The peer's regions as last fetched, sorted by address.
    remote_regions: RefCell<Vec<RegionInfo>>,
    next_req_id: Cell<u64>,
    next_slot: Cell<usize>,
    closed: Cell<bool>,
}

/// A session to one TCP peer. Cheap to clone; clones share the streams.
#[derive(Clone)]
pub struct TcpSession {
    inner: Rc<SessionInner>,
}

impl TcpTransport {
    /// Opens a session to the endpoint listening at `peer`.
    pub async fn open_tcp(&self, peer: SocketAddr) -> Result<TcpSession, TransportError> {
        let config = self.target.config.clone();
        let slots = (0..config.streams).map(|_| Mutex::new(None)).collect();
        let turns = Turns::new(config.streams);
        let session = TcpSession {
            inner: Rc::new(SessionInner {
                peer,
                config,
                local: Arc::clone(&self.target.registry),
                fence: Rc::clone(&self.target.fence),
                slots,
                turns,
                note_slot: Mutex::new(None),
                note_turn: Turns::new(1),
                remote_regions: RefCell::new(Vec::new()),
                next_req_id: Cell::new(1),
                next_slot: Cell::new(0),
                closed: Cell::new(false),
            }),
        };
        // Connect one stream now, so an unreachable peer fails here, and
        // learn the peer's regions for the initiator-side check.
        let mut slot = session.inner.slots[0].lock().await;
        session.inner.refresh_regions(&mut slot).await?;
        drop(slot);
        Ok(session)
    }
}

/// One frame of a batch: descriptors `start..end` of the (split) batch.
#[derive(Clone, Copy, Debug)]
struct FrameSpec {
    start: usize,
    end: usize,
    bytes: u64,
}

/// A batch cut to frame size.
struct Plan<'a> {
    descs: Cow<'a, [Desc]>,
    /// Index in the caller's batch of each descriptor, when some were split.
    origin: Option<Vec<usize>>,
    frames: Vec<FrameSpec>,
}

fn plan<'a>(descs: &'a [Desc], config: &TcpConfig) -> Plan<'a> {
    let max_bytes = config.frame_max_bytes;
    let (descs, origin) = if descs.iter().any(|d| d.len_bytes > max_bytes) {
        let mut split = Vec::with_capacity(descs.len());
        let mut origin = Vec::with_capacity(descs.len());
        for (i, d) in descs.iter().enumerate() {
            let mut off = 0;
            while off < d.len_bytes {
                let len = (d.len_bytes - off).min(max_bytes);
                // The remote side is only checked after planning, so a
                // hostile `remote_addr` must not overflow here; wrapped
                // pieces fail that check like the original would.
                split.push(Desc {
                    local_addr: d.local_addr.wrapping_add(off),
                    remote_addr: d.remote_addr.wrapping_add(off),
                    len_bytes: len,
                });
                origin.push(i);
                off += len;
            }
        }
        (Cow::Owned(split), Some(origin))
    } else {
        (Cow::Borrowed(descs), None)
    };
    let mut frames = Vec::new();
    let mut cur = FrameSpec {
        start: 0,
        end: 0,
        bytes: 0,
    };
    for (i, d) in descs.iter().enumerate() {
        let full = cur.end - cur.start >= config.frame_max_descs as usize
            || cur.bytes + d.len_bytes > max_bytes;
        if cur.end > cur.start && full {
            frames.push(cur);
            cur = FrameSpec {
                start: i,
                end: i,
                bytes: 0,
            };
        }
        cur.end = i + 1;
        cur.bytes += d.len_bytes;
    }
    if cur.end > cur.start {
        frames.push(cur);
    }
    Plan {
        descs,
        origin,
        frames,
    }
}

impl SessionInner {
    /// Makes sure the slot holds a live connection, reconnecting when the
    /// previous one failed or the peer closed it (e.g. it restarted).
    async fn ensure_conn(&self, slot: &mut Option<Conn>) -> Result<(), TransportError> {
        if slot.as_ref().is_some_and(Conn::is_stale) {
            *slot = None;
        }
        if slot.is_none() {
            let timeout = Duration::from_millis(self.config.connect_timeout_ms);
            let stream = TcpStream::connect_timeout(self.peer, timeout)
                .await
                .map_err(|e| TransportError::io("connect", e.into()))?;
            let _ = stream.set_nodelay(true);
            *slot = Some(Conn::new(stream));
        }
        Ok(())
    }

    fn take_req_ids(&self, n: u64) -> u64 {
        let base = self.next_req_id.get();
        self.next_req_id.set(base.wrapping_add(n));
        base
    }

    async fn refresh_regions(&self, slot: &mut Option<Conn>) -> Result<(), TransportError> {
        self.ensure_conn(slot).await?;
        // Taken out so that a failure or cancellation drops (closes) it.
        let Some(mut conn) = slot.take() else {
            unreachable!("ensure_conn leaves a connection in the slot")
        };
        let req_id = self.take_req_ids(1);
        let poll = self.config.poll;
        let mut hb = Header {
            opcode: wire::OP_REGIONS,
            req_id,
            ..Header::default()
        }
        .encode();
        let mut v = [iov(hb.as_ptr() as u64, hb.len() as u64)];
        fdio::send_all(&mut conn.wr, conn.fd, &mut v, None)
            .await
            .map_err(conv("asking for regions"))?;
        let mut v = [iov(hb.as_mut_ptr() as u64, hb.len() as u64)];
        fdio::recv_exact(&mut conn.rd, conn.fd, &mut v, poll, None)
            .await
            .map_err(conv("reading regions"))?;
        let h = Header::decode(&hb).map_err(|_| protocol("bad REGIONS response header"))?;
        if h.opcode != wire::OP_REGIONS || h.req_id != req_id || h.status != wire::STATUS_OK {
            return Err(protocol("unexpected REGIONS response"));
        }
        if h.count > wire::MAX_REGIONS
            || h.payload_len != u64::from(h.count) * wire::ENTRY_LEN as u64
        {
            return Err(protocol("REGIONS response of a bad size"));
        }
        let mut table = vec![0u8; h.payload_len as usize];
        let mut v = [iov(table.as_mut_ptr() as u64, table.len() as u64)];
        fdio::recv_exact(&mut conn.rd, conn.fd, &mut v, poll, None)
            .await
            .map_err(conv("reading regions"))?;
        let mut regions: Vec<RegionInfo> = (0..h.count as usize)
            .map(|i| {
                let (addr, len_bytes) = wire::decode_entry(&table, i);
                RegionInfo { addr, len_bytes }
            })
            .collect();
        regions.sort_by_key(|r| r.addr);
        // The list is peer input: reject empty, wrapping or overlapping
        // regions rather than trusting them in later range checks.
        let mut prev_end = 0u64;
        for r in &regions {
            let end = r.addr.checked_add(r.len_bytes).filter(|_| r.len_bytes > 0);
            match end {
                Some(end) if r.addr >= prev_end => prev_end = end,
                _ => return Err(protocol("peer advertised a malformed region list")),
            }
        }
        *self.remote_regions.borrow_mut() = regions;
        *slot = Some(conn);
        Ok(())
    }

    /// Locks `k` unlocked streams, starting at a rotating one so that the
    /// connections share the work. The caller holds `k` turns, which means
    /// at least `k` streams are unlocked: only `close` holds a stream
    /// without a turn, and it marks the session closed first.
    fn free_streams(&self, k: usize) -> Result<Vec<MutexGuard<'_, Option<Conn>>>, TransportError> {
        let n = self.slots.len();
        let first = self.next_slot.get();
        self.next_slot.set((first + 1) % n);
        let guards: Vec<_> = (0..n)
            .filter_map(|i| self.slots[(first + i) % n].try_lock())
            .take(k)
            .collect();
        if guards.len() < k {
            return Err(MisuseError::SessionClosed.into());
        }
        Ok(guards)
    }

    /// Sends one NOTIFY on the session's notification connection and waits
    /// for its answer.
    async fn notify(&self, payload: &[u8]) -> Result<(), TransportError> {
        if self.closed.get() {
            return Err(MisuseError::SessionClosed.into());
        }
        if payload.len() as u64 > wire::MAX_NOTIFY_BYTES {
            return Err(MisuseError::BadConfig(format!(
                "a notification of {} bytes exceeds {}",
                payload.len(),
                wire::MAX_NOTIFY_BYTES
            ))
            .into());
        }
        let _turn = self.note_turn.acquire(1).await;
        // Uncontended: the turn is held, and only `close` takes it otherwise.
        let mut guard = self.note_slot.lock().await;
        if self.closed.get() {
            return Err(MisuseError::SessionClosed.into());
        }
        self.ensure_conn(&mut guard).await?;
        // Taken out so that a failure or cancellation drops (closes) it.
        let Some(mut conn) = guard.take() else {
            unreachable!("ensure_conn leaves a connection in the slot")
        };
        let req_id = self.take_req_ids(1);
        let h = Header {
            opcode: wire::OP_NOTIFY,
            req_id,
            payload_len: payload.len() as u64,
            ..Header::default()
        };
        let hb = h.encode();
        let mut v = [
            iov(hb.as_ptr() as u64, hb.len() as u64),
            iov(payload.as_ptr() as u64, payload.len() as u64),
        ];
        fdio::send_all(&mut conn.wr, conn.fd, &mut v, None)
            .await
            .map_err(conv("sending a notification"))?;
        let mut rb = [0u8; wire::HEADER_LEN];
        let mut v = [iov(rb.as_mut_ptr() as u64, rb.len() as u64)];
        fdio::recv_exact(&mut conn.rd, conn.fd, &mut v, self.config.poll, None)
            .await
            .map_err(conv("awaiting a notification answer"))?;
        let refused = notification_answer(&rb, wire::OP_NOTIFY, req_id)?;
        if refused.is_none_or(|r| r.keeps_connection()) {
            *guard = Some(conn);
        }
        match refused {
            None => Ok(()),
            Some(reason) => Err(PeerError::Rejected { reason, index: 0 }.into()),
        }
    }

    fn check_remote(&self, descs: &[Desc]) -> Result<(), (usize, registry::RangeFault)> {
        registry::check_remote(
            &self.remote_regions.borrow(),
            descs.iter().map(|d| (d.remote_addr, d.len_bytes)),
        )
    }

    /// Moves `descs`; with a `trailer` (WRITE only) that fits a
    /// notification, also hands it to the peer's handler behind the last
    /// frame when the whole batch takes one stream, delivered only if every
    /// frame landed. `Ok(true)` when the trailer was delivered.
    async fn transfer(
        &self,
        op: Op,
        descs: &[Desc],
        trailer: Option<&[u8]>,
    ) -> Result<bool, TransportError> {
        if self.closed.get() {
            return Err(MisuseError::SessionClosed.into());
        }
        if descs.is_empty() {
            return Ok(false);
        }
        let trailer =
            trailer.filter(|t| op == Op::Write && t.len() as u64 <= wire::MAX_NOTIFY_BYTES);
        if descs.len() > self.config.max_batch_descs {
            return Err(MisuseError::BatchTooLarge {
                descs: descs.len(),
                max_descs: self.config.max_batch_descs,
            }
            .into());
        }
        // Local side first: nothing is sent unless all of it is registered.
        let _pins = self
            .local
            .pin(descs.iter().map(|d| (d.local_addr, d.len_bytes)))
            .map_err(|(index, fault)| MisuseError::LocalDescriptor { index, fault })?;
        let plan = plan(descs, &self.config);
        let after_ms = self.config.batch_timeout_ms;
        let body = self.run_plan(op, descs, &plan, trailer);
        let deadline = async {
            glommio::timer::Timer::new(Duration::from_millis(after_ms)).await;
            Err(TransportError::Timeout { after_ms })
        };
        futures_lite::future::or(body, deadline).await
    }

    async fn run_plan(
        &self,
        op: Op,
        descs: &[Desc],
        plan: &Plan<'_>,
        trailer: Option<&[u8]>,
    ) -> Result<bool, TransportError> {
        let k = plan.frames.len().min(self.slots.len());
        // Frames on several streams land in no order the peer can see, so
        // only a one-stream batch carries a trailer.
        let trailer = trailer.filter(|_| k == 1);
        // Batches take their turn for streams in arrival order. Waiting on
        // the stream locks themselves was unfair: futures' `Mutex` wakes the
        // waiter with the lowest slab key, which new waiters keep reusing,
        // and newcomers grab any idle stream first, so under load some
        // batches waited behind hundreds of later ones (p99 near a second
        // for transfers that move in milliseconds). glommio's semaphore
        // lets newcomers pass too, so the turns are our own FIFO.
        let _turn = self.turns.acquire(k).await;
        let mut guards = self.free_streams(k)?;
        for g in guards.iter_mut() {
            self.ensure_conn(g).await?;
        }
        // Remote side: check against the peer's regions, refreshing them
        // once if they look stale, before any byte moves.
        if self.check_remote(descs).is_err() {
            self.refresh_regions(&mut guards[0]).await?;
            self.check_remote(descs)
                .map_err(|(index, fault)| MisuseError::RemoteDescriptor { index, fault })?;
        }
        let ids = plan.frames.len() as u64 + u64::from(trailer.is_some());
        let base_req_id = self.take_req_ids(ids);
        let per_stream_bytes = self.config.inflight_max_bytes / k as u64;
        let streams = guards.iter_mut().enumerate().map(|(j, g)| {
            let stream = Stream {
                op,
                j,
                k,
                base_req_id,
                per_stream_bytes,
            };
            self.drive_stream(g, plan, stream, trailer)
        });
        let delivered = futures::future::try_join_all(streams).await?;
        Ok(delivered.into_iter().any(|d| d))
    }

    /// Sends frames `j, j+k, j+2k, ...` of the plan on one stream while
    /// reading their responses; then the `trailer`, if any, as a
    /// NOTIFY_AFTER_WRITE in the same send as the last frame. `Ok(true)`
    /// when the peer's handler took the trailer.
    async fn drive_stream(
        &self,
        slot: &mut Option<Conn>,
        plan: &Plan<'_>,
        stream: Stream,
        trailer: Option<&[u8]>,
    ) -> Result<bool, TransportError> {
        let Stream {
            op,
            j,
            k,
            base_req_id,
            per_stream_bytes,
        } = stream;
        // Taken out so that a failure or cancellation drops (closes) it: a
        // stream that stopped mid-frame is out of step for good.
        let Some(mut conn) = slot.take() else {
            unreachable!("ensure_conn leaves a connection in the slot")
        };
        let poll = self.config.poll;
        let fd = conn.fd;
        let opcode = match op {
            Op::Write => wire::OP_WRITE,
            Op::Read => wire::OP_READ,
        };
        let credit = Semaphore::new(per_stream_bytes);
        let all_sent = Cell::new(false);
        let fence = self.fence.borrow().clone();
        let frames = || plan.frames.iter().enumerate().skip(j).step_by(k);
        let descs = &plan.descs[..];
        let Conn { rd, wr, .. } = &mut conn;
        let frames_here = frames().count();
        let trailer_id = base_req_id.wrapping_add(plan.frames.len() as u64);
        let trailer_head = trailer.map(|t| {
            Header {
                opcode: wire::OP_NOTIFY_AFTER_WRITE,
                // Only one-stream batches carry a trailer: every frame of
                // the plan is right before it.
                detail: frames_here as u32,
                req_id: trailer_id,
                payload_len: t.len() as u64,
                ..Header::default()
            }
            .encode()
        });
        let send = async {
            let mut head: Vec<u8> = Vec::new();
            let mut iovs: Vec<libc::iovec> = Vec::new();
            for (i, (n, f)) in frames().enumerate() {
                credit
                    .acquire(f.bytes.min(per_stream_bytes))
                    .await
                    .map_err(|_| protocol("credit semaphore closed"))?;
                let h = Header {
                    opcode,
                    count: (f.end - f.start) as u32,
                    req_id: base_req_id.wrapping_add(n as u64),
                    payload_len: match op {
                        Op::Write => f.bytes,
                        Op::Read => 0,
                    },
                    ..Header::default()
                };
                head.clear();
                head.extend_from_slice(&h.encode());
                for d in &descs[f.start..f.end] {
                    wire::encode_entry(&mut head, d.remote_addr, d.len_bytes);
                }
                iovs.clear();
                iovs.push(iov(head.as_ptr() as u64, head.len() as u64));
                if op == Op::Write {
                    iovs.extend(
                        descs[f.start..f.end]
                            .iter()
                            .map(|d| iov(d.local_addr, d.len_bytes)),
                    );
                }
                // The trailer shares the last frame's send: one segment,
                // one wake-up at the peer.
                if let (Some(th), Some(t), true) = (&trailer_head, trailer, i + 1 == frames_here) {
                    iovs.push(iov(th.as_ptr() as u64, th.len() as u64));
                    iovs.push(iov(t.as_ptr() as u64, t.len() as u64));
                }
                let guard = Guard::new(fence.as_deref());
                let local = || {
                    guard.check(
                        descs[f.start..f.end]
                            .iter()
                            .map(|d| (d.local_addr, d.len_bytes)),
                    )
                };
                let check: Option<&dyn Fn() -> bool> = match op {
                    Op::Write => Some(&local),
                    Op::Read => None,
                };
                fdio::send_all(wr, fd, &mut iovs, check)
                    .await
                    .map_err(conv("sending a frame"))?;
            }
            all_sent.set(true);
            Ok::<(), TransportError>(())
        };
        let recv = async {
            let mut hb = [0u8; wire::HEADER_LEN];
            let mut iovs: Vec<libc::iovec> = Vec::new();
            for (n, f) in frames() {
                let mut v = [iov(hb.as_mut_ptr() as u64, hb.len() as u64)];
                // Spin for the response only once every frame is out:
                // before that the sender half waits on io_uring readiness,
                // which a spinning sibling would only delay.
                let wait = if all_sent.get() {
                    poll
                } else {
                    PollPolicy::Park
                };
                fdio::recv_exact(rd, fd, &mut v, wait, None)
                    .await
                    .map_err(conv("awaiting a response"))?;
                let h = Header::decode(&hb).map_err(|_| protocol("bad response header"))?;
                if h.opcode != opcode || h.req_id != base_req_id.wrapping_add(n as u64) {
                    return Err(protocol("response out of order"));
                }
                if h.status != wire::STATUS_OK {
                    let in_frame = (h.detail as usize).min(f.end - f.start - 1);
                    let split_index = f.start + in_frame;
                    let index = plan.origin.as_ref().map_or(split_index, |o| o[split_index]);
                    let reason = RejectReason::from_status(h.status);
                    return Err(PeerError::Rejected { reason, index }.into());
                }
                match op {
                    Op::Write => {
                        if h.payload_len != 0 {
                            return Err(protocol("WRITE response with a payload"));
                        }
                    }
                    Op::Read => {
                        if h.payload_len != f.bytes {
                            return Err(protocol("READ response of the wrong length"));
                        }
                        iovs.clear();
                        iovs.extend(
                            descs[f.start..f.end]
                                .iter()
                                .map(|d| iov(d.local_addr, d.len_bytes)),
                        );
                        let guard = Guard::new(fence.as_deref());
                        let local = || {
                            guard.check(
                                descs[f.start..f.end]
                                    .iter()
                                    .map(|d| (d.local_addr, d.len_bytes)),
                            )
                        };
                        fdio::recv_exact(rd, fd, &mut iovs, PollPolicy::Park, Some(&local))
                            .await
                            .map_err(conv("receiving a payload"))?;
                    }
                }
                credit.signal(f.bytes.min(per_stream_bytes));
            }
            if trailer.is_none() {
                return Ok::<bool, TransportError>(false);
            }
            let mut v = [iov(hb.as_mut_ptr() as u64, hb.len() as u64)];
            fdio::recv_exact(rd, fd, &mut v, poll, None)
                .await
                .map_err(conv("awaiting a notification answer"))?;
            match notification_answer(&hb, wire::OP_NOTIFY_AFTER_WRITE, trailer_id)? {
                None => Ok(true),
                // Every frame landed; the peer only did not take the trailer.
                Some(reason) if reason.keeps_connection() => Ok(false),
                Some(reason) => Err(PeerError::Rejected { reason, index: 0 }.into()),
            }
        };
        let (_, delivered) = futures::future::try_join(send, recv).await?;
        *slot = Some(conn);
        Ok(delivered)
    }
}

/// Where one stream's share of a plan lies: frames `j, j+k, ...`.
#[derive(Clone, Copy)]
struct Stream {
    op: Op,
    j: usize,
    k: usize,
    base_req_id: u64,
    per_stream_bytes: u64,
}

impl Session for TcpSession {
    async fn transfer(&self, op: Op, descs: &[Desc]) -> Result<(), TransportError> {
        self.inner.transfer(op, descs, None).await.map(|_| ())
    }

    async fn close(self) {
        self.inner.closed.set(true);
        for slot in &self.inner.slots {
            slot.lock().await.take();
        }
        self.inner.note_slot.lock().await.take();
    }
}

impl TcpSession {
    /// The peer's listening address.
    pub fn peer(&self) -> SocketAddr {
        self.inner.peer
    }

    /// The peer's regions as last learned from it.
    pub fn remote_regions(&self) -> Vec<RegionInfo> {
        self.inner.remote_regions.borrow().clone()
    }

    /// Writes `descs` like [`Session::transfer`], and hands `trailer` to
    /// the peer's notification handler only once every byte landed: in the
    /// same send as the last frame when the batch fits one stream (then
    /// `Ok(true)` says the handler took it), else not at all (`Ok(false)`:
    /// the caller delivers it its own way). The peer's node learns the
    /// batch landed one trip earlier than from this side.
    pub async fn write_then_notify(
        &self,
        descs: &[Desc],
        trailer: &[u8],
    ) -> Result<bool, TransportError> {
        self.inner.transfer(Op::Write, descs, Some(trailer)).await
    }

    /// Hands `payload` (at most [`wire::MAX_NOTIFY_BYTES`]) to the peer's
    /// notification handler; `Ok` once the handler took it. Notifications
    /// have a connection of their own, taken in arrival order, so they never
    /// wait behind bulk batches, and nothing orders them against batches
    /// still in flight: to say something about data, send it once that
    /// data's batch returned (or use [`TcpSession::write_then_notify`]).
    pub async fn notify(&self, payload: &[u8]) -> Result<(), TransportError> {
        let after_ms = self.inner.config.batch_timeout_ms;
        let deadline = async {
            glommio::timer::Timer::new(Duration::from_millis(after_ms)).await;
            Err(TransportError::Timeout { after_ms })
        };
        futures_lite::future::or(self.inner.notify(payload), deadline).await
    }
}

impl Transport for TcpTransport {
    type Session = TcpSession;

    unsafe fn register(&self, addr: *mut u8, len_bytes: usize) -> Result<RegionId, TransportError> {
        Ok(self.target.registry.insert(addr as u64, len_bytes as u64)?)
    }

    fn unregister(&self, id: RegionId) -> Result<(), TransportError> {
        Ok(self.target.registry.remove(id)?)
    }

    fn regions(&self) -> Vec<RegionInfo> {
        self.target.registry.regions()
    }

    fn endpoint_addr(&self) -> EndpointAddr {
        EndpointAddr::Tcp(self.local_addr)
    }

    async fn open(&self, peer: &EndpointAddr) -> Result<TcpSession, TransportError> {
        match peer {
            EndpointAddr::Tcp(addr) => self.open_tcp(*addr).await,
            EndpointAddr::Local(_) => {
                Err(MisuseError::UnreachableEndpoint(peer.to_string()).into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_splits_and_groups() {
        let config = TcpConfig {
            frame_max_bytes: 100,
            frame_max_descs: 3,
            ..TcpConfig::default()
        };
        let d = |len| Desc {
            local_addr: 0,
            remote_addr: 1000,
            len_bytes: len,
        };
        let descs = [d(250), d(10), d(10), d(10), d(10), d(90)];
        let p = plan(&descs, &config);
        let sizes: Vec<u64> = p.descs.iter().map(|d| d.len_bytes).collect();
        assert_eq!(sizes, vec![100, 100, 50, 10, 10, 10, 10, 90]);
        assert_eq!(p.origin.as_deref(), Some(&[0, 0, 0, 1, 2, 3, 4, 5][..]));
        assert_eq!(p.descs[2].remote_addr, 1200);
        let frames: Vec<(usize, usize, u64)> =
            p.frames.iter().map(|f| (f.start, f.end, f.bytes)).collect();
        assert_eq!(
            frames,
            vec![(0, 1, 100), (1, 2, 100), (2, 5, 70), (5, 7, 20), (7, 8, 90)]
        );
    }
}
