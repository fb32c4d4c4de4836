//! One engine's connection: its requests in order, each answered with the
//! keys removed since the last answer; a hello names the engine's
//! endpoint, and puts and gets move their bytes over a data-plane session
//! to it.

use std::time::{Duration, Instant};

use futures_lite::AsyncWriteExt;
use glommio::net::TcpStream;
use kvferry_auth::Surface;
use kvferry_store::internal::proto::{
    Answer, Channel, Item, KeyAnswer, Refusal, Reply, Request, REMOVED_PER_REPLY_MAX,
};
use kvferry_transport::TcpSession;
use kvferry_transport::{Desc, EndpointAddr, Op, Session, Transport, TransportError};

use crate::descs::{push_descs, total_bytes, value_len};
use crate::framing::{open_channel, read_request, ReadEnd};
use crate::metrics::ServerCounters;
use crate::server::Server;

/// One engine's connection.
pub(crate) struct Conn {
    /// The engine's address on this connection: a hello must name an
    /// endpoint at this IP.
    peer: Option<std::net::IpAddr>,
    endpoint: Option<EndpointAddr>,
    session: Option<TcpSession>,
    /// The next removed key to tell this engine of.
    removed_at: u64,
}

impl Conn {
    pub(crate) fn new(server: &Server, stream: &TcpStream) -> Conn {
        Conn {
            peer: stream.peer_addr().ok().map(|a| a.ip()),
            endpoint: None,
            session: None,
            removed_at: server.space.borrow().removed_end(),
        }
    }

    pub(crate) async fn serve(mut self, server: &Server, mut stream: TcpStream) {
        let Some(mut channel) = open_channel(server, &mut stream).await else {
            return;
        };
        loop {
            // Idle past the bound: a crashed engine's half-open
            // connection gives its slot back; a live one reconnects.
            let idle = async {
                glommio::timer::Timer::new(server.idle_max).await;
                Err(ReadEnd::Closed)
            };
            let read = read_request(&mut channel, &mut stream);
            let (id, req) = match futures_lite::future::or(read, idle).await {
                Ok(r) => r,
                Err(ReadEnd::Closed) => return,
                Err(ReadEnd::Unauthenticated) => {
                    server.rejects().count(Surface::Store);
                    tracing::warn!(
                        "store server: a frame's tag does not verify; connection closed"
                    );
                    return;
                }
                Err(ReadEnd::Malformed(e)) => {
                    tracing::warn!("store server: malformed request: {e}");
                    let refused = Answer::Refused(Refusal::Malformed);
                    let _ = self
                        .answer(server, (&mut channel, &mut stream), 0, refused)
                        .await;
                    return;
                }
            };
            let answer = self.handle(server, req).await;
            let to = (&mut channel, &mut stream);
            if self.answer(server, to, id, answer).await.is_err() {
                return;
            }
        }
    }

    async fn answer(
        &mut self,
        server: &Server,
        (channel, stream): (&mut Channel, &mut TcpStream),
        id: u64,
        answer: Answer,
    ) -> std::io::Result<()> {
        if matches!(answer, Answer::Refused(_)) {
            ServerCounters::add(&server.counters.refused, 1);
        }
        ServerCounters::add(&server.counters.requests, 1);
        server.publish();
        // A hello's answer tells none: the engine takes removed keys from
        // the answers to its calls only.
        let max = match answer {
            Answer::Hello { .. } => 0,
            _ => REMOVED_PER_REPLY_MAX,
        };
        let (removed, removed_lost, next) =
            (server.space.borrow()).removed_since(self.removed_at, max);
        self.removed_at = next;
        let reply = Reply {
            answer,
            removed,
            removed_lost,
            removed_next: next,
        };
        let frame = channel
            .encode(id, &reply)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        stream.write_all(&frame).await
    }

    async fn handle(&mut self, server: &Server, req: Request) -> Answer {
        match req {
            Request::Hello {
                endpoint,
                removed_from,
            } => self.hello(server, &endpoint, removed_from),
            Request::Exists { keys } => {
                let space = server.space.borrow();
                Answer::Exists(keys.iter().map(|k| space.exists(k)).collect())
            }
            Request::Remove { keys } => {
                let mut space = server.space.borrow_mut();
                Answer::Keys(keys.iter().map(|k| space.remove(k)).collect())
            }
            Request::RemovePrefix { prefix } => {
                Answer::Removed(server.space.borrow_mut().remove_prefix(&prefix))
            }
            Request::Put { budget_ms, items } => {
                self.moved(server, Op::Read, budget_ms, &items).await
            }
            Request::Get { budget_ms, items } => {
                self.moved(server, Op::Write, budget_ms, &items).await
            }
        }
    }

    /// Takes the engine's endpoint: only one at the IP this connection
    /// comes from, and never the server's own, so a client can point the
    /// server's reads and writes neither at another engine nor at the
    /// arena itself.
    fn hello(&mut self, server: &Server, endpoint: &str, removed_from: Option<u64>) -> Answer {
        let own = server.transport.endpoint_addr();
        match endpoint.parse::<EndpointAddr>() {
            Ok(ep @ EndpointAddr::Tcp(addr)) if Some(addr.ip()) == self.peer && ep != own => {
                self.endpoint = Some(ep);
                self.session = None;
                let space = server.space.borrow();
                if let Some(from) = removed_from {
                    // A later position than the log's end is no position.
                    self.removed_at = from.min(space.removed_end());
                }
                Answer::Hello {
                    capacity_bytes: space.capacity(),
                }
            }
            _ => {
                tracing::warn!("store server: hello naming {endpoint:?} refused");
                Answer::Refused(Refusal::NoHello)
            }
        }
    }

    /// The session to the engine's endpoint, opened on first use within
    /// `bound` (an endpoint that accepts and never answers costs no more).
    async fn session(&mut self, server: &Server, bound: Duration) -> Result<TcpSession, Refusal> {
        if let Some(s) = &self.session {
            return Ok(s.clone());
        }
        let ep = self.endpoint.ok_or(Refusal::NoHello)?;
        match kvferry_transport::within(bound, server.transport.open(&ep)).await {
            Ok(s) => {
                self.session = Some(s.clone());
                Ok(s)
            }
            Err(e) => {
                tracing::warn!("store server: engine endpoint {ep}: {e}");
                Err(Refusal::EndpointUnreachable)
            }
        }
    }

    /// A put (`Op::Read`: the engine's blocks into reserved extents) or a
    /// get (`Op::Write`: pinned values into the engine's blocks): claim
    /// each item's extent, move every claimed item's bytes in one batch,
    /// then settle the claims (commit or abort; unpin).
    async fn moved(&mut self, server: &Server, op: Op, budget_ms: u32, items: &[Item]) -> Answer {
        let deadline = Instant::now() + budget(server, budget_ms);
        let left = deadline.saturating_duration_since(Instant::now());
        let session = match self.session(server, left).await {
            Ok(s) => s,
            Err(r) => return Answer::Refused(r),
        };
        let regions = session.remote_regions();
        let mut answers = vec![KeyAnswer::Done; items.len()];
        let mut claimed = Vec::new();
        let mut descs = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let claim = value_len(&regions, it).and_then(|len| {
                let mut space = server.space.borrow_mut();
                match op {
                    Op::Read => space.reserve(&it.key, len),
                    Op::Write => space.pin(&it.key, len),
                }
            });
            match claim {
                Ok(off) => {
                    claimed.push(i);
                    push_descs(&mut descs, server.base() + off, it);
                }
                Err(a) => answers[i] = a,
            }
        }
        let result = self.transfer(server, &session, op, deadline, &descs).await;
        let mut space = server.space.borrow_mut();
        for &i in &claimed {
            let key = &items[i].key;
            match (op, result) {
                (Op::Read, Ok(())) => space.commit(key),
                (Op::Read, Err(_)) => space.abort(key),
                (Op::Write, _) => space.unpin(key),
            }
            if let Err(a) = result {
                answers[i] = a;
            }
        }
        if result.is_ok() {
            let counter = match op {
                Op::Read => &server.counters.bytes_in,
                Op::Write => &server.counters.bytes_out,
            };
            ServerCounters::add(counter, total_bytes(&descs));
            if session.uses_shm() && !descs.is_empty() {
                ServerCounters::add(&server.counters.shm_batches, 1);
            }
        }
        Answer::Keys(answers)
    }

    /// Moves one batch within the request's budget; a failed batch drops
    /// the session, so the next one re-learns the engine's regions.
    async fn transfer(
        &mut self,
        server: &Server,
        session: &TcpSession,
        op: Op,
        deadline: Instant,
        descs: &[Desc],
    ) -> Result<(), KeyAnswer> {
        if descs.is_empty() {
            return Ok(());
        }
        match session.transfer_until(op, descs, None, deadline).await {
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::debug!("store server: {op:?} batch of {} failed: {e}", descs.len());
                ServerCounters::add(&server.counters.transfer_failures, 1);
                self.session = None;
                Err(match e {
                    TransportError::Timeout { .. } => KeyAnswer::Timeout,
                    _ => KeyAnswer::Transport,
                })
            }
        }
    }
}

/// A request's budget, cut to the server's bound.
fn budget(server: &Server, budget_ms: u32) -> Duration {
    Duration::from_millis(budget_ms.into()).min(server.budget_max)
}
