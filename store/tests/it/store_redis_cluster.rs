//! The `redis+cluster://` backend against a real Redis Cluster: three
//! masters and a replica each, six `redis-server` processes (installed by
//! scripts/test.sh, with `redis-cli`) started per test on free 127.0.0.1
//! ports whose cluster bus ports (+10000) are free too.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use crate::store_buffer;

use kvferry_store::internal::redis::{hash_slot, HEADER_BYTES, REDIRECTS_MAX};
use kvferry_store::{
    ClusterConfig, ItemError, PutOutcome, RedisClusterStore, StoreBackend, StoreConnector,
};
use store_buffer::connector::{self, config, save, save_as, BLOCK_BYTES};
use store_buffer::{far, key, Buffer};

/// One cluster at a time: six servers with a 1 s node timeout on a
/// machine of two busy cores would otherwise take each other's slow
/// answers for failures and fail over on their own.
static ONE_CLUSTER: Mutex<()> = Mutex::new(());

/// How long a cluster may take to form or to fail over.
const CONVERGE: Duration = Duration::from_secs(40);

/// One node of a cluster: its port and, while it runs, its process.
struct Node {
    port: u16,
    child: Option<Child>,
}

/// Six `redis-server`s of this test's own, formed into a cluster of three
/// masters with a replica each; killed (and their files removed) on drop.
struct Cluster {
    dir: PathBuf,
    nodes: Vec<Node>,
}

/// Ports `p` with `p` and `p + 10000` free, all different.
fn free_ports(n: usize) -> Vec<u16> {
    let mut held = Vec::new();
    for _ in 0..1000 {
        if held.len() == n {
            break;
        }
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p > u16::MAX - 10000 {
            continue;
        }
        if let Ok(bus) = TcpListener::bind(("127.0.0.1", p + 10000)) {
            held.push((p, l, bus));
        }
    }
    assert_eq!(held.len(), n, "free ports with free bus ports");
    held.into_iter().map(|(p, _, _)| p).collect()
}

/// Polls `ready` until it holds, within [`CONVERGE`].
fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let until = Instant::now() + CONVERGE;
    while !ready() {
        assert!(Instant::now() < until, "{what}");
        // Between polls of servers still converging.
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A connection to one node, for asking and for writing behind the
/// backend's back; `None` while it does not answer.
fn client(port: u16) -> Option<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(500)))
        .ok()
}

fn info(port: u16, section: &str) -> String {
    (client(port))
        .and_then(|mut c| redis::cmd("INFO").arg(section).query(&mut c).ok())
        .unwrap_or_default()
}

fn cluster_info(port: u16) -> String {
    (client(port))
        .and_then(|mut c| redis::cmd("CLUSTER").arg("INFO").query(&mut c).ok())
        .unwrap_or_default()
}

/// One line of `CLUSTER NODES`: id, port, is a master, its slot ranges.
type NodeLine = (String, u16, bool, String, Vec<(u16, u16)>);

/// `CLUSTER NODES`, as seen by the node on `port`.
fn cluster_nodes(port: u16) -> Vec<NodeLine> {
    let text: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query(&mut client(port).unwrap())
        .unwrap();
    (text.lines())
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let addr = f[1].split('@').next().unwrap();
            let port = addr.rsplit_once(':').unwrap().1.parse().unwrap();
            // `a-b` or `a`; `[slot->-id]` marks a migration, not a range.
            let ranges = (f[8..].iter())
                .filter(|r| !r.starts_with('['))
                .map(|r| {
                    let (a, b) = r.split_once('-').unwrap_or((r, r));
                    (a.parse().unwrap(), b.parse().unwrap())
                })
                .collect();
            (
                f[0].into(),
                port,
                f[2].contains("master"),
                f[3].into(),
                ranges,
            )
        })
        .collect()
}

static CLUSTERS: AtomicU64 = AtomicU64::new(0);

impl Cluster {
    fn start(extra: &[&str]) -> Cluster {
        let n = CLUSTERS.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kvferry-cluster-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = Cluster {
            dir,
            nodes: free_ports(6)
                .into_iter()
                .map(|port| Node { port, child: None })
                .collect(),
        };
        for i in 0..6 {
            c.spawn(i, extra);
        }
        for n in &c.nodes {
            wait_for("redis-server answers", || client(n.port).is_some());
        }
        let status = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(c.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .status()
            .expect("redis-cli (scripts/test.sh installs it with redis-server)");
        assert!(status.success(), "redis-cli --cluster create");
        c.wait_ok();
        // Every node learns the replicas by gossip, after `create` returns:
        // wait until each lists one replica per master.
        for n in &c.nodes {
            wait_for("every node lists the three replicas", || {
                let nodes = cluster_nodes(n.port);
                nodes.iter().filter(|x| !x.2 && x.3 != "-").count() == 3
            });
        }
        // A replica that never synced does not take over (its data would
        // be too old): wait for every link.
        for port in c.replicas() {
            wait_for("replica synced", || {
                info(port, "replication").contains("master_link_status:up")
            });
        }
        c
    }

    fn spawn(&mut self, i: usize, extra: &[&str]) {
        let port = self.nodes[i].port.to_string();
        let conf = self.dir.join(format!("nodes-{port}.conf"));
        let child = Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1"])
            .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
            .arg("--cluster-config-file")
            .arg(&conf)
            .arg("--dir")
            .arg(&self.dir)
            .args(["--save", "", "--appendonly", "no"])
            // A replica's first sync starts at once, not after the 5 s
            // Redis waits by default for more replicas to share it.
            .args(["--repl-diskless-sync-delay", "0"])
            .args(extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (scripts/test.sh installs it)");
        self.nodes[i].child = Some(child);
    }

    /// Waits for `cluster_state:ok` on every running node.
    fn wait_ok(&self) {
        for n in self.nodes.iter().filter(|n| n.child.is_some()) {
            wait_for("cluster_state:ok", || {
                cluster_info(n.port).contains("cluster_state:ok")
            });
        }
    }

    fn url(&self) -> String {
        let seeds: Vec<String> = (self.nodes.iter())
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    fn store(&self) -> RedisClusterStore {
        RedisClusterStore::new(ClusterConfig::from_url(&self.url()).unwrap())
    }

    fn live(&self) -> u16 {
        self.nodes.iter().find(|n| n.child.is_some()).unwrap().port
    }

    fn masters(&self) -> Vec<u16> {
        let nodes = cluster_nodes(self.live());
        let alive = |p: u16| self.nodes.iter().any(|n| n.port == p && n.child.is_some());
        (nodes.iter())
            .filter(|n| n.2 && alive(n.1))
            .map(|n| n.1)
            .collect()
    }

    fn replicas(&self) -> Vec<u16> {
        let nodes = cluster_nodes(self.live());
        nodes.iter().filter(|n| !n.2).map(|n| n.1).collect()
    }

    fn id_of(&self, port: u16) -> String {
        let nodes = cluster_nodes(self.live());
        nodes.into_iter().find(|n| n.1 == port).unwrap().0
    }

    /// The master that serves `slot`.
    fn owner(&self, slot: u16) -> u16 {
        let nodes = cluster_nodes(self.live());
        let serves = |ranges: &[(u16, u16)]| ranges.iter().any(|r| (r.0..=r.1).contains(&slot));
        nodes.into_iter().find(|n| serves(&n.4)).unwrap().1
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn dbsize(port: u16) -> u64 {
    redis::cmd("DBSIZE")
        .query(&mut client(port).unwrap())
        .unwrap()
}

/// Fills block `b` of `kv` with bytes of `(seed, b, i)`.
fn fill(kv: &mut Buffer, blocks: std::ops::Range<u64>, seed: u64) {
    for b in blocks {
        let at = (b * kv.block) as usize;
        for (i, x) in kv.bytes[at..at + kv.block as usize].iter_mut().enumerate() {
            *x = (seed.wrapping_mul(31) ^ b.wrapping_mul(7) ^ i as u64 ^ (i as u64 >> 8)) as u8;
        }
    }
}

#[test]
fn saves_load_every_byte_dedup_and_spread_over_all_masters() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = Cluster::start(&[]);
    let mut store = cluster.store();
    let mut kv = Buffer::new(96, 16 << 10, 0);
    fill(&mut kv, 0..48, 1);
    let puts: Vec<_> = (0..48).map(|b| kv.put(&format!("k{b}"), b)).collect();
    let stored = store.put(&puts, far()).unwrap();
    assert!(
        stored.iter().all(|r| *r == Ok(PutOutcome::Stored)),
        "{stored:?}"
    );
    // Again, from other bytes: every key exists, its value unchanged.
    let again: Vec<_> = (0..48).map(|b| kv.put(&format!("k{b}"), 95 - b)).collect();
    let second = store.put(&again, far()).unwrap();
    assert!(
        second.iter().all(|r| *r == Ok(PutOutcome::Exists)),
        "{second:?}"
    );
    let gets: Vec<_> = (0..48).map(|b| kv.get(&format!("k{b}"), 48 + b)).collect();
    let got = store.get(&gets, far()).unwrap();
    assert!(got.iter().all(|r| *r == Ok(())), "{got:?}");
    for b in 0..48 {
        assert_eq!(kv.block(b), kv.block(48 + b), "block {b}");
    }
    let masters = cluster.masters();
    assert_eq!(masters.len(), 3);
    let sizes: Vec<u64> = masters.iter().map(|&p| dbsize(p)).collect();
    assert!(sizes.iter().all(|&n| n > 0), "{sizes:?}");
    assert_eq!(sizes.iter().sum::<u64>(), 48);
    let s = store.stats();
    assert_eq!((s.moved, s.asked, s.node_failures), (0, 0, 0), "{s:?}");
    // One round trip per call: three pipelines sent together.
    assert_eq!(s.pipelines, 3 * 3, "{s:?}");
    let removed = store.remove(&[key("k0"), key("k0")], far()).unwrap();
    assert_eq!(removed, [Ok(()), Err(ItemError::NotFound)]);
}

/// Fresh keys put and got back, round after round, through a failover.
struct Rounds {
    kv: Buffer,
    keys: u64,
    /// Blocks that came back with other bytes, or were written though
    /// their get failed (must stay 0).
    wrong: u64,
    /// Keys or calls that failed.
    failed: u64,
}

impl Rounds {
    /// Round `it`: `keys` fresh keys and bytes put, then got into the
    /// buffer's other half; true when every key of both calls succeeded.
    fn round(&mut self, store: &mut RedisClusterStore, it: u64) -> bool {
        let (kv, keys) = (&mut self.kv, self.keys);
        fill(kv, 0..keys, it);
        kv.bytes[(keys * kv.block) as usize..].fill(0xEE);
        let name = |b: u64| format!("it{it}:{b}");
        let deadline = Instant::now() + Duration::from_millis(1500);
        let puts: Vec<_> = (0..keys).map(|b| kv.put(&name(b), b)).collect();
        let put = store.put(&puts, deadline);
        let gets: Vec<_> = (0..keys).map(|b| kv.get(&name(b), keys + b)).collect();
        let got = store.get(&gets, deadline);
        // Ended by the deadline, give or take the scheduler.
        assert!(Instant::now() < deadline + Duration::from_secs(2));
        let (Ok(put), Ok(got)) = (put, got) else {
            self.failed += 1;
            return false;
        };
        for b in 0..keys {
            let landed = kv.block(keys + b);
            match got[b as usize] {
                Ok(()) if landed != kv.block(b) => self.wrong += 1,
                Ok(()) => {}
                Err(_) if landed.iter().any(|&x| x != 0xEE) => self.wrong += 1,
                Err(_) => self.failed += 1,
            }
        }
        put.iter().all(Result::is_ok) && got.iter().all(Result::is_ok)
    }
}

#[test]
fn a_killed_master_fails_its_keys_by_the_deadline_and_its_replica_takes_over() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let mut cluster = Cluster::start(&[]);
    let victim = cluster.masters()[0];
    let victim_id = cluster.id_of(victim);
    let heir = (cluster_nodes(victim).into_iter())
        .find(|n| n.3 == victim_id)
        .unwrap()
        .1;
    let node = cluster.nodes.iter_mut().find(|n| n.port == victim).unwrap();
    let mut child = node.child.take().unwrap();
    let mut store = cluster.store();
    let mut r = Rounds {
        kv: Buffer::new(48, 64 << 10, 0),
        keys: 24,
        wrong: 0,
        failed: 0,
    };
    let (go, start) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        // SIGKILLs the master while the rounds after the third run.
        s.spawn(move || {
            start.recv().unwrap();
            child.kill().unwrap();
            child.wait().unwrap();
        });
        for it in 0..3 {
            assert!(r.round(&mut store, it), "before the kill");
        }
        go.send(()).unwrap();
        for it in 3..6 {
            r.round(&mut store, it);
        }
    });
    wait_for("the replica takes over", || {
        info(heir, "replication").contains("role:master")
    });
    cluster.wait_ok();
    assert_eq!(cluster.masters().len(), 3, "a replica took over");
    let mut it = 6;
    // The first call after a failure reads the map again.
    while !r.round(&mut store, it) {
        it += 1;
        assert!(it < 10, "saves and loads resume after the failover");
    }
    assert_eq!(r.wrong, 0);
    assert!(r.failed > 0, "keys failed while the master was gone");
    let s = store.stats();
    assert!(s.node_failures > 0 && s.refreshes >= 2, "{s:?}");
}

#[test]
fn a_slot_in_migration_is_followed_through_ask_and_endless_redirects_end() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = Cluster::start(&[]);
    let slot = hash_slot(b"mig");
    let from = cluster.owner(slot);
    let to = *cluster.masters().iter().find(|&&p| p != from).unwrap();
    let (from_id, to_id) = (cluster.id_of(from), cluster.id_of(to));
    let mut store = cluster.store();
    let mut kv = Buffer::new(32, 4096, 0);
    fill(&mut kv, 0..8, 9);
    let name = |b: u64| format!("{{mig}}:{b}");
    let puts: Vec<_> = (0..4).map(|b| kv.put(&name(b), b)).collect();
    assert!(store.put(&puts, far()).unwrap().iter().all(|r| r.is_ok()));
    // Mid-run: the slot moves from `from` to `to`, keys 0 and 1 with it.
    let setslot = |port: u16, state: &str, id: &str| {
        redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(state)
            .arg(id)
            .exec(&mut client(port).unwrap())
            .unwrap();
    };
    setslot(to, "IMPORTING", &from_id);
    setslot(from, "MIGRATING", &to_id);
    redis::cmd("MIGRATE")
        .arg("127.0.0.1")
        .arg(to)
        .arg("")
        .arg(0)
        .arg(5000)
        .arg("KEYS")
        .arg(name(0))
        .arg(name(1))
        .exec(&mut client(from).unwrap())
        .unwrap();
    // Keys 4..8 are new: `from` sends their puts to `to` too.
    let puts: Vec<_> = (4..8).map(|b| kv.put(&name(b), b)).collect();
    assert!(store.put(&puts, far()).unwrap().iter().all(|r| r.is_ok()));
    let gets: Vec<_> = (0..8).map(|b| kv.get(&name(b), 8 + b)).collect();
    let got = store.get(&gets, far()).unwrap();
    assert!(got.iter().all(|r| *r == Ok(())), "{got:?}");
    for b in 0..8 {
        assert_eq!(kv.block(b), kv.block(8 + b), "block {b}");
    }
    assert_eq!(dbsize(to), 6, "keys 0, 1 and 4..8 moved");
    let s = store.stats();
    // Puts of 4..8, gets of 0, 1 and 4..8; the map kept (no refresh).
    assert_eq!((s.asked, s.moved, s.refreshes), (4 + 6, 0, 1), "{s:?}");
    // `to` forgets it imports the slot: it sends the key back to `from`
    // (MOVED), which sends it to `to` (ASK)... until the bound.
    redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("STABLE")
        .exec(&mut client(to).unwrap())
        .unwrap();
    let got = store.get(&[kv.get(&name(0), 20), kv.get(&name(2), 21)], far());
    assert_eq!(got, Ok(vec![Err(ItemError::Transport), Ok(())]));
    assert!(kv.block(20).iter().all(|&x| x == 0), "nothing written");
    let s = store.stats();
    assert_eq!(s.redirects_exhausted, 1, "{s:?}");
    assert_eq!(
        (s.asked + s.moved) - (4 + 6),
        u64::from(REDIRECTS_MAX) + 1,
        "{s:?}"
    );
}

#[test]
fn a_full_cluster_takes_the_pressure_path_until_space_frees() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = Cluster::start(&["--maxmemory", "32mb", "--maxmemory-policy", "noeviction"]);
    let kv = Buffer::new(34, BLOCK_BYTES, 4);
    let mut c = StoreConnector::new(config(), cluster.store()).unwrap();
    // SAFETY: `kv` outlives the connector and is not touched meanwhile.
    unsafe { c.register_kv_caches(kv.layout()).unwrap() };
    let blocks: Vec<u32> = (0..32).collect();
    // 8 MiB per save of 32 new hashes; three masters of 32 MiB each fill
    // before 16 saves.
    let mut id = 0;
    while c.stats().pressure.full_saves == 0 {
        id += 1;
        assert!(id <= 16, "{:?}", c.stats());
        let hashes: Vec<u32> = (0..32).map(|h| id as u32 * 1000 + h).collect();
        save_as(&mut c, id, &hashes, &blocks);
    }
    assert!(c.stats().save_failed_keys > 0, "{:?}", c.stats());
    for port in cluster.masters() {
        redis::cmd("FLUSHALL")
            .exec(&mut client(port).unwrap())
            .unwrap();
    }
    save(&mut c, 100, 32..34);
    let s = c.stats();
    assert_eq!(s.pressure.clears, 1, "{s:?}");
}

#[test]
fn a_value_corrupted_on_its_node_is_a_load_error_for_exactly_its_block() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = Cluster::start(&[]);
    let mut kv = Buffer::new(8, BLOCK_BYTES, 0xEE);
    for b in 0..4 {
        let at = (b * kv.block) as usize;
        kv.bytes[at..at + kv.block as usize].fill(b as u8 + 1);
    }
    let mut c = StoreConnector::new(config(), cluster.store()).unwrap();
    // SAFETY: `kv` outlives the connector and is not touched meanwhile.
    unsafe { c.register_kv_caches(kv.layout()).unwrap() };
    save(&mut c, 1, 0..4);
    // Block 2's value, found on whichever master holds it, overwritten
    // through redis-cli on that node.
    let (port, block_2) = (cluster.masters().into_iter())
        .find_map(|port| {
            let mut raw = client(port).unwrap();
            let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut raw).unwrap();
            (keys.into_iter()).find_map(|k| {
                let v: Vec<u8> = redis::cmd("GET").arg(&k).query(&mut raw).unwrap();
                (v.get(HEADER_BYTES) == Some(&3)).then_some((port, k))
            })
        })
        .unwrap();
    let set = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "SET", &block_2, "garbage"])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(set.success());
    connector::load_with_block_6_spoilt(&mut c, &kv);
}

/// A fake node that answers its first read with `reply`, then keeps the
/// connection open until the client hangs up.
fn hostile(reply: &'static [u8]) -> (RedisClusterStore, std::thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis+cluster://{}", l.local_addr().unwrap());
    let t = std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let mut buf = [0u8; 4096];
        let _ = s.read(&mut buf);
        let _ = s.write_all(reply);
        let _ = s.read(&mut buf);
    });
    (
        RedisClusterStore::new(ClusterConfig::from_url(&url).unwrap()),
        t,
    )
}

#[test]
fn slot_maps_past_their_bounds_are_refused_and_a_silent_node_ends_by_the_deadline() {
    use kvferry_store::CallError;
    let cases: [(&[u8], CallError); 5] = [
        // A map of one node whose entry nests past ARRAY_DEPTH_MAX.
        (
            b"*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:1\r\n*1\r\n*1\r\n:1\r\n",
            CallError::Refused,
        ),
        // Longer than ARRAY_LEN_MAX.
        (b"*99999999\r\n", CallError::Refused),
        // A range past the last slot.
        (
            b"*1\r\n*3\r\n:0\r\n:16384\r\n*2\r\n$9\r\n127.0.0.1\r\n:1\r\n",
            CallError::Refused,
        ),
        (
            b"-ERR This instance has cluster support disabled\r\n",
            CallError::Refused,
        ),
        // Half a reply, then silence.
        (b"*1\r\n*3\r\n:0\r\n", CallError::Timeout),
    ];
    for (reply, want) in cases {
        let (mut store, t) = hostile(reply);
        let deadline = Instant::now() + Duration::from_millis(500);
        let got = store.exists(&[key("a")], deadline);
        assert_eq!(got, Err(want), "{:?}", String::from_utf8_lossy(reply));
        // Returned by the deadline, give or take the scheduler.
        assert!(Instant::now() < deadline + Duration::from_secs(2));
        drop(store);
        t.join().unwrap();
    }
}

/// A fake node that answers its connection's reads in turn with the
/// replies `script` gives for its port, then keeps it open until the
/// client hangs up.
fn scripted(script: impl FnOnce(u16) -> Vec<Vec<u8>>) -> (u16, std::thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let replies = script(port);
    let t = std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let mut buf = [0u8; 4096];
        for reply in replies {
            let _ = s.read(&mut buf);
            let _ = s.write_all(&reply);
        }
        let _ = s.read(&mut buf);
    });
    (port, t)
}

#[test]
fn a_node_that_failed_is_asked_for_the_slot_map_after_the_others() {
    use kvferry_store::CallError;
    // Takes connections (the kernel's backlog) and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    // Answers `CLUSTER SLOTS` with itself as the one master, then EXISTS.
    let (good, t) = scripted(|port| {
        let map = format!("*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:{port}\r\n");
        vec![map.into_bytes(), b":1\r\n".to_vec()]
    });
    let url = format!(
        "redis+cluster://{},127.0.0.1:{good}",
        silent.local_addr().unwrap()
    );
    let mut store = RedisClusterStore::new(ClusterConfig::from_url(&url).unwrap());
    let soon = || Instant::now() + Duration::from_millis(1000);
    // The silent seed is asked first and holds the call to its deadline.
    assert_eq!(store.exists(&[key("a")], soon()), Err(CallError::Timeout));
    // Then last: the other seed gives the map and the answer at once.
    assert_eq!(store.exists(&[key("a")], soon()), Ok(vec![true]));
    drop(store);
    t.join().unwrap();
}
