//! The stores the CLI's tests run the binary against: a `kvferry store
//! serve` of the binary under test and a `redis-server`, each killed when
//! dropped, and a reader of a `/metrics` page.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `kvferry store serve` with a metrics endpoint.
pub(crate) struct StoreServe {
    pub(crate) child: Child,
    /// `kvferry://HOST:PORT`.
    pub(crate) url: String,
    /// `HOST:PORT` of its `/metrics`.
    pub(crate) metrics: String,
}

impl StoreServe {
    /// Starts one on a free port with `capacity` bytes and waits for its
    /// address lines.
    pub(crate) fn start(capacity: u64) -> StoreServe {
        StoreServe::start_on("127.0.0.1:0", capacity)
    }

    /// Starts one listening on `listen` (an address a killed one had, to
    /// start it again).
    pub(crate) fn start_on(listen: &str, capacity: u64) -> StoreServe {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(["store", "serve", "--listen", listen])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .args(["--capacity-bytes", &capacity.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvferry store serve");
        let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let mut line = || lines.next().and_then(Result::ok).unwrap_or_default();
        let url = line()
            .trim()
            .strip_prefix("listening on ")
            .unwrap()
            .to_string();
        let metrics = line();
        let metrics = (metrics.trim().strip_prefix("metrics on http://"))
            .and_then(|m| m.strip_suffix("/metrics"))
            .unwrap()
            .to_string();
        StoreServe {
            child,
            url,
            metrics,
        }
    }

    /// `HOST:PORT` it listens on.
    pub(crate) fn addr(&self) -> &str {
        self.url.strip_prefix("kvferry://").unwrap_or(&self.url)
    }

    /// Its counter or gauge `name` now (0 when unreadable).
    pub(crate) fn metric(&self, name: &str) -> u64 {
        metric(&self.metrics, name)
    }

    /// SIGKILLs it.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for StoreServe {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A counter of the `/metrics` page at `addr`, 0 when it cannot be read.
pub(crate) fn metric(addr: &str, name: &str) -> u64 {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return 0;
    };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n");
    let mut page = String::new();
    let _ = std::io::Read::read_to_string(&mut s, &mut page);
    (page.lines())
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0)
}

/// `redis-cli -p PORT COMMAND`'s answer, trimmed (empty when it failed).
pub(crate) fn redis_cli(port: &str, command: &str) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", port, command])
        .output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// A `redis-server` on a port below the ephemeral range.
pub(crate) struct Redis {
    pub(crate) child: Child,
    pub(crate) port: String,
}

impl Redis {
    /// Starts one with `extra` options and waits for its PING.
    pub(crate) fn start(extra: &[&str]) -> Redis {
        let port = kvferry_testkit::server_port().to_string();
        let child = Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (scripts/test.sh installs it)");
        let redis = Redis { child, port };
        let give_up = Instant::now() + Duration::from_secs(20);
        while redis.cli("ping") != "PONG" {
            assert!(Instant::now() < give_up, "redis-server answered no PING");
            // Between attempts to reach a server still starting.
            std::thread::sleep(Duration::from_millis(10));
        }
        redis
    }

    /// `redis-cli COMMAND`'s answer, trimmed (empty when it failed).
    pub(crate) fn cli(&self, command: &str) -> String {
        redis_cli(&self.port, command)
    }

    /// `redis://127.0.0.1:PORT`.
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// SIGKILLs it.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}
