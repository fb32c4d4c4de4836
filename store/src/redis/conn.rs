//! One connection to one Redis server: a socket whose every system call
//! waits at most until the call's deadline, and the bounded RESP reply
//! reader (docs/design.md, "Backends", "Redis").

use std::io::{self, BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::config::RedisConfig;
use crate::backend::{CallError, ItemError};

/// Bytes of the connection's read buffer: what one system call reads at
/// most into it. Lines and small replies are parsed from it; a bulk is
/// copied out of it only for the part already buffered, the rest read
/// straight into the bulk's buffer. Kept small for that: a buffer of a
/// whole value (1 MiB) filled behind each reply's first line copied most
/// of every value twice.
pub const READ_BUFFER_BYTES: usize = 64 << 10;
/// Longest reply line read (status, error, integer, bulk or array
/// length): past it the server is not speaking RESP to us.
pub const LINE_BYTES_MAX: usize = 64 << 10;
/// Largest bulk reply read, Redis's own `proto-max-bulk-len` default
/// (512 MiB); a longer one is refused before any of it is buffered.
pub const BULK_BYTES_MAX: usize = 512 << 20;
/// Most elements of one array reply (`CLUSTER SLOTS` has one per slot
/// range: at most 16 384).
pub const ARRAY_LEN_MAX: usize = 1 << 14;
/// Deepest nesting of array replies read (`CLUSTER SLOTS` nests three:
/// ranges, a range's nodes, a node's metadata).
pub const ARRAY_DEPTH_MAX: usize = 4;
/// Most replies, nested ones included, in one array reply read whole: a
/// bound on the memory a hostile `CLUSTER SLOTS` answer can make us hold.
pub const TREE_REPLIES_MAX: usize = 1 << 18;

/// One reply, of the kinds `EXISTS`, `SET`, `GET`, `DEL`, `AUTH`,
/// `ASKING` and `CLUSTER SLOTS` give.
#[derive(Debug)]
pub(crate) enum RespValue<'a> {
    /// `+OK`.
    Ok,
    /// `$-1`, `*-1` or `_`.
    Nil,
    /// `:N`.
    Int(i64),
    /// `$N`: the bytes.
    Bulk(&'a [u8]),
    /// `-CODE detail`: the whole text after the `-`.
    Error(&'a str),
    /// `*N`: the header of an array of `N` replies, which follow.
    Array(usize),
}

/// An error reply's code: its first word (`OOM`, `MOVED`, `ASK`...).
pub(crate) fn error_code(text: &str) -> &str {
    text.split(' ').next().unwrap_or("")
}

/// A reply read whole, arrays included (for `CLUSTER SLOTS`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Tree {
    /// `+OK`.
    Ok,
    /// Nil.
    Nil,
    /// `:N`.
    Int(i64),
    /// `$N`.
    Bulk(Vec<u8>),
    /// `-CODE detail`.
    Error(String),
    /// `*N`.
    Array(Vec<Tree>),
}

/// One connection: the socket, the deadline its reads and writes keep, its
/// read buffer, and the buffer the current bulk reply is read into.
pub(crate) struct Conn {
    io: io::BufReader<DeadlineStream>,
    line: Vec<u8>,
    bulk: Vec<u8>,
}

impl Conn {
    /// Connects to `cfg.server` within `min(connect_timeout, time left)`
    /// and sends `AUTH` when there is a password.
    pub(crate) fn open(cfg: &RedisConfig, deadline: Instant) -> Result<Conn, CallError> {
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
                Some(matches!(r, RespValue::Ok))
            })?;
            if ok != [true] {
                return Err(CallError::Refused);
            }
        }
        Ok(conn)
    }

    /// Sends `packed` and reads its `count` replies, each handed to `one`
    /// as it arrives; a reply `one` does not expect (`None`) is `Refused`.
    pub(crate) fn exchange<R>(
        &mut self,
        packed: &[u8],
        count: usize,
        deadline: Instant,
        one: impl FnMut(usize, RespValue<'_>) -> Option<R>,
    ) -> Result<Vec<R>, CallError> {
        self.send(packed, deadline)?;
        self.receive(count, deadline, one)
    }

    /// Writes `packed` whole by `deadline`.
    pub(crate) fn send(&mut self, packed: &[u8], deadline: Instant) -> Result<(), CallError> {
        self.io.get_mut().deadline = deadline;
        self.io.get_mut().write_all(packed).map_err(io_error)
    }

    /// Reads `count` replies by `deadline`, as [`Conn::exchange`].
    pub(crate) fn receive<R>(
        &mut self,
        count: usize,
        deadline: Instant,
        mut one: impl FnMut(usize, RespValue<'_>) -> Option<R>,
    ) -> Result<Vec<R>, CallError> {
        self.io.get_mut().deadline = deadline;
        let mut answers = Vec::with_capacity(count);
        for i in 0..count {
            let reply = self.read_reply()?;
            answers.push(one(i, reply).ok_or(CallError::Refused)?);
        }
        Ok(answers)
    }

    /// Sends one command and reads its reply whole, arrays included,
    /// within [`ARRAY_LEN_MAX`], [`ARRAY_DEPTH_MAX`] and
    /// [`TREE_REPLIES_MAX`].
    pub(crate) fn query_tree(
        &mut self,
        packed: &[u8],
        deadline: Instant,
    ) -> Result<Tree, CallError> {
        self.send(packed, deadline)?;
        let mut budget = TREE_REPLIES_MAX;
        self.read_tree(0, &mut budget)
    }

    fn read_tree(&mut self, depth: usize, budget: &mut usize) -> Result<Tree, CallError> {
        *budget = budget.checked_sub(1).ok_or(CallError::Refused)?;
        let len = match self.read_reply()? {
            RespValue::Array(n) => n,
            RespValue::Ok => return Ok(Tree::Ok),
            RespValue::Nil => return Ok(Tree::Nil),
            RespValue::Int(n) => return Ok(Tree::Int(n)),
            RespValue::Bulk(b) if b.len() <= LINE_BYTES_MAX => return Ok(Tree::Bulk(b.to_vec())),
            RespValue::Bulk(_) => return Err(CallError::Refused),
            RespValue::Error(e) => return Ok(Tree::Error(e.to_string())),
        };
        if depth + 1 > ARRAY_DEPTH_MAX || len > *budget {
            return Err(CallError::Refused);
        }
        let mut items = Vec::with_capacity(len);
        for _ in 0..len {
            items.push(self.read_tree(depth + 1, budget)?);
        }
        Ok(Tree::Array(items))
    }

    /// Reads one reply; a kind our commands never get, or a line, bulk or
    /// array past its bound, is `Refused`.
    fn read_reply(&mut self) -> Result<RespValue<'_>, CallError> {
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
            b'+' if text == "OK" => Ok(RespValue::Ok),
            b'-' => Ok(RespValue::Error(text)),
            b':' => Ok(RespValue::Int(int()?)),
            b'_' => Ok(RespValue::Nil),
            b'*' => match int()? {
                -1 => Ok(RespValue::Nil),
                n if (0..=ARRAY_LEN_MAX as i64).contains(&n) => Ok(RespValue::Array(n as usize)),
                _ => Err(CallError::Refused),
            },
            b'$' => match int()? {
                -1 => Ok(RespValue::Nil),
                n if (0..=BULK_BYTES_MAX as i64).contains(&n) => {
                    read_bulk(&mut self.io, &mut self.bulk, n as usize)
                }
                _ => Err(CallError::Refused),
            },
            _ => Err(CallError::Refused),
        }
    }
}

/// The `n` bytes of a bulk and its `\r\n`, into the kept buffer `bulk`.
/// The buffer only grows: a reply no longer than the longest so far is
/// read over the old bytes, with no pass to zero them first.
fn read_bulk<'a>(
    io: &mut impl Read,
    bulk: &'a mut Vec<u8>,
    n: usize,
) -> Result<RespValue<'a>, CallError> {
    if bulk.len() < n + 2 {
        bulk.resize(n + 2, 0);
    }
    let bytes = &mut bulk[..n + 2];
    io.read_exact(bytes).map_err(io_error)?;
    match bytes.strip_suffix(b"\r\n") {
        Some(bytes) => Ok(RespValue::Bulk(bytes)),
        None => Err(CallError::Refused),
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

/// A socket error as a call's failure: its deadline, or the transport.
pub(crate) fn io_error(e: io::Error) -> CallError {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => CallError::Timeout,
        _ => CallError::Transport,
    }
}

/// A call's failure as the answer of each of its keys.
pub(crate) fn item_error(e: CallError) -> ItemError {
    match e {
        CallError::Timeout => ItemError::Timeout,
        _ => ItemError::Transport,
    }
}
