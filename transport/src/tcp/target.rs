//! The target side of a TCP endpoint: the acceptor and the connections it
//! serves against the endpoint's registered memory.

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use glommio::net::{TcpListener, TcpStream};
use slab::Slab;

use kvferry_auth::seal::{Sealer, TAG_LEN};
use kvferry_auth::{ClusterKey, Surface};

use super::auth::{self, Head};
use super::config::TcpConfig;
use super::fail::{conv, protocol};
use super::inbuf::InBuf;
use super::shared::{DeviceSide, FenceCell};
use crate::device::{Dir, Lease, Mark};
use crate::fdio::{self, iov, Conn, IoFail};
use crate::fence::Guard;
use crate::registry::{self, Registry};
use crate::shm::{HostId, ShmTarget, HOST_ID_LEN};
use crate::wire::{self, Header, RejectReason};
use crate::{Op, PollPolicy, TransportError};

/// Takes the bytes of a NOTIFY frame on the target's executor; returns
/// whether it took them (a refusal tells the sender to use another path).
pub type NotifyHandler = Rc<dyn Fn(&[u8]) -> bool>;

/// State shared by the acceptor and the connection tasks of one endpoint.
pub(super) struct Target {
    /// The device behind device regions, when configured.
    pub(super) device: Option<Rc<DeviceSide>>,
    pub(super) registry: Arc<Registry>,
    /// The node's block fence, shared with the sessions this endpoint opens.
    pub(super) fence: FenceCell,
    pub(super) config: TcpConfig,
    /// Where NOTIFY frames go; without one they are refused.
    pub(super) notify: RefCell<Option<NotifyHandler>>,
    /// Sockets of the live connections, so shutdown can close them at once.
    pub(super) conns: RefCell<Slab<RawFd>>,
    pub(super) shutting_down: Cell<bool>,
    /// Shared memory with peers on this host, unless off or unavailable.
    pub(super) shm: Option<ShmTarget>,
}

pub(super) async fn accept_loop(target: Rc<Target>, listener: TcpListener) {
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
    /// Holds `h`, sealed now: answers go out in the order they are held.
    fn hold(&mut self, seal: &mut Option<Sealer>, h: Header) {
        self.bytes
            .extend_from_slice(Head::new(seal, &h, &[]).bytes());
    }

    fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    fn is_full(&self) -> bool {
        self.bytes.len() >= MAX_HELD_ANSWERS * wire::SEALED_HEADER_LEN
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
        self.hold(&mut conn.seal, h);
        self.flush(conn).await
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
    let mut served = Served::new(target, conn);
    if let Some(key) = &target.config.key {
        served.authenticate(key).await?;
    }
    // WRITE frames that landed in full right before the current frame.
    let mut landed_run: u32 = 0;
    loop {
        let run_before = std::mem::take(&mut landed_run);
        let Some(h) = served.next_header().await? else {
            // A close between frames is the normal end of a connection.
            return Ok(());
        };
        match h.opcode {
            wire::OP_WRITE => {
                if served.serve_data(Op::Write, &h).await? {
                    landed_run = run_before.saturating_add(1);
                }
            }
            wire::OP_READ => {
                served.serve_data(Op::Read, &h).await?;
            }
            wire::OP_REGIONS => served.serve_regions(&h).await?,
            wire::OP_SHM => served.serve_shm(&h).await?,
            wire::OP_NOTIFY | wire::OP_NOTIFY_AFTER_WRITE => {
                served.serve_notify(&h, run_before).await?
            }
            other => {
                let why = format!("unknown opcode {other}");
                let reason = RejectReason::UnknownOpcode;
                return Err(served.refuse(other, h.req_id, reason, why).await);
            }
        }
    }
}

/// One served connection and the buffers it reuses from frame to frame.
struct Served<'a> {
    target: &'a Target,
    conn: &'a mut Conn,
    poll: PollPolicy,
    answers: Answers,
    inbuf: InBuf,
    /// The current frame's descriptor table as read...
    table: Vec<u8>,
    /// ...and decoded: `(addr, len)` ranges of the target's memory.
    ranges: Vec<(u64, u64)>,
    iovs: Vec<libc::iovec>,
    /// A notification's payload, or the bytes of a refused payload.
    scratch: Vec<u8>,
    /// The current frame's header as read, until its tag is checked.
    raw: Head,
}

impl<'a> Served<'a> {
    fn new(target: &'a Target, conn: &'a mut Conn) -> Served<'a> {
        Served {
            target,
            conn,
            poll: target.config.poll,
            answers: Answers::default(),
            inbuf: InBuf::new(),
            table: Vec::new(),
            ranges: Vec::new(),
            iovs: Vec::new(),
            scratch: Vec::new(),
            raw: Head::empty(&None),
        }
    }

    /// Runs the AUTH exchange that must open the connection, within
    /// `connect_timeout`.
    async fn authenticate(&mut self, key: &ClusterKey) -> Result<(), TransportError> {
        let config = &self.target.config;
        let exchange = auth::respond(self.conn, &mut self.inbuf, key, config, self.poll);
        match crate::within(config.connect_timeout, exchange).await {
            Err(TransportError::Timeout { .. }) => {
                config.rejects.count(Surface::DataPlane);
                Err(protocol("a peer did not authenticate in time"))
            }
            other => other,
        }
    }

    /// Checks the current frame's tag over its header and `body` before
    /// the frame is acted on; a frame that fails closes the connection,
    /// unanswered, and counts.
    fn check(&mut self, body: Which) -> Result<(), TransportError> {
        let body: &[u8] = match body {
            Which::Nothing => &[],
            Which::Table => &self.table,
            Which::Scratch => &self.scratch,
        };
        self.raw.check(&mut self.conn.open, body).map_err(|_| {
            self.target.config.rejects.count(Surface::DataPlane);
            protocol("a frame's tag does not verify")
        })
    }

    /// Sends the held answers and then a refusal of request `req_id`, so
    /// the peer learns why; returns the error that closes the connection.
    async fn refuse(
        &mut self,
        opcode: u8,
        req_id: u64,
        reason: RejectReason,
        why: impl Into<String>,
    ) -> TransportError {
        let refusal = reject(opcode, req_id, reason, 0);
        match self.answers.respond(self.conn, refusal).await {
            Ok(()) => protocol(why),
            Err(e) => e,
        }
    }

    /// Reads the next request header; `None` when the peer closed between
    /// frames. The held answers go out first unless another request is
    /// already here (see [`Answers`]).
    async fn next_header(&mut self) -> Result<Option<Header>, TransportError> {
        self.raw = Head::empty(&self.conn.open);
        let hb = self.raw.buf();
        let hlen = hb.len();
        if self.answers.is_full() {
            self.answers.flush(self.conn).await?;
        }
        if self.inbuf.len() < hlen && !self.answers.is_empty() {
            // Another request already here is read first; otherwise the
            // tasks the delivered requests woke run once, then the answers go.
            match self.inbuf.try_fill(self.conn.fd) {
                Ok(true) => {}
                Ok(false) => futures_lite::future::yield_now().await,
                Err(IoFail::Closed) if self.inbuf.len() == 0 => return Ok(None),
                Err(e) => return Err(conv("reading a header")(e)),
            }
        }
        if self.inbuf.len() < hlen {
            self.answers.flush(self.conn).await?;
            while self.inbuf.len() < hlen {
                match self.inbuf.fill(self.conn, self.poll).await {
                    Ok(()) => {}
                    Err(IoFail::Closed) if self.inbuf.len() == 0 => return Ok(None),
                    Err(e) => return Err(conv("reading a header")(e)),
                }
            }
        }
        self.inbuf.drain(self.raw.buf());
        match self.raw.decode() {
            Ok(h) if h.status == wire::STATUS_OK => Ok(Some(h)),
            Ok(h) => {
                let reason = RejectReason::BadHeader;
                let why = "request with a status byte";
                Err(self.refuse(h.opcode, h.req_id, reason, why).await)
            }
            Err(reason) => {
                let opcode = self.raw.buf()[4];
                Err(self.refuse(opcode, 0, reason, "bad request header").await)
            }
        }
    }

    /// Answers a REGIONS request, after the answers held before it.
    async fn serve_regions(&mut self, h: &Header) -> Result<(), TransportError> {
        if h.count != 0 || h.payload_len != 0 {
            let why = "REGIONS request with a body";
            return Err(self
                .refuse(h.opcode, h.req_id, RejectReason::BadHeader, why)
                .await);
        }
        self.check(Which::Nothing)?;
        self.answers.flush(self.conn).await?;
        send_regions(self.target, self.conn, h.req_id).await
    }

    /// Answers the shm hello: the target's identity, a token and its
    /// socket when it shares memory with this peer, `Undeliverable` else.
    async fn serve_shm(&mut self, h: &Header) -> Result<(), TransportError> {
        if h.count != 0 || h.payload_len != HOST_ID_LEN as u64 {
            let why = "SHM hello of a bad size";
            return Err(self
                .refuse(h.opcode, h.req_id, RejectReason::BadHeader, why)
                .await);
        }
        self.scratch.resize(HOST_ID_LEN, 0);
        self.inbuf
            .read_exact(self.conn, &mut self.scratch, self.poll)
            .await
            .map_err(conv("reading a shm hello"))?;
        self.check(Which::Scratch)?;
        let answer = HostId::decode(&self.scratch)
            .and_then(|peer| self.target.shm.as_ref().and_then(|s| s.hello(&peer)));
        let Some(answer) = answer else {
            let refusal = reject(h.opcode, h.req_id, RejectReason::Undeliverable, 0);
            self.answers.hold(&mut self.conn.seal, refusal);
            return Ok(());
        };
        self.answers.flush(self.conn).await?;
        let head = Head::new(
            &mut self.conn.seal,
            &accept(h, answer.len() as u64),
            &answer,
        );
        let mut body = head.bytes().to_vec();
        body.extend_from_slice(&answer);
        let mut v = [iov(body.as_ptr() as u64, body.len() as u64)];
        fdio::send_all(&mut self.conn.wr, self.conn.fd, &mut v, None)
            .await
            .map_err(conv("answering a shm hello"))
    }

    /// Reads a NOTIFY or NOTIFY_AFTER_WRITE (after `run_before` WRITEs that
    /// landed in full), hands it to the handler and holds the answer.
    async fn serve_notify(&mut self, h: &Header, run_before: u32) -> Result<(), TransportError> {
        if h.count != 0 || h.payload_len > wire::MAX_NOTIFY_BYTES {
            let why = "NOTIFY with descriptors or too long";
            return Err(self
                .refuse(h.opcode, h.req_id, RejectReason::TooLarge, why)
                .await);
        }
        // Bounded by MAX_NOTIFY_BYTES; never registered memory.
        self.scratch.resize(h.payload_len as usize, 0);
        self.inbuf
            .read_exact(self.conn, &mut self.scratch, self.poll)
            .await
            .map_err(conv("reading a notification"))?;
        self.check(Which::Scratch)?;
        // A conditional notification says what its sender learns only from
        // the WRITEs before it: deliver it only if they all landed (a
        // fenced one closed the connection already).
        let deliverable = h.opcode == wire::OP_NOTIFY || (h.detail >= 1 && h.detail <= run_before);
        let handler = self.target.notify.borrow().clone();
        let taken = deliverable && handler.is_some_and(|f| f(&self.scratch));
        let answer = if taken {
            accept(h, 0)
        } else {
            reject(h.opcode, h.req_id, RejectReason::Undeliverable, 0)
        };
        self.answers.hold(&mut self.conn.seal, answer);
        Ok(())
    }

    /// Serves a WRITE or READ frame; `Ok(true)` when a WRITE landed in full.
    async fn serve_data(&mut self, op: Op, h: &Header) -> Result<bool, TransportError> {
        let total = self.read_table(op, h).await?;
        let pins = match self.target.registry.pin(self.ranges.iter().copied()) {
            Ok(pins) => pins,
            Err((index, fault)) => {
                self.skip_refused(op, h, index, fault).await?;
                return Ok(false);
            }
        };
        if self.conn.payload_mac && pins.touches_device() {
            drop(pins);
            let why = "payload tags over device memory are not supported";
            return Err(self
                .refuse(h.opcode, h.req_id, RejectReason::BadHeader, why)
                .await);
        }
        match (op, self.target.device.clone()) {
            (Op::Write, Some(dev)) if pins.touches_device() => self.receive_staged(h, &dev).await?,
            (Op::Read, Some(dev)) if pins.touches_device() => self.send_staged(h, &dev).await?,
            (Op::Write, _) => self.receive_payload(h).await?,
            (Op::Read, _) => self.send_payload(h, total).await?,
        }
        drop(pins);
        Ok(op == Op::Write)
    }

    /// Reads a data frame's descriptor table into `ranges` and checks its
    /// sizes against the header; returns the frame's bytes in total.
    async fn read_table(&mut self, op: Op, h: &Header) -> Result<u64, TransportError> {
        let (opcode, req_id) = (h.opcode, h.req_id);
        if h.count == 0 || h.count > wire::MAX_FRAME_DESCS {
            let why = "descriptor count out of range";
            return Err(self
                .refuse(opcode, req_id, RejectReason::TooLarge, why)
                .await);
        }
        // The table is bounded by MAX_FRAME_DESCS entries (64 KiB).
        self.table.resize(h.count as usize * wire::ENTRY_LEN, 0);
        self.inbuf
            .read_exact(self.conn, &mut self.table, self.poll)
            .await
            .map_err(conv("reading a descriptor table"))?;
        self.check(Which::Table)?;
        self.ranges.clear();
        let mut total: u64 = 0;
        for i in 0..h.count as usize {
            let (addr, len) = wire::decode_entry(&self.table, i);
            total = total.saturating_add(len);
            self.ranges.push((addr, len));
        }
        if total > wire::MAX_FRAME_BYTES {
            let why = "frame payload too large";
            return Err(self
                .refuse(opcode, req_id, RejectReason::TooLarge, why)
                .await);
        }
        let expected_payload = match op {
            Op::Write => total,
            Op::Read => 0,
        };
        if h.payload_len != expected_payload {
            let why = "payload length does not match the descriptors";
            let reason = RejectReason::LengthMismatch;
            return Err(self.refuse(opcode, req_id, reason, why).await);
        }
        Ok(total)
    }

    /// Refuses a data frame whose ranges are not all registered. The
    /// framing is sound, so the payload is skipped without touching
    /// registered memory and the connection goes on.
    async fn skip_refused(
        &mut self,
        op: Op,
        h: &Header,
        index: usize,
        fault: registry::RangeFault,
    ) -> Result<(), TransportError> {
        if op == Op::Write {
            // A payload's tag follows it where payloads are tagged.
            let tag = if self.conn.payload_mac { TAG_LEN } else { 0 };
            let skip = h.payload_len + tag as u64;
            self.scratch.resize(64 << 10, 0);
            let buffered = self.inbuf.skip(skip);
            let Conn { rd, fd, .. } = &mut *self.conn;
            fdio::discard(rd, *fd, skip - buffered, &mut self.scratch, self.poll)
                .await
                .map_err(conv("discarding a rejected payload"))?;
        }
        let reason = match fault {
            registry::RangeFault::Empty => RejectReason::EmptyDescriptor,
            registry::RangeFault::Overflow => RejectReason::Overflow,
            registry::RangeFault::OutOfRegion => RejectReason::OutOfRegion,
        };
        let refusal = reject(h.opcode, h.req_id, reason, index as u32);
        self.answers.hold(&mut self.conn.seal, refusal);
        Ok(())
    }

    /// Receives a WRITE's payload into the frame's (pinned) ranges and holds
    /// its acknowledgement.
    async fn receive_payload(&mut self, h: &Header) -> Result<(), TransportError> {
        self.iovs.clear();
        self.iovs
            .extend(self.ranges.iter().map(|&(a, l)| iov(a, l)));
        let fence = self.target.fence.borrow().clone();
        let guard = Guard::new(fence.as_deref());
        let ranges = &self.ranges;
        let allowed = || guard.check(ranges.iter().copied());
        // What came along with the header goes in first, under the fence
        // like any read into these ranges.
        if self.inbuf.len() > 0 {
            if !allowed() {
                return Err(conv("receiving a payload")(IoFail::Fenced));
            }
            self.inbuf.drain_into(&mut self.iovs, h.payload_len);
        }
        // The payload follows its header at once or streams in at bulk
        // pace; either way spinning buys nothing, and on shared cores it
        // slows the sender, so payloads always park. A fenced payload
        // closes the connection: the peer's batch fails and the rest of its
        // bytes are never read.
        let Conn { rd, fd, .. } = &mut *self.conn;
        fdio::recv_exact(rd, *fd, &mut self.iovs, PollPolicy::Park, Some(&allowed))
            .await
            .map_err(conv("receiving a payload"))?;
        if self.conn.payload_mac {
            self.check_payload().await?;
        }
        self.answers.hold(&mut self.conn.seal, accept(h, 0));
        Ok(())
    }

    /// Reads the tag after a WRITE's payload and checks it over the bytes
    /// that landed: a mismatch (bytes changed in flight) fails the frame
    /// unanswered, closing the connection, so the peer's batch fails.
    async fn check_payload(&mut self) -> Result<(), TransportError> {
        let mut tag = [0u8; TAG_LEN];
        self.inbuf
            .read_exact(self.conn, &mut tag, self.poll)
            .await
            .map_err(conv("reading a payload's tag"))?;
        let ranges = self.ranges.iter().copied();
        auth::check_payload(&self.conn.open, self.raw.tag(), ranges, &tag).map_err(|_| {
            self.target.config.rejects.count(Surface::DataPlane);
            protocol("a payload's tag does not verify")
        })
    }

    /// Answers a READ with its header and the frame's (pinned) ranges in
    /// one send, after the answers held before it.
    async fn send_payload(&mut self, h: &Header, total: u64) -> Result<(), TransportError> {
        self.answers.flush(self.conn).await?;
        let head = Head::new(&mut self.conn.seal, &accept(h, total), &[]);
        let ob = head.bytes();
        self.iovs.clear();
        self.iovs.push(iov(ob.as_ptr() as u64, ob.len() as u64));
        self.iovs
            .extend(self.ranges.iter().map(|&(a, l)| iov(a, l)));
        let ranges = self.ranges.iter().copied();
        let tag =
            (self.conn.payload_mac).then(|| auth::payload_tag(&self.conn.seal, head.tag(), ranges));
        if let Some(t) = &tag {
            self.iovs.push(iov(t.as_ptr() as u64, t.len() as u64));
        }
        let fence = self.target.fence.borrow().clone();
        let guard = Guard::new(fence.as_deref());
        let ranges = &self.ranges;
        let allowed = || guard.check(ranges.iter().copied());
        let Conn { wr, fd, .. } = &mut *self.conn;
        fdio::send_all(wr, *fd, &mut self.iovs, Some(&allowed))
            .await
            .map_err(conv("sending a payload"))
    }

    /// Receives a WRITE whose ranges include device memory: in windows of
    /// at most two staging buffers, host ranges straight from the socket,
    /// device ranges into the buffers and then onto the device, the next
    /// window's bytes read while this one's copy runs. The frame is
    /// acknowledged once every copy finished.
    async fn receive_staged(&mut self, h: &Header, dev: &DeviceSide) -> Result<(), TransportError> {
        let ranges = std::mem::take(&mut self.ranges);
        let moved = self.receive_windows(h, dev, &ranges).await;
        self.ranges = ranges;
        moved?;
        self.answers.hold(&mut self.conn.seal, accept(h, 0));
        Ok(())
    }

    /// Receives a frame's windows; returns once every copy ended.
    async fn receive_windows(
        &mut self,
        h: &Header,
        dev: &DeviceSide,
        ranges: &[(u64, u64)],
    ) -> Result<(), TransportError> {
        let fence = self.target.fence.borrow().clone();
        let guard = Guard::new(fence.as_deref());
        let allowed = || guard.check(ranges.iter().copied());
        let mut cursor = Cursor::new(&self.target.registry, ranges);
        // The previous window, its copy onto the device running while this
        // one's bytes come in.
        let mut copying: Option<(Mark, Window)> = None;
        debug_assert_eq!(h.payload_len, ranges.iter().map(|r| r.1).sum::<u64>());
        while cursor.index < ranges.len() {
            // Waiting for a buffer while holding some could deadlock with
            // other connections doing the same: the previous window goes
            // back first (its copy ends on its own).
            if dev.pool.exhausted() {
                if let Some(before) = copying.take() {
                    wait_window(before).await?;
                }
            }
            let mut w = self.window(dev, ranges, &mut cursor).await?;
            if !allowed() {
                return Err(conv("receiving a payload")(IoFail::Fenced));
            }
            // Buffered bytes beyond the window belong to later windows, or
            // to the next frame.
            self.inbuf.drain_into(&mut self.iovs, w.bytes);
            let Conn { rd, fd, .. } = &mut *self.conn;
            fdio::recv_exact(rd, *fd, &mut self.iovs, PollPolicy::Park, Some(&allowed))
                .await
                .map_err(conv("receiving a payload"))?;
            if w.device.is_empty() {
                continue;
            }
            if !allowed() {
                return Err(conv("receiving a payload")(IoFail::Fenced));
            }
            let mark = self.copy_window(dev, Dir::ToDevice, &mut w)?;
            if let Some(before) = copying.replace((mark, w)) {
                wait_window(before).await?;
            }
        }
        match copying {
            Some(last) => wait_window(last).await,
            None => Ok(()),
        }
    }

    /// Answers a READ whose ranges include device memory: each window's
    /// device ranges copied into staging buffers, then sent with the host
    /// ranges behind the answer header.
    async fn send_staged(&mut self, h: &Header, dev: &DeviceSide) -> Result<(), TransportError> {
        self.answers.flush(self.conn).await?;
        let ranges = std::mem::take(&mut self.ranges);
        let sent = self.send_windows(h, dev, &ranges).await;
        self.ranges = ranges;
        sent
    }

    async fn send_windows(
        &mut self,
        h: &Header,
        dev: &DeviceSide,
        ranges: &[(u64, u64)],
    ) -> Result<(), TransportError> {
        let total = ranges.iter().map(|r| r.1).sum();
        let head = Head::new(&mut self.conn.seal, &accept(h, total), &[]);
        let ob = head.bytes();
        let fence = self.target.fence.borrow().clone();
        let guard = Guard::new(fence.as_deref());
        let mut cursor = Cursor::new(&self.target.registry, ranges);
        let allowed = || guard.check(ranges.iter().copied());
        let mut first = true;
        while cursor.index < ranges.len() {
            // Its leases are dropped after its bytes went out.
            let mut w = self.window(dev, ranges, &mut cursor).await?;
            if !w.device.is_empty() {
                if !allowed() {
                    return Err(conv("sending a payload")(IoFail::Fenced));
                }
                let during = "copying a staged payload";
                let mark = self.copy_window(dev, Dir::ToHost, &mut w)?;
                mark.wait().await.map_err(TransportError::device(during))?;
            }
            if std::mem::take(&mut first) {
                self.iovs
                    .insert(0, iov(ob.as_ptr() as u64, ob.len() as u64));
            }
            let Conn { wr, fd, .. } = &mut *self.conn;
            fdio::send_all(wr, *fd, &mut self.iovs, Some(&allowed))
                .await
                .map_err(conv("sending a payload"))?;
        }
        Ok(())
    }

    /// The next window of a frame's ranges from `cursor`: `iovs` over its
    /// bytes in payload order (host ranges themselves, device ranges in up
    /// to two leased buffers) and the device copies it needs. It waits for
    /// a buffer only while it holds none.
    async fn window(
        &mut self,
        dev: &DeviceSide,
        ranges: &[(u64, u64)],
        cursor: &mut Cursor,
    ) -> Result<Window, TransportError> {
        self.iovs.clear();
        let mut w = Window::default();
        while cursor.index < ranges.len() && w.leases.len() < 2 {
            let (addr, len) = ranges[cursor.index];
            if !cursor.device[cursor.index] {
                self.iovs.push(iov(addr, len));
                w.bytes += len;
                cursor.index += 1;
                continue;
            }
            // The first buffer may be waited for, holding none; a second
            // only if one is free now.
            let lease = match w.leases.is_empty() {
                true => dev.pool.lease().await,
                false => match dev.pool.try_lease() {
                    Some(lease) => lease,
                    None => break,
                },
            };
            let lease = lease.map_err(TransportError::device("leasing a staging buffer"))?;
            let cap = lease.len_bytes() as u64;
            let mut used = 0;
            while cursor.index < ranges.len() && used < cap {
                let (addr, len) = ranges[cursor.index];
                if !cursor.device[cursor.index] {
                    break;
                }
                let take = (len - cursor.offset).min(cap - used);
                let buf = lease.addr() + used;
                self.iovs.push(iov(buf, take));
                // (device address, buffer address, length)
                w.device.push((addr + cursor.offset, buf, take));
                used += take;
                cursor.offset += take;
                if cursor.offset == len {
                    cursor.index += 1;
                    cursor.offset = 0;
                }
            }
            w.bytes += used;
            w.leases.push(lease);
        }
        Ok(w)
    }

    /// Enqueues a window's device copies; its leases keep their buffers,
    /// and pins keep the device ranges registered, until the copies end.
    fn copy_window(
        &self,
        dev: &DeviceSide,
        dir: Dir,
        w: &mut Window,
    ) -> Result<Mark, TransportError> {
        let during = "copying a staged payload";
        let copies: Vec<(u64, u64, u64)> = w
            .device
            .iter()
            .map(|&(d, b, l)| match dir {
                Dir::ToHost => (b, d, l),
                Dir::ToDevice | Dir::DeviceToDevice => (d, b, l),
            })
            .collect();
        let pins = self
            .target
            .registry
            .pin(w.device.iter().map(|c| (c.0, c.2)))
            .map_err(|_| protocol("a staged range left its region"))?;
        // SAFETY: the buffers are leased and the device ranges pinned
        // until the mark is done (`Lease::copying` holds both).
        let mark =
            unsafe { dev.copies.copy(dir, &copies) }.map_err(TransportError::device(during))?;
        let mut keep: Option<Box<dyn std::any::Any>> = Some(Box::new(pins));
        for lease in w.leases.iter_mut() {
            lease.copying(mark.clone(), keep.take().unwrap_or_else(|| Box::new(())));
        }
        Ok(mark)
    }
}

/// The answer that request `h` was served, with `payload_len` bytes behind.
fn accept(h: &Header, payload_len: u64) -> Header {
    Header {
        opcode: h.opcode,
        req_id: h.req_id,
        payload_len,
        ..Header::default()
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
    let mut table = Vec::with_capacity(regions.len() * wire::ENTRY_LEN);
    for r in &regions {
        wire::encode_entry(&mut table, r.addr, r.len_bytes);
    }
    let mut body = Head::new(&mut conn.seal, &h, &table).bytes().to_vec();
    body.extend_from_slice(&table);
    let mut v = [iov(body.as_ptr() as u64, body.len() as u64)];
    fdio::send_all(&mut conn.wr, conn.fd, &mut v, None)
        .await
        .map_err(conv("sending regions"))
}

/// What a frame's tag covers besides its header.
#[derive(Clone, Copy)]
enum Which {
    Nothing,
    Table,
    Scratch,
}

/// Waits for a window's copy, then gives its buffers back.
async fn wait_window((mark, w): (Mark, Window)) -> Result<(), TransportError> {
    let waited = mark.wait().await;
    drop(w);
    waited.map_err(TransportError::device("copying a staged payload"))
}

/// Where the next window of a frame starts: a range, and the bytes of it
/// already in earlier windows; and which of the frame's ranges are device
/// memory.
struct Cursor {
    index: usize,
    offset: u64,
    device: Vec<bool>,
}

impl Cursor {
    fn new(registry: &Registry, ranges: &[(u64, u64)]) -> Cursor {
        Cursor {
            index: 0,
            offset: 0,
            device: registry.device_flags(ranges.iter().map(|r| r.0)),
        }
    }
}

/// One window of a staged frame.
#[derive(Default)]
struct Window {
    /// Its payload bytes.
    bytes: u64,
    /// `(device address, buffer address, length)` of its device pieces.
    device: Vec<(u64, u64, u64)>,
    leases: Vec<Lease>,
}
