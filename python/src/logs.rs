//! kvferry's `tracing` events for Python's `logging`.
//!
//! Events are formatted where they happen (any thread: executors, bridge,
//! engine threads) and queued, bounded; a Python thread takes them with
//! `_next_logs` (the GIL released while it waits) and hands them to the
//! `kvferry` logger. No Rust thread ever waits for the GIL, so logging can
//! never deadlock against a Python thread waiting on the node.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::{EnvFilter, Layer};

/// Most events waiting for Python; past it new ones are dropped (counted).
const MAX_QUEUED: usize = 4096;
/// Most events handed over per `_next_logs` call.
const MAX_BATCH: usize = 256;

/// `(Python logging level, target, message)`.
type Record = (u32, String, String);

struct Queue {
    tx: flume::Sender<Record>,
    rx: flume::Receiver<Record>,
    dropped: AtomicU64,
}

static QUEUE: OnceLock<Queue> = OnceLock::new();

fn queue() -> &'static Queue {
    QUEUE.get_or_init(|| {
        let (tx, rx) = flume::bounded(MAX_QUEUED);
        Queue {
            tx,
            rx,
            dropped: AtomicU64::new(0),
        }
    })
}

/// Python's level numbers.
fn level(l: &tracing::Level) -> u32 {
    match *l {
        tracing::Level::ERROR => 40,
        tracing::Level::WARN => 30,
        tracing::Level::INFO => 20,
        tracing::Level::DEBUG | tracing::Level::TRACE => 10,
    }
}

/// The message, then `key=value` for every other field.
#[derive(Default)]
struct Text(String, String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.1, " {}={value:?}", field.name());
        }
    }
}

struct ToPython;

impl<S: tracing::Subscriber> Layer<S> for ToPython {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut text = Text::default();
        event.record(&mut text);
        let meta = event.metadata();
        let record = (
            level(meta.level()),
            meta.target().to_owned(),
            text.0 + &text.1,
        );
        let q = queue();
        if q.tx.try_send(record).is_err() {
            q.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Installs the forwarding subscriber, filtered by `KVFERRY_LOG` (tracing's
/// `EnvFilter` syntax; `warn` when unset). Does nothing if the process
/// already has a global subscriber.
pub(crate) fn install() {
    let filter = EnvFilter::try_from_env("KVFERRY_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let subscriber = tracing_subscriber::registry().with(ToPython.with_filter(filter));
    let _ = tracing::subscriber::set_global_default(subscriber);
}

/// Wakes a `_next_logs` that waits, with an empty record (level 0) it
/// skips: the Python thread that drains the queue stops at interpreter
/// exit, before the interpreter would end it inside a native call.
#[pyfunction]
pub(crate) fn _wake_logs() {
    let _ = queue().tx.try_send((0, String::new(), String::new()));
}

/// Up to `MAX_BATCH` queued events, waiting at most `timeout_s` for the
/// first (GIL released), and how many were dropped so far.
#[pyfunction]
pub(crate) fn _next_logs(py: Python<'_>, timeout_s: f64) -> PyResult<(Vec<Record>, u64)> {
    let wait = crate::args::seconds("timeout_s", timeout_s)?;
    let q = queue();
    let first = py.detach(|| q.rx.recv_timeout(wait.min(Duration::from_secs(1))));
    let mut out: Vec<Record> = first.into_iter().collect();
    out.extend(q.rx.try_iter().take(MAX_BATCH.saturating_sub(out.len())));
    Ok((out, q.dropped.load(Ordering::Relaxed)))
}
