//! Lookups off the scheduler's thread: [`LookupBoard`].

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvferry_machines::store::lookup::LookupHit;
use kvferry_machines::Backoff;
use kvferry_reactor::lock;

use super::{LookupClient, LookupFailure, LookupQuery, LookupServerError, PrefixLookup};

/// Why a [`LookupBoard`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum BoardError {
    /// The lookup server's endpoint is not one a client may use.
    #[error(transparent)]
    Connect(#[from] LookupServerError),
    /// The thread could not be spawned.
    #[error("the lookup thread could not start: {0}")]
    Thread(std::io::Error),
}

/// One answer, as the scheduler takes it.
pub type Answer = Result<LookupHit, String>;

/// The lookups out and the answers not yet taken, bounded by
/// `max_requests` together.
#[derive(Default)]
struct Board {
    /// Lookups out, and when each was posted.
    posted: HashMap<String, Instant>,
    done: HashMap<String, Answer>,
    /// Lookups are skipped (a miss) until then: the last one found the
    /// store or the lookup server down.
    down_until: Option<Instant>,
    late: u64,
    skipped_down: u64,
    failed: u64,
    /// Answers not awaited: another source held the whole prompt.
    given_up: u64,
}

/// A thread that asks the lookup server for the scheduler, and the board
/// where it leaves the answers: the scheduler asks without waiting on the
/// network for longer than it chooses.
pub struct LookupBoard {
    tx: flume::Sender<(String, LookupQuery)>,
    board: Arc<(Mutex<Board>, Condvar)>,
    max: usize,
}

impl LookupBoard {
    /// Connects to the lookup server at `endpoint` (each lookup bounded by
    /// `timeout`) and starts the thread; `down` paces the lookups skipped
    /// after one found the store or the server down; `max` bounds the
    /// lookups out and the answers not taken, together.
    pub fn start(
        endpoint: &str,
        timeout: Duration,
        down: Backoff,
        max: usize,
    ) -> Result<LookupBoard, BoardError> {
        let mut client = LookupClient::connect(endpoint, timeout)?;
        let (tx, rx) = flume::bounded::<(String, LookupQuery)>(max);
        let board: Arc<(Mutex<Board>, Condvar)> = Arc::default();
        let b = Arc::clone(&board);
        std::thread::Builder::new()
            .name("kvferry-store-lookups".into())
            .spawn(move || {
                // How long lookups are skipped after one found the store down.
                let mut down_for = down.start();
                // Ends when the scheduler's half is dropped (the sender).
                for (rid, q) in rx.iter() {
                    let answer = client.lookup(&q);
                    let (m, cv) = &*b;
                    let mut board = lock(m);
                    match &answer {
                        Ok(_) => down_for.reset(),
                        Err(e) => {
                            board.failed += 1;
                            if matches!(e, LookupFailure::Timeout(_) | LookupFailure::Transport(_))
                            {
                                board.down_until = Some(Instant::now() + down_for.next_delay());
                            }
                        }
                    }
                    if board.posted.remove(&rid).is_some() {
                        board.done.insert(rid, answer.map_err(|e| e.to_string()));
                    } else {
                        board.late += 1;
                    }
                    cv.notify_all();
                }
            })
            .map_err(BoardError::Thread)?;
        Ok(LookupBoard { tx, board, max })
    }

    /// The answer for `rid`, posting `query` if it was never asked and
    /// waiting for it at most `wait`; `None` while it is out.
    pub fn answer(&self, rid: &str, query: LookupQuery, wait: Duration) -> Option<Answer> {
        let (m, cv) = &*self.board;
        let mut board = lock(m);
        if let Some(a) = board.done.remove(rid) {
            return Some(a);
        }
        if !board.posted.contains_key(rid) {
            if board.down_until.is_some_and(|t| Instant::now() < t) {
                board.skipped_down += 1;
                return Some(Err("the store was down a moment ago".into()));
            }
            if board.posted.len() + board.done.len() >= self.max
                || self.tx.try_send((rid.to_owned(), query)).is_err()
            {
                return Some(Err(format!("{} lookups out already", self.max)));
            }
            board.posted.insert(rid.to_owned(), Instant::now());
        }
        let deadline = Instant::now() + wait;
        loop {
            if let Some(a) = board.done.remove(rid) {
                return Some(a);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            board = cv
                .wait_timeout(board, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Forgets `rid`'s answer or lookup (the request ended).
    pub fn forget(&self, rid: &str) {
        let mut board = lock(&self.board.0);
        board.done.remove(rid);
        board.posted.remove(rid);
    }

    /// Gives up on `rid`'s lookup once it has been out `after`: forgets
    /// it, counted (its answer, when it comes, is late). True if so.
    pub fn give_up(&self, rid: &str, after: Duration) -> bool {
        let mut board = lock(&self.board.0);
        if board.posted.get(rid).is_none_or(|at| at.elapsed() < after) {
            return false;
        }
        board.posted.remove(rid);
        board.given_up += 1;
        true
    }

    /// The board's counters, by name.
    pub fn stats(&self) -> [(&'static str, u64); 5] {
        let board = lock(&self.board.0);
        [
            ("lookups_out", board.posted.len() as u64),
            ("lookups_late", board.late),
            ("lookups_skipped_down", board.skipped_down),
            ("lookup_errors", board.failed),
            ("lookups_given_up", board.given_up),
        ]
    }
}
