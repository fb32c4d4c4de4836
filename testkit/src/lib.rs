//! What the `kvferry` CLI and the end-to-end tests share and the library
//! does not offer: a synthetic KV cache whose every byte is known
//! ([`synth::SynthKv`]), an in-process cluster of prefill and decode ranks
//! ([`synth::Cluster`]), the model shapes the tests share ([`model`]), the
//! timeouts of demo-style runs and log set-up.

#![warn(missing_docs)]

pub mod bench;
pub mod model;
pub mod synth;

use std::time::Duration;

use kvferry_machines::internal::common::Config;

/// Timeouts for demo-style runs: everything ends within `timeout_ms` plus
/// the fence.
pub fn demo_timeouts(timeout_ms: u64) -> Config {
    let t = Duration::from_millis(timeout_ms.max(10));
    Config {
        bootstrap_timeout: t,
        waiting_timeout: t,
        claim_timeout: t,
        hold_limit: t * 3,
        transfer_bound: t.min(Duration::from_secs(10)),
        fence_margin: Duration::from_millis(200).min(t),
        heartbeat_interval: (t / 4).min(Duration::from_secs(1)),
        lease: (t / 2)
            .min(Duration::from_secs(4))
            .max((t / 4).min(Duration::from_secs(1)) * 2),
        heartbeat_misses: 3,
        ..Config::default()
    }
}

/// The timeouts of the end-to-end tests on real nodes: a bootstrap timeout
/// longer than any wait of a test (a prefill rank that is never told it is
/// not needed fails the test instead of expiring within it), seconds for
/// the rest, a 100 ms heartbeat so dead peers show quickly.
pub fn e2e_timeouts() -> Config {
    Config {
        bootstrap_timeout: Duration::from_secs(30),
        waiting_timeout: Duration::from_secs(5),
        claim_timeout: Duration::from_secs(5),
        lease: Duration::from_millis(2000),
        hold_limit: Duration::from_secs(10),
        transfer_bound: Duration::from_secs(2),
        fence_margin: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_misses: 3,
        ..Config::default()
    }
}

/// Logs go to stderr; `RUST_LOG` selects the levels, as a default level
/// and `target=level` pairs (`warn`, `kvferry=debug,warn`); default: warn.
pub fn init_tracing() {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|s| s.parse::<Targets>().ok())
        .unwrap_or_else(|| Targets::new().with_default(LevelFilter::WARN));
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .finish()
        .with(filter)
        .try_init();
}

/// A free 127.0.0.1 port below the kernel's ephemeral range, for a server
/// a test kills and starts again on the same port.
///
/// A port from the ephemeral range (what binding port 0 gives) may be
/// handed to an outgoing connection while the server is down, and a client
/// reconnecting to it may get that very port as its own: TCP connects it
/// to itself, and it reads its own request back as the answer.
pub fn server_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768)
        .clamp(12_000, 65_536);
    let span = low - 10_000;
    // Test binaries run one after another and their tests as threads:
    // the process id spreads binaries, the counter spreads threads.
    let start = std::process::id().wrapping_mul(7919);
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 10_000 + start.wrapping_add(n.wrapping_mul(31)) % span;
        let Ok(port) = u16::try_from(port) else {
            continue;
        };
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free 127.0.0.1 port between 10000 and {low}");
}
