//! When a rank asks its peer again for an answer that may have been lost.
//!
//! Control messages can be lost (a connection reset between a send and its
//! delivery, a full queue). The rank that waits for an answer sends again
//! what asked for it; the peer absorbs duplicates and answers with its
//! current state. The schedule: the first resend `resend_after` after
//! arming, each later one twice as far, capped at `heartbeat_interval`;
//! at most `max_resends` while the peer stays silent. Hearing from the peer
//! starts the count again (it is alive, so the answer may still be lost),
//! progress from it starts the whole schedule again. The deadlines of the
//! request bound everything: resending never extends them.

use std::time::Instant;

use super::{after, Config};
use crate::Backoff;

/// The resend schedule towards one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Resend {
    /// When the next resend is due; `None` while disarmed.
    due: Option<Instant>,
    /// Resends so far since the schedule (re)started: the backoff exponent.
    step: u32,
    /// Resends since the peer was last heard.
    silent: u32,
    /// Armed at least once and not stopped: hearing the peer re-arms it.
    running: bool,
}

impl Resend {
    /// Disarmed; [`Resend::restart`] arms it.
    pub(crate) const fn idle() -> Resend {
        Resend {
            due: None,
            step: 0,
            silent: 0,
            running: false,
        }
    }

    /// Arms the schedule from its start (on the first send and on progress).
    pub(crate) fn restart(&mut self, now: Instant, cfg: &Config) {
        *self = Resend::idle();
        if cfg.max_resends > 0 {
            self.running = true;
            self.due = Some(after(now, schedule(cfg).delay(0)));
        }
    }

    /// The peer was heard: its silence count starts again, and a schedule
    /// that gave up on its silence resumes at the current backoff.
    pub(crate) fn heard(&mut self, now: Instant, cfg: &Config) {
        self.silent = 0;
        if self.running && self.due.is_none() {
            self.due = Some(after(now, schedule(cfg).delay(self.step)));
        }
    }

    /// No more resends (the peer answered for good, or the request ended).
    pub(crate) fn stop(&mut self) {
        *self = Resend::idle();
    }

    pub(crate) fn due(&self) -> Option<Instant> {
        self.due
    }

    /// True when a resend is due at `now`; then schedules the next one.
    pub(crate) fn fire(&mut self, now: Instant, cfg: &Config) -> bool {
        if self.due.is_none_or(|d| now < d) {
            return false;
        }
        self.step = self.step.saturating_add(1);
        self.silent += 1;
        self.due =
            (self.silent < cfg.max_resends).then(|| after(now, schedule(cfg).delay(self.step)));
        true
    }
}

/// The waits between resends (see the module docs): `resend_after`,
/// doubling, capped at the heartbeat interval. The cap is never below
/// `resend_after`, so a heartbeat interval shorter than it does not make
/// the first resend come sooner than configured.
fn schedule(cfg: &Config) -> Backoff {
    Backoff::doubling(
        cfg.resend_after,
        cfg.heartbeat_interval.max(cfg.resend_after),
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn cfg() -> Config {
        Config {
            resend_after: Duration::from_millis(10),
            heartbeat_interval: Duration::from_millis(50),
            max_resends: 3,
            ..Config::default()
        }
    }

    #[test]
    fn backs_off_to_the_heartbeat_and_gives_up_while_silent() {
        let cfg = cfg();
        let t0 = Instant::now();
        let mut r = Resend::idle();
        r.restart(t0, &cfg);
        let ms = |n| t0 + Duration::from_millis(n);
        assert!(!r.fire(ms(9), &cfg));
        assert!(r.fire(ms(10), &cfg));
        assert_eq!(r.due(), Some(ms(30)));
        assert!(r.fire(ms(30), &cfg));
        assert_eq!(r.due(), Some(ms(70)));
        assert!(r.fire(ms(70), &cfg));
        // Three resends without an answer: it gives up.
        assert_eq!(r.due(), None);
        // Hearing the peer resumes at the capped backoff.
        r.heard(ms(100), &cfg);
        assert_eq!(r.due(), Some(ms(150)));
        r.stop();
        r.heard(ms(200), &cfg);
        assert_eq!(r.due(), None);
    }

    #[test]
    fn off_when_max_resends_is_zero() {
        let cfg = Config {
            max_resends: 0,
            ..cfg()
        };
        let mut r = Resend::idle();
        r.restart(Instant::now(), &cfg);
        assert_eq!(r.due(), None);
    }
}
