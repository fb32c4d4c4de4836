//! The `redis://` backend against a real `redis-server` (installed by
//! scripts/test.sh), started per test on a free 127.0.0.1 port.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::store_buffer;

use kvferry_store::{
    CallError, GetItem, ItemError, PutItem, PutOutcome, RedisConfig, RedisStore, Scatter, Segment,
    StoreBackend,
};
use store_buffer::{check_remove_prefix, far, key, Buffer};

/// A `redis-server` of this test's own, killed when dropped.
struct Redis {
    port: u16,
    extra: Vec<String>,
    child: Option<Child>,
}

impl Redis {
    fn start(extra: &[&str]) -> Redis {
        // Killed and started again on the same port by some tests.
        let port = kvferry_testkit::server_port();
        let mut r = Redis {
            port,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            child: None,
        };
        r.restart();
        r
    }

    /// Starts the server (again) on its port and waits for its PING.
    fn restart(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (scripts/test.sh installs it)");
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            let pong = redis::Client::open(self.url())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            // Any answer from Redis (`NOAUTH` included) means it is up.
            match pong {
                Ok(_) => return,
                Err(e) if !e.is_io_error() => return,
                Err(_) => {}
            }
            assert!(Instant::now() < until, "redis-server answered no PING");
            // Between attempts to connect to a server still starting.
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn store(&self) -> RedisStore {
        RedisStore::new(RedisConfig::from_url(&self.url()).unwrap())
    }

    /// A plain client, for writing behind the backend's back.
    fn client(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .unwrap()
            .get_connection()
            .unwrap()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

#[test]
fn a_second_put_of_a_key_is_exists_and_leaves_its_value() {
    let srv = Redis::start(&[]);
    let mut store = srv.store();
    let mut kv = Buffer::new(3, 4096, 0);
    for (i, b) in kv.bytes.iter_mut().enumerate() {
        *b = (i / 4096) as u8 + 1;
    }
    let first = store.put(&[kv.put("k", 0)], far()).unwrap();
    assert_eq!(first, [Ok(PutOutcome::Stored)]);
    let second = store.put(&[kv.put("k", 1)], far()).unwrap();
    assert_eq!(second, [Ok(PutOutcome::Exists)]);
    assert_eq!(
        store.exists(&[key("k"), key("no")], far()),
        Ok(vec![true, false])
    );
    let got = store
        .get(&[kv.get("k", 2), kv.get("no", 1)], far())
        .unwrap();
    assert_eq!(got, [Ok(()), Err(ItemError::NotFound)]);
    assert!(kv.block(2).iter().all(|&b| b == 1), "the first put's value");
    assert!(kv.block(1).iter().all(|&b| b == 2), "block 1 untouched");
    let removed = store.remove(&[key("k"), key("k")], far()).unwrap();
    assert_eq!(removed, [Ok(()), Err(ItemError::NotFound)]);
}

#[test]
fn a_prefix_removes_its_keys_and_no_others() {
    let srv = Redis::start(&[]);
    check_remove_prefix(&mut srv.store(), &Buffer::new(4, 64, 0));
}

#[test]
fn corrupt_truncated_and_foreign_values_are_errors_and_write_nothing() {
    let srv = Redis::start(&[]);
    let mut store = srv.store();
    let mut kv = Buffer::new(8, 1024, 0xEE);
    kv.bytes[..1024].fill(7);
    let names = ["good", "magic", "short", "crc", "garbage", "list", "size"];
    let puts: Vec<PutItem> = names.iter().map(|n| kv.put(n, 0)).collect();
    let stored = store.put(&puts, far()).unwrap();
    assert!(stored.iter().all(|r| *r == Ok(PutOutcome::Stored)));
    let mut raw = srv.client();
    let value: Vec<u8> = redis::cmd("GET").arg("good").query(&mut raw).unwrap();
    let set = |raw: &mut redis::Connection, k: &str, v: &[u8]| {
        redis::cmd("SET").arg(k).arg(v).exec(raw).unwrap();
    };
    let mut v = value.clone();
    v[0] ^= 0xFF;
    set(&mut raw, "magic", &v);
    set(&mut raw, "short", &value[..value.len() - 1]);
    let mut v = value.clone();
    v[value.len() / 2] ^= 1;
    set(&mut raw, "crc", &v);
    set(&mut raw, "garbage", b"not a kvferry value");
    redis::cmd("DEL").arg("list").exec(&mut raw).unwrap();
    redis::cmd("RPUSH")
        .arg("list")
        .arg("x")
        .exec(&mut raw)
        .unwrap();
    let gets: Vec<GetItem> = (names.iter().enumerate())
        .map(|(i, n)| kv.get(n, i as u64 + 1))
        .collect();
    let mut gets = gets;
    // A block of half the stored length: another size, nothing written.
    let half = Scatter::clone(&gets[6].into);
    let seg = half.segments()[0];
    // SAFETY: the first half of block 7, inside `kv`.
    gets[6].into = unsafe {
        Scatter::from_raw(vec![Segment {
            addr: seg.addr,
            len: seg.len / 2,
        }])
    };
    let got = store.get(&gets, far()).unwrap();
    let corrupt = Err(ItemError::Corrupt);
    assert_eq!(
        got[..6],
        [Ok(()), corrupt, corrupt, corrupt, corrupt, corrupt]
    );
    assert_eq!(
        got[6],
        Err(ItemError::WrongSize {
            got_bytes: 1024,
            want_bytes: 512
        })
    );
    assert!(kv.block(1).iter().all(|&b| b == 7), "the good value loaded");
    for b in 2..8 {
        assert!(
            kv.block(b).iter().all(|&x| x == 0xEE),
            "block {b} untouched"
        );
    }
    assert_eq!(store.stats().corrupt, 5);
}

#[test]
fn a_full_redis_answers_full_for_the_keys_it_refuses() {
    let srv = Redis::start(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]);
    let mut store = srv.store();
    let kv = Buffer::new(64, 64 << 10, 3);
    let puts: Vec<PutItem> = (0..64).map(|i| kv.put(&format!("f{i}"), i)).collect();
    let answers = store.put(&puts, far()).unwrap();
    let full = answers
        .iter()
        .filter(|r| **r == Err(ItemError::Full))
        .count();
    assert!(full > 0, "{answers:?}");
    let stored = answers.iter().filter(|r| r.is_ok()).count();
    assert_eq!(stored + full, 64, "{answers:?}");
}

#[test]
fn a_killed_redis_fails_calls_by_their_deadline_and_a_restarted_one_is_picked_up() {
    let mut srv = Redis::start(&[]);
    let mut store = srv.store();
    let kv = Buffer::new(2, 256, 5);
    assert_eq!(
        store.put(&[kv.put("a", 0)], far()),
        Ok(vec![Ok(PutOutcome::Stored)])
    );
    srv.kill();
    let deadline = Instant::now() + Duration::from_secs(5);
    assert_eq!(
        store.exists(&[key("a")], deadline),
        Err(CallError::Transport)
    );
    assert!(Instant::now() < deadline);
    assert_eq!(
        store.get(&[kv.get("a", 1)], deadline),
        Err(CallError::Transport)
    );
    srv.restart();
    // The new server is empty (no persistence): the key is gone, calls work.
    assert_eq!(store.exists(&[key("a")], far()), Ok(vec![false]));
    assert_eq!(
        store.put(&[kv.put("a", 0)], far()),
        Ok(vec![Ok(PutOutcome::Stored)])
    );
    assert!(store.stats().connects >= 2);
}

#[test]
fn a_server_that_never_answers_times_the_call_out_at_its_deadline() {
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}", silent.local_addr().unwrap());
    let mut store = RedisStore::new(RedisConfig::from_url(&url).unwrap());
    let kv = Buffer::new(1, 256, 5);
    let deadline = Instant::now() + Duration::from_millis(300);
    assert_eq!(
        store.get(&[kv.get("a", 0)], deadline),
        Err(CallError::Timeout)
    );
    // Returned by the deadline, give or take the scheduler.
    assert!(Instant::now() < deadline + Duration::from_secs(2));
    drop(silent);
}

#[test]
fn a_password_in_the_url_is_sent_with_auth_and_a_wrong_one_is_refused() {
    let srv = Redis::start(&["--requirepass", "s3cret"]);
    let kv = Buffer::new(2, 256, 9);
    let url = |pw: &str| format!("redis://:{pw}@127.0.0.1:{}", srv.port);
    let mut store = RedisStore::new(RedisConfig::from_url(&url("s3cret")).unwrap());
    assert_eq!(
        store.put(&[kv.put("a", 0)], far()),
        Ok(vec![Ok(PutOutcome::Stored)])
    );
    assert_eq!(store.get(&[kv.get("a", 1)], far()), Ok(vec![Ok(())]));
    let mut wrong = RedisStore::new(RedisConfig::from_url(&url("nope")).unwrap());
    assert_eq!(wrong.exists(&[key("a")], far()), Err(CallError::Refused));
    let mut none = srv.store();
    assert_eq!(none.exists(&[key("a")], far()), Err(CallError::Refused));
}

/// A fake server that answers every connection's first read with `reply`
/// and then keeps it open until the test ends.
fn hostile(reply: &'static [u8]) -> (RedisStore, std::thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}", l.local_addr().unwrap());
    let t = std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let mut buf = [0u8; 4096];
        let _ = s.read(&mut buf);
        let _ = s.write_all(reply);
        // Until the client hangs up.
        let _ = s.read(&mut buf);
    });
    (RedisStore::new(RedisConfig::from_url(&url).unwrap()), t)
}

#[test]
fn replies_no_redis_command_gives_are_refused_calls_not_panics() {
    let kv = Buffer::new(1, 256, 5);
    let cases: [(&[u8], CallError); 7] = [
        (b"*1\r\n:1\r\n", CallError::Refused),
        (b":7\r\n", CallError::Refused),
        (b"$99999999999\r\n", CallError::Refused),
        (b"$-7\r\n", CallError::Refused),
        (b"$3\r\nabcXY", CallError::Refused),
        (b"%\xff\r\n", CallError::Refused),
        // Half a line, then silence: the deadline ends the call.
        (b"+OK", CallError::Timeout),
    ];
    for (reply, want) in cases {
        let (mut store, t) = hostile(reply);
        let deadline = Instant::now() + Duration::from_millis(500);
        let got = store.get(&[kv.get("a", 0)], deadline);
        assert_eq!(got, Err(want), "{:?}", String::from_utf8_lossy(reply));
        drop(store);
        t.join().unwrap();
    }
    assert!(kv.block(0).iter().all(|&b| b == 5), "nothing written");
}

mod through_the_connector {
    //! The connector's pressure path over a Redis with `noeviction`.

    use super::store_buffer::connector::{self, config, save, BLOCK_TOKENS, HEAD_BYTES};
    use super::*;
    use kvferry_store::StoreConnector;

    #[test]
    fn a_full_redis_takes_the_pressure_path_until_a_save_succeeds() {
        let srv = Redis::start(&["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]);
        let kv = Buffer::new(40, 8 * BLOCK_TOKENS as u64 * HEAD_BYTES, 4);
        let mut c = StoreConnector::new(config(), srv.store()).unwrap();
        // SAFETY: `kv` outlives the connector and is not touched meanwhile.
        unsafe { c.register_kv_caches(kv.layout()).unwrap() };
        // 32 blocks of 256 KiB in one batch: Redis refuses the later ones.
        save(&mut c, 1, 0..32);
        let s = c.stats();
        assert_eq!(s.pressure.full_saves, 1, "{s:?}");
        assert!(s.save_failed_keys > 0, "{s:?}");
        // Room again: a save that fits clears the pressure.
        redis::cmd("FLUSHALL").exec(&mut srv.client()).unwrap();
        save(&mut c, 2, 32..34);
        let s = c.stats();
        assert_eq!(s.pressure.clears, 1, "{s:?}");
    }

    #[test]
    fn a_value_corrupted_in_redis_is_a_load_error_for_exactly_its_block() {
        let srv = Redis::start(&[]);
        let mut kv = Buffer::new(8, 8 * BLOCK_TOKENS as u64 * HEAD_BYTES, 0xEE);
        for b in 0..4 {
            let at = (b * kv.block) as usize;
            kv.bytes[at..at + kv.block as usize].fill(b as u8 + 1);
        }
        let mut c = StoreConnector::new(config(), srv.store()).unwrap();
        // SAFETY: `kv` outlives the connector and is not touched meanwhile.
        unsafe { c.register_kv_caches(kv.layout()).unwrap() };
        save(&mut c, 1, 0..4);
        // Flip one payload byte of block 2's value, behind kvferry's back.
        let mut raw = srv.client();
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut raw).unwrap();
        assert_eq!(keys.len(), 4);
        let block_2 = (keys.iter())
            .find(|k| {
                let v: Vec<u8> = redis::cmd("GET").arg(*k).query(&mut raw).unwrap();
                v.get(kvferry_store::internal::redis::HEADER_BYTES) == Some(&3)
            })
            .unwrap();
        let mut v: Vec<u8> = redis::cmd("GET").arg(block_2).query(&mut raw).unwrap();
        *v.last_mut().unwrap() ^= 1;
        redis::cmd("SET")
            .arg(block_2)
            .arg(v)
            .exec(&mut raw)
            .unwrap();
        connector::load_with_block_6_spoilt(&mut c, &kv);
    }
}
