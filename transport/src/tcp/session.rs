//! The initiator side of a TCP endpoint: sessions to peers, and the
//! streams that move a batch's frames.

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::io::{ReadHalf, WriteHalf};
use futures::lock::{Mutex, MutexGuard};
use glommio::net::TcpStream;
use glommio::sync::Semaphore;

mod staged;

use kvferry_auth::seal::{Opener, Sealer, TAG_LEN};

use super::auth::{self, Head};
use super::config::TcpConfig;
use super::fail::{conv, protocol};
use super::plan::{plan, FrameSpec, Plan};
use super::shared::{DeviceSide, FenceCell};
use super::TcpTransport;
use crate::fdio::{self, iov, Conn};
use crate::fence::{BlockFence, Guard};
use crate::registry::{self, Registry};
use crate::shm::{Answer, CopyFail, HostId, ShmLink, ShmMode, ShmRefusal, SHM_CHUNK_BYTES};
use crate::turns::Turns;
use crate::wire::{self, Header, RejectReason};
use crate::{
    within, Desc, MisuseError, Op, PeerError, PollPolicy, RegionInfo, Session, TransportError,
};

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
    closed: Cell<bool>,
    /// The link through the peer's shared memory, when it shares.
    shm: RefCell<Option<Rc<ShmLink>>>,
    /// When the last shm hello went out (a batch the link does not cover
    /// asks again at most once a second: the peer may share more now).
    shm_hello_at: Cell<Option<Instant>>,
    /// Bytes copied through the peer's shared memory over this `TcpSession`.
    shm_copied: Cell<u64>,
    /// The endpoint's device, for batches whose local side is on it.
    device: Option<Rc<DeviceSide>>,
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
                closed: Cell::new(false),
                shm: RefCell::new(None),
                shm_hello_at: Cell::new(None),
                shm_copied: Cell::new(0),
                device: self.target.device.clone(),
            }),
        };
        // Connect one stream now, so an unreachable peer fails here, and
        // learn the peer's regions for the initiator-side check.
        let mut slot = session.inner.slots[0].lock().await;
        session.inner.refresh_regions(&mut slot).await?;
        drop(slot);
        match session.inner.config.shm.mode {
            ShmMode::Off => {}
            ShmMode::Auto => {
                if let Err(e) = session.inner.connect_shm().await {
                    tracing::debug!(peer = %peer, error = %e, "shm: not shared; tcp frames");
                }
            }
            ShmMode::Require => session.inner.connect_shm().await?,
        }
        Ok(session)
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
            let timeout = self.config.connect_timeout;
            let stream = TcpStream::connect_timeout(self.peer, timeout)
                .await
                .map_err(|e| TransportError::io("connect", e.into()))?;
            let _ = stream.set_nodelay(true);
            let mut conn = Conn::new(stream);
            if let Some(key) = &self.config.key {
                let exchange = auth::initiate(&mut conn, key, &self.config);
                within(timeout, exchange).await?;
            }
            *slot = Some(conn);
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
        let ask = Header {
            opcode: wire::OP_REGIONS,
            req_id,
            ..Header::default()
        };
        let hb = Head::new(&mut conn.seal, &ask, &[]);
        let mut v = [iov(hb.bytes().as_ptr() as u64, hb.bytes().len() as u64)];
        fdio::send_all(&mut conn.wr, conn.fd, &mut v, None)
            .await
            .map_err(conv("asking for regions"))?;
        let mut raw = Head::empty(&conn.open);
        recv_head(&mut conn, &mut raw, poll, "reading regions").await?;
        let h = raw
            .decode()
            .map_err(|_| protocol("bad REGIONS response header"))?;
        if h.status == RejectReason::Unauthenticated.to_status() {
            return Err(PeerError::Unauthenticated("the peer requires the cluster key").into());
        }
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
        raw.check(&mut conn.open, &table)
            .map_err(|_| protocol("a REGIONS answer's tag does not verify"))?;
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

    /// Locks the first `k` unlocked streams. The caller holds `k` turns,
    /// which means at least `k` streams are unlocked: only `close` holds a
    /// stream without a turn, and it marks the session closed first.
    ///
    /// Always from the first: one small batch after another then keeps to
    /// the same connection, whose served task is the one spinning for the
    /// next header under [`PollPolicy::Spin`]. Dealt round-robin, every
    /// connection's served task spun at once, and each batch's header
    /// waited for the other spinners' tries (a 4 KiB batch took about 2 µs
    /// more with 4 streams than with 1 on a 2-vCPU VM).
    fn free_streams(&self, k: usize) -> Result<Vec<MutexGuard<'_, Option<Conn>>>, TransportError> {
        let guards: Vec<_> = self
            .slots
            .iter()
            .filter_map(|slot| slot.try_lock())
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
        let hb = Head::new(&mut conn.seal, &h, payload);
        let mut v = [
            iov(hb.bytes().as_ptr() as u64, hb.bytes().len() as u64),
            iov(payload.as_ptr() as u64, payload.len() as u64),
        ];
        fdio::send_all(&mut conn.wr, conn.fd, &mut v, None)
            .await
            .map_err(conv("sending a notification"))?;
        let mut raw = Head::empty(&conn.open);
        let during = "awaiting a notification answer";
        recv_head(&mut conn, &mut raw, self.config.poll, during).await?;
        let refused = notification_answer(&raw, &mut conn.open, wire::OP_NOTIFY, req_id)?;
        if refused.is_none_or(|r| r.keeps_connection()) {
            *guard = Some(conn);
        }
        match refused {
            None => Ok(()),
            Some(reason) => Err(PeerError::Rejected { reason, index: 0 }.into()),
        }
    }

    /// Says the shm hello on the notification connection and, if the peer
    /// shares, maps its memory (the handshake on a helper thread: it
    /// blocks on a Unix socket).
    async fn connect_shm(&self) -> Result<(), TransportError> {
        self.shm_hello_at.set(Some(Instant::now()));
        self.shm.borrow_mut().take();
        let mut me = HostId::current().map_err(|e| TransportError::io("reading the host id", e))?;
        if let Some(b) = self.config.shm.boot_id_override {
            me.boot_id = b;
        }
        let answer = within(self.config.connect_timeout, self.shm_hello(&me)).await?;
        let answer = answer.ok_or(PeerError::ShmRefused(ShmRefusal::NotOffered))?;
        let (tx, rx) = futures::channel::oneshot::channel();
        let timeout = self.config.shm.handshake_timeout;
        // With a device here, the peer's device regions are opened too.
        let device = self.device.as_ref().map(|d| Arc::clone(&d.copies.device));
        std::thread::Builder::new()
            .name("kvferry-shm-link".into())
            .spawn(move || {
                let _ = tx.send(ShmLink::establish(&answer, &me, timeout, device.as_deref()));
            })
            .map_err(|e| TransportError::io("starting the shm handshake", e))?;
        let link = within(timeout * 2, async {
            rx.await.map_err(|_| protocol("shm handshake thread ended"))
        })
        .await?
        .map_err(PeerError::ShmRefused)?;
        if link.is_empty() {
            // Dropped at once: its socket's hang-up frees our lane there.
            return Err(PeerError::ShmRefused(ShmRefusal::NotOffered).into());
        }
        *self.shm.borrow_mut() = Some(Rc::new(link));
        Ok(())
    }

    /// The hello itself: `None` when the peer shares nothing with us.
    async fn shm_hello(&self, me: &HostId) -> Result<Option<Answer>, TransportError> {
        let _turn = self.note_turn.acquire(1).await;
        let mut guard = self.note_slot.lock().await;
        self.ensure_conn(&mut guard).await?;
        // Taken out so that a failure or cancellation drops (closes) it.
        let Some(mut conn) = guard.take() else {
            unreachable!("ensure_conn leaves a connection in the slot")
        };
        let req_id = self.take_req_ids(1);
        let hello = me.encode();
        let ask = Header {
            opcode: wire::OP_SHM,
            req_id,
            payload_len: hello.len() as u64,
            ..Header::default()
        };
        let hb = Head::new(&mut conn.seal, &ask, &hello);
        let mut v = [
            iov(hb.bytes().as_ptr() as u64, hb.bytes().len() as u64),
            iov(hello.as_ptr() as u64, hello.len() as u64),
        ];
        fdio::send_all(&mut conn.wr, conn.fd, &mut v, None)
            .await
            .map_err(conv("sending a shm hello"))?;
        let mut raw = Head::empty(&conn.open);
        recv_head(
            &mut conn,
            &mut raw,
            self.config.poll,
            "awaiting a shm answer",
        )
        .await?;
        let h = raw
            .decode()
            .map_err(|_| protocol("bad shm answer header"))?;
        if h.opcode != wire::OP_SHM || h.req_id != req_id {
            return Err(protocol("unexpected shm answer"));
        }
        if h.status != wire::STATUS_OK {
            raw.check(&mut conn.open, &[])
                .map_err(|_| protocol("a shm answer's tag does not verify"))?;
            // An endpoint that predates the hello closes the connection.
            if RejectReason::from_status(h.status).keeps_connection() {
                *guard = Some(conn);
            }
            return Ok(None);
        }
        if h.payload_len > 1024 {
            return Err(protocol("shm answer too long"));
        }
        let mut body = vec![0u8; h.payload_len as usize];
        let mut v = [iov(body.as_mut_ptr() as u64, body.len() as u64)];
        fdio::recv_exact(&mut conn.rd, conn.fd, &mut v, self.config.poll, None)
            .await
            .map_err(conv("reading a shm answer"))?;
        raw.check(&mut conn.open, &body)
            .map_err(|_| protocol("a shm answer's tag does not verify"))?;
        *guard = Some(conn);
        Answer::decode(&body)
            .map(Some)
            .map_err(|_| protocol("malformed shm answer"))
    }

    /// Moves the descriptors of the batch whose target memory the peer
    /// shares through the link. `None`: no link, tcp moves everything;
    /// `Some(Ok(rest))`: the indices of the descriptors left for tcp (the
    /// target's private memory, such as the partial pages at the edges of
    /// an engine's buffer shared in place). With [`ShmMode::Require`] a
    /// batch that cannot go entirely through shared memory fails.
    /// `local_device`: the local side of every descriptor is device memory.
    async fn shm_transfer(
        &self,
        op: Op,
        descs: &[Desc],
        deadline: Instant,
        local_device: bool,
    ) -> Option<Result<Vec<usize>, TransportError>> {
        let require = self.config.shm.mode == ShmMode::Require;
        let refuse = || -> Option<Result<Vec<usize>, TransportError>> {
            require.then(|| Err(PeerError::ShmRefused(ShmRefusal::NotOffered).into()))
        };
        // One new handshake per batch at most: a peer that keeps retiring
        // its map sends the batch to tcp (or fails it, when required).
        let mut may_ask = true;
        loop {
            let link = self.shm.borrow().clone();
            let Some(link) = link.filter(|l| l.current()) else {
                // Ask again when the peer changed what it shares, or, with
                // no link, at most once a second.
                let ask = self.shm.borrow().is_some()
                    || (self.shm_hello_at.get())
                        .is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
                if !(may_ask && ask) || self.connect_shm().await.is_err() {
                    return refuse();
                }
                may_ask = false;
                continue;
            };
            let (here, rest): (Vec<usize>, Vec<usize>) =
                (0..descs.len()).partition(|&i| link.covers(&descs[i], local_device));
            if here.is_empty() || (require && !rest.is_empty()) {
                return refuse();
            }
            let covered: Vec<Desc> = here.iter().map(|&i| descs[i]).collect();
            match self
                .copy_through(link, op, &covered, deadline, local_device)
                .await
            {
                Ok(()) => return Some(Ok(rest)),
                Err(CopyFail::Stale) if may_ask => {
                    may_ask = false;
                    if self.connect_shm().await.is_err() {
                        return refuse();
                    }
                }
                Err(CopyFail::Stale | CopyFail::Uncovered) => return refuse(),
                Err(CopyFail::Fenced) => {
                    let during = "copying through shared memory";
                    return Some(Err(TransportError::Fenced { during }));
                }
                Err(CopyFail::Device(source)) => {
                    let during = "copying into a peer's device memory";
                    return Some(Err(TransportError::Device { during, source }));
                }
                Err(CopyFail::Timeout) => {
                    let bound = self.config.batch_timeout;
                    let after_ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
                    return Some(Err(TransportError::Timeout { after_ms }));
                }
            }
        }
    }

    /// Copies `descs` chunk by chunk through `link`, each chunk under both
    /// fences, yielding to the executor every 64 MiB. A chunk into or out
    /// of the peer's device memory is a copy on this endpoint's device, up
    /// to [`DEVICE_CHUNK_BYTES`] at once.
    async fn copy_through(
        &self,
        link: Rc<ShmLink>,
        op: Op,
        descs: &[Desc],
        deadline: Instant,
        local_device: bool,
    ) -> Result<(), CopyFail> {
        const YIELD_EVERY_BYTES: u64 = 64 << 20;
        let fence = self.fence.borrow().clone();
        let copies = self.device.as_ref().map(|d| Rc::clone(&d.copies));
        let mut since_yield = 0u64;
        for d in descs {
            let device = link.is_device(d.remote_addr, d.len_bytes);
            let chunk = if device {
                DEVICE_CHUNK_BYTES
            } else {
                SHM_CHUNK_BYTES
            };
            let mut off = 0;
            while off < d.len_bytes {
                let n = chunk.min(d.len_bytes - off);
                let (local, remote) = (d.local_addr + off, d.remote_addr + off);
                let write = op == Op::Write;
                match (&copies, device) {
                    (Some(c), true) => {
                        let f = fence.as_deref();
                        link.copy_device(write, local, remote, n, local_device, f, c)?;
                    }
                    (None, true) => return Err(CopyFail::Uncovered),
                    (_, false) => link.copy_chunk(write, local, remote, n, fence.as_deref())?,
                }
                self.shm_copied.set(self.shm_copied.get() + n);
                off += n;
                since_yield += n;
                if since_yield >= YIELD_EVERY_BYTES {
                    since_yield = 0;
                    if Instant::now() >= deadline {
                        return Err(CopyFail::Timeout);
                    }
                    futures_lite::future::yield_now().await;
                }
            }
        }
        Ok(())
    }

    fn check_remote(&self, descs: &[Desc]) -> Result<(), (usize, registry::RangeFault)> {
        registry::check_remote(
            &self.remote_regions.borrow(),
            descs.iter().map(|d| (d.remote_addr, d.len_bytes)),
        )
    }

    /// Moves `descs` within `bound`; with a `trailer` (WRITE only) that
    /// fits a notification, also hands it to the peer's handler behind the
    /// last frame when the whole batch takes one stream, delivered only if
    /// every frame landed. `Ok(true)` when the trailer was delivered.
    async fn transfer(
        &self,
        op: Op,
        descs: &[Desc],
        trailer: Option<&[u8]>,
        bound: Duration,
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
        let pins = self
            .local
            .pin(descs.iter().map(|d| (d.local_addr, d.len_bytes)))
            .map_err(|(index, fault)| MisuseError::LocalDescriptor { index, fault })?;
        if pins.touches_device() {
            return within(bound, self.transfer_mixed(op, descs, bound)).await;
        }
        self.transfer_host(op, descs, trailer, bound).await
    }

    /// Moves what of `descs` the peer's shared memory (or its device memory
    /// opened here) covers, within `bound`: `None` when that path is off
    /// or unused (everything is left), else the indices left for the
    /// other path. `local_device`: as for [`SessionInner::shm_transfer`].
    async fn shm_first(
        &self,
        op: Op,
        descs: &[Desc],
        bound: Duration,
        local_device: bool,
    ) -> Result<Option<Vec<usize>>, TransportError> {
        if self.config.shm.mode == ShmMode::Off {
            return Ok(None);
        }
        let deadline = Instant::now() + bound;
        let copied = within(bound, async {
            Ok(self.shm_transfer(op, descs, deadline, local_device).await)
        });
        copied.await?.transpose()
    }

    /// Moves a batch whose local side is host memory: through the peer's
    /// shared memory where it shares, over tcp frames for the rest.
    async fn transfer_host(
        &self,
        op: Op,
        descs: &[Desc],
        trailer: Option<&[u8]>,
        bound: Duration,
    ) -> Result<bool, TransportError> {
        let deadline = Instant::now() + bound;
        let rest = match self.shm_first(op, descs, bound, false).await? {
            // A batch wholly through shared memory delivers no trailer:
            // the caller sends it its own way.
            Some(r) if r.is_empty() => return Ok(false),
            // The rest over tcp, its trailer behind its frames (the
            // shared-memory part landed before they went out).
            rest => rest,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(rest) = rest else {
            let plan = plan(descs, &self.config);
            return within(left, self.run_plan(op, descs, &plan, trailer)).await;
        };
        let part: Vec<Desc> = rest.iter().map(|&i| descs[i]).collect();
        let plan = plan(&part, &self.config);
        let moved = within(left, self.run_plan(op, &part, &plan, trailer)).await;
        moved.map_err(|e| blame_in(e, &rest))
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
        // Taken out so that a failure or cancellation drops (closes) it: a
        // stream that stopped mid-frame is out of step for good.
        let Some(mut conn) = slot.take() else {
            unreachable!("ensure_conn leaves a connection in the slot")
        };
        let fence = self.fence.borrow().clone();
        let run = StreamRun::new(plan, stream, trailer, fence, self.config.poll, conn.fd);
        let Conn {
            rd,
            wr,
            seal,
            open,
            payload_mac,
            ..
        } = &mut conn;
        let sent = run.send(wr, seal, *payload_mac);
        let received = run.recv(rd, open, *payload_mac);
        let (_, delivered) = futures::future::try_join(sent, received).await?;
        *slot = Some(conn);
        Ok(delivered)
    }
}

/// One stream's share of a batch while it moves: what its sending half and
/// its receiving half share.
struct StreamRun<'p> {
    plan: &'p Plan<'p>,
    s: Stream,
    opcode: u8,
    fd: RawFd,
    poll: PollPolicy,
    fence: Option<Rc<BlockFence>>,
    /// Payload bytes the sending half may still have unacknowledged.
    credit: Semaphore,
    /// Set once every frame is out.
    all_sent: Cell<bool>,
    /// The trailer and its NOTIFY_AFTER_WRITE header.
    trailer: Option<(&'p [u8], Header)>,
    /// Frames of the plan on this stream.
    frames_here: usize,
}

impl<'p> StreamRun<'p> {
    fn new(
        plan: &'p Plan<'p>,
        s: Stream,
        trailer: Option<&'p [u8]>,
        fence: Option<Rc<BlockFence>>,
        poll: PollPolicy,
        fd: RawFd,
    ) -> StreamRun<'p> {
        let opcode = match s.op {
            Op::Write => wire::OP_WRITE,
            Op::Read => wire::OP_READ,
        };
        let frames_here = plan.frames.iter().skip(s.j).step_by(s.k).count();
        let trailer = trailer.map(|t| {
            let head = Header {
                opcode: wire::OP_NOTIFY_AFTER_WRITE,
                // Only one-stream batches carry a trailer: every frame of
                // the plan is right before it.
                detail: frames_here as u32,
                req_id: trailer_id(plan, &s),
                payload_len: t.len() as u64,
                ..Header::default()
            };
            (t, head)
        });
        StreamRun {
            plan,
            s,
            opcode,
            fd,
            poll,
            fence,
            credit: Semaphore::new(s.per_stream_bytes),
            all_sent: Cell::new(false),
            trailer,
            frames_here,
        }
    }

    /// This stream's frames, with their index in the plan.
    fn frames(&self) -> impl Iterator<Item = (usize, &'p FrameSpec)> {
        let plan: &'p Plan<'p> = self.plan;
        plan.frames
            .iter()
            .enumerate()
            .skip(self.s.j)
            .step_by(self.s.k)
    }

    fn trailer_id(&self) -> u64 {
        trailer_id(self.plan, &self.s)
    }

    fn descs(&self, f: &FrameSpec) -> &'p [Desc] {
        &self.plan.descs[f.start..f.end]
    }

    /// Credit a frame takes while unacknowledged.
    fn cost(&self, f: &FrameSpec) -> u64 {
        f.bytes.min(self.s.per_stream_bytes)
    }

    /// The sending half: every frame, as credit allows.
    async fn send(
        &self,
        wr: &mut WriteHalf<TcpStream>,
        seal: &mut Option<Sealer>,
        payload_mac: bool,
    ) -> Result<(), TransportError> {
        let mut head: Vec<u8> = Vec::new();
        let mut tail: Vec<u8> = Vec::new();
        // A WRITE's payload tag, when payloads are tagged.
        let mut ptag: Option<[u8; TAG_LEN]> = None;
        let mut iovs: Vec<libc::iovec> = Vec::new();
        for (i, (n, f)) in self.frames().enumerate() {
            self.credit
                .acquire(self.cost(f))
                .await
                .map_err(|_| protocol("credit semaphore closed"))?;
            let bufs = (&mut head, &mut tail, &mut iovs);
            let tagged = payload_mac.then_some(&mut ptag);
            self.frame_iovs(n, f, i + 1 == self.frames_here, seal, tagged, bufs);
            let guard = Guard::new(self.fence.as_deref());
            let local = local_check(&guard, self.descs(f));
            let check: Option<&dyn Fn() -> bool> = match self.s.op {
                Op::Write => Some(&local),
                Op::Read => None,
            };
            fdio::send_all(wr, self.fd, &mut iovs, check)
                .await
                .map_err(conv("sending a frame"))?;
        }
        self.all_sent.set(true);
        Ok(())
    }

    /// Lays out frame `n` (`f`) for one send: its header and descriptor
    /// table (in `head`), a WRITE's payload, and behind the `last` frame the
    /// trailer: one segment, one wake-up at the peer.
    fn frame_iovs(
        &self,
        n: usize,
        f: &FrameSpec,
        last: bool,
        seal: &mut Option<Sealer>,
        ptag: Option<&mut Option<[u8; TAG_LEN]>>,
        (head, tail, iovs): (&mut Vec<u8>, &mut Vec<u8>, &mut Vec<libc::iovec>),
    ) {
        let op = self.s.op;
        let h = Header {
            opcode: self.opcode,
            count: (f.end - f.start) as u32,
            req_id: self.s.base_req_id.wrapping_add(n as u64),
            payload_len: match op {
                Op::Write => f.bytes,
                Op::Read => 0,
            },
            ..Header::default()
        };
        // The table is laid out behind room for the header, which covers it.
        let hl = match seal {
            Some(_) => wire::SEALED_HEADER_LEN,
            None => wire::HEADER_LEN,
        };
        head.clear();
        head.resize(hl, 0);
        for d in self.descs(f) {
            wire::encode_entry(head, d.remote_addr, d.len_bytes);
        }
        let sealed = Head::new(seal, &h, &head[hl..]);
        head[..hl].copy_from_slice(sealed.bytes());
        iovs.clear();
        iovs.push(iov(head.as_ptr() as u64, head.len() as u64));
        if op == Op::Write {
            iovs.extend(self.descs(f).iter().map(|d| iov(d.local_addr, d.len_bytes)));
            if let Some(ptag) = ptag {
                let local = self.descs(f).iter().map(|d| (d.local_addr, d.len_bytes));
                let tag = ptag.insert(auth::payload_tag(seal, &head[hl - TAG_LEN..hl], local));
                iovs.push(iov(tag.as_ptr() as u64, tag.len() as u64));
            }
        }
        if let (Some((t, th)), true) = (&self.trailer, last) {
            tail.clear();
            tail.extend_from_slice(Head::new(seal, th, t).bytes());
            iovs.push(iov(tail.as_ptr() as u64, tail.len() as u64));
            iovs.push(iov(t.as_ptr() as u64, t.len() as u64));
        }
    }

    /// The receiving half: every frame's response (and a READ's payload),
    /// then the trailer's answer. `Ok(true)` when the peer took the trailer.
    async fn recv(
        &self,
        rd: &mut ReadHalf<TcpStream>,
        open: &mut Option<Opener>,
        payload_mac: bool,
    ) -> Result<bool, TransportError> {
        let mut iovs: Vec<libc::iovec> = Vec::new();
        for (n, f) in self.frames() {
            let frame_tag = self.await_response(rd, open, n, f).await?;
            if self.s.op == Op::Read {
                iovs.clear();
                iovs.extend(self.descs(f).iter().map(|d| iov(d.local_addr, d.len_bytes)));
                let guard = Guard::new(self.fence.as_deref());
                let local = local_check(&guard, self.descs(f));
                fdio::recv_exact(rd, self.fd, &mut iovs, PollPolicy::Park, Some(&local))
                    .await
                    .map_err(conv("receiving a payload"))?;
                if payload_mac {
                    self.check_payload(rd, open, &frame_tag, f).await?;
                }
            }
            self.credit.signal(self.cost(f));
        }
        if self.trailer.is_none() {
            return Ok(false);
        }
        let mut raw = Head::empty(open);
        let hb = raw.buf();
        let mut v = [iov(hb.as_mut_ptr() as u64, hb.len() as u64)];
        fdio::recv_exact(rd, self.fd, &mut v, self.poll, None)
            .await
            .map_err(conv("awaiting a notification answer"))?;
        let opcode = wire::OP_NOTIFY_AFTER_WRITE;
        match notification_answer(&raw, open, opcode, self.trailer_id())? {
            None => Ok(true),
            // Every frame landed; the peer only did not take the trailer.
            Some(reason) if reason.keeps_connection() => Ok(false),
            Some(reason) => Err(PeerError::Rejected { reason, index: 0 }.into()),
        }
    }

    /// Reads the tag after a READ's payload and checks it over the bytes
    /// that landed in local memory.
    async fn check_payload(
        &self,
        rd: &mut ReadHalf<TcpStream>,
        open: &Option<Opener>,
        frame_tag: &[u8; TAG_LEN],
        f: &FrameSpec,
    ) -> Result<(), TransportError> {
        let mut tag = [0u8; TAG_LEN];
        let mut v = [iov(tag.as_mut_ptr() as u64, tag.len() as u64)];
        fdio::recv_exact(rd, self.fd, &mut v, PollPolicy::Park, None)
            .await
            .map_err(conv("reading a payload's tag"))?;
        let local = self.descs(f).iter().map(|d| (d.local_addr, d.len_bytes));
        auth::check_payload(open, frame_tag, local, &tag)
            .map_err(|_| protocol("a READ payload's tag does not verify"))
    }

    /// Reads and checks the response to frame `n` (`f`), up to a READ's
    /// payload; returns the response's tag (zeros when not sealed).
    async fn await_response(
        &self,
        rd: &mut ReadHalf<TcpStream>,
        open: &mut Option<Opener>,
        n: usize,
        f: &FrameSpec,
    ) -> Result<[u8; TAG_LEN], TransportError> {
        let mut raw = Head::empty(open);
        let hb = raw.buf();
        let mut v = [iov(hb.as_mut_ptr() as u64, hb.len() as u64)];
        // Spin for the response only once every frame is out: before that
        // the sender half waits on io_uring readiness, which a spinning
        // sibling would only delay.
        let wait = if self.all_sent.get() {
            self.poll
        } else {
            PollPolicy::Park
        };
        fdio::recv_exact(rd, self.fd, &mut v, wait, None)
            .await
            .map_err(conv("awaiting a response"))?;
        let h = raw.decode().map_err(|_| protocol("bad response header"))?;
        raw.check(open, &[])
            .map_err(|_| protocol("a response's tag does not verify"))?;
        if h.opcode != self.opcode || h.req_id != self.s.base_req_id.wrapping_add(n as u64) {
            return Err(protocol("response out of order"));
        }
        if h.status != wire::STATUS_OK {
            let in_frame = (h.detail as usize).min(f.end - f.start - 1);
            let split_index = f.start + in_frame;
            let index = self
                .plan
                .origin
                .as_ref()
                .map_or(split_index, |o| o[split_index]);
            let reason = RejectReason::from_status(h.status);
            return Err(PeerError::Rejected { reason, index }.into());
        }
        match self.s.op {
            Op::Write if h.payload_len != 0 => Err(protocol("WRITE response with a payload")),
            Op::Read if h.payload_len != f.bytes => {
                Err(protocol("READ response of the wrong length"))
            }
            _ => Ok(raw.tag().try_into().unwrap_or([0; TAG_LEN])),
        }
    }
}

/// Reads the next header on `conn` into `raw`.
async fn recv_head(
    conn: &mut Conn,
    raw: &mut Head,
    poll: PollPolicy,
    during: &'static str,
) -> Result<(), TransportError> {
    let hb = raw.buf();
    let mut v = [iov(hb.as_mut_ptr() as u64, hb.len() as u64)];
    fdio::recv_exact(&mut conn.rd, conn.fd, &mut v, poll, None)
        .await
        .map_err(conv(during))
}

/// Checks the answer to notification `req_id` (a NOTIFY or a
/// NOTIFY_AFTER_WRITE, `opcode`), read as `raw` on a connection opened by
/// `open`: `None` when the peer's handler took it, else why the peer
/// refused it.
fn notification_answer(
    raw: &auth::Head,
    open: &mut Option<kvferry_auth::seal::Opener>,
    opcode: u8,
    req_id: u64,
) -> Result<Option<RejectReason>, TransportError> {
    let h = raw
        .decode()
        .map_err(|_| protocol("bad notification answer header"))?;
    raw.check(open, &[])
        .map_err(|_| protocol("a notification answer's tag does not verify"))?;
    if h.opcode != opcode || h.req_id != req_id || h.payload_len != 0 {
        return Err(protocol("unexpected notification answer"));
    }
    Ok((h.status != wire::STATUS_OK).then(|| RejectReason::from_status(h.status)))
}

/// `e` with the descriptor it blames (an index into a part of the batch,
/// `part[i]` its index in the whole batch) renumbered to the whole batch.
fn blame_in(e: TransportError, part: &[usize]) -> TransportError {
    let whole = |i: usize| part.get(i).copied().unwrap_or(i);
    match e {
        TransportError::Peer(PeerError::Rejected { reason, index }) => PeerError::Rejected {
            reason,
            index: whole(index),
        }
        .into(),
        TransportError::Misuse(MisuseError::RemoteDescriptor { index, fault }) => {
            MisuseError::RemoteDescriptor {
                index: whole(index),
                fault,
            }
            .into()
        }
        other => other,
    }
}

/// Most bytes of one copy into or out of a peer's device memory: the copy
/// runs while the fence's lane is published, and a peer's close waits
/// for it.
const DEVICE_CHUNK_BYTES: u64 = 64 << 20;

/// The request id of a trailer: the one after the plan's frames.
fn trailer_id(plan: &Plan<'_>, s: &Stream) -> u64 {
    s.base_req_id.wrapping_add(plan.frames.len() as u64)
}

/// Whether the fence still lets the local side of `descs` be touched.
fn local_check<'g>(guard: &'g Guard<'g>, descs: &'g [Desc]) -> impl Fn() -> bool + 'g {
    move || guard.check(descs.iter().map(|d| (d.local_addr, d.len_bytes)))
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
    /// Notifications have a connection of their own ([`TcpSession::notify`]).
    async fn notify_peer(&self, payload: &[u8]) -> Result<bool, TransportError> {
        self.notify(payload).await.map(|()| true)
    }

    async fn transfer(&self, op: Op, descs: &[Desc]) -> Result<(), TransportError> {
        let bound = self.inner.config.batch_timeout;
        self.inner
            .transfer(op, descs, None, bound)
            .await
            .map(|_| ())
    }

    async fn transfer_until(
        &self,
        op: Op,
        descs: &[Desc],
        trailer: Option<&[u8]>,
        deadline: Instant,
    ) -> Result<bool, TransportError> {
        let bound = deadline.saturating_duration_since(Instant::now());
        self.inner.transfer(op, descs, trailer, bound).await
    }

    async fn close(self) {
        self.inner.closed.set(true);
        self.inner.shm.borrow_mut().take();
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

    /// Whether batches to this peer go through its shared memory now.
    pub fn uses_shm(&self) -> bool {
        self.inner.shm.borrow().is_some()
    }

    /// Bytes copied through the peer's shared memory over this `TcpSession`.
    pub fn shm_copied_bytes(&self) -> u64 {
        self.inner.shm_copied.get()
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
    /// batch landed one trip earlier than from this side. The same as
    /// [`Session::transfer_until`] with a trailer, under the configured
    /// batch bound.
    pub async fn write_then_notify(
        &self,
        descs: &[Desc],
        trailer: &[u8],
    ) -> Result<bool, TransportError> {
        let bound = self.inner.config.batch_timeout;
        self.inner
            .transfer(Op::Write, descs, Some(trailer), bound)
            .await
    }

    /// Hands `payload` (at most [`wire::MAX_NOTIFY_BYTES`]) to the peer's
    /// notification handler; `Ok` once the handler took it. Notifications
    /// have a connection of their own, taken in arrival order, so they never
    /// wait behind bulk batches, and nothing orders them against batches
    /// still in flight: to say something about data, send it once that
    /// data's batch returned (or use [`TcpSession::write_then_notify`]).
    pub async fn notify(&self, payload: &[u8]) -> Result<(), TransportError> {
        within(self.inner.config.batch_timeout, self.inner.notify(payload)).await
    }
}
