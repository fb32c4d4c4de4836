//! Small transfers to one peer share data-plane batches.

use super::*;

/// A transfer at most this many descriptors long (and one planner batch)
/// may share a data-plane batch with others to the same peer.
pub(super) const COALESCE_MAX_DESCS: usize = 256;
/// ... and at most this many bytes.
pub(super) const COALESCE_MAX_BYTES: u64 = 256 << 10;
/// Most descriptors in one shared batch.
pub(super) const SHARED_BATCH_MAX_DESCS: usize = 4096;
/// Most bytes in one shared batch.
pub(super) const SHARED_BATCH_MAX_BYTES: u64 = 4 << 20;
/// Shared batches in flight per peer: one per TCP stream of the session.
pub(super) const PUMPS_PER_LANE: usize = 2;

/// Small transfers to one peer, waiting for a shared batch. A TCP stream
/// carries one batch per round trip, so with hundreds of small requests in
/// flight one batch per request capped the rate at a few thousand per
/// second; a pump instead takes everything queued (in arrival order, so no
/// request starves) and moves it as one batch.
#[derive(Default)]
pub(super) struct Lane {
    pub(super) queue: VecDeque<Queued>,
    /// Pump tasks running for this lane (at most [`PUMPS_PER_LANE`]).
    pub(super) pumps: usize,
}

/// One small transfer in a lane.
pub(super) struct Queued {
    pub(super) op: Op,
    pub(super) descs: Vec<Desc>,
    /// When the op was posted plus the transfer bound: no byte of it may
    /// move after this.
    pub(super) deadline: Instant,
    /// The encoded side-channel frame to deliver behind the batch once it
    /// landed (a write's closing `Status`).
    pub(super) note: Option<Vec<u8>>,
    /// `Ok(true)` when the note was delivered.
    pub(super) done: futures::channel::oneshot::Sender<Result<bool, MoveError>>,
}

pub(super) type Lanes = Rc<RefCell<HashMap<EndpointAddr, Lane>>>;

/// What a shared batch needs to run.
pub(super) struct Io {
    pub(super) transport: Rc<AnyTransport>,
    pub(super) sessions: Sessions,
    pub(super) lanes: Lanes,
    /// This node's data-plane endpoint (see [`Messenger::sender`]).
    pub(super) sender: String,
}

impl Io {
    /// Queues a small transfer on the lane of `endpoint` and waits for the
    /// shared batch that carries it.
    pub(super) async fn queue(
        self,
        endpoint: EndpointAddr,
        op: Op,
        descs: Vec<Desc>,
        note: Option<Vec<u8>>,
        deadline: Instant,
    ) -> Result<bool, MoveError> {
        let (done, answer) = futures::channel::oneshot::channel();
        let start_pump = {
            let mut lanes = self.lanes.borrow_mut();
            let lane = lanes.entry(endpoint).or_default();
            lane.queue.push_back(Queued {
                op,
                descs,
                deadline,
                note,
                done,
            });
            let start = lane.pumps < PUMPS_PER_LANE;
            if start {
                lane.pumps += 1;
            }
            start
        };
        if start_pump {
            let io = Io {
                transport: self.transport.clone(),
                sessions: self.sessions.clone(),
                lanes: self.lanes.clone(),
                sender: self.sender.clone(),
            };
            glommio::spawn_local(io.pump(endpoint)).detach();
        }
        answer.await.unwrap_or(Err(MoveError::BatchDropped))
    }

    /// Moves what the lane holds, batch after batch, until it is empty.
    pub(super) async fn pump(self, endpoint: EndpointAddr) {
        loop {
            let jobs = self.take(endpoint);
            if jobs.is_empty() {
                return;
            }
            let now = Instant::now();
            let (live, late): (Vec<Queued>, Vec<Queued>) =
                jobs.into_iter().partition(|j| now < j.deadline);
            for j in late {
                // Never started: no byte of it moved.
                let _ = j.done.send(Err(MoveError::WaitedPastBound));
            }
            let Some(first) = live.first() else { continue };
            let op = first.op;
            // The whole batch stops at the earliest deadline of its parts,
            // so no part touches memory past its own bound.
            let deadline = live.iter().map(|j| j.deadline).min().unwrap_or(now);
            let descs: Vec<Desc> = live.iter().flat_map(|j| j.descs.iter().copied()).collect();
            let whole = std::iter::once(0..descs.len()).collect::<Vec<_>>();
            let notes: Vec<&[u8]> = live.iter().filter_map(|j| j.note.as_deref()).collect();
            let trailer = (!notes.is_empty()).then(|| wire::encode_notify(&self.sender, notes));
            let route = Route {
                transport: &self.transport,
                sessions: &self.sessions,
                endpoint,
            };
            let result = route
                .move_bytes(op, &descs, &whole, trailer.as_deref(), deadline)
                .await;
            for j in live {
                let answer = result.clone().map(|d| d && j.note.is_some());
                let _ = j.done.send(answer);
            }
        }
    }

    /// Takes the next shared batch off the lane: queued transfers in order,
    /// of one direction, within the batch bounds. An empty result retires
    /// this pump (and the lane, when it was the last one).
    pub(super) fn take(&self, endpoint: EndpointAddr) -> Vec<Queued> {
        let mut lanes = self.lanes.borrow_mut();
        let Some(lane) = lanes.get_mut(&endpoint) else {
            return Vec::new();
        };
        let mut jobs: Vec<Queued> = Vec::new();
        let (mut n, mut bytes) = (0usize, 0u64);
        // The notes share one notification, within its bounds.
        let (mut notes, mut note_bytes) = (0usize, wire::notify_endpoint_len(&self.sender));
        while let Some(next) = lane.queue.front() {
            let len: u64 = next.descs.iter().map(|d| d.len_bytes).sum();
            let note_len = next.note.as_deref().map_or(0, wire::notify_frame_len);
            let notes_fit = next.note.is_none()
                || (notes < wire::MAX_NOTIFY_FRAMES
                    && note_bytes + note_len <= crate::transport::internal::wire::MAX_NOTIFY_BYTES);
            let fits = jobs.is_empty()
                || (jobs[0].op == next.op
                    && n + next.descs.len() <= SHARED_BATCH_MAX_DESCS
                    && bytes + len <= SHARED_BATCH_MAX_BYTES
                    && notes_fit);
            if !fits {
                break;
            }
            n += next.descs.len();
            bytes += len;
            notes += usize::from(next.note.is_some());
            note_bytes += note_len;
            jobs.extend(lane.queue.pop_front());
        }
        if jobs.is_empty() {
            lane.pumps = lane.pumps.saturating_sub(1);
            if lane.pumps == 0 {
                lanes.remove(&endpoint);
            }
        }
        jobs
    }
}
