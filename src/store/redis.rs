//! The `redis://[user:password@]HOST:PORT` backend: one Redis server
//! (docs/design.md, "Backends", "Redis").
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
//! (`+OK`, `-ERR`, `:N`, `$N`, nil), each line within [`LINE_BYTES_MAX`]
//! and each bulk within [`BULK_BYTES_MAX`]; anything else is
//! [`CallError::Refused`] and drops the connection. A bulk reply is read
//! into one buffer kept by the connection, checked, and copied into the
//! block: one copy on the way in.

use std::io::{self, BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use kvferry_machines::store::ChunkKey;

use super::backend::{
    Answers, CallError, GetItem, ItemError, PutItem, PutOutcome, Scatter, StoreBackend,
};

/// The first four bytes of every value this backend stores.
pub const MAGIC: [u8; 4] = *b"KVFR";
/// The header's layout version.
pub const VERSION: u32 = 1;
/// Bytes of the header: magic, version (u32 LE), payload length (u64 LE),
/// CRC-32 of the payload (u32 LE).
pub const HEADER_BYTES: usize = 20;
/// Bytes read from the socket at most per system call.
pub const READ_BUFFER_BYTES: usize = 1 << 20;
/// Longest reply line read (status, error, integer, bulk length): past it
/// the server is not speaking RESP to us.
pub const LINE_BYTES_MAX: usize = 64 << 10;
/// Largest bulk reply read, Redis's own `proto-max-bulk-len` default
/// (512 MiB); a longer one is refused before any of it is buffered.
pub const BULK_BYTES_MAX: usize = 512 << 20;
/// Environment variable naming a file whose first line is the password
/// (so it never has to be on a command line).
pub const PASSWORD_FILE_ENV: &str = "KVFERRY_REDIS_PASSWORD_FILE";

/// How a [`RedisStore`] reaches its server.
#[derive(Clone)]
pub struct RedisConfig {
    /// `HOST:PORT`.
    pub server: String,
    /// ACL user for `AUTH` (with `password`).
    pub user: Option<String>,
    /// Password for `AUTH`.
    pub password: Option<String>,
    /// Most time a connect waits (also bounded by the call's deadline).
    pub connect_timeout: Duration,
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The password stays out of logs.
        f.debug_struct("RedisConfig")
            .field("server", &self.server)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

/// Why a `redis://` URL or its password file is not usable.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    /// Not `redis://[user:password@]HOST:PORT`.
    #[error("{url:?}: {reason}")]
    Url {
        /// The URL, its password hidden.
        url: String,
        /// Why.
        reason: &'static str,
    },
    /// The password file could not be read.
    #[error("{PASSWORD_FILE_ENV} {path:?}: {reason}")]
    PasswordFile {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
}

impl RedisConfig {
    /// The settings for `redis://[user:password@]HOST:PORT`; a password
    /// in [`PASSWORD_FILE_ENV`] wins over one in the URL.
    pub fn from_url(url: &str) -> Result<RedisConfig, RedisError> {
        let bad = |reason| RedisError::Url {
            url: url.split('@').next_back().unwrap_or("").to_string(),
            reason,
        };
        let rest = url
            .strip_prefix("redis://")
            .ok_or_else(|| bad("not redis://"))?;
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let (auth, server) = match rest.rsplit_once('@') {
            Some((a, s)) => (Some(a), s),
            None => (None, rest),
        };
        let (host, port) = server.rsplit_once(':').ok_or_else(|| bad("no :PORT"))?;
        if host.is_empty() || port.parse::<u16>().is_err() || server.contains('/') {
            return Err(bad("not HOST:PORT"));
        }
        let (user, password) = match auth {
            None => (None, None),
            Some(a) => match a.split_once(':') {
                Some((u, p)) => ((!u.is_empty()).then(|| u.to_string()), Some(p.to_string())),
                None => return Err(bad("credentials are user:password@")),
            },
        };
        let password = match std::env::var_os(PASSWORD_FILE_ENV) {
            Some(path) => Some(read_password(&path.to_string_lossy())?),
            None => password,
        };
        Ok(RedisConfig {
            server: server.to_string(),
            user,
            password,
            connect_timeout: Duration::from_secs(2),
        })
    }
}

fn read_password(path: &str) -> Result<String, RedisError> {
    let text = std::fs::read_to_string(path).map_err(|e| RedisError::PasswordFile {
        path: path.to_string(),
        reason: e.to_string(),
    })?;
    Ok(text.lines().next().unwrap_or("").to_string())
}

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

    /// Sends `packed` (`count` commands) and hands each reply to `one`
    /// as it arrives, all by `deadline`; any failure, or a reply `one`
    /// does not expect (`None`), drops the connection.
    fn pipeline<T>(
        &mut self,
        packed: &[u8],
        count: usize,
        deadline: Instant,
        one: impl FnMut(usize, Reply<'_>) -> Option<Result<T, ItemError>>,
    ) -> Answers<T> {
        if Instant::now() >= deadline {
            return Err(CallError::Timeout);
        }
        if self.conn.is_none() {
            self.conn = Some(Conn::open(&self.cfg, deadline)?);
            self.stats.connects += 1;
            self.stats.round_trips += 1;
        }
        let conn = self.conn.as_mut().ok_or(CallError::Transport)?;
        self.stats.round_trips += 1;
        let answers = conn.exchange(packed, count, deadline, one);
        if answers.is_err() {
            self.conn = None;
        }
        answers
    }
}

/// One reply, of the kinds `EXISTS`, `SET`, `GET`, `DEL` and `AUTH` give.
#[derive(Debug)]
enum Reply<'a> {
    /// `+OK`.
    Ok,
    /// `$-1` or `_`.
    Nil,
    /// `:N`.
    Int(i64),
    /// `$N`: the bytes.
    Bulk(&'a [u8]),
    /// `-CODE detail`: the code.
    Error(&'a str),
}

/// One connection: the socket, the deadline its reads and writes keep, its
/// read buffer, and the buffer the current bulk reply is read into.
struct Conn {
    io: io::BufReader<DeadlineStream>,
    line: Vec<u8>,
    bulk: Vec<u8>,
}

impl Conn {
    fn open(cfg: &RedisConfig, deadline: Instant) -> Result<Conn, CallError> {
        let addr = resolve(&cfg.server)?;
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = left.min(cfg.connect_timeout);
        if wait.is_zero() {
            return Err(CallError::Timeout);
        }
        let stream = TcpStream::connect_timeout(&addr, wait).map_err(io_error)?;
        let _ = stream.set_nodelay(true);
        let io = DeadlineStream { stream, deadline };
        let mut conn = Conn {
            io: io::BufReader::with_capacity(READ_BUFFER_BYTES, io),
            line: Vec::new(),
            bulk: Vec::new(),
        };
        if let Some(password) = &cfg.password {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = &cfg.user {
                auth.arg(user);
            }
            auth.arg(password);
            let ok = conn.exchange(&auth.get_packed_command(), 1, deadline, |_, r| {
                Some(match r {
                    Reply::Ok => Ok(()),
                    _ => Err(ItemError::Transport),
                })
            })?;
            if ok != [Ok(())] {
                return Err(CallError::Refused);
            }
        }
        Ok(conn)
    }

    fn exchange<T>(
        &mut self,
        packed: &[u8],
        count: usize,
        deadline: Instant,
        mut one: impl FnMut(usize, Reply<'_>) -> Option<Result<T, ItemError>>,
    ) -> Answers<T> {
        self.io.get_mut().deadline = deadline;
        self.io.get_mut().write_all(packed).map_err(io_error)?;
        let mut answers = Vec::with_capacity(count);
        for i in 0..count {
            let reply = self.read_reply()?;
            let answer = match reply {
                Reply::Error(code) => Some(Err(server_error(code))),
                r => one(i, r),
            };
            answers.push(answer.ok_or(CallError::Refused)?);
        }
        Ok(answers)
    }

    /// Reads one reply; a kind our commands never get, or a line or bulk
    /// past its bound, is `Refused`.
    fn read_reply(&mut self) -> Result<Reply<'_>, CallError> {
        self.line.clear();
        let mut limited = (&mut self.io).take(LINE_BYTES_MAX as u64);
        limited
            .read_until(b'\n', &mut self.line)
            .map_err(io_error)?;
        let Some(body) = self.line.strip_suffix(b"\r\n") else {
            // EOF, or a line past its bound.
            return Err(if self.line.is_empty() {
                CallError::Transport
            } else {
                CallError::Refused
            });
        };
        let (kind, rest) = body.split_first().ok_or(CallError::Refused)?;
        let text = std::str::from_utf8(rest).map_err(|_| CallError::Refused)?;
        let int = || text.parse::<i64>().map_err(|_| CallError::Refused);
        match kind {
            b'+' if text == "OK" => Ok(Reply::Ok),
            b'-' => Ok(Reply::Error(text.split(' ').next().unwrap_or(""))),
            b':' => Ok(Reply::Int(int()?)),
            b'_' => Ok(Reply::Nil),
            b'$' => match int()? {
                -1 => Ok(Reply::Nil),
                n if (0..=BULK_BYTES_MAX as i64).contains(&n) => {
                    self.bulk.clear();
                    self.bulk.resize(n as usize + 2, 0);
                    self.io.read_exact(&mut self.bulk).map_err(io_error)?;
                    match self.bulk.strip_suffix(b"\r\n") {
                        Some(bytes) => Ok(Reply::Bulk(bytes)),
                        None => Err(CallError::Refused),
                    }
                }
                _ => Err(CallError::Refused),
            },
            _ => Err(CallError::Refused),
        }
    }
}
/// A socket whose every read and write waits at most until `deadline`.
struct DeadlineStream {
    stream: TcpStream,
    deadline: Instant,
}

impl DeadlineStream {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        Ok(left)
    }
}

impl Read for DeadlineStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        self.stream.read(buf)
    }
}

impl Write for DeadlineStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

fn resolve(server: &str) -> Result<SocketAddr, CallError> {
    let mut addrs = server.to_socket_addrs().map_err(|_| CallError::Transport)?;
    addrs.next().ok_or(CallError::Transport)
}

fn io_error(e: io::Error) -> CallError {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => CallError::Timeout,
        _ => CallError::Transport,
    }
}

/// One command per key, packed into one pipeline.
fn packed(name: &str, keys: impl Iterator<Item = impl AsRef<str>>) -> (Vec<u8>, usize) {
    let mut buf = Vec::new();
    let mut n = 0;
    for key in keys {
        redis::cmd(name)
            .arg(key.as_ref())
            .write_packed_command(&mut buf);
        n += 1;
    }
    (buf, n)
}

/// `SET key <header><value> NX` per item, the value read from engine
/// memory straight into the pipeline's buffer (the one copy). Items the
/// deadline leaves no time for are not sent (`None`).
fn packed_puts(items: &[PutItem], deadline: Instant) -> Result<Vec<u8>, CallError> {
    let total: usize = (items.iter())
        .map(|it| it.key.as_str().len() + it.from.len() as usize + HEADER_BYTES + 64)
        .sum();
    let mut buf = Vec::with_capacity(total);
    for it in items {
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
    }
    Ok(buf)
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
        let (buf, n) = packed("EXISTS", keys.iter().map(ChunkKey::as_str));
        let found = self.pipeline(&buf, n, deadline, |_, r| match r {
            Reply::Int(0) => Some(Ok(false)),
            Reply::Int(1) => Some(Ok(true)),
            _ => None,
        })?;
        (found.into_iter())
            .map(|r| r.map_err(|_| CallError::Refused))
            .collect()
    }

    fn put(&mut self, items: &[PutItem], deadline: Instant) -> Answers<PutOutcome> {
        let buf = packed_puts(items, deadline)?;
        self.pipeline(&buf, items.len(), deadline, |_, r| match r {
            Reply::Ok => Some(Ok(PutOutcome::Stored)),
            Reply::Nil => Some(Ok(PutOutcome::Exists)),
            _ => None,
        })
    }

    fn get(&mut self, items: &[GetItem], deadline: Instant) -> Answers<()> {
        let (buf, n) = packed("GET", items.iter().map(|it| it.key.as_str()));
        let got = self.pipeline(&buf, n, deadline, |i, r| match r {
            Reply::Nil => Some(Err(ItemError::NotFound)),
            Reply::Bulk(bytes) => Some(write_value(&items.get(i)?.into, bytes, deadline)),
            _ => None,
        })?;
        let corrupt = got
            .iter()
            .filter(|r| **r == Err(ItemError::Corrupt))
            .count();
        self.stats.corrupt += corrupt as u64;
        Ok(got)
    }

    fn remove(&mut self, keys: &[ChunkKey], deadline: Instant) -> Answers<()> {
        let (buf, n) = packed("DEL", keys.iter().map(ChunkKey::as_str));
        self.pipeline(&buf, n, deadline, |_, r| match r {
            Reply::Int(1) => Some(Ok(())),
            Reply::Int(0) => Some(Err(ItemError::NotFound)),
            _ => None,
        })
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
    fn urls_parse_with_and_without_credentials() {
        let c = RedisConfig::from_url("redis://127.0.0.1:6379").unwrap();
        assert_eq!(
            (c.server.as_str(), c.user, c.password),
            ("127.0.0.1:6379", None, None)
        );
        let c = RedisConfig::from_url("redis://u:p@h:1/").unwrap();
        assert_eq!(
            (c.server.as_str(), c.user.as_deref(), c.password.as_deref()),
            ("h:1", Some("u"), Some("p"))
        );
        assert!(RedisConfig::from_url("redis://h").is_err());
        assert!(RedisConfig::from_url("kvferry://h:1").is_err());
        assert!(RedisConfig::from_url("redis://h:99999").is_err());
    }
}
