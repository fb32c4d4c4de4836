//! The `redis+cluster://[user:password@]HOST:PORT[,HOST:PORT...]`
//! backend: a Redis Cluster (docs/design.md, "Backends", "Redis").
//!
//! * The slot map comes from `CLUSTER SLOTS`, asked of any reachable node
//!   (the known masters first, then the URL's seeds) on the first call
//!   and at the next call after anything showed it stale.
//! * A key's slot is CRC16 (XMODEM) of the key, or of its `{hashtag}`,
//!   modulo [`SLOTS`]. Each batch's keys are grouped by the master that
//!   owns their slot and pipelined per node, every node's pipeline sent
//!   before any is read; no command names keys of two slots.
//! * `MOVED slot node`: the slot's owner is set to the node (the whole
//!   map is asked again at the next call) and the key is sent there;
//!   `ASK slot node`: `ASKING` and the command go to that node, the map
//!   left as it is. A key redirected more than [`REDIRECTS_MAX`] times is
//!   [`ItemError::Transport`] (counted in
//!   [`ClusterStats::redirects_exhausted`]), never a loop.
//! * A node that cannot be reached, breaks, or answers `CLUSTERDOWN`,
//!   `TRYAGAIN`, `LOADING` or `MASTERDOWN`: its keys are
//!   [`ItemError::Transport`] ([`ItemError::Timeout`] at the deadline) and
//!   the map is asked again at the next call, so saves and loads resume
//!   once a replica took over.
//! * One connection per node, at most [`CONNS_MAX`]; every socket call
//!   waits at most until the call's deadline, and engine memory is read
//!   and written only before it (as for one server).

use std::collections::HashMap;
use std::time::Instant;

use kvferry_machines::store::ChunkKey;

use super::config::{parse_url, url_error, RedisConfig, RedisError};
use super::conn::{error_code, item_error, Conn, RespValue, Tree};
use super::{
    corrupt_count, del_batch, exists_batch, server_error, Batch, GetBatch, Packed, PutBatch,
};
use crate::backend::{Answers, CallError, GetItem, ItemError, PutItem, PutOutcome, StoreBackend};

/// Hash slots of a Redis Cluster.
pub const SLOTS: usize = 16384;
/// Redirects (`MOVED` or `ASK`) one key follows within a call; past it
/// the key is [`ItemError::Transport`].
pub const REDIRECTS_MAX: u32 = 5;
/// Connections kept open at most, one per node; also the most masters a
/// slot map may name.
pub const CONNS_MAX: usize = 64;

/// The hash slot of `key`: CRC16 (XMODEM) of the key, or of the text
/// between its first `{` and the next `}` when that is not empty.
pub fn hash_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16(hashed) % SLOTS as u16
}

/// CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0), the one
/// Redis Cluster hashes keys with; eight bytes per step (a 128k-token
/// lookup hashes some 65 536 keys of about 100 bytes, and byte by byte
/// that was most of the lookup's own time).
fn crc16(bytes: &[u8]) -> u16 {
    let t = &CRC16_TABLES;
    let mut chunks = bytes.chunks_exact(8);
    let mut crc = 0u16;
    for c in &mut chunks {
        let [hi, lo] = crc.to_be_bytes();
        crc = t[7][usize::from(hi ^ c[0])]
            ^ t[6][usize::from(lo ^ c[1])]
            ^ t[5][usize::from(c[2])]
            ^ t[4][usize::from(c[3])]
            ^ t[3][usize::from(c[4])]
            ^ t[2][usize::from(c[5])]
            ^ t[1][usize::from(c[6])]
            ^ t[0][usize::from(c[7])];
    }
    (chunks.remainder().iter()).fold(crc, |crc, &b| {
        (crc << 8) ^ t[0][usize::from((crc >> 8) as u8 ^ b)]
    })
}

/// `CRC16_TABLES[k][x]`: the CRC of byte `x` followed by `k` zero bytes,
/// so eight bytes' effects are eight lookups.
const CRC16_TABLES: [[u16; 256]; 8] = {
    let mut t = [[0u16; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        t[0][i] = crc;
        i += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[k - 1][i];
            t[k][i] = (prev << 8) ^ t[0][(prev >> 8) as usize];
            i += 1;
        }
        k += 1;
    }
    t
};

/// How a [`RedisClusterStore`] reaches its cluster.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// `HOST:PORT` of the nodes asked for the slot map when no known node
    /// answers.
    pub seeds: Vec<String>,
    /// Credentials and connect timeout of every node's connection (its
    /// `server` unused).
    pub node: RedisConfig,
}

impl ClusterConfig {
    /// The settings for `redis+cluster://[user:password@]HOST:PORT[,...]`;
    /// a password in [`super::PASSWORD_FILE_ENV`] wins over one in the URL.
    pub fn from_url(url: &str) -> Result<ClusterConfig, RedisError> {
        let (node, seeds) = parse_url(url, "redis+cluster://")?;
        if seeds.is_empty() {
            return Err(url_error(url, "no HOST:PORT"));
        }
        Ok(ClusterConfig { seeds, node })
    }
}

/// Counters of a [`RedisClusterStore`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClusterStats {
    /// Connections opened.
    pub connects: u64,
    /// Round trips: each round of per-node pipelines (sent together, then
    /// read) and each `CLUSTER SLOTS`.
    pub round_trips: u64,
    /// Per-node pipelines sent.
    pub pipelines: u64,
    /// Slot maps read.
    pub refreshes: u64,
    /// `MOVED` replies followed.
    pub moved: u64,
    /// `ASK` replies followed.
    pub asked: u64,
    /// Keys that were still redirected after [`REDIRECTS_MAX`].
    pub redirects_exhausted: u64,
    /// Per-node pipelines that failed (unreachable, broken, or the node
    /// down, loading or failing over).
    pub node_failures: u64,
    /// Values a get found corrupt, truncated or foreign.
    pub corrupt: u64,
}

/// Which master owns each slot.
struct SlotMap {
    /// Per slot, an index into `nodes`, or [`NO_NODE`].
    owner: Vec<u16>,
    /// `HOST:PORT` of each master.
    nodes: Vec<String>,
}

/// A slot no master serves.
const NO_NODE: u16 = u16::MAX;

impl SlotMap {
    fn node_of(&self, slot: u16) -> Option<&str> {
        let n = *self.owner.get(usize::from(slot))?;
        self.nodes.get(usize::from(n)).map(String::as_str)
    }

    /// `node`'s index, added when new (at most [`CONNS_MAX`] nodes).
    fn index_of(&mut self, node: &str) -> Option<u16> {
        match self.nodes.iter().position(|x| x == node) {
            Some(n) => Some(n as u16),
            None if self.nodes.len() < CONNS_MAX => {
                self.nodes.push(node.to_string());
                Some((self.nodes.len() - 1) as u16)
            }
            None => None,
        }
    }

    /// `MOVED`: `slot` is `node`'s now.
    fn set_owner(&mut self, slot: u16, node: &str) {
        if let Some(n) = self.index_of(node) {
            if let Some(o) = self.owner.get_mut(usize::from(slot)) {
                *o = n;
            }
        }
    }

    /// The map in a `CLUSTER SLOTS` reply; `asked` stands in for a node
    /// whose address is empty (the node that answered).
    fn parse(reply: &Tree, asked: &str) -> Option<SlotMap> {
        let Tree::Array(ranges) = reply else {
            return None;
        };
        let mut map = SlotMap {
            owner: vec![NO_NODE; SLOTS],
            nodes: Vec::new(),
        };
        for range in ranges {
            let Tree::Array(range) = range else {
                return None;
            };
            let (Tree::Int(start), Tree::Int(end), Tree::Array(master)) =
                (range.first()?, range.get(1)?, range.get(2)?)
            else {
                return None;
            };
            let slots = usize::try_from(*start).ok()?..=usize::try_from(*end).ok()?;
            if slots.is_empty() || *slots.end() >= SLOTS {
                return None;
            }
            let n = map.index_of(&node_address(master, asked)?)?;
            map.owner[slots].fill(n);
        }
        Some(map)
    }
}

/// `HOST:PORT` of a `CLUSTER SLOTS` node entry (`[ip, port, id, ...]`).
fn node_address(entry: &[Tree], asked: &str) -> Option<String> {
    let (Tree::Bulk(ip), Tree::Int(port)) = (entry.first()?, entry.get(1)?) else {
        return None;
    };
    let port = u16::try_from(*port).ok()?;
    let ip = std::str::from_utf8(ip).ok()?;
    Some(address(ip, port, asked))
}

/// `ip:port`, bracketing an IPv6 address; an empty or `?` ip is the host
/// of `asked`.
fn address(ip: &str, port: u16, asked: &str) -> String {
    let host = match ip {
        "" | "?" => asked.rsplit_once(':').map_or(asked, |(h, _)| h),
        ip => ip,
    };
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A redirect's target: `ip:port` of `MOVED slot ip:port` or `ASK ...`.
fn redirect(text: &str, asked: &str) -> Option<(u16, String)> {
    let mut words = text.split(' ').skip(1);
    let slot = words.next()?.parse::<u16>().ok()?;
    let (ip, port) = words.next()?.rsplit_once(':')?;
    let ip = ip.trim_start_matches('[').trim_end_matches(']');
    Some((slot, address(ip, port.parse().ok()?, asked)))
}

/// A key still to be answered, and where it goes.
struct Pending {
    /// Its index in the batch.
    i: usize,
    /// The node an `ASK` named (sent `ASKING` first), else its slot's owner.
    ask: Option<String>,
    /// Redirects followed so far.
    redirects: u32,
}

/// What one reply of a node's pipeline says.
enum Heard<T> {
    /// `ASKING`'s reply (the command after it answers for the key).
    Asking,
    /// The key's answer.
    Done(Result<T, ItemError>),
    /// `MOVED`: the slot and its owner.
    Moved(u16, String),
    /// `ASK`: the node to ask.
    Ask(String),
    /// The node cannot serve now (`CLUSTERDOWN`, `TRYAGAIN`, `LOADING`,
    /// `MASTERDOWN`).
    Down,
}

/// One node's share of a round: its keys and the replies it will send.
struct NodeRound {
    node: String,
    keys: Vec<Pending>,
    /// Per reply: `None` for `ASKING`, else the position in `keys`.
    replies: Vec<Option<usize>>,
    sent: bool,
}

/// The `redis+cluster://` backend. See the module docs.
pub struct RedisClusterStore {
    cfg: ClusterConfig,
    map: Option<SlotMap>,
    stale: bool,
    conns: HashMap<String, Conn>,
    /// Nodes that failed since they last gave a slot map (at most
    /// [`CONNS_MAX`]): asked for the map last, so a dead master that
    /// takes its whole connect timeout to fail is not the first asked.
    suspects: Vec<String>,
    /// The buffer each node's pipeline is packed into in turn, kept (see
    /// [`super::PACKED_KEEP_BYTES`]).
    packed: Vec<u8>,
    stats: ClusterStats,
}

impl std::fmt::Debug for RedisClusterStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisClusterStore")
            .field("cfg", &self.cfg)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl RedisClusterStore {
    /// A backend for `cfg`; the cluster is asked for its slot map on the
    /// first call (it need not be up yet).
    pub fn new(cfg: ClusterConfig) -> RedisClusterStore {
        RedisClusterStore {
            cfg,
            map: None,
            stale: true,
            conns: HashMap::new(),
            suspects: Vec::new(),
            packed: Vec::new(),
            stats: ClusterStats::default(),
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> ClusterStats {
        self.stats
    }

    /// Round trips so far (for `kvferry bench store`).
    pub fn round_trips(&self) -> u64 {
        self.stats.round_trips
    }

    /// `node`'s connection, opened within the deadline when there is none
    /// (closing one of a node not in `keep` when [`CONNS_MAX`] are open).
    fn conn(
        &mut self,
        node: &str,
        keep: &[&str],
        deadline: Instant,
    ) -> Result<&mut Conn, CallError> {
        if !self.conns.contains_key(node) {
            if self.conns.len() >= CONNS_MAX {
                let idle = (self.conns.keys())
                    .find(|n| !keep.contains(&n.as_str()))
                    .cloned()
                    .ok_or(CallError::Transport)?;
                self.conns.remove(&idle);
            }
            let conn = Conn::open(&self.cfg.node.for_server(node), deadline)?;
            self.stats.connects += 1;
            self.conns.insert(node.to_string(), conn);
        }
        self.conns.get_mut(node).ok_or(CallError::Transport)
    }

    /// Reads the slot map from the first node that gives one: the known
    /// masters, then the seeds, the nodes that failed last of all.
    fn refresh(&mut self, deadline: Instant) -> Result<(), CallError> {
        let mut ask: Vec<String> = (self.map.iter())
            .flat_map(|m| m.nodes.iter().cloned())
            .collect();
        for seed in &self.cfg.seeds {
            if !ask.contains(seed) {
                ask.push(seed.clone());
            }
        }
        // Stable: the order above holds among the healthy and the suspect.
        ask.sort_by_key(|n| self.suspects.contains(n));
        let query = redis::cmd("CLUSTER").arg("SLOTS").get_packed_command();
        let mut failed = CallError::Transport;
        for node in ask {
            if Instant::now() >= deadline {
                return Err(CallError::Timeout);
            }
            self.stats.round_trips += 1;
            let reply =
                (self.conn(&node, &[], deadline)).and_then(|c| c.query_tree(&query, deadline));
            match reply.map(|r| SlotMap::parse(&r, &node)) {
                Ok(Some(map)) => {
                    self.suspects.retain(|s| *s != node);
                    self.map = Some(map);
                    self.stale = false;
                    self.stats.refreshes += 1;
                    return Ok(());
                }
                Ok(None) => failed = CallError::Refused,
                Err(e) => {
                    self.conns.remove(&node);
                    self.suspect(&node);
                    if e != CallError::Transport || failed == CallError::Transport {
                        failed = e;
                    }
                }
            }
        }
        Err(failed)
    }

    /// Every key of `batch` answered: grouped per node, pipelined, the
    /// redirected ones sent again, all by `deadline`.
    fn call<B: Batch>(&mut self, batch: &B, deadline: Instant) -> Answers<B::Out> {
        if Instant::now() >= deadline {
            return Err(CallError::Timeout);
        }
        if self.map.is_none() || self.stale {
            self.refresh(deadline)?;
        }
        let mut answers: Vec<Option<Result<B::Out, ItemError>>> =
            (0..batch.len()).map(|_| None).collect();
        let mut pending: Vec<Pending> = (0..batch.len())
            .map(|i| Pending {
                i,
                ask: None,
                redirects: 0,
            })
            .collect();
        while !pending.is_empty() {
            if Instant::now() >= deadline {
                for p in pending.drain(..) {
                    answers[p.i] = Some(Err(ItemError::Timeout));
                }
                break;
            }
            let nodes = self.group(batch, pending, &mut answers);
            pending = self.round(batch, nodes, deadline, &mut answers);
        }
        Ok((answers.into_iter())
            .map(|a| a.unwrap_or(Err(ItemError::Transport)))
            .collect())
    }

    /// The keys per node: an `ASK`'s node, else their slot's owner. A key
    /// of a slot no master serves is [`ItemError::Transport`] (and the map
    /// is asked again at the next call).
    fn group<B: Batch, T>(
        &mut self,
        batch: &B,
        pending: Vec<Pending>,
        answers: &mut [Option<Result<T, ItemError>>],
    ) -> Vec<NodeRound> {
        let mut nodes: Vec<NodeRound> = Vec::new();
        let mut unserved = false;
        for p in pending {
            // No text is copied per key: a lookup groups some 65 536.
            let owner =
                (self.map.as_ref()).and_then(|m| m.node_of(hash_slot(batch.key(p.i).as_bytes())));
            let Some(node) = p.ask.as_deref().or(owner) else {
                unserved = true;
                answers[p.i] = Some(Err(ItemError::Transport));
                continue;
            };
            let at = match nodes.iter().position(|n| n.node == node) {
                Some(at) => at,
                None if nodes.len() < CONNS_MAX => {
                    nodes.push(NodeRound {
                        node: node.to_string(),
                        keys: Vec::new(),
                        replies: Vec::new(),
                        sent: false,
                    });
                    nodes.len() - 1
                }
                None => {
                    answers[p.i] = Some(Err(ItemError::Transport));
                    continue;
                }
            };
            let n = &mut nodes[at];
            if p.ask.is_some() {
                n.replies.push(None);
            }
            n.replies.push(Some(n.keys.len()));
            n.keys.push(p);
        }
        self.stale |= unserved;
        nodes
    }

    /// One round: every node's pipeline sent, then every node's replies
    /// read. Answers what it can; hands back the redirected keys.
    fn round<B: Batch>(
        &mut self,
        batch: &B,
        mut nodes: Vec<NodeRound>,
        deadline: Instant,
        answers: &mut [Option<Result<B::Out, ItemError>>],
    ) -> Vec<Pending> {
        self.stats.round_trips += 1;
        let names: Vec<String> = nodes.iter().map(|n| n.node.clone()).collect();
        let keep: Vec<&str> = names.iter().map(String::as_str).collect();
        for n in &mut nodes {
            let sent = self.send(batch, n, &keep, deadline);
            if let Err(e) = sent {
                self.node_failed(&n.node, &n.keys, e, answers);
            }
            n.sent = sent.is_ok();
        }
        let mut again = Vec::new();
        for n in nodes.into_iter().filter(|n| n.sent) {
            again.extend(self.receive(batch, n, deadline, answers));
        }
        again
    }

    /// Packs and writes `n`'s pipeline (`ASKING` before each asked key).
    fn send<B: Batch>(
        &mut self,
        batch: &B,
        n: &NodeRound,
        keep: &[&str],
        deadline: Instant,
    ) -> Result<(), CallError> {
        let mut packed = Packed::take(&mut self.packed, 0);
        for p in &n.keys {
            if p.ask.is_some() {
                redis::cmd("ASKING").write_packed_command(&mut packed.0);
            }
            batch.pack(p.i, &mut packed.0, deadline)?;
        }
        self.stats.pipelines += 1;
        let sent = (self.conn(&n.node, keep, deadline)).and_then(|c| c.send(&packed.0, deadline));
        packed.keep(&mut self.packed);
        sent
    }

    /// Reads `n`'s replies: answers, redirects to follow (handed back),
    /// or the node's failure for all its keys.
    fn receive<B: Batch>(
        &mut self,
        batch: &B,
        n: NodeRound,
        deadline: Instant,
        answers: &mut [Option<Result<B::Out, ItemError>>],
    ) -> Vec<Pending> {
        let Some(conn) = self.conns.get_mut(&n.node) else {
            self.node_failed(&n.node, &n.keys, CallError::Transport, answers);
            return Vec::new();
        };
        let (keys, replies, node) = (&n.keys, &n.replies, n.node.as_str());
        let heard = conn.receive(replies.len(), deadline, |j, r| {
            let Some(at) = replies[j] else {
                // A failed `ASKING` shows in the command's own reply.
                return matches!(r, RespValue::Ok | RespValue::Error(_)).then_some(Heard::Asking);
            };
            Some(match r {
                RespValue::Error(text) => heard_error(text, node),
                r => Heard::Done(batch.answer(keys[at].i, r, deadline)?),
            })
        });
        let heard = match heard {
            Ok(heard) => heard,
            Err(e) => {
                self.node_failed(&n.node, &n.keys, e, answers);
                return Vec::new();
            }
        };
        self.follow(n.keys, heard, answers)
    }

    /// Each key's reply: its answer, or its redirect to follow (handed
    /// back while it has redirects left).
    fn follow<T>(
        &mut self,
        keys: Vec<Pending>,
        heard: Vec<Heard<T>>,
        answers: &mut [Option<Result<T, ItemError>>],
    ) -> Vec<Pending> {
        let mut again = Vec::new();
        let mut down = false;
        // One reply per key in the order sent, `ASKING`'s aside.
        let per_key = heard.into_iter().filter(|h| !matches!(h, Heard::Asking));
        for (h, key) in per_key.zip(keys) {
            let ask = match h {
                Heard::Asking => continue,
                Heard::Done(r) => {
                    answers[key.i] = Some(r);
                    continue;
                }
                Heard::Down => {
                    down = true;
                    answers[key.i] = Some(Err(ItemError::Transport));
                    continue;
                }
                Heard::Moved(slot, to) => {
                    self.stats.moved += 1;
                    self.stale = true;
                    if let Some(m) = self.map.as_mut() {
                        m.set_owner(slot, &to);
                    }
                    None
                }
                Heard::Ask(to) => {
                    self.stats.asked += 1;
                    Some(to)
                }
            };
            if key.redirects >= REDIRECTS_MAX {
                self.stats.redirects_exhausted += 1;
                answers[key.i] = Some(Err(ItemError::Transport));
            } else {
                again.push(Pending {
                    i: key.i,
                    ask,
                    redirects: key.redirects + 1,
                });
            }
        }
        if down {
            self.stats.node_failures += 1;
            self.stale = true;
        }
        again
    }

    /// `node` is asked for the map after the others until it gives one.
    fn suspect(&mut self, node: &str) {
        if !self.suspects.iter().any(|s| s == node) && self.suspects.len() < CONNS_MAX {
            self.suspects.push(node.to_string());
        }
    }

    /// `node` failed: its connection dropped, its keys answered `e`'s
    /// per-key error, the map asked again at the next call.
    fn node_failed<T>(
        &mut self,
        node: &str,
        keys: &[Pending],
        e: CallError,
        answers: &mut [Option<Result<T, ItemError>>],
    ) {
        self.conns.remove(node);
        self.suspect(node);
        self.stale = true;
        self.stats.node_failures += 1;
        for p in keys {
            answers[p.i] = Some(Err(item_error(e)));
        }
    }
}

/// A key's error reply from `node`: a redirect, the node down, or the
/// key's own error as on one server.
fn heard_error<T>(text: &str, node: &str) -> Heard<T> {
    match error_code(text) {
        "MOVED" => redirect(text, node).map_or(Heard::Down, |(slot, to)| Heard::Moved(slot, to)),
        "ASK" => redirect(text, node).map_or(Heard::Down, |(_, to)| Heard::Ask(to)),
        "CLUSTERDOWN" | "TRYAGAIN" | "LOADING" | "MASTERDOWN" => Heard::Down,
        code => Heard::Done(Err(server_error(code))),
    }
}

impl StoreBackend for RedisClusterStore {
    fn name(&self) -> &'static str {
        "redis-cluster"
    }

    fn exists(&mut self, keys: &[ChunkKey], deadline: Instant) -> Result<Vec<bool>, CallError> {
        let found = self.call(&exists_batch(keys), deadline)?;
        // A lookup has no per-key error: any key's failure fails the call.
        let failed = |e: &ItemError| match e {
            ItemError::Timeout => CallError::Timeout,
            _ => CallError::Transport,
        };
        found
            .into_iter()
            .map(|r| r.map_err(|e| failed(&e)))
            .collect()
    }

    fn put(&mut self, items: &[PutItem], deadline: Instant) -> Answers<PutOutcome> {
        self.call(&PutBatch(items), deadline)
    }

    fn get(&mut self, items: &[GetItem], deadline: Instant) -> Answers<()> {
        let got = self.call(&GetBatch(items), deadline)?;
        self.stats.corrupt += corrupt_count(&got);
        Ok(got)
    }

    fn remove(&mut self, keys: &[ChunkKey], deadline: Instant) -> Answers<()> {
        self.call(&del_batch(keys), deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CRC bit by bit, as its definition says.
    fn crc16_bitwise(bytes: &[u8]) -> u16 {
        let mut crc = 0u16;
        for &b in bytes {
            crc ^= u16::from(b) << 8;
            for _ in 0..8 {
                crc = if crc & 0x8000 != 0 {
                    (crc << 1) ^ 0x1021
                } else {
                    crc << 1
                };
            }
        }
        crc
    }

    #[test]
    fn slots_are_redis_clusters_own() {
        assert_eq!(crc16(b"123456789"), 0x31C3);
        let text: Vec<u8> = (0..300u32).map(|i| (i * 7919 % 251) as u8).collect();
        for len in 0..text.len() {
            assert_eq!(crc16(&text[..len]), crc16_bitwise(&text[..len]), "{len}");
        }
        // Slots `CLUSTER KEYSLOT` gives.
        assert_eq!(hash_slot(b"foo"), 12182);
        assert_eq!(hash_slot(b"bar"), 5061);
        assert_eq!(hash_slot(b"{user1000}.following"), hash_slot(b"user1000"));
        assert_eq!(hash_slot(b"{user1000}.followers"), hash_slot(b"user1000"));
        // An empty tag hashes the whole key; only the first tag counts.
        assert_eq!(hash_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
        assert_eq!(hash_slot(b"foo{{bar}}zap"), hash_slot(b"{bar"));
        assert_eq!(hash_slot(b"foo{bar}{zap}"), hash_slot(b"bar"));
    }

    #[test]
    fn a_cluster_slots_reply_is_a_slot_map_and_redirects_parse() {
        let node = |ip: &str, port| Tree::Array(vec![Tree::Bulk(ip.into()), Tree::Int(port)]);
        let range = |a, b, n| Tree::Array(vec![Tree::Int(a), Tree::Int(b), n]);
        let reply = Tree::Array(vec![
            range(0, 8000, node("10.0.0.1", 7000)),
            range(8001, 16383, node("", 7001)),
        ]);
        let map = SlotMap::parse(&reply, "seed:7001").unwrap();
        assert_eq!(map.node_of(0), Some("10.0.0.1:7000"));
        assert_eq!(map.node_of(8000), Some("10.0.0.1:7000"));
        assert_eq!(map.node_of(16383), Some("seed:7001"));
        let gap = Tree::Array(vec![range(5, 6, node("h", 1))]);
        assert_eq!(SlotMap::parse(&gap, "s:1").unwrap().node_of(0), None);
        let past = Tree::Array(vec![range(0, 16384, node("h", 1))]);
        assert!(SlotMap::parse(&past, "s:1").is_none());
        assert!(SlotMap::parse(&Tree::Int(3), "s:1").is_none());
        assert_eq!(
            redirect("MOVED 3999 127.0.0.1:6381", "x:1"),
            Some((3999, "127.0.0.1:6381".into()))
        );
        assert_eq!(redirect("ASK 12 :6381", "h:1"), Some((12, "h:6381".into())));
        assert_eq!(redirect("MOVED x y", "h:1"), None);
    }

    #[test]
    fn cluster_urls_take_several_seeds_and_one_node_urls_one() {
        let c = ClusterConfig::from_url("redis+cluster://u:p@a:1,b:2/").unwrap();
        assert_eq!(c.seeds, ["a:1", "b:2"]);
        assert_eq!(
            (c.node.user.as_deref(), c.node.password.as_deref()),
            (Some("u"), Some("p"))
        );
        assert!(ClusterConfig::from_url("redis+cluster://a:1,").is_err());
        assert!(ClusterConfig::from_url("redis://a:1").is_err());
        assert!(RedisConfig::from_url("redis://a:1,b:2").is_err());
    }
}
