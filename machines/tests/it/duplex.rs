//! The machine of either direction: it is exactly the machine it wraps,
//! and refuses the other direction's events without changing.

use std::time::{Duration, Instant};

use kvferry_machines::internal::common::{BlockId, Config, Mode, Msg, PeerId, Phase, TransferId};
use kvferry_machines::internal::duplex::{self, Direction, Duplex};
use kvferry_machines::internal::{recv, send};
use kvferry_machines::{InputError, Machine, RecvMachine, SendMachine};

fn pair(now: Instant) -> (Duplex, Duplex) {
    let cfg = Config::default();
    let tid = TransferId(5);
    let tx = SendMachine::new(now, &cfg, tid, Mode::Push);
    let dst = vec![vec![BlockId(1), BlockId(2)]];
    let rx = RecvMachine::new(now, &cfg, tid, Mode::Push, dst, vec![0]).unwrap();
    (Duplex::Send(tx), Duplex::Recv(rx))
}

#[test]
fn an_event_for_the_other_direction_is_refused_and_changes_nothing() {
    let now = Instant::now();
    let (mut tx, mut rx) = pair(now);
    assert_eq!(
        (tx.direction(), rx.direction()),
        (Direction::Send, Direction::Recv)
    );
    let peer = PeerId(0);
    let to_recv = duplex::Event::Recv(recv::Event::Msg {
        peer,
        msg: Msg::Status { ok: true },
    });
    let to_send = duplex::Event::Send(send::Event::Msg {
        peer,
        msg: Msg::Done { ok: true },
    });
    for (m, wrong) in [(&mut tx, to_recv), (&mut rx, to_send)] {
        let (phase, deadline) = (m.phase(), m.poll_timeout());
        let e = m.handle_event(now, wrong).unwrap_err();
        assert!(matches!(e, InputError::Peer(_)), "{e}");
        assert_eq!((m.phase(), m.poll_timeout()), (phase, deadline));
        assert_eq!(m.poll_action(), None);
    }
}

#[test]
fn each_direction_runs_its_own_machine() {
    let now = Instant::now();
    let (mut tx, mut rx) = pair(now);
    let chunk = send::Event::ChunkReady {
        src_blocks: vec![vec![BlockId(7), BlockId(8)]],
        is_last: true,
    };
    tx.handle_event(now, duplex::Event::Send(chunk)).unwrap();
    assert!(matches!(
        tx.phase(),
        Phase::Bootstrapping | Phase::WaitingForInput
    ));
    // Aborts and timeouts reach the wrapped machines and end them.
    rx.abort(now, kvferry_machines::AbortReason::Engine);
    assert!(rx.phase().is_terminal(), "{:?}", rx.phase());
    let late = now + Duration::from_secs(3600);
    tx.handle_timeout(late);
    assert!(tx.phase().is_terminal(), "{:?}", tx.phase());
    let actions: Vec<_> = std::iter::from_fn(|| rx.poll_action()).collect();
    assert!(actions.iter().all(|a| matches!(a, duplex::Action::Recv(_))));
}
