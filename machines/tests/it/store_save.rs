//! `SaveMachine`: dedup, bounded batches, store pressure, timeouts and
//! aborts as transitions, typed misuse; proptests that dedup never stores a
//! key twice and that the blocks are released exactly once, never while a
//! put may still read them, under random store answers, timeouts and aborts.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use kvferry_machines::internal::common::BlockId;
use kvferry_machines::internal::store::save::{
    Action, Event, PutResult, SaveEnd, SaveKeyResult, SaveMachine, SaveReport,
};
use kvferry_machines::internal::store::{
    BlockHash, ChunkKey, GroupSpec, Pressure, StoreConfig, StoreFault, StoreItem,
};
use kvferry_machines::LayoutKind;
use kvferry_machines::{AbortReason, FailReason, InputError, Machine, Phase, TransferId};

use crate::store_common::keyspace;

const REQ: TransferId = TransferId(7);

fn cfg() -> StoreConfig {
    StoreConfig {
        max_keys_per_batch: 2,
        max_batches_in_flight: 2,
        op_bound: Duration::from_secs(10),
        request_timeout: Duration::from_secs(60),
        ..StoreConfig::default()
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// `n` items of one group, block `i` at position `i`, keys from hashes
/// `first..first + n` (so two requests can share a prefix).
fn items(first: u64, n: u32) -> Vec<StoreItem> {
    let group = GroupSpec {
        block_tokens: 16,
        window_tokens: None,
    };
    let ks = keyspace(LayoutKind::Hnd, 8, 1, 1, vec![group]);
    let scope = ks.scope(None, &[]).unwrap();
    let (shard, _) = ks.shard_of(0, 0).unwrap();
    (0..n)
        .map(|i| StoreItem {
            key: ks
                .key(
                    &shard,
                    &scope,
                    0,
                    &BlockHash::from_u64(first + u64::from(i)),
                )
                .unwrap(),
            group: 0,
            index: i,
            block: BlockId(100 + i),
            hash: BlockHash::from_u64(first + u64::from(i)),
            value_bytes: 4096,
        })
        .collect()
}

fn drain(m: &mut SaveMachine) -> Vec<Action> {
    std::iter::from_fn(|| m.poll_action()).collect()
}

fn ev(m: &mut SaveMachine, now: Instant, e: Event) -> Vec<Action> {
    m.handle_event(now, e).expect("event accepted");
    drain(m)
}

fn puts(actions: &[Action]) -> Vec<(u32, Vec<u32>)> {
    (actions.iter())
        .filter_map(|a| match a {
            Action::Put { batch, items } => Some((*batch, items.iter().map(|i| i.index).collect())),
            _ => None,
        })
        .collect()
}

fn report(actions: &[Action]) -> Option<SaveReport> {
    actions.iter().find_map(|a| match a {
        Action::Release { report } => Some(report.clone()),
        _ => None,
    })
}

fn exists(n: usize, present: &[usize]) -> Event {
    Event::ExistsDone {
        answer: Ok((0..n).map(|i| present.contains(&i)).collect()),
    }
}

fn stored(n: usize) -> Result<Vec<PutResult>, StoreFault> {
    Ok(vec![PutResult::Stored; n])
}

#[test]
fn dedups_then_puts_the_missing_keys_in_bounded_batches() {
    let t0 = Instant::now();
    let mut p = Pressure::new(8);
    let mut m = SaveMachine::new(t0, &cfg(), REQ, items(0, 7), &mut p).unwrap();
    let a = drain(&mut m);
    assert!(matches!(&a[..], [Action::Exists { keys }] if keys.len() == 7));
    assert_eq!(m.phase(), Phase::WaitingForInput);
    // Keys 1 and 4 are stored already: 5 to put, 2 per batch, 2 in flight.
    let a = ev(&mut m, t0, exists(7, &[1, 4]));
    assert_eq!(puts(&a), vec![(0, vec![0, 2]), (1, vec![3, 5])]);
    assert_eq!(m.phase(), Phase::Transferring);
    let a = ev(
        &mut m,
        t0,
        Event::PutDone {
            batch: 1,
            answer: stored(2),
        },
    );
    assert_eq!(puts(&a), vec![(2, vec![6])]);
    let a = ev(
        &mut m,
        t0,
        Event::PutDone {
            batch: 0,
            answer: stored(2),
        },
    );
    assert!(a.is_empty());
    let a = ev(
        &mut m,
        t0,
        Event::PutDone {
            batch: 2,
            answer: Ok(vec![PutResult::Exists]),
        },
    );
    let r = report(&a).expect("released");
    assert_eq!((r.end, r.stored(), r.deduped()), (SaveEnd::Done, 4, 3));
    assert_eq!(m.phase(), Phase::Success);
    // Terminal: absorbs everything, releases nothing more.
    let a = ev(
        &mut m,
        t0 + secs(100),
        Event::PutDone {
            batch: 0,
            answer: stored(2),
        },
    );
    m.handle_timeout(t0 + secs(1000));
    m.abort(t0, AbortReason::Engine);
    assert!(a.is_empty() && drain(&mut m).is_empty());
    assert_eq!(m.poll_timeout(), None);
}

#[test]
fn nothing_to_save_releases_at_once() {
    let mut p = Pressure::new(8);
    let mut m = SaveMachine::new(Instant::now(), &cfg(), REQ, Vec::new(), &mut p).unwrap();
    let r = report(&drain(&mut m)).unwrap();
    assert_eq!(r.end, SaveEnd::Done);
    assert_eq!(m.phase(), Phase::Success);
}

#[test]
fn a_full_store_stops_the_save_and_skips_the_request_until_a_success() {
    let t0 = Instant::now();
    let mut p = Pressure::new(8);
    let mut m = SaveMachine::new(t0, &cfg(), REQ, items(0, 6), &mut p).unwrap();
    drain(&mut m);
    let a = ev(&mut m, t0, exists(6, &[]));
    assert_eq!(puts(&a).len(), 2);
    let full = Ok(vec![PutResult::Stored, PutResult::Full]);
    let a = ev(
        &mut m,
        t0,
        Event::PutDone {
            batch: 0,
            answer: full,
        },
    );
    // No more puts; batch 1 still reads the blocks.
    assert!(a.is_empty());
    assert_eq!(m.phase(), Phase::Transferring);
    let a = ev(
        &mut m,
        t0,
        Event::PutDone {
            batch: 1,
            answer: stored(2),
        },
    );
    let r = report(&a).unwrap();
    assert_eq!(r.end, SaveEnd::StoreFull);
    assert_eq!(r.results[1], SaveKeyResult::Full);
    assert_eq!(r.results[4..], [SaveKeyResult::NotAttempted; 2]);
    assert_eq!(m.phase(), Phase::Failed(FailReason::Transport));
    p.handle_report(REQ, &r);
    assert!(p.is_active());
    // The next save of that request is skipped; another request's is not.
    let mut skipped = SaveMachine::new(t0, &cfg(), REQ, items(6, 2), &mut p).unwrap();
    assert_eq!(report(&drain(&mut skipped)).unwrap().end, SaveEnd::Skipped);
    assert!(skipped.phase().is_terminal());
    let mut other = SaveMachine::new(t0, &cfg(), TransferId(8), items(20, 1), &mut p).unwrap();
    drain(&mut other);
    ev(&mut other, t0, exists(1, &[]));
    let r = report(&ev(
        &mut other,
        t0,
        Event::PutDone {
            batch: 0,
            answer: stored(1),
        },
    ))
    .unwrap();
    p.handle_report(TransferId(8), &r);
    assert!(!p.is_active());
    let mut again = SaveMachine::new(t0, &cfg(), REQ, items(6, 2), &mut p).unwrap();
    assert!(matches!(&drain(&mut again)[..], [Action::Exists { .. }]));
    let s = p.stats();
    assert_eq!((s.full_saves, s.skipped_saves, s.clears), (1, 1, 1));
}

#[test]
fn a_put_past_its_bound_fails_and_its_late_answer_is_absorbed() {
    let t0 = Instant::now();
    let mut p = Pressure::new(8);
    let mut m = SaveMachine::new(t0, &cfg(), REQ, items(0, 4), &mut p).unwrap();
    drain(&mut m);
    ev(&mut m, t0 + secs(1), exists(4, &[]));
    assert_eq!(m.poll_timeout(), Some(t0 + secs(11)));
    ev(
        &mut m,
        t0 + secs(2),
        Event::PutDone {
            batch: 0,
            answer: stored(2),
        },
    );
    m.handle_timeout(t0 + secs(10));
    assert!(drain(&mut m).is_empty(), "spurious timeout");
    m.handle_timeout(t0 + secs(11));
    let r = report(&drain(&mut m)).unwrap();
    assert_eq!(r.end, SaveEnd::Fault(StoreFault::Timeout));
    assert_eq!(
        r.results,
        [
            SaveKeyResult::Stored,
            SaveKeyResult::Stored,
            SaveKeyResult::Failed,
            SaveKeyResult::Failed
        ]
    );
    assert!(ev(
        &mut m,
        t0 + secs(12),
        Event::PutDone {
            batch: 1,
            answer: stored(2)
        }
    )
    .is_empty());
}

#[test]
fn an_abort_waits_for_the_puts_in_flight() {
    let t0 = Instant::now();
    let mut p = Pressure::new(8);
    // While the existence check is out no block is read: released at once.
    let mut m = SaveMachine::new(t0, &cfg(), REQ, items(0, 4), &mut p).unwrap();
    drain(&mut m);
    m.abort(t0, AbortReason::Engine);
    assert_eq!(
        report(&drain(&mut m)).unwrap().end,
        SaveEnd::Aborted(AbortReason::Engine)
    );
    assert_eq!(
        m.phase(),
        Phase::Failed(FailReason::Aborted(AbortReason::Engine))
    );
    // While puts are out it waits for them.
    let mut m = SaveMachine::new(t0, &cfg(), REQ, items(0, 6), &mut p).unwrap();
    drain(&mut m);
    ev(&mut m, t0, exists(6, &[]));
    m.abort(t0, AbortReason::Shutdown);
    assert!(drain(&mut m).is_empty());
    assert_eq!(m.phase(), Phase::Transferring);
    ev(
        &mut m,
        t0,
        Event::PutDone {
            batch: 0,
            answer: Err(StoreFault::Transport),
        },
    );
    assert!(!m.is_released());
    let r = report(&ev(
        &mut m,
        t0,
        Event::PutDone {
            batch: 1,
            answer: stored(2),
        },
    ))
    .unwrap();
    assert_eq!(r.end, SaveEnd::Aborted(AbortReason::Shutdown));
}

#[test]
fn the_request_deadline_expires_the_save() {
    let t0 = Instant::now();
    let mut p = Pressure::new(8);
    let mut m = SaveMachine::new(t0, &cfg(), REQ, items(0, 2), &mut p).unwrap();
    drain(&mut m);
    // An existence check unanswered past its bound fails the save.
    m.handle_timeout(t0 + secs(10));
    assert_eq!(
        report(&drain(&mut m)).unwrap().end,
        SaveEnd::Fault(StoreFault::Timeout)
    );
    let c = StoreConfig {
        request_timeout: secs(5),
        ..cfg()
    };
    let mut m = SaveMachine::new(t0, &c, REQ, items(0, 2), &mut p).unwrap();
    drain(&mut m);
    assert_eq!(m.poll_timeout(), Some(t0 + secs(5)));
    m.handle_timeout(t0 + secs(5));
    assert_eq!(report(&drain(&mut m)).unwrap().end, SaveEnd::Expired);
    assert_eq!(m.phase(), Phase::Expired);
}

#[test]
fn misuse_is_refused_and_changes_nothing() {
    let t0 = Instant::now();
    let mut p = Pressure::new(8);
    let mut dup = items(0, 2);
    dup[1].key = dup[0].key.clone();
    assert!(matches!(
        SaveMachine::new(t0, &cfg(), REQ, dup, &mut p),
        Err(InputError::Misuse(_))
    ));
    let c = StoreConfig {
        max_keys_per_request: 1,
        ..cfg()
    };
    assert!(SaveMachine::new(t0, &c, REQ, items(0, 2), &mut p).is_err());
    let mut m = SaveMachine::new(t0, &cfg(), REQ, items(0, 3), &mut p).unwrap();
    drain(&mut m);
    let put = Event::PutDone {
        batch: 0,
        answer: stored(2),
    };
    assert!(m.handle_event(t0, put).is_err());
    assert!(m.handle_event(t0, exists(2, &[])).is_err());
    ev(&mut m, t0, exists(3, &[]));
    assert!(m.handle_event(t0, exists(3, &[])).is_err());
    assert!(m
        .handle_event(
            t0,
            Event::PutDone {
                batch: 0,
                answer: stored(1)
            }
        )
        .is_err());
    assert!(m
        .handle_event(
            t0,
            Event::PutDone {
                batch: 5,
                answer: stored(1)
            }
        )
        .is_err());
    assert!(drain(&mut m).is_empty());
    ev(
        &mut m,
        t0,
        Event::PutDone {
            batch: 0,
            answer: stored(2),
        },
    );
    let r = report(&ev(
        &mut m,
        t0,
        Event::PutDone {
            batch: 1,
            answer: stored(1),
        },
    ))
    .unwrap();
    assert!(r.is_complete());
}

// ---- proptests ----

#[derive(Clone, Debug)]
enum Step {
    /// Answer the outstanding call at this index (mod their count).
    Answer(usize, Reply),
    Advance(u64),
    Abort,
}

#[derive(Clone, Copy, Debug)]
enum Reply {
    Honest,
    Full,
    Failed,
    Fault,
}

fn step() -> impl Strategy<Value = Step> {
    let reply = prop_oneof![
        6 => Just(Reply::Honest),
        1 => Just(Reply::Full),
        1 => Just(Reply::Failed),
        1 => Just(Reply::Fault),
    ];
    prop_oneof![
        8 => (any::<usize>(), reply).prop_map(|(i, r)| Step::Answer(i, r)),
        2 => (1u64..8).prop_map(Step::Advance),
        1 => Just(Step::Abort),
    ]
}

/// A call the harness saw posted and has not answered.
#[derive(Clone, Debug)]
enum Call {
    Exists(Vec<ChunkKey>),
    Put {
        batch: u32,
        keys: Vec<ChunkKey>,
        posted: Instant,
    },
}

/// Ground truth the harness keeps beside one machine.
struct Harness {
    m: SaveMachine,
    now: Instant,
    calls: Vec<Call>,
    /// The store: key -> how many times a value was put.
    store: BTreeMap<ChunkKey, u32>,
    /// Keys the existence check said were stored.
    existing: BTreeSet<ChunkKey>,
    put_keys: BTreeSet<ChunkKey>,
    released: u32,
    cfg: StoreConfig,
}

impl Harness {
    fn collect(&mut self) -> Result<(), TestCaseError> {
        while let Some(a) = self.m.poll_action() {
            prop_assert_eq!(self.released, 0, "an action after the release: {:?}", a);
            match a {
                Action::Exists { keys } => self.calls.push(Call::Exists(keys)),
                Action::Put { batch, items } => {
                    prop_assert!(items.len() <= self.cfg.max_keys_per_batch);
                    let keys: Vec<ChunkKey> = items.into_iter().map(|i| i.key).collect();
                    for k in &keys {
                        prop_assert!(!self.existing.contains(k), "put a key found stored: {}", k);
                        prop_assert!(self.put_keys.insert(k.clone()), "put {} twice", k);
                    }
                    self.calls.push(Call::Put {
                        batch,
                        keys,
                        posted: self.now,
                    });
                }
                Action::Release { .. } => {
                    self.released += 1;
                    // No put may still read the blocks.
                    for c in &self.calls {
                        if let Call::Put { posted, .. } = c {
                            prop_assert!(
                                self.now >= *posted + self.cfg.op_bound,
                                "released under a live put"
                            );
                        }
                    }
                }
            }
        }
        let in_flight = self
            .calls
            .iter()
            .filter(
                |c| matches!(c, Call::Put { posted, .. } if self.now < *posted + self.cfg.op_bound),
            )
            .count();
        prop_assert!(in_flight <= self.cfg.max_batches_in_flight);
        prop_assert_eq!(self.m.phase().is_terminal(), self.released == 1);
        if let Some(t) = self.m.poll_timeout() {
            prop_assert!(t > self.now, "deadline not in the future");
        }
        Ok(())
    }

    fn answer(&mut self, i: usize, reply: Reply) -> Result<(), TestCaseError> {
        if self.calls.is_empty() {
            return Ok(());
        }
        let call = self.calls.remove(i % self.calls.len());
        let event = match (call, reply) {
            (Call::Exists(_), Reply::Fault) => Event::ExistsDone {
                answer: Err(StoreFault::Transport),
            },
            (Call::Exists(keys), _) => {
                let answer: Vec<bool> = keys.iter().map(|k| self.store.contains_key(k)).collect();
                for (k, &e) in keys.iter().zip(&answer) {
                    if e {
                        self.existing.insert(k.clone());
                    }
                }
                Event::ExistsDone { answer: Ok(answer) }
            }
            (Call::Put { batch, .. }, Reply::Fault) => Event::PutDone {
                batch,
                answer: Err(StoreFault::Transport),
            },
            (Call::Put { batch, keys, .. }, reply) => {
                let answer = keys
                    .iter()
                    .enumerate()
                    .map(|(j, k)| match reply {
                        Reply::Full if j == 0 => PutResult::Full,
                        Reply::Failed if j == 0 => PutResult::Failed,
                        _ if self.store.contains_key(k) => PutResult::Exists,
                        _ => {
                            *self.store.entry(k.clone()).or_default() += 1;
                            PutResult::Stored
                        }
                    })
                    .collect();
                Event::PutDone {
                    batch,
                    answer: Ok(answer),
                }
            }
        };
        // Answers may come after the machine gave up on them: absorbed.
        self.m
            .handle_event(self.now, event)
            .map_err(|e| TestCaseError::fail(format!("refused: {e}")))?;
        self.collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random interleavings of answers, faults, time and aborts: exactly
    /// one release, never under a live put, no key put twice or put when
    /// found stored, and every machine ends once time runs out.
    #[test]
    fn releases_exactly_once_and_never_under_a_live_put(
        n in 0u32..9,
        stored_before in proptest::collection::vec(any::<bool>(), 9),
        steps in proptest::collection::vec(step(), 0..40),
    ) {
        let t0 = Instant::now();
        let its = items(0, n);
        let store: BTreeMap<ChunkKey, u32> = (its.iter().zip(&stored_before))
            .filter(|(_, s)| **s)
            .map(|(i, _)| (i.key.clone(), 0))
            .collect();
        let mut p = Pressure::new(4);
        let m = SaveMachine::new(t0, &cfg(), REQ, its, &mut p).unwrap();
        let mut h = Harness { m, now: t0, calls: Vec::new(), store, existing: BTreeSet::new(), put_keys: BTreeSet::new(), released: 0, cfg: cfg() };
        h.collect()?;
        for s in steps {
            match s {
                Step::Answer(i, r) => h.answer(i, r)?,
                Step::Advance(d) => {
                    h.now += secs(d);
                    h.m.handle_timeout(h.now);
                    h.collect()?;
                }
                Step::Abort => {
                    h.m.abort(h.now, AbortReason::Engine);
                    h.collect()?;
                }
            }
        }
        // Liveness: silence and time end every save.
        for _ in 0..3 {
            h.now += secs(61);
            h.m.handle_timeout(h.now);
            h.collect()?;
        }
        prop_assert_eq!(h.released, 1);
        prop_assert!(h.store.values().all(|&c| c <= 1), "a key stored twice");
    }

    /// Sequential saves of requests sharing prefixes against one store:
    /// each key is put once overall, and every key ends up stored.
    #[test]
    fn dedup_never_stores_a_key_twice(requests in proptest::collection::vec((0u64..6, 0u32..6), 1..6)) {
        let t0 = Instant::now();
        let mut store: HashMap<ChunkKey, u32> = HashMap::new();
        let mut p = Pressure::new(4);
        for (r, &(first, n)) in requests.iter().enumerate() {
            let mut m = SaveMachine::new(t0, &cfg(), TransferId(r as u64), items(first, n), &mut p).unwrap();
            let mut pending: Vec<Action> = drain(&mut m);
            let mut released = 0;
            while let Some(a) = pending.pop() {
                let e = match a {
                    Action::Exists { keys } => Event::ExistsDone { answer: Ok(keys.iter().map(|k| store.contains_key(k)).collect()) },
                    Action::Put { batch, items } => {
                        for it in &items {
                            *store.entry(it.key.clone()).or_default() += 1;
                        }
                        Event::PutDone { batch, answer: stored(items.len()) }
                    }
                    Action::Release { report } => {
                        prop_assert!(report.is_complete());
                        released += 1;
                        continue;
                    }
                };
                m.handle_event(t0, e).unwrap();
                pending.extend(drain(&mut m));
            }
            prop_assert_eq!(released, 1);
            for it in items(first, n) {
                prop_assert!(store.contains_key(&it.key));
            }
        }
        prop_assert!(store.values().all(|&c| c == 1), "{:?}", store);
    }
}
