//! `kvferry bench transport --baseline iperf3`: the kernel's loopback
//! ceiling, measured by iperf3 in the same run as kvferry, with the same
//! message size and the same pinning.
//!
//! iperf3 runs as two child processes on 127.0.0.1: a one-off server
//! (`-s -1`) and a client writing `-l` bytes per call for whole seconds.
//! When the bench pins (two cores or more, no `--no-pin`), the client gets
//! core 0 like the bench's initiator and the server core 1 like its target
//! (`-A`); otherwise both inherit the bench's own affinity, so `taskset -c
//! 0 kvferry bench ...` puts both on core 0.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use clap::ValueEnum;

use super::measure::{pins, Params};
use crate::usage::UsageError;

/// `--baseline`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum BaselineArg {
    /// iperf3 over loopback (must be on PATH); the ratio is of throughput.
    Iperf3,
    /// Two threads (pinned like the executors) busy-polling one blocking
    /// TCP socket, exchanging the bytes of one batch each way: the
    /// loopback round trip with nothing of kvferry; the ratio is of the
    /// batch latency p50 and p99.
    Pingpong,
}

/// The largest `-l` iperf3 takes for TCP.
pub(crate) const IPERF3_MAX_LEN: u64 = 1 << 20;

/// A baseline whose tool was found.
#[derive(Clone, Debug)]
pub(crate) struct Baseline {
    iperf3: PathBuf,
}

/// One baseline measurement.
#[derive(Clone, Debug)]
pub(crate) struct BaselineRun {
    /// Payload GB/s (10^9 bytes per second) the receiver saw.
    pub(crate) gbps: f64,
    /// The message size used, `--block-bytes` capped at [`IPERF3_MAX_LEN`].
    pub(crate) len: u64,
}

impl Baseline {
    /// Finds iperf3; a one-line usage error if it is missing.
    pub(crate) fn find_iperf3() -> Result<Baseline, UsageError> {
        find_on_path("iperf3")
            .map(|iperf3| Baseline { iperf3 })
            .ok_or_else(|| {
                UsageError(
                    "--baseline iperf3: iperf3 is not on PATH (install it, e.g. \
                     `apt-get install iperf3`)"
                        .into(),
                )
            })
    }

    /// Measures iperf3 with `p`'s message size, time and pinning.
    pub(crate) fn run(&self, p: &Params) -> Result<BaselineRun, String> {
        let len = p.block_bytes.min(IPERF3_MAX_LEN);
        let pinned = pins(p.pin);
        let port = free_port()?;
        let mut server = self.start_server(port, pinned)?;
        let client = self.run_client(port, len, p.seconds, pinned);
        if client.is_err() {
            // The one-off server would wait for a client forever.
            let _ = server.kill();
        }
        let _ = server.wait();
        Ok(BaselineRun { gbps: client?, len })
    }

    /// Starts `iperf3 -s -1` and returns once it listens.
    fn start_server(&self, port: u16, pinned: bool) -> Result<Child, String> {
        let mut cmd = Command::new(&self.iperf3);
        cmd.args(["-s", "-1", "--forceflush", "-p", &port.to_string()]);
        if pinned {
            cmd.args(["-A", "1"]);
        }
        let mut server = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting the iperf3 server: {e}"))?;
        let out = server.stdout.take().expect("stdout is piped");
        let mut lines = BufReader::new(out).lines();
        // The server prints this line once its socket listens.
        let listening = lines
            .by_ref()
            .map_while(Result::ok)
            .any(|l| l.contains("Server listening"));
        if !listening {
            let _ = server.kill();
            let _ = server.wait();
            return Err("the iperf3 server exited before listening".into());
        }
        // Drained so that the server never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Ok(server)
    }

    /// Runs the client for whole seconds (iperf3's `-t` is an integer) and
    /// returns the GB/s its receiver saw.
    fn run_client(&self, port: u16, len: u64, seconds: f64, pinned: bool) -> Result<f64, String> {
        let secs = seconds.ceil().max(1.0) as u64;
        let mut cmd = Command::new(&self.iperf3);
        cmd.args(["-c", "127.0.0.1", "-J", "-p", &port.to_string()]);
        cmd.args(["-l", &len.to_string(), "-t", &secs.to_string()]);
        if pinned {
            cmd.args(["-A", "0"]);
        }
        let out = cmd
            .stderr(Stdio::null())
            .output()
            .map_err(|e| format!("running the iperf3 client: {e}"))?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .map_err(|e| format!("iperf3 client output is not JSON: {e}"))?;
        if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
            return Err(format!("iperf3: {e}"));
        }
        v.pointer("/end/sum_received/bits_per_second")
            .and_then(serde_json::Value::as_f64)
            .map(|bps| bps / 8e9)
            .ok_or_else(|| "iperf3 client output has no end.sum_received".into())
    }
}

impl BaselineRun {
    /// The line the human-readable report prints.
    pub(crate) fn describe(&self, kvferry_gbps: f64) -> String {
        format!(
            "  iperf3         {:.3} GB/s ({} B writes, one stream, same pinning); \
             kvferry/iperf3 {:.3}",
            self.gbps,
            self.len,
            ratio(kvferry_gbps, self.gbps)
        )
    }
}

/// `a / b`, 0 when `b` is not positive.
pub(crate) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// A loopback port nobody listens on right now.
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("finding a free port for iperf3: {e}"))
}

/// The first executable file called `name` in a directory of `PATH`.
fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|f| is_executable(f))
}

fn is_executable(f: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    f.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
