//! Both sides of a lease: the toucher's (counts from when it asked) and
//! the granter's (counts from when it granted).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{after, Config, InputError, Msg};

/// Set in the `seq` of a `LeaseGrant` that answers a lease *ticket* rather
/// than a `LeaseRequest`. A ticket is a message the toucher's node sent to
/// the granter's node earlier (the node uses its heartbeat replies): the
/// granter names it when it grants, and the toucher counts the lease from
/// when it sent that message, which precedes the grant. This is the
/// `LeaseRequest` rule (count from when you asked) without the round trip,
/// so a push-mode P can write as soon as D's `Pull` arrives. The node's
/// driver turns such a grant into [`crate::send::Event::TicketGrant`].
pub const TICKET_BIT: u64 = 1 << 63;

/// Toucher side of one lease (one per peer whose blocks we touch).
#[derive(Clone, Debug)]
pub(crate) struct TouchLease {
    next_seq: u64,
    /// `(seq, asked_at)` of the latest requests, oldest first.
    asked: VecDeque<(u64, Instant)>,
    valid_until: Option<Instant>,
    renew_at: Option<Instant>,
}

impl TouchLease {
    pub(crate) fn new() -> Self {
        TouchLease {
            next_seq: 0,
            asked: VecDeque::new(),
            valid_until: None,
            renew_at: None,
        }
    }

    /// Records a request made at `now` (before it is sent) and returns its sequence number.
    pub(crate) fn request(&mut self, now: Instant, cfg: &Config) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        // A grant for a request older than the longest lease would already
        // be over when it arrives: nothing is lost by forgetting it.
        while self
            .asked
            .front()
            .is_some_and(|&(_, at)| after(at, cfg.lease) <= now)
        {
            self.asked.pop_front();
        }
        // Full: replace the newest request, not the oldest. When the round
        // trip is longer than several renewals, forgetting the oldest one
        // each time would forget every request just before its grant comes
        // back, and the lease would never go live. The oldest ones answer
        // first; the newest slot keeps one fresh request out in case the
        // old ones were lost.
        if self.asked.len() >= cfg.max_lease_requests.max(1) {
            self.asked.pop_back();
        }
        self.asked.push_back((seq, now));
        self.renew_at = Some(after(now, cfg.heartbeat_interval));
        seq
    }

    /// Plans the first request for when a lost ticket grant would be
    /// resent (`resend_after`; one heartbeat interval with resending off
    /// or longer): a ticket grant is expected first. An earlier plan stays.
    pub(crate) fn defer_request(&mut self, now: Instant, cfg: &Config) {
        let wait = match cfg.max_resends {
            0 => cfg.heartbeat_interval,
            _ => cfg.resend_after.min(cfg.heartbeat_interval),
        };
        if self.renew_at.is_none() && self.asked.is_empty() {
            self.renew_at = Some(after(now, wait));
        }
    }

    /// Checks a grant without applying it.
    pub(crate) fn check_grant(&self, seq: u64) -> Result<(), InputError> {
        if seq >= self.next_seq {
            return Err(InputError::Peer("lease grant for a request never made"));
        }
        Ok(())
    }

    /// Applies a grant that passed `check_grant`. A grant for a forgotten
    /// request is ignored: we no longer know when we asked.
    pub(crate) fn handle_grant(&mut self, seq: u64, duration_ms: u64, cfg: &Config) {
        let Some(&(_, asked_at)) = self.asked.iter().find(|(s, _)| *s == seq) else {
            return;
        };
        let granted = Duration::from_millis(duration_ms).min(cfg.lease);
        let end = after(asked_at, granted);
        self.valid_until = Some(self.valid_until.map_or(end, |u| u.max(end)));
        // A grant for an older request would end earlier than this one.
        self.asked.retain(|&(s, _)| s > seq);
    }

    /// Applies a grant that answers a ticket sent at `sent_at` (see
    /// [`TICKET_BIT`]).
    pub(crate) fn handle_ticket(&mut self, sent_at: Instant, duration_ms: u64, cfg: &Config) {
        let granted = Duration::from_millis(duration_ms).min(cfg.lease);
        let end = after(sent_at, granted);
        self.valid_until = Some(self.valid_until.map_or(end, |u| u.max(end)));
        // No request of ours was out, so nothing would renew this lease:
        // ask one heartbeat interval before it ends (an earlier plan stays),
        // which leaves the round trip time to come back in.
        let renew = end
            .checked_sub(cfg.heartbeat_interval)
            .unwrap_or(sent_at)
            .max(sent_at);
        self.renew_at = Some(self.renew_at.map_or(renew, |r| r.min(renew)));
    }

    pub(crate) fn is_live(&self, now: Instant) -> bool {
        self.valid_until.is_some_and(|u| now < u)
    }

    pub(crate) fn renew_at(&self) -> Option<Instant> {
        self.renew_at
    }

    /// End of the lease as the toucher counts it (for tests and debugging).
    pub(crate) fn valid_until(&self) -> Option<Instant> {
        self.valid_until
    }
}

/// Granter side of one lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GrantLease {
    /// End of the latest grant as the granter counts it; `None`: never granted.
    pub(crate) until: Option<Instant>,
}

impl GrantLease {
    pub(crate) fn new() -> Self {
        GrantLease { until: None }
    }

    /// Grants `d` from `now` and returns the message to send.
    pub(crate) fn grant(&mut self, now: Instant, seq: u64, d: Duration) -> Msg {
        let end = after(now, d);
        self.until = Some(self.until.map_or(end, |u| u.max(end)));
        Msg::LeaseGrant {
            seq,
            duration_ms: d.as_millis().min(u64::MAX as u128) as u64,
        }
    }
}

#[cfg(test)]
mod lease_tests {
    use super::*;

    /// Renewals every heartbeat interval, each grant arriving `rtt` after its
    /// request; returns whether the lease ever went live.
    fn goes_live(rtt_intervals: u32, max_lease_requests: usize) -> bool {
        let cfg = Config {
            heartbeat_interval: Duration::from_millis(100),
            lease: Duration::from_secs(10),
            max_lease_requests,
            ..Config::default()
        };
        let t0 = Instant::now();
        let rtt = cfg.heartbeat_interval * rtt_intervals;
        let mut lease = TouchLease::new();
        let mut in_flight: VecDeque<(Instant, u64)> = VecDeque::new();
        for step in 0..(4 * rtt_intervals + 8) {
            let now = t0 + cfg.heartbeat_interval * step;
            while in_flight
                .front()
                .is_some_and(|&(arrives, _)| arrives <= now)
            {
                let (_, seq) = in_flight.pop_front().expect("checked");
                lease.check_grant(seq).expect("a request we made");
                lease.handle_grant(seq, cfg.lease.as_millis() as u64, &cfg);
                if lease.is_live(now) {
                    return true;
                }
            }
            let seq = lease.request(now, &cfg);
            in_flight.push_back((now + rtt, seq));
        }
        false
    }

    #[test]
    fn lease_goes_live_when_the_round_trip_spans_many_renewals() {
        // A round trip of 10 renewal intervals with 4 remembered requests:
        // forgetting the oldest request each time starved this for good.
        for rtt in [1, 3, 4, 5, 10, 40] {
            assert!(goes_live(rtt, 4), "rtt of {rtt} intervals never went live");
        }
    }

    #[test]
    fn remembered_requests_stay_bounded_and_age_out() {
        let cfg = Config {
            max_lease_requests: 3,
            ..Config::default()
        };
        let t0 = Instant::now();
        let mut lease = TouchLease::new();
        for i in 0..50 {
            lease.request(t0 + Duration::from_millis(i), &cfg);
            assert!(lease.asked.len() <= 3);
        }
        // The oldest requests are kept: their grants come back first.
        assert_eq!(lease.asked.front().map(|a| a.0), Some(0));
        // Past the longest lease every old request is forgotten.
        lease.request(t0 + cfg.lease + Duration::from_secs(1), &cfg);
        assert_eq!(lease.asked.len(), 1);
        // A grant forgets the requests it supersedes.
        let seq = lease.request(t0 + cfg.lease + Duration::from_secs(2), &cfg);
        lease.handle_grant(seq, 1_000, &cfg);
        assert!(lease.asked.is_empty());
        assert!(lease.is_live(t0 + cfg.lease + Duration::from_secs(2)));
    }
}
