//! The target side of a TCP endpoint: the acceptor and the connections it
//! serves against the endpoint's registered memory.

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use glommio::net::{TcpListener, TcpStream};
use slab::Slab;

use super::inbuf::InBuf;
use super::{conv, protocol, FenceCell, NotifyHandler, TcpConfig};
use crate::transport::fdio::{self, iov, Conn, IoFail};
use crate::transport::fence::Guard;
use crate::transport::registry::{self, Registry};
use crate::transport::wire::{self, Header, RejectReason};
use crate::transport::{Op, PollPolicy, TransportError};

/// State shared by the acceptor and the connection tasks of one endpoint.
pub(super) struct Target {
    pub(super) registry: Arc<Registry>,
    /// The node's block fence, shared with the sessions this endpoint opens.
    pub(super) fence: FenceCell,
    pub(super) config: TcpConfig,
    /// Where NOTIFY frames go; without one they are refused.
    pub(super) notify: RefCell<Option<NotifyHandler>>,
    /// Sockets of the live connections, so shutdown can close them at once.
    pub(super) conns: RefCell<Slab<RawFd>>,
    pub(super) shutting_down: Cell<bool>,
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
