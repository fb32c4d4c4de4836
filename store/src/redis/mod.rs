//! The `redis://[user:password@]HOST:PORT` backend, one Redis server, and
//! the `redis+cluster://[user:password@]HOST:PORT[,HOST:PORT...]` one, a
//! Redis Cluster ([`RedisClusterStore`], in `cluster.rs`); docs/design.md,
//! "Backends", "Redis". Both share the value format, the commands
//! (`Batch`: how a key's command is packed and its reply read), the
//! connection (`conn.rs`) and its settings (`config.rs`: the URLs, the
//! password file).
//!
//! * Keys are the store connector's [`ChunkKey`] text, as they are.
//! * A value is a [`HEADER_BYTES`]-byte header (magic `KVFR`, version,
//!   payload length, CRC-32 of the payload) then the block's bytes. A get
//!   checks all four before it writes a byte: a value of another length is
//!   [`ItemError::WrongSize`], a truncated, foreign or corrupt one is
//!   [`ItemError::Corrupt`], and the block is left untouched either way.
//! * One batch is one pipeline on one connection: `EXISTS`, `SET key value
//!   NX` (an existing key is [`PutOutcome::Exists`]; an `OOM` reply is
//!   [`ItemError::Full`], the pressure path), `GET`, `DEL`.
//! * The socket is this backend's own, on the backend's thread: every read
//!   and write waits at most until the call's deadline (socket timeouts
//!   set from it before each system call), so a call ends by its deadline
//!   whatever the server does, and no engine memory is touched after it.
//! * A call that fails on the socket, or gets a reply it cannot read,
//!   drops the connection; the next call connects again, so a restarted
//!   server is picked up by itself.
//!
//! The `redis` crate (no default features: no async runtime) encodes the
//! commands. The replies are read here, not by the crate's connection:
//! its connection waits the socket timeout once per missing reply of a
//! pipeline, so a silent server would hold a batch of N keys for N
//! timeouts. The reader takes only the reply kinds these commands give
//! (`+OK`, `-ERR`, `:N`, `$N`, nil, and arrays where `CLUSTER SLOTS`
//! gives one), each line within [`LINE_BYTES_MAX`], each bulk within
//! [`BULK_BYTES_MAX`], arrays within [`ARRAY_LEN_MAX`],
//! [`ARRAY_DEPTH_MAX`] and [`TREE_REPLIES_MAX`]; anything else is
//! [`CallError::Refused`] and drops the connection. A bulk reply is read
//! into one buffer kept by the connection, checked, and copied into the
//! block: one copy on the way in.

mod cluster;
mod config;
mod conn;

use std::io::Write;
use std::time::Instant;

use kvferry_machines::store::ChunkKey;

use super::backend::{
    Answers, CallError, GetItem, ItemError, PutItem, PutOutcome, Scatter, StoreBackend,
};
use conn::{error_code, Conn, RespValue, Tree};

pub use cluster::{
    hash_slot, ClusterConfig, ClusterStats, RedisClusterStore, CONNS_MAX, REDIRECTS_MAX, SLOTS,
};
pub use config::{RedisConfig, RedisError, PASSWORD_FILE_ENV, SEEDS_MAX};
pub use conn::{
    ARRAY_DEPTH_MAX, ARRAY_LEN_MAX, BULK_BYTES_MAX, LINE_BYTES_MAX, READ_BUFFER_BYTES,
    TREE_REPLIES_MAX,
};

/// The first four bytes of every value this backend stores.
pub const MAGIC: [u8; 4] = *b"KVFR";
/// The header's layout version.
pub const VERSION: u32 = 1;
/// Bytes of the header: magic, version (u32 LE), payload length (u64 LE),
/// CRC-32 of the payload (u32 LE).
pub const HEADER_BYTES: usize = 20;
/// Capacity of the pipeline buffer a backend keeps between calls, at most:
/// a buffer allocated afresh for each batch of 32 MiB of puts costs a page
/// fault per page on every call; a larger one is let go after its call.
pub const PACKED_KEEP_BYTES: usize = 64 << 20;

/// Counters of a [`RedisStore`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RedisStats {
    /// Connections opened (the first one included).
    pub connects: u64,
    /// Pipelines sent (one per call, plus `AUTH` on connect).
    pub round_trips: u64,
    /// Values a get found corrupt, truncated or foreign.
    pub corrupt: u64,
}

/// The `redis://` backend. See the module docs.
pub struct RedisStore {
    cfg: RedisConfig,
    conn: Option<Conn>,
    /// The pipeline's buffer, kept (see [`PACKED_KEEP_BYTES`]).
    packed: Vec<u8>,
    stats: RedisStats,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("cfg", &self.cfg)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A backend for `cfg`; the server is connected on the first call (it
    /// need not be up yet).
    pub fn new(cfg: RedisConfig) -> RedisStore {
        RedisStore {
            cfg,
            conn: None,
            packed: Vec::new(),
            stats: RedisStats::default(),
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> RedisStats {
        self.stats
    }

    /// Pipelines sent so far (for `kvferry bench store`).
    pub fn round_trips(&self) -> u64 {
        self.stats.round_trips
    }

    /// Sends the batch's commands in one pipeline and reads each reply as
    /// it arrives, all by `deadline`; any failure, or a reply the command
    /// never gives, drops the connection.
    fn pipeline<B: Batch>(&mut self, batch: &B, deadline: Instant) -> Answers<B::Out> {
        if Instant::now() >= deadline {
            return Err(CallError::Timeout);
        }
        let mut packed = Packed::take(&mut self.packed, batch.packed_bytes());
        for i in 0..batch.len() {
            batch.pack(i, &mut packed.0, deadline)?;
        }
        if self.conn.is_none() {
            self.conn = Some(Conn::open(&self.cfg, deadline)?);
            self.stats.connects += 1;
            self.stats.round_trips += 1;
        }
        let conn = self.conn.as_mut().ok_or(CallError::Transport)?;
        self.stats.round_trips += 1;
        let answers = conn.exchange(&packed.0, batch.len(), deadline, |i, r| match r {
            RespValue::Error(text) => Some(Err(server_error(error_code(text)))),
            r => batch.answer(i, r, deadline),
        });
        if answers.is_err() {
            self.conn = None;
        }
        packed.keep(&mut self.packed);
        answers
    }
}

/// A pipeline buffer taken from its keeper for one call.
pub(crate) struct Packed(pub(crate) Vec<u8>);

impl Packed {
    /// The kept buffer, emptied, with room for `bytes`.
    pub(crate) fn take(kept: &mut Vec<u8>, bytes: usize) -> Packed {
        let mut buf = std::mem::take(kept);
        buf.clear();
        buf.reserve(bytes);
        Packed(buf)
    }

    /// Hands the buffer back unless it grew past [`PACKED_KEEP_BYTES`].
    pub(crate) fn keep(self, kept: &mut Vec<u8>) {
        if self.0.capacity() <= PACKED_KEEP_BYTES {
            *kept = self.0;
        }
    }
}

/// One batched command, one per key: how a key's command is packed and
/// how its reply reads. One place for both the single server and the
/// cluster (which packs each node's keys apart).
pub(crate) trait Batch {
    /// A key's answer.
    type Out;
    /// Keys in the batch.
    fn len(&self) -> usize;
    /// Key `i`'s text.
    fn key(&self, i: usize) -> &str;
    /// About how many bytes the whole batch packs into.
    fn packed_bytes(&self) -> usize {
        (0..self.len()).map(|i| self.key(i).len() + 32).sum()
    }
    /// Appends key `i`'s command to `buf` (engine memory is read here only,
    /// never past `deadline`).
    fn pack(&self, i: usize, buf: &mut Vec<u8>, deadline: Instant) -> Result<(), CallError>;
    /// Key `i`'s answer from a reply that is not an error; `None` for a
    /// reply the command never gives.
    fn answer(
        &self,
        i: usize,
        r: RespValue<'_>,
        deadline: Instant,
    ) -> Option<Result<Self::Out, ItemError>>;
}

/// `NAME key` for every key (`EXISTS`, `DEL`), its integer reply read by
/// `answer`.
pub(crate) struct KeyBatch<'a, T> {
    name: &'static str,
    keys: &'a [ChunkKey],
    answer: fn(i64) -> Option<Result<T, ItemError>>,
}

impl<T> Batch for KeyBatch<'_, T> {
    type Out = T;
    fn len(&self) -> usize {
        self.keys.len()
    }
    fn key(&self, i: usize) -> &str {
        self.keys[i].as_str()
    }
    fn pack(&self, i: usize, buf: &mut Vec<u8>, _: Instant) -> Result<(), CallError> {
        pack_key_command(buf, self.name, self.key(i))
    }
    fn answer(&self, _: usize, r: RespValue<'_>, _: Instant) -> Option<Result<T, ItemError>> {
        match r {
            RespValue::Int(n) => (self.answer)(n),
            _ => None,
        }
    }
}

/// `NAME key` in RESP, written straight into `buf`: what the `redis`
/// crate's `Cmd` packs, without its allocations per command (a lookup
/// packs some 65 536).
fn pack_key_command(buf: &mut Vec<u8>, name: &str, key: &str) -> Result<(), CallError> {
    write!(
        buf,
        "*2\r\n${}\r\n{name}\r\n${}\r\n{key}\r\n",
        name.len(),
        key.len()
    )
    .map_err(|_| CallError::Refused)
}

fn exists_batch(keys: &[ChunkKey]) -> KeyBatch<'_, bool> {
    KeyBatch {
        name: "EXISTS",
        keys,
        answer: |n| match n {
            0 => Some(Ok(false)),
            1 => Some(Ok(true)),
            _ => None,
        },
    }
}

fn del_batch(keys: &[ChunkKey]) -> KeyBatch<'_, ()> {
    KeyBatch {
        name: "DEL",
        keys,
        answer: |n| match n {
            1 => Some(Ok(())),
            0 => Some(Err(ItemError::NotFound)),
            _ => None,
        },
    }
}

/// `SET key <header><value> NX` per item, the value read from engine
/// memory straight into the pipeline's buffer (the one copy).
pub(crate) struct PutBatch<'a>(&'a [PutItem]);

impl Batch for PutBatch<'_> {
    type Out = PutOutcome;
    fn len(&self) -> usize {
        self.0.len()
    }
    fn key(&self, i: usize) -> &str {
        self.0[i].key.as_str()
    }
    fn packed_bytes(&self) -> usize {
        (self.0.iter())
            .map(|it| it.key.as_str().len() + it.from.len() as usize + HEADER_BYTES + 64)
            .sum()
    }
    fn pack(&self, i: usize, buf: &mut Vec<u8>, deadline: Instant) -> Result<(), CallError> {
        let it = &self.0[i];
        // Engine memory is read here only: check the deadline first.
        if Instant::now() >= deadline {
            return Err(CallError::Timeout);
        }
        let key = it.key.as_str();
        let value_len = HEADER_BYTES + it.from.len() as usize;
        write!(
            buf,
            "*4\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${value_len}\r\n",
            key.len()
        )
        .map_err(|_| CallError::Refused)?;
        let at = buf.len();
        buf.resize(at + value_len, 0);
        let (head, payload) = buf[at..].split_at_mut(HEADER_BYTES);
        it.from.read_into(payload);
        head.copy_from_slice(&header(payload));
        buf.extend_from_slice(b"\r\n$2\r\nNX\r\n");
        Ok(())
    }
    fn answer(
        &self,
        _: usize,
        r: RespValue<'_>,
        _: Instant,
    ) -> Option<Result<PutOutcome, ItemError>> {
        match r {
            RespValue::Ok => Some(Ok(PutOutcome::Stored)),
            RespValue::Nil => Some(Ok(PutOutcome::Exists)),
            _ => None,
        }
    }
}

/// `GET key` per item; a value is checked, then copied into its block.
pub(crate) struct GetBatch<'a>(&'a [GetItem]);

impl Batch for GetBatch<'_> {
    type Out = ();
    fn len(&self) -> usize {
        self.0.len()
    }
    fn key(&self, i: usize) -> &str {
        self.0[i].key.as_str()
    }
    fn pack(&self, i: usize, buf: &mut Vec<u8>, _: Instant) -> Result<(), CallError> {
        pack_key_command(buf, "GET", self.key(i))
    }
    fn answer(
        &self,
        i: usize,
        r: RespValue<'_>,
        deadline: Instant,
    ) -> Option<Result<(), ItemError>> {
        match r {
            RespValue::Nil => Some(Err(ItemError::NotFound)),
            RespValue::Bulk(bytes) => Some(write_value(&self.0.get(i)?.into, bytes, deadline)),
            _ => None,
        }
    }
}

/// Gets found corrupt, truncated or foreign.
fn corrupt_count(got: &[Result<(), ItemError>]) -> u64 {
    got.iter()
        .filter(|r| **r == Err(ItemError::Corrupt))
        .count() as u64
}

/// The header of a value whose payload is `payload`.
pub fn header(payload: &[u8]) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..4].copy_from_slice(&MAGIC);
    h[4..8].copy_from_slice(&VERSION.to_le_bytes());
    h[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    h[16..20].copy_from_slice(&crc32fast::hash(payload).to_le_bytes());
    h
}

/// The payload of a stored value, checked against its header and the
/// length the get wants.
pub fn payload(value: &[u8], want_bytes: u64) -> Result<&[u8], ItemError> {
    if value.len() < HEADER_BYTES || value[0..4] != MAGIC {
        return Err(ItemError::Corrupt);
    }
    let word = |r: std::ops::Range<usize>| value.get(r).unwrap_or(&[]);
    let version = u32::from_le_bytes(word(4..8).try_into().map_err(|_| ItemError::Corrupt)?);
    let len = u64::from_le_bytes(word(8..16).try_into().map_err(|_| ItemError::Corrupt)?);
    let crc = u32::from_le_bytes(word(16..20).try_into().map_err(|_| ItemError::Corrupt)?);
    let body = &value[HEADER_BYTES..];
    if version != VERSION || body.len() as u64 != len {
        return Err(ItemError::Corrupt);
    }
    if len != want_bytes {
        return Err(ItemError::WrongSize {
            got_bytes: len,
            want_bytes,
        });
    }
    if crc32fast::hash(body) != crc {
        return Err(ItemError::Corrupt);
    }
    Ok(body)
}

/// A key's error reply: `OOM` is the pressure path; any other is this
/// key's failure.
fn server_error(code: &str) -> ItemError {
    match code {
        "OOM" => ItemError::Full,
        "WRONGTYPE" => ItemError::Corrupt,
        _ => ItemError::Transport,
    }
}

fn write_value(into: &Scatter, value: &[u8], deadline: Instant) -> Result<(), ItemError> {
    let body = payload(value, into.len())?;
    // Engine memory is written here only: never past the deadline.
    if Instant::now() >= deadline {
        return Err(ItemError::Timeout);
    }
    into.write_from(body);
    Ok(())
}

impl StoreBackend for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn exists(&mut self, keys: &[ChunkKey], deadline: Instant) -> Result<Vec<bool>, CallError> {
        let found = self.pipeline(&exists_batch(keys), deadline)?;
        (found.into_iter())
            .map(|r| r.map_err(|_| CallError::Refused))
            .collect()
    }

    fn put(&mut self, items: &[PutItem], deadline: Instant) -> Answers<PutOutcome> {
        self.pipeline(&PutBatch(items), deadline)
    }

    fn get(&mut self, items: &[GetItem], deadline: Instant) -> Answers<()> {
        let got = self.pipeline(&GetBatch(items), deadline)?;
        self.stats.corrupt += corrupt_count(&got);
        Ok(got)
    }

    fn remove(&mut self, keys: &[ChunkKey], deadline: Instant) -> Answers<()> {
        self.pipeline(&del_batch(keys), deadline)
    }

    fn remove_prefix(&mut self, prefix: &str, deadline: Instant) -> Result<u64, CallError> {
        let r = self.scan_and_delete(prefix, deadline);
        if r.is_err() {
            self.conn = None;
        }
        r
    }
}

/// `*` and the glob's other special bytes of `prefix` escaped for `MATCH`.
fn glob_prefix(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 1);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('*');
    out
}

/// A command of bulk strings.
fn pack_command(buf: &mut Vec<u8>, words: &[&str]) -> Result<(), CallError> {
    write!(buf, "*{}\r\n", words.len()).map_err(|_| CallError::Refused)?;
    for w in words {
        write!(buf, "${}\r\n{w}\r\n", w.len()).map_err(|_| CallError::Refused)?;
    }
    Ok(())
}

impl RedisStore {
    /// `SCAN … MATCH prefix*`, then `DEL` of each page's keys, until the
    /// cursor comes back to 0 or the deadline passes.
    fn scan_and_delete(&mut self, prefix: &str, deadline: Instant) -> Result<u64, CallError> {
        let pattern = glob_prefix(prefix);
        let (mut cursor, mut removed) = ("0".to_owned(), 0u64);
        loop {
            if Instant::now() >= deadline {
                return Err(CallError::Timeout);
            }
            if self.conn.is_none() {
                self.conn = Some(Conn::open(&self.cfg, deadline)?);
                self.stats.connects += 1;
            }
            let conn = self.conn.as_mut().ok_or(CallError::Transport)?;
            let mut packed = Vec::new();
            pack_command(
                &mut packed,
                &["SCAN", &cursor, "MATCH", &pattern, "COUNT", "512"],
            )?;
            self.stats.round_trips += 1;
            let Tree::Array(page) = conn.query_tree(&packed, deadline)? else {
                return Err(CallError::Refused);
            };
            let (Some(Tree::Bulk(next)), Some(Tree::Array(keys))) = (page.first(), page.get(1))
            else {
                return Err(CallError::Refused);
            };
            let keys: Vec<String> = (keys.iter())
                .filter_map(|k| match k {
                    Tree::Bulk(b) => String::from_utf8(b.clone()).ok(),
                    _ => None,
                })
                .collect();
            if !keys.is_empty() {
                let mut words = vec!["DEL"];
                words.extend(keys.iter().map(String::as_str));
                let mut packed = Vec::new();
                pack_command(&mut packed, &words)?;
                self.stats.round_trips += 1;
                match conn.query_tree(&packed, deadline)? {
                    Tree::Int(n) => removed += u64::try_from(n).unwrap_or(0),
                    _ => return Err(CallError::Refused),
                }
            }
            cursor = String::from_utf8(next.clone()).map_err(|_| CallError::Refused)?;
            if cursor == "0" {
                return Ok(removed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_round_trips_through_its_header() {
        let body = b"some block bytes".to_vec();
        let mut value = header(&body).to_vec();
        value.extend_from_slice(&body);
        assert_eq!(payload(&value, body.len() as u64), Ok(&body[..]));
        assert_eq!(
            payload(&value, 3),
            Err(ItemError::WrongSize {
                got_bytes: body.len() as u64,
                want_bytes: 3
            })
        );
        let mut bad = value.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert_eq!(payload(&bad, body.len() as u64), Err(ItemError::Corrupt));
        assert_eq!(
            payload(&value[..value.len() - 1], body.len() as u64),
            Err(ItemError::Corrupt)
        );
        assert_eq!(payload(b"garbage", 7), Err(ItemError::Corrupt));
        bad = value.clone();
        bad[4] = 9;
        assert_eq!(payload(&bad, body.len() as u64), Err(ItemError::Corrupt));
    }

    #[test]
    fn key_commands_pack_as_the_redis_crate_packs_them() {
        let mut buf = Vec::new();
        pack_key_command(&mut buf, "EXISTS", "a:key/1").unwrap();
        let want = redis::cmd("EXISTS").arg("a:key/1").get_packed_command();
        assert_eq!(buf, want);
    }
}
