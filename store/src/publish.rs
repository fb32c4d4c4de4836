//! The store tier's KV events over ZeroMQ, in vLLM's wire format, for
//! engines whose own publisher does not carry them (inside vLLM the
//! connector hands them to vLLM's publisher instead).
//!
//! # Wire format (vLLM 0.33's `ZmqEventPublisher`)
//!
//! Each batch is one PUB message of three frames: the topic, the batch's
//! sequence number as 8 big-endian bytes, and the msgpack payload.
//! Sequence numbers start at 0 and grow by one per batch. The payload is
//! what `msgspec.msgpack.Encoder` makes of a `KVEventBatch`, byte for
//! byte ([`KvEventBatch::encode`]):
//!
//! * the batch is an array `[ts, events, data_parallel_rank]` (an
//!   `array_like` struct: msgspec keeps its trailing `None`);
//! * each event is a map whose first key, `type`, names the variant
//!   (`tag=True`), followed by its fields in declaration order, with the
//!   fields whose value is their default (`None`) left out
//!   (`omit_defaults`). `BlockStored` has 15 fields plus the tag, so
//!   msgspec gives it a map16 header even for fewer keys; the others get a
//!   fixmap.
//! * ints take msgpack's shortest form, `ts` is a float64.
//!
//! | variant | keys |
//! |---|---|
//! | `BlockStored` | `type`, `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id` (always nil: kvferry knows adapters by name), `medium`, `lora_name`, `group_idx` |
//! | `BlockRemoved` | `type`, `block_hashes`, `medium`, `group_idx` when known |
//! | `AllBlocksCleared` | `type` |
//!
//! Block hashes follow [`HashEncoding`]: by default the integer vLLM
//! itself publishes for the same hash (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`
//! is on by default: the hash's bytes as a big-endian integer, keeping its
//! low 64 bits), so a router sees the same identifiers from vLLM's GPU
//! tier and from kvferry's store tier.
//!
//! # Replay
//!
//! With a replay endpoint, a ROUTER answers a request `[empty, start]`
//! (what a REQ or DEALER sends; `start` a big-endian sequence number) with
//! every buffered batch from `start` on, each as `[empty, topic, seq,
//! payload]`, then the end marker `[empty, empty, -1 as 8 bytes, empty]`.
//! At most [`PublisherConfig::replay_batches`] batches are buffered.
//!
//! # Threads and bounds
//!
//! [`KvEventPublisher::publish`] encodes on the caller's thread and hands
//! the payload to the publisher's thread through an in-process socket
//! without waiting ([`zmq::DONTWAIT`]); when that queue is at its
//! high-water mark the batch is dropped, counted, and the call answers
//! [`PublishError::QueueFull`]. A dropped batch still takes its sequence
//! number, so subscribers see the loss as a gap. The publisher's thread
//! owns the PUB and ROUTER sockets; PUB drops for a subscriber past its
//! high-water mark (ZeroMQ's PUB semantics, as in vLLM), which the
//! subscriber sees as a gap it can ask the replay socket to fill.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::thread::JoinHandle;
use std::time::Duration;

use kvferry_machines::store::events::{BlockStored, KvEvent, Medium};
use kvferry_machines::store::key::BlockHash;
use rmp::encode::{self as enc, ByteBuf, RmpWrite, ValueWriteError};

/// Batches kept for replay by default (vLLM's `buffer_steps`).
pub const REPLAY_BATCHES_DEFAULT: usize = 10_000;
/// Most batches a replay buffer may keep.
pub const REPLAY_BATCHES_MAX: usize = 1 << 20;
/// The PUB socket's high-water mark by default (vLLM's `hwm`).
pub const PUB_HWM_DEFAULT: i32 = 100_000;
/// Batches waiting for the publisher's thread by default, before
/// [`PublishError::QueueFull`].
pub const QUEUE_BATCHES_DEFAULT: i32 = 1024;
/// The sequence-number frame of the replay's end marker.
pub const REPLAY_END_SEQ: [u8; 8] = (-1i64).to_be_bytes();
/// How long dropping a publisher waits to hand its thread the stop.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(1);
/// The in-process queue between the caller and the publisher's thread
/// (each publisher has its own ZeroMQ context, so the name is free).
const QUEUE_ENDPOINT: &str = "inproc://kvferry-kv-events";

/// How block hashes go on the wire (vLLM's `ExternalBlockHash`, `bytes | int`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HashEncoding {
    /// The hash's bytes as a big-endian integer, low 64 bits kept: what
    /// vLLM publishes with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, its
    /// default.
    #[default]
    Int,
    /// The hash's bytes as msgpack bin: what vLLM publishes with
    /// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`.
    Bytes,
}

impl HashEncoding {
    /// The integer vLLM publishes for `hash` under [`HashEncoding::Int`].
    pub fn int_of(hash: &BlockHash) -> u64 {
        let b = hash.as_bytes();
        let low = &b[b.len().saturating_sub(8)..];
        low.iter().fold(0, |acc, &x| (acc << 8) | u64::from(x))
    }
}

/// A batch of events as vLLM's `KVEventBatch`.
#[derive(Clone, Copy, Debug)]
pub struct KvEventBatch<'a> {
    /// Seconds since the Unix epoch (vLLM's `time.time()`).
    pub ts: f64,
    /// The events, in order.
    pub events: &'a [KvEvent],
    /// The engine's data-parallel rank, if any.
    pub data_parallel_rank: Option<u32>,
}

/// Why a batch could not be encoded.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A list or string longer than msgpack can frame (2^32 - 1).
    #[error("{what} has {len} entries, more than msgpack can frame")]
    TooLong {
        /// Which list or string.
        what: &'static str,
        /// Its length.
        len: usize,
    },
}

impl KvEventBatch<'_> {
    /// The batch's msgpack payload, exactly as vLLM's encoder makes it.
    pub fn encode(&self, hashes: HashEncoding) -> Result<Vec<u8>, EncodeError> {
        let mut w = ByteBuf::with_capacity(64usize.saturating_mul(1 + self.events.len()));
        ok(enc::write_array_len(&mut w, 3));
        ok(enc::write_f64(&mut w, self.ts));
        ok(enc::write_array_len(
            &mut w,
            len32("events", self.events.len())?,
        ));
        for e in self.events {
            write_event(&mut w, e, hashes)?;
        }
        match self.data_parallel_rank {
            Some(r) => write_uint(&mut w, r),
            None => write_nil(&mut w),
        }
        Ok(w.into_vec())
    }
}

/// The value of a write into a [`ByteBuf`], which cannot fail.
fn ok<T>(r: Result<T, ValueWriteError<Infallible>>) -> T {
    match r {
        Ok(v) => v,
        Err(ValueWriteError::InvalidMarkerWrite(e) | ValueWriteError::InvalidDataWrite(e)) => {
            match e {}
        }
    }
}

/// [`ok`] for the writes whose error is the writer's own.
fn done<T>(r: Result<T, Infallible>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => match e {},
    }
}

/// Writes a map key: a short constant, never too long.
fn key(w: &mut ByteBuf, k: &'static str) {
    ok(enc::write_str(w, k));
}

fn len32(what: &'static str, len: usize) -> Result<u32, EncodeError> {
    u32::try_from(len).map_err(|_| EncodeError::TooLong { what, len })
}

fn write_str(w: &mut ByteBuf, what: &'static str, s: &str) -> Result<(), EncodeError> {
    len32(what, s.len())?;
    ok(enc::write_str(w, s));
    Ok(())
}

fn write_nil(w: &mut ByteBuf) {
    done(enc::write_nil(w));
}

fn write_hash(w: &mut ByteBuf, h: &BlockHash, hashes: HashEncoding) {
    match hashes {
        HashEncoding::Int => drop(ok(enc::write_uint(w, HashEncoding::int_of(h)))),
        // At most BLOCK_HASH_BYTES_MAX bytes: always fits a bin8.
        HashEncoding::Bytes => ok(enc::write_bin(w, h.as_bytes())),
    }
}

fn write_hashes(
    w: &mut ByteBuf,
    hs: &[BlockHash],
    hashes: HashEncoding,
) -> Result<(), EncodeError> {
    ok(enc::write_array_len(w, len32("block_hashes", hs.len())?));
    for h in hs {
        write_hash(w, h, hashes);
    }
    Ok(())
}

fn write_uint(w: &mut ByteBuf, v: u32) {
    ok(enc::write_uint(w, u64::from(v)));
}

fn write_medium(w: &mut ByteBuf, m: Medium) {
    key(w, "medium");
    key(w, m.as_str());
}

fn write_event(w: &mut ByteBuf, e: &KvEvent, hashes: HashEncoding) -> Result<(), EncodeError> {
    match e {
        KvEvent::BlockStored(s) => write_stored(w, s, hashes),
        KvEvent::BlockRemoved {
            block_hashes,
            medium: m,
            group,
        } => {
            ok(enc::write_map_len(w, 3 + u32::from(group.is_some())));
            key(w, "type");
            key(w, "BlockRemoved");
            key(w, "block_hashes");
            write_hashes(w, block_hashes, hashes)?;
            write_medium(w, *m);
            if let Some(g) = group {
                key(w, "group_idx");
                write_uint(w, *g);
            }
            Ok(())
        }
        KvEvent::AllBlocksCleared => {
            ok(enc::write_map_len(w, 1));
            key(w, "type");
            key(w, "AllBlocksCleared");
            Ok(())
        }
    }
}

fn write_stored(w: &mut ByteBuf, s: &BlockStored, hashes: HashEncoding) -> Result<(), EncodeError> {
    // msgspec sizes a struct's map header for all its keys (the tag and
    // BlockStored's 15 fields) before leaving defaults out: a map16 even
    // for the 9 keys written here.
    const KEYS: u16 = 9;
    done(w.write_u8(rmp::Marker::Map16.to_u8()));
    done(w.write_bytes(&KEYS.to_be_bytes()));
    key(w, "type");
    key(w, "BlockStored");
    key(w, "block_hashes");
    write_hashes(w, &s.block_hashes, hashes)?;
    key(w, "parent_block_hash");
    match &s.parent_block_hash {
        Some(h) => write_hash(w, h, hashes),
        None => write_nil(w),
    }
    key(w, "token_ids");
    ok(enc::write_array_len(
        w,
        len32("token_ids", s.token_ids.len())?,
    ));
    for &t in &s.token_ids {
        write_uint(w, t);
    }
    key(w, "block_size");
    write_uint(w, s.block_size);
    key(w, "lora_id");
    write_nil(w);
    write_medium(w, s.medium);
    key(w, "lora_name");
    match &s.lora_name {
        Some(name) => write_str(w, "lora_name", name)?,
        None => write_nil(w),
    }
    key(w, "group_idx");
    write_uint(w, s.group);
    Ok(())
}

/// Where and how a [`KvEventPublisher`] publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublisherConfig {
    /// The PUB endpoint to bind (vLLM's default `tcp://*:5557`;
    /// `tcp://127.0.0.1:0` takes a free port, see
    /// [`KvEventPublisher::endpoint`]).
    pub endpoint: String,
    /// The replay ROUTER endpoint to bind, if any.
    pub replay_endpoint: Option<String>,
    /// The first frame of every message (vLLM's default is empty).
    pub topic: String,
    /// Batches kept for replay, at most [`REPLAY_BATCHES_MAX`] (only with
    /// a replay endpoint).
    pub replay_batches: usize,
    /// The PUB socket's high-water mark, in messages per subscriber.
    pub hwm: i32,
    /// Batches waiting for the publisher's thread, at least 1.
    pub queue_batches: i32,
    /// Written into every batch: the engine's data-parallel rank (vLLM's
    /// publisher always writes one, 0 without data parallelism; `None`
    /// writes nil). Unlike vLLM, the endpoints' ports are not offset by
    /// it: each rank's publisher is given its own endpoints.
    pub data_parallel_rank: Option<u32>,
    /// How block hashes are written.
    pub hashes: HashEncoding,
}

impl Default for PublisherConfig {
    /// vLLM's defaults.
    fn default() -> PublisherConfig {
        PublisherConfig {
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            topic: String::new(),
            replay_batches: REPLAY_BATCHES_DEFAULT,
            hwm: PUB_HWM_DEFAULT,
            queue_batches: QUEUE_BATCHES_DEFAULT,
            data_parallel_rank: Some(0),
            hashes: HashEncoding::Int,
        }
    }
}

/// Why a publisher could not start or a batch was not published.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// A configuration value out of range.
    #[error("bad publisher configuration: {0}")]
    Config(&'static str),
    /// An endpoint could not be bound.
    #[error("binding {endpoint}: {source}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// ZeroMQ's error.
        source: zmq::Error,
    },
    /// A socket could not be set up or used.
    #[error("zmq {what}: {source}")]
    Zmq {
        /// What was being done.
        what: &'static str,
        /// ZeroMQ's error.
        source: zmq::Error,
    },
    /// The publisher's thread could not be started.
    #[error("publisher thread: {0}")]
    Thread(std::io::Error),
    /// The batch could not be encoded; it took no sequence number.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// The queue to the publisher's thread is full: batch `seq` was
    /// dropped (and counted).
    #[error("publisher queue full: batch {seq} dropped")]
    QueueFull {
        /// The sequence number the dropped batch took.
        seq: u64,
    },
    /// The publisher's thread has stopped: batch `seq` was dropped.
    #[error("publisher thread stopped: batch {seq} dropped")]
    Stopped {
        /// The sequence number the dropped batch took.
        seq: u64,
    },
}

fn zerr(what: &'static str) -> impl Fn(zmq::Error) -> PublishError {
    move |source| PublishError::Zmq { what, source }
}

/// Publishes batches of [`KvEvent`]s as vLLM's `ZmqEventPublisher` does
/// (see the module docs).
pub struct KvEventPublisher {
    /// The caller's end of the queue to the publisher's thread.
    queue: zmq::Socket,
    thread: Option<JoinHandle<()>>,
    endpoint: String,
    replay_endpoint: Option<String>,
    next_seq: u64,
    dropped: u64,
    data_parallel_rank: Option<u32>,
    hashes: HashEncoding,
}

impl std::fmt::Debug for KvEventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventPublisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .field("next_seq", &self.next_seq)
            .field("dropped", &self.dropped)
            .finish_non_exhaustive()
    }
}

fn check(config: &PublisherConfig) -> Result<(), PublishError> {
    if config.replay_batches > REPLAY_BATCHES_MAX {
        return Err(PublishError::Config(
            "replay_batches over REPLAY_BATCHES_MAX",
        ));
    }
    if config.hwm < 0 {
        return Err(PublishError::Config("hwm below 0"));
    }
    if config.queue_batches < 1 {
        return Err(PublishError::Config("queue_batches below 1"));
    }
    Ok(())
}

/// Binds `s` to `endpoint`; returns the endpoint it is bound at.
fn bind(s: &zmq::Socket, endpoint: &str) -> Result<String, PublishError> {
    s.bind(endpoint).map_err(|source| PublishError::Bind {
        endpoint: endpoint.to_owned(),
        source,
    })?;
    let bound = s.get_last_endpoint().map_err(zerr("bound endpoint"))?;
    Ok(bound.unwrap_or_else(|_| endpoint.to_owned()))
}

impl KvEventPublisher {
    /// Binds the PUB (and replay ROUTER) endpoints and starts the
    /// publisher's thread.
    pub fn bind(config: &PublisherConfig) -> Result<KvEventPublisher, PublishError> {
        check(config)?;
        let ctx = zmq::Context::new();
        let publ = ctx.socket(zmq::PUB).map_err(zerr("socket"))?;
        publ.set_linger(0).map_err(zerr("linger"))?;
        publ.set_sndhwm(config.hwm).map_err(zerr("hwm"))?;
        let endpoint = bind(&publ, &config.endpoint)?;
        let (replay, replay_endpoint) = match &config.replay_endpoint {
            Some(ep) => {
                let (r, bound) = replay_socket(&ctx, ep, config.replay_batches)?;
                (Some(r), Some(bound))
            }
            None => (None, None),
        };
        let (queue, worker_end) = queue_pair(&ctx, config.queue_batches)?;
        let worker = Worker {
            queue: worker_end,
            publ,
            replay,
            topic: config.topic.as_bytes().to_vec(),
            buffer: VecDeque::new(),
            replay_batches: if config.replay_endpoint.is_some() {
                config.replay_batches
            } else {
                0
            },
        };
        let thread = std::thread::Builder::new()
            .name("kvferry-kv-events".into())
            .spawn(move || worker.run())
            .map_err(PublishError::Thread)?;
        Ok(KvEventPublisher {
            queue,
            thread: Some(thread),
            endpoint,
            replay_endpoint,
            next_seq: 0,
            dropped: 0,
            data_parallel_rank: config.data_parallel_rank,
            hashes: config.hashes,
        })
    }

    /// The PUB endpoint as bound (a port of 0 resolved).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay endpoint as bound, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The sequence number the next batch takes.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Batches dropped so far (queue full or thread stopped).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// [`KvEventPublisher::publish`] stamped with the current time, as
    /// vLLM stamps its batches (`time.time()`). A clock before the epoch
    /// stamps 0.
    pub fn publish_now(&mut self, events: &[KvEvent]) -> Result<u64, PublishError> {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.publish(ts, events)
    }

    /// Publishes `events` as one batch stamped `ts` (seconds since the
    /// Unix epoch); returns its sequence number. Never waits: a full
    /// queue drops the batch (see the module docs).
    pub fn publish(&mut self, ts: f64, events: &[KvEvent]) -> Result<u64, PublishError> {
        let batch = KvEventBatch {
            ts,
            events,
            data_parallel_rank: self.data_parallel_rank,
        };
        let payload = batch.encode(self.hashes)?;
        let seq = self.next_seq;
        self.next_seq = seq.wrapping_add(1);
        let mut frame = Vec::with_capacity(8 + payload.len());
        frame.extend_from_slice(&seq.to_be_bytes());
        frame.extend_from_slice(&payload);
        if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
            self.dropped += 1;
            return Err(PublishError::Stopped { seq });
        }
        match self.queue.send(frame, zmq::DONTWAIT) {
            Ok(()) => Ok(seq),
            Err(zmq::Error::EAGAIN) => {
                self.dropped += 1;
                Err(PublishError::QueueFull { seq })
            }
            Err(source) => {
                self.dropped += 1;
                Err(PublishError::Zmq {
                    what: "queue",
                    source,
                })
            }
        }
    }
}

impl Drop for KvEventPublisher {
    /// Hands the thread the stop (an empty frame, after every queued
    /// batch) and waits for it; a thread that does not take it within
    /// `SHUTDOWN_WAIT` (a second) is left behind.
    fn drop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        if thread.is_finished() {
            let _ = thread.join();
            return;
        }
        let _ = self.queue.set_sndtimeo(SHUTDOWN_WAIT.as_millis() as i32);
        match self.queue.send(Vec::new(), 0) {
            Ok(()) => {
                let _ = thread.join();
            }
            Err(e) => tracing::warn!("kv events publisher thread not stopped: {e}"),
        }
    }
}

/// The replay ROUTER, bound at `endpoint`, and the endpoint as bound.
fn replay_socket(
    ctx: &zmq::Context,
    endpoint: &str,
    batches: usize,
) -> Result<(zmq::Socket, String), PublishError> {
    let r = ctx.socket(zmq::ROUTER).map_err(zerr("socket"))?;
    r.set_linger(0).map_err(zerr("linger"))?;
    // vLLM's bound: a whole replay and its end marker fit, even with
    // ZeroMQ acknowledging reads only every HWM/2 messages. Past it the
    // ROUTER drops (it never waits).
    let hwm = 2 * (batches + 1);
    r.set_sndhwm(i32::try_from(hwm).unwrap_or(i32::MAX))
        .map_err(zerr("replay hwm"))?;
    let bound = bind(&r, endpoint)?;
    Ok((r, bound))
}

/// The two ends of the bounded queue to the publisher's thread.
fn queue_pair(
    ctx: &zmq::Context,
    batches: i32,
) -> Result<(zmq::Socket, zmq::Socket), PublishError> {
    let end = |what| -> Result<zmq::Socket, PublishError> {
        let s = ctx.socket(zmq::PAIR).map_err(zerr(what))?;
        s.set_linger(0).map_err(zerr("linger"))?;
        s.set_sndhwm(batches).map_err(zerr("queue hwm"))?;
        s.set_rcvhwm(batches).map_err(zerr("queue hwm"))?;
        Ok(s)
    };
    let worker = end("queue socket")?;
    worker.bind(QUEUE_ENDPOINT).map_err(zerr("queue bind"))?;
    let caller = end("queue socket")?;
    caller
        .connect(QUEUE_ENDPOINT)
        .map_err(zerr("queue connect"))?;
    Ok((caller, worker))
}

/// The publisher's thread: owns the PUB and replay sockets and the
/// replay buffer.
struct Worker {
    queue: zmq::Socket,
    publ: zmq::Socket,
    replay: Option<zmq::Socket>,
    topic: Vec<u8>,
    buffer: VecDeque<(u64, Vec<u8>)>,
    replay_batches: usize,
}

impl Worker {
    fn run(mut self) {
        loop {
            let ready = {
                let mut items = vec![self.queue.as_poll_item(zmq::POLLIN)];
                if let Some(r) = &self.replay {
                    items.push(r.as_poll_item(zmq::POLLIN));
                }
                match zmq::poll(&mut items, -1) {
                    Ok(_) => items.get(1).is_some_and(|i| i.is_readable()),
                    Err(zmq::Error::EINTR) => continue,
                    Err(e) => {
                        tracing::warn!("kv events publisher stops: {e}");
                        return;
                    }
                }
            };
            // The queue first, always: a replay must see every batch
            // published before the request.
            if !self.drain_queue() {
                return;
            }
            if ready {
                self.serve_replay();
            }
        }
    }

    /// Publishes every queued batch; false once the stop came.
    fn drain_queue(&mut self) -> bool {
        loop {
            let frame = match self.queue.recv_bytes(zmq::DONTWAIT) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) => return true,
                Err(zmq::Error::EINTR) => continue,
                Err(e) => {
                    tracing::warn!("kv events publisher stops: {e}");
                    return false;
                }
            };
            // Every batch's frame starts with its 8-byte sequence number;
            // the stop is an empty frame.
            let Some((seq, payload)) = frame.split_first_chunk::<8>() else {
                return false;
            };
            let frames: [&[u8]; 3] = [&self.topic, seq, payload];
            // PUB never waits: past a subscriber's HWM it drops for that
            // subscriber, who sees a gap.
            if let Err(e) = self.publ.send_multipart(frames, zmq::DONTWAIT) {
                tracing::warn!("kv events batch not published: {e}");
            }
            if self.replay_batches > 0 {
                if self.buffer.len() == self.replay_batches {
                    self.buffer.pop_front();
                }
                self.buffer
                    .push_back((u64::from_be_bytes(*seq), payload.to_vec()));
            }
        }
    }

    /// Answers one waiting replay request (see the module docs); the
    /// loop comes back for the next after draining the queue again.
    fn serve_replay(&mut self) {
        let Some(replay) = &self.replay else {
            return;
        };
        if let Ok(request) = replay.recv_multipart(zmq::DONTWAIT) {
            let [client, _, start] = request.as_slice() else {
                tracing::warn!("replay request of {} frames ignored", request.len());
                return;
            };
            let start = start_seq(start);
            for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
                let frames: [&[u8]; 5] = [client, b"", &self.topic, &seq.to_be_bytes(), payload];
                if let Err(e) = replay.send_multipart(frames, zmq::DONTWAIT) {
                    tracing::warn!("replay of batch {seq} not sent: {e}");
                }
            }
            let end: [&[u8]; 5] = [client, b"", b"", &REPLAY_END_SEQ, b""];
            if let Err(e) = replay.send_multipart(end, zmq::DONTWAIT) {
                tracing::warn!("replay end marker not sent: {e}");
            }
        }
    }
}

/// A replay request's start: a big-endian unsigned integer of any length
/// (vLLM's `int.from_bytes(b, "big")`); one past `u64` starts after
/// every batch.
fn start_seq(b: &[u8]) -> u64 {
    b.iter()
        .try_fold(0u64, |acc, &x| {
            acc.checked_mul(256).map(|v| v | u64::from(x))
        })
        .unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    //! Payloads against msgpack derived by hand from vLLM's structs (the
    //! module docs give the rules); `tests/it/store_kv_events.rs` checks them
    //! against vLLM's own decoder and encoder.
    use super::*;

    /// A fixstr: `0xa0 | len`, then the bytes.
    fn s(x: &str) -> Vec<u8> {
        assert!(x.len() < 32);
        let mut v = vec![0xa0 | x.len() as u8];
        v.extend_from_slice(x.as_bytes());
        v
    }

    /// `[ts = 1.5, [events], rank]`: the batch around `events`.
    fn batch(n_events: u8, events: &[u8], rank: &[u8]) -> Vec<u8> {
        let mut v = vec![0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x90 | n_events];
        v.extend_from_slice(events);
        v.extend_from_slice(rank);
        v
    }

    fn cat(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    fn encode(events: &[KvEvent], rank: Option<u32>, hashes: HashEncoding) -> Vec<u8> {
        let b = KvEventBatch {
            ts: 1.5,
            events,
            data_parallel_rank: rank,
        };
        b.encode(hashes).unwrap()
    }

    #[test]
    fn all_blocks_cleared_without_rank() {
        let got = encode(&[KvEvent::AllBlocksCleared], None, HashEncoding::Int);
        let ev = cat(&[&[0x81], &s("type"), &[0xb0], b"AllBlocksCleared"]);
        assert_eq!(got, batch(1, &ev, &[0xc0]));
    }

    #[test]
    fn block_removed_with_group_and_int_hashes() {
        let long = BlockHash::from_bytes(&[0xab; 32]).unwrap();
        let e = KvEvent::BlockRemoved {
            block_hashes: vec![BlockHash::from_u64(1), long],
            medium: Medium::Cpu,
            group: Some(2),
        };
        let got = encode(&[e], Some(3), HashEncoding::Int);
        let ev = cat(&[
            &[0x84],
            &s("type"),
            &s("BlockRemoved"),
            &s("block_hashes"),
            &[0x92, 0x01, 0xcf],
            &[0xab; 8],
            &s("medium"),
            &s("CPU"),
            &s("group_idx"),
            &[0x02],
        ]);
        assert_eq!(got, batch(1, &ev, &[0x03]));
    }

    #[test]
    fn block_removed_without_group_and_bytes_hashes() {
        let e = KvEvent::BlockRemoved {
            block_hashes: vec![BlockHash::from_bytes(&[1, 2]).unwrap()],
            medium: Medium::Storage,
            group: None,
        };
        let got = encode(&[e], Some(300), HashEncoding::Bytes);
        let ev = cat(&[
            &[0x83],
            &s("type"),
            &s("BlockRemoved"),
            &s("block_hashes"),
            &[0x91, 0xc4, 0x02, 0x01, 0x02],
            &s("medium"),
            &s("STORAGE"),
        ]);
        assert_eq!(got, batch(1, &ev, &[0xcd, 0x01, 0x2c]));
    }

    fn stored(parent: Option<BlockHash>, lora: Option<&str>) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: vec![BlockHash::from_u64(0x1234)],
            parent_block_hash: parent,
            token_ids: vec![1, 200, 70_000],
            block_size: 16,
            medium: Medium::Gpu,
            group: 0,
            lora_name: lora.map(str::to_owned),
        })
    }

    #[test]
    fn block_stored_with_parent_and_lora() {
        let e = stored(Some(BlockHash::from_u64(300)), Some("a"));
        let got = encode(&[e], Some(0), HashEncoding::Int);
        let ev = cat(&[
            &[0xde, 0x00, 0x09],
            &s("type"),
            &s("BlockStored"),
            &s("block_hashes"),
            &[0x91, 0xcd, 0x12, 0x34],
            &s("parent_block_hash"),
            &[0xcd, 0x01, 0x2c],
            &s("token_ids"),
            &[0x93, 0x01, 0xcc, 0xc8, 0xce, 0x00, 0x01, 0x11, 0x70],
            &s("block_size"),
            &[0x10],
            &s("lora_id"),
            &[0xc0],
            &s("medium"),
            &s("GPU"),
            &s("lora_name"),
            &s("a"),
            &s("group_idx"),
            &[0x00],
        ]);
        assert_eq!(got, batch(1, &ev, &[0x00]));
    }

    #[test]
    fn block_stored_without_parent_or_lora_and_bytes_hashes() {
        let got = encode(&[stored(None, None)], None, HashEncoding::Bytes);
        let hash = [0xc4, 0x08, 0, 0, 0, 0, 0, 0, 0x12, 0x34];
        let ev = cat(&[
            &[0xde, 0x00, 0x09],
            &s("type"),
            &s("BlockStored"),
            &s("block_hashes"),
            &[0x91],
            &hash,
            &s("parent_block_hash"),
            &[0xc0],
            &s("token_ids"),
            &[0x93, 0x01, 0xcc, 0xc8, 0xce, 0x00, 0x01, 0x11, 0x70],
            &s("block_size"),
            &[0x10],
            &s("lora_id"),
            &[0xc0],
            &s("medium"),
            &s("GPU"),
            &s("lora_name"),
            &[0xc0],
            &s("group_idx"),
            &[0x00],
        ]);
        assert_eq!(got, batch(1, &ev, &[0xc0]));
    }

    #[test]
    fn empty_batch() {
        assert_eq!(encode(&[], None, HashEncoding::Int), batch(0, &[], &[0xc0]));
    }

    #[test]
    fn int_hashes_keep_the_low_64_bits_big_endian() {
        let short = BlockHash::from_bytes(&[1, 2]).unwrap();
        assert_eq!(HashEncoding::int_of(&short), 0x0102);
        let bytes: Vec<u8> = (0..32).collect();
        let long = BlockHash::from_bytes(&bytes).unwrap();
        assert_eq!(HashEncoding::int_of(&long), 0x18191a1b1c1d1e1f);
        assert_eq!(
            HashEncoding::int_of(&BlockHash::from_u64(u64::MAX)),
            u64::MAX
        );
    }

    #[test]
    fn replay_start_is_big_endian_of_any_length() {
        assert_eq!(start_seq(&[]), 0);
        assert_eq!(start_seq(&5u64.to_be_bytes()), 5);
        assert_eq!(start_seq(&[0, 0, 0, 0, 0, 0, 0, 1, 2]), 0x0102);
        assert_eq!(start_seq(&[1, 0, 0, 0, 0, 0, 0, 0, 0]), u64::MAX);
    }

    #[test]
    fn bad_configs_are_refused() {
        let bad = [
            PublisherConfig {
                replay_batches: REPLAY_BATCHES_MAX + 1,
                ..PublisherConfig::default()
            },
            PublisherConfig {
                hwm: -1,
                ..PublisherConfig::default()
            },
            PublisherConfig {
                queue_batches: 0,
                ..PublisherConfig::default()
            },
        ];
        for c in &bad {
            assert!(matches!(
                KvEventPublisher::bind(c),
                Err(PublishError::Config(_))
            ));
        }
    }

    /// A publisher whose queue has no reader: every batch finds it full.
    #[test]
    fn a_full_queue_drops_and_counts_and_keeps_numbering() {
        let ctx = zmq::Context::new();
        let queue = ctx.socket(zmq::PAIR).unwrap();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let mut p = KvEventPublisher {
            queue,
            thread: Some(std::thread::spawn(move || {
                let _ = stopped.recv();
            })),
            endpoint: String::new(),
            replay_endpoint: None,
            next_seq: 0,
            dropped: 0,
            data_parallel_rank: None,
            hashes: HashEncoding::Int,
        };
        let events = [KvEvent::AllBlocksCleared];
        assert!(matches!(
            p.publish(1.0, &events),
            Err(PublishError::QueueFull { seq: 0 })
        ));
        assert!(matches!(
            p.publish(1.0, &events),
            Err(PublishError::QueueFull { seq: 1 })
        ));
        assert_eq!((p.dropped(), p.next_seq()), (2, 2));
        let thread = p.thread.take().unwrap();
        stop.send(()).unwrap();
        thread.join().unwrap();
        assert!(matches!(
            p.publish(1.0, &events),
            Err(PublishError::Stopped { seq: 2 })
        ));
        assert_eq!(p.dropped(), 3);
    }
}
