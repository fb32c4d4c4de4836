//! The liveness table against a model: a peer is reported dead exactly
//! when it went silent past the bound (or dropped), once per death, never
//! while it is being heard from, and anything heard revives it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvferry_machines::{DeathCause, Liveness};
use proptest::prelude::*;

const SILENCE: Duration = Duration::from_millis(300);

#[derive(Clone, Debug)]
enum Op {
    Add(u32),
    Heard(u32),
    Dropped(u32),
    Tick(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u32..4).prop_map(Op::Add),
        (0u32..4).prop_map(Op::Heard),
        (0u32..4).prop_map(Op::Dropped),
        (0u64..200).prop_map(Op::Tick),
    ]
}

/// The model: per peer, when last heard (or added) and whether dead.
#[derive(Default)]
struct Model {
    peers: BTreeMap<u32, (Instant, bool)>,
    deaths: u64,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn deaths_match_the_model(ops in prop::collection::vec(op(), 1..200)) {
        let t0 = Instant::now();
        let mut now = t0;
        let mut table = Liveness::new(SILENCE);
        let mut model = Model::default();
        let mut reported = 0u64;
        for op in ops {
            match op {
                Op::Add(p) => {
                    table.handle_added(now, p);
                    model.peers.insert(p, (now, false));
                }
                Op::Heard(p) => {
                    let revived = table.handle_heard(now, p);
                    let was_dead = model.peers.get(&p).is_some_and(|e| e.1);
                    prop_assert_eq!(revived, was_dead);
                    if let Some(e) = model.peers.get_mut(&p) {
                        *e = (now, false);
                    }
                }
                Op::Dropped(p) => {
                    table.handle_dropped(p);
                    if let Some(e) = model.peers.get_mut(&p) {
                        if !e.1 {
                            e.1 = true;
                            model.deaths += 1;
                        }
                    }
                }
                Op::Tick(ms) => {
                    now += Duration::from_millis(ms);
                    table.handle_tick(now);
                    for e in model.peers.values_mut() {
                        if !e.1 && now.duration_since(e.0) > SILENCE {
                            e.1 = true;
                            model.deaths += 1;
                        }
                    }
                }
            }
            while let Some((peer, cause)) = table.poll_dead() {
                reported += 1;
                prop_assert!(table.is_dead(peer), "reported {peer} is dead");
                if let DeathCause::Silent { quiet } = cause {
                    prop_assert!(quiet > SILENCE, "{peer} died after only {quiet:?}");
                }
            }
            prop_assert_eq!(reported, model.deaths, "each death reported once");
            for (p, &(_, dead)) in &model.peers {
                prop_assert_eq!(table.is_dead(*p), dead, "peer {}", p);
            }
            let dead = model.peers.values().filter(|e| e.1).count();
            prop_assert_eq!(table.dead_count(), dead);
        }
    }
}

#[test]
fn a_peer_heard_every_interval_never_dies() {
    let t0 = Instant::now();
    let mut table = Liveness::new(SILENCE);
    table.handle_added(t0, 1);
    for i in 1..1000u64 {
        let now = t0 + SILENCE * (i as u32) / 2;
        table.handle_heard(now, 1);
        table.handle_tick(now);
        assert_eq!(table.poll_dead(), None);
    }
    // Silent one bound plus a tick: dead, once.
    let last = t0 + SILENCE * 999 / 2;
    table.handle_tick(last + SILENCE + Duration::from_millis(1));
    assert!(matches!(
        table.poll_dead(),
        Some((1, DeathCause::Silent { .. }))
    ));
    table.handle_tick(last + SILENCE * 5);
    assert_eq!(table.poll_dead(), None);
}
