//! A request machine of either direction, so one executor drives the
//! prefill (send) and the decode (receive) requests of one rank: what a
//! node with both roles (vLLM's `kv_role = "kv_both"`) runs, and what every
//! node runs, whatever its role.
//!
//! Each request keeps the direction it was created with. An event for the
//! other direction is bad input ([`InputError::Peer`]) and changes nothing:
//! a peer that names a transfer this rank receives as if it were one this
//! rank sends is refused, never handed to the wrong machine.

use std::time::Instant;

use crate::common::{AbortReason, InputError, Phase};
use crate::machine::Machine;
use crate::recv::{self, RecvMachine};
use crate::send::{self, SendMachine};

/// Which way a request moves KV, seen from this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// This rank is the request's prefill side: it sends.
    Send,
    /// This rank is the request's decode side: it receives.
    Recv,
}

/// A send or a receive machine.
#[derive(Debug)]
pub enum Duplex {
    /// The prefill side of a request.
    Send(SendMachine),
    /// The decode side of a request.
    Recv(RecvMachine),
}

/// An input for one direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// For a [`Duplex::Send`] machine.
    Send(send::Event),
    /// For a [`Duplex::Recv`] machine.
    Recv(recv::Event),
}

/// An output of one direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Of a [`Duplex::Send`] machine.
    Send(send::Action),
    /// Of a [`Duplex::Recv`] machine.
    Recv(recv::Action),
}

impl Duplex {
    /// The direction the request was created with.
    pub fn direction(&self) -> Direction {
        match self {
            Duplex::Send(_) => Direction::Send,
            Duplex::Recv(_) => Direction::Recv,
        }
    }
}

impl Event {
    /// The direction of the machine this event is for.
    pub fn direction(&self) -> Direction {
        match self {
            Event::Send(_) => Direction::Send,
            Event::Recv(_) => Direction::Recv,
        }
    }
}

impl Machine for Duplex {
    type Event = Event;
    type Action = Action;

    fn handle_event(&mut self, now: Instant, event: Event) -> Result<(), InputError> {
        match (self, event) {
            (Duplex::Send(m), Event::Send(e)) => m.handle_event(now, e),
            (Duplex::Recv(m), Event::Recv(e)) => m.handle_event(now, e),
            (Duplex::Send(_), Event::Recv(_)) | (Duplex::Recv(_), Event::Send(_)) => Err(
                InputError::Peer("message for the other direction of this transfer"),
            ),
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        match self {
            Duplex::Send(m) => m.handle_timeout(now),
            Duplex::Recv(m) => m.handle_timeout(now),
        }
    }

    fn abort(&mut self, now: Instant, reason: AbortReason) {
        match self {
            Duplex::Send(m) => m.abort(now, reason),
            Duplex::Recv(m) => m.abort(now, reason),
        }
    }

    fn poll_action(&mut self) -> Option<Action> {
        match self {
            Duplex::Send(m) => m.poll_action().map(Action::Send),
            Duplex::Recv(m) => m.poll_action().map(Action::Recv),
        }
    }

    fn poll_timeout(&self) -> Option<Instant> {
        match self {
            Duplex::Send(m) => m.poll_timeout(),
            Duplex::Recv(m) => m.poll_timeout(),
        }
    }

    fn phase(&self) -> Phase {
        match self {
            Duplex::Send(m) => m.phase(),
            Duplex::Recv(m) => m.phase(),
        }
    }
}
