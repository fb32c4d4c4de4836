//! Resolving the prefill ranks of decode requests: the bootstrap service
//! lookup, the directory it fills, and the requests waiting for it.

use std::ops::ControlFlow;

use super::*;

impl Bridge {
    pub(super) fn retry_pending(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        for p in pending {
            if !self.try_resolve(&p) {
                self.pending.push(p);
            }
        }
    }

    /// Starts a directory query for `target`; false if the directory is
    /// full of targets being queried (the caller fails its request).
    pub(super) fn start_query(&mut self, target: &PrefillTarget) -> bool {
        let PrefillTarget::Bootstrap {
            addr,
            engine_id,
            dp_rank,
        } = target
        else {
            return true;
        };
        if !self.room_for_query(target) {
            return false;
        }
        self.directory.insert(target.clone(), Dir::Querying);
        let spawned = self.spawn_query(target.clone(), addr.clone(), engine_id.clone(), *dp_rank);
        if spawned.is_err() {
            self.directory
                .insert(target.clone(), Dir::Failed(Instant::now()));
        }
        true
    }

    /// Whether the directory has room for `target`. When it is full, a
    /// cached answer is forgotten (it is only a cache) rather than
    /// `target` refused; a target being queried stays, so false when
    /// every one is.
    fn room_for_query(&mut self, target: &PrefillTarget) -> bool {
        if self.directory.contains_key(target)
            || self.directory.len() < self.shared.config.max_bootstrap_targets
        {
            return true;
        }
        let idle = self
            .directory
            .iter()
            .find(|(_, d)| !matches!(d, Dir::Querying))
            .map(|(k, _)| k.clone());
        match idle {
            Some(k) => {
                self.directory.remove(&k);
                self.routes_changed(None);
                true
            }
            None => {
                let limit = self.shared.config.max_bootstrap_targets;
                let what = format_args!("bootstrap target {target:?} not queried");
                self.shared
                    .limit_reached("max_bootstrap_targets", limit, what);
                false
            }
        }
    }

    /// Asks the bootstrap service at `addr` for the ranks of `engine_id`
    /// at `dp_rank`; the answer comes back as `BridgeCmd::Directory` for
    /// `key`. HTTP would block the sockets: one short-lived thread per
    /// query, and at most one query per target at a time.
    fn spawn_query(
        &self,
        key: PrefillTarget,
        addr: String,
        engine_id: String,
        dp_rank: Option<u32>,
    ) -> std::io::Result<JoinHandle<()>> {
        let tx = self.shared.bridge_tx.clone();
        let waker = self.shared.waker.clone();
        let resolver = self.resolver.clone();
        let cluster_key = self.shared.key.clone();
        std::thread::Builder::new()
            .name("kvferry-bootstrap-query".into())
            .spawn(move || {
                let client = BootstrapClient::new(&addr).map(|c| {
                    c.with_io_timeout(Duration::from_secs(2))
                        .with_resolver(resolver)
                        .with_key(cluster_key)
                });
                let result = client
                    .map_err(LookupError::from)
                    .and_then(|c| query_bootstrap(&c, &engine_id, dp_rank));
                let _ = tx.send_timeout(
                    BridgeCmd::Directory {
                        target: key,
                        result,
                    },
                    Duration::from_secs(5),
                );
                waker.wake();
            })
    }

    /// Tries to hand the P ranks to the machine of `p`; false: wait.
    pub(super) fn try_resolve(&mut self, p: &Pending) -> bool {
        let Some(local) = self.shared.local.get().cloned() else {
            return false;
        };
        // A request that ended (aborted, expired) before its `Pull` left
        // still has prefill ranks waiting for it: resolve them anyway, and
        // tell them (bounded by `give_up`).
        let ended = p.aborted
            || self
                .handle
                .poll(p.tid)
                .is_none_or(|phase| phase.is_terminal());
        if ended && Instant::now() >= p.give_up {
            return true;
        }
        let engine = match self.prefill_ranks(p) {
            ControlFlow::Continue(ranks) => ranks,
            ControlFlow::Break(done) => return done,
        };
        let pair = TpPair::new(&local.model, engine.tp, local.layout.tp_size);
        let stages = stages_read(local.layout.stage, engine.pp);
        let (pair, stages) = match (pair, stages) {
            (Ok(pair), Some(stages)) if engine.addrs.len() == (engine.tp * engine.pp) as usize => {
                (pair, stages)
            }
            _ => {
                tracing::warn!(tid = ?p.tid, ?engine, "prefill TP or PP does not fit; aborting");
                let _ = self.abort_engine(p.tid);
                return true;
            }
        };
        let Some(ranks) = self.rank_peers(&pair, local.layout.tp_rank, &engine, stages) else {
            let _ = self.abort_engine(p.tid);
            return true;
        };
        if ranks.stale {
            return self.refresh_stale(p);
        }
        if ranks.waiting && ranks.dead.is_empty() && ranks.refused.is_empty() {
            return false;
        }
        if ended {
            self.abort_unpulled(p.tid, &ranks);
            return true;
        }
        self.remember_route(p, &ranks);
        self.hand_resolved(p.tid, ranks);
        true
    }

    /// The directory's ranks of `p`'s target disagree with what the ranks
    /// say of their stages: query again and wait (bootstrap), or fail the
    /// request (a direct target is wrong as given). What `try_resolve`
    /// answers.
    fn refresh_stale(&mut self, p: &Pending) -> bool {
        match &p.target {
            PrefillTarget::Bootstrap { .. } => {
                tracing::debug!(tid = ?p.tid, "prefill stages changed; asking again");
                self.directory.remove(&p.target);
                self.routes_changed(None);
                let t = p.target.clone();
                if !self.start_query(&t) {
                    let _ = self.abort_engine(p.tid);
                    return true;
                }
                false
            }
            PrefillTarget::Direct { .. } => {
                tracing::warn!(tid = ?p.tid, "prefill ranks' stages do not match the target; aborting");
                let _ = self.abort_engine(p.tid);
                true
            }
        }
    }

    /// The ranks of `p`'s prefill engine, or what `try_resolve` answers
    /// while the directory does not know them yet.
    fn prefill_ranks(&mut self, p: &Pending) -> ControlFlow<bool, EngineRanks> {
        match &p.target {
            PrefillTarget::Direct {
                tp_size,
                pp_size,
                side_channels,
            } => ControlFlow::Continue(EngineRanks {
                tp: *tp_size,
                pp: *pp_size,
                addrs: side_channels.clone(),
            }),
            PrefillTarget::Bootstrap { .. } => match self.directory.get(&p.target) {
                Some(Dir::Known(ranks)) => ControlFlow::Continue(ranks.clone()),
                Some(Dir::Querying) => ControlFlow::Break(false),
                Some(Dir::Refused(at)) => {
                    if at.elapsed() >= self.tick {
                        let t = p.target.clone();
                        self.start_query(&t);
                        return ControlFlow::Break(false);
                    }
                    let _ = self.abort_engine(p.tid);
                    ControlFlow::Break(true)
                }
                Some(Dir::Failed(at)) => {
                    if at.elapsed() >= self.tick {
                        let t = p.target.clone();
                        self.start_query(&t);
                    }
                    ControlFlow::Break(false)
                }
                None => {
                    let t = p.target.clone();
                    if !self.start_query(&t) {
                        let _ = self.abort_engine(p.tid);
                        return ControlFlow::Break(true);
                    }
                    ControlFlow::Break(false)
                }
            },
        }
    }

    /// The prefill ranks `my_rank` reads from in `stages` of `engine`,
    /// each with the dealer that reaches it and its state; `None` if a
    /// side channel has no dealer.
    fn rank_peers(
        &mut self,
        pair: &TpPair,
        my_rank: u32,
        engine: &EngineRanks,
        stages: std::ops::Range<u32>,
    ) -> Option<RankPeers> {
        let mut ranks = RankPeers {
            peers: Vec::new(),
            unneeded: Vec::new(),
            dead: Vec::new(),
            refused: Vec::new(),
            unsupported: Vec::new(),
            waiting: false,
            stale: false,
        };
        for stage in stages {
            let addrs = &engine.addrs[(stage * engine.tp) as usize..][..engine.tp as usize];
            let place = (stage, engine.pp);
            self.stage_peers(pair, my_rank, addrs, place, &mut ranks)?;
        }
        Some(ranks)
    }

    /// Adds the ranks of one prefill stage (`addrs`, by TP rank; `place`:
    /// the stage and the engine's PP size as the directory shows them) to
    /// `ranks`.
    fn stage_peers(
        &mut self,
        pair: &TpPair,
        my_rank: u32,
        addrs: &[String],
        (stage, pp): (u32, u32),
        ranks: &mut RankPeers,
    ) -> Option<()> {
        for rank in pair.unpaired_told_by(my_rank) {
            let Some(addr) = addrs.get(rank as usize) else {
                continue;
            };
            let peer = self.dealer_for(addr)?;
            let slot = &self.slots[peer as usize];
            // A dead or refusing rank holds nothing of ours to release.
            if self.liveness.is_dead(peer) || slot.refused.is_some() {
                continue;
            }
            ranks.waiting |= !slot.ready;
            ranks.unneeded.push(PeerId(peer));
        }
        for (rank, _) in pair.sources_of(my_rank) {
            let Some(addr) = addrs.get(rank as usize) else {
                continue;
            };
            let peer = self.dealer_for(addr)?;
            let slot = &self.slots[peer as usize];
            if self.liveness.is_dead(peer) {
                ranks.dead.push(peer);
            } else if slot.refused.is_some() {
                ranks.refused.push(peer);
            } else if !slot.ready {
                ranks.waiting = true;
            } else if let Some(d) = self.shared.peer(peer) {
                // The rank's own word on its stage: a directory that lists
                // fewer stages than the engine has (stages still
                // registering) must not let decode read only some layers.
                let s = d.hello.layout.stage;
                ranks.stale |= s.pp_size != pp || s.pp_rank != stage;
                if d.pair.as_ref().is_err_and(|e| e.is_unsupported()) {
                    ranks.unsupported.push(peer);
                }
            }
            let receivers = pair.targets_of(rank).count() as u16;
            let lease_ticket = self.shared.routes().fresh_ticket(peer, &self.shared.config);
            ranks.peers.push(ResolvedPeer {
                peer: PeerId(peer),
                receivers_expected: receivers,
                lease_ticket,
            });
        }
        Some(())
    }

    /// Caches the route of a target whose ranks are all fine, or forgets
    /// the directory's answer for one that has a dead or refused rank.
    fn remember_route(&mut self, p: &Pending, ranks: &RankPeers) {
        if !ranks.unsupported.is_empty() {
            // No cached route: a request resolved on the engine's thread
            // would not be told why its transfer cannot be planned.
            return;
        }
        if ranks.dead.is_empty() && ranks.refused.is_empty() {
            // Every rank connected and alive: later requests for this
            // target resolve on the engine's thread until something changes.
            let told = ranks.unneeded.iter().map(|p| (p.0, 0));
            let route = (ranks.peers.iter())
                .map(|rp| (rp.peer.0, rp.receivers_expected))
                .chain(told)
                .collect();
            let max = self.shared.config.max_bootstrap_targets;
            self.shared.routes().insert(p.target.clone(), route, max);
        } else {
            // The directory may be stale (a replacement registers at another
            // address): the next request asks the bootstrap service again.
            if let PrefillTarget::Bootstrap { .. } = &p.target {
                self.directory.remove(&p.target);
                self.routes_changed(None);
            }
        }
    }

    /// Tells the prefill ranks of a request that ended before its `Pull`
    /// left (the ones it would have pulled from and the unpaired ones it
    /// would have told) that it is gone, so they release at once instead
    /// of at their bootstrap timeout, as vLLM's empty "abort" pull does.
    fn abort_unpulled(&mut self, tid: TransferId, ranks: &RankPeers) {
        let live = ranks
            .peers
            .iter()
            .map(|rp| rp.peer)
            .chain(ranks.unneeded.iter().copied());
        let peers: Vec<u32> = live
            .map(|p| p.0)
            .filter(|p| !ranks.dead.contains(p) && !ranks.refused.contains(p))
            .collect();
        tracing::debug!(
            ?tid,
            ?peers,
            "telling prefill ranks of a request that ended before its pull"
        );
        for peer in peers {
            let frame = Frame::Transfer {
                transfer_id: tid,
                msg: Msg::Abort,
            };
            self.send_frame(peer, &frame);
        }
    }

    /// Records `tid` with each of its peers and hands them to its machine,
    /// then tells it which of them are dead or refused us.
    fn hand_resolved(&mut self, tid: TransferId, ranks: RankPeers) {
        for rp in &ranks.peers {
            self.slots[rp.peer.0 as usize].transfers.insert(tid);
        }
        let h = &self.handle;
        let to_recv = duplex::Event::Recv;
        {
            let resolved = recv::Event::PeersResolved {
                peers: ranks.peers,
                unneeded: ranks.unneeded,
            };
            let _ = h.send_event(tid, to_recv(resolved));
            for d in ranks.dead {
                let dead = recv::Event::PeerDead { peer: PeerId(d) };
                let _ = h.send_event(tid, to_recv(dead));
            }
            // A peer of another protocol version cannot pair with us: the
            // same failure as layouts that do not fit.
            for r in ranks.refused {
                let unfit = recv::Event::PlanFailed { peer: PeerId(r) };
                let _ = h.send_event(tid, to_recv(unfit));
            }
            // The `Pull` went out, so the prefill rank refuses the transfer
            // too (`NotPaired`), for the same reason.
            for u in ranks.unsupported {
                let unsupported = recv::Event::Unsupported { peer: PeerId(u) };
                let _ = h.send_event(tid, to_recv(unsupported));
            }
        }
    }
}

/// The prefill ranks a decode request reads from, as they stand now.
struct RankPeers {
    peers: Vec<ResolvedPeer>,
    /// Unpaired prefill ranks this rank tells that nobody reads from them.
    unneeded: Vec<PeerId>,
    /// Ranks whose peer is dead.
    dead: Vec<u32>,
    /// Ranks whose peer refused our hello.
    refused: Vec<u32>,
    /// Ranks whose layouts pair with ours only by a rule kvferry does not
    /// implement (`PlanError::Unsupported`).
    unsupported: Vec<u32>,
    /// Some rank is connected but has not said hello yet.
    waiting: bool,
    /// Some rank's hello names another stage or PP size than the
    /// directory: ask the bootstrap service again.
    stale: bool,
}

/// The prefill stages a decode rank at `stage` reads from, of an engine
/// with `prefill_pp` stages: all of them without pipeline parallelism on
/// decode, its own with the same PP size; `None` for other sizes.
fn stages_read(stage: kvferry_machines::Stage, prefill_pp: u32) -> Option<std::ops::Range<u32>> {
    if stage.pp_size == 1 {
        Some(0..prefill_pp)
    } else if stage.pp_size == prefill_pp {
        Some(stage.pp_rank..stage.pp_rank + 1)
    } else {
        None
    }
}

/// Asks the bootstrap service for the side channels of `engine_id`'s ranks
/// at data-parallel rank `dp_rank` (`None`: its one rank), every TP rank
/// of every stage.
pub(super) fn query_bootstrap(
    client: &BootstrapClient,
    engine_id: &str,
    dp_rank: Option<u32>,
) -> Result<EngineRanks, LookupError> {
    let found = client.query(Some(engine_id))?;
    let entry = engine_at(&found, dp_rank).ok_or(LookupError::NotRegistered(dp_rank))?;
    let (tp, pp) = (entry.tp_size() as u32, entry.pp_size() as u32);
    let mut addrs = Vec::with_capacity((tp * pp) as usize);
    for stage in 0..pp {
        for rank in 0..tp {
            let a = (entry.addr(rank, stage)).ok_or(LookupError::RankMissing { rank, stage })?;
            addrs.push(a.to_string());
        }
    }
    Ok(EngineRanks { tp, pp, addrs })
}

/// The entry of an engine's ranks at `dp_rank`, or with no rank given its
/// one entry: vLLM gives each data-parallel engine an engine id of its own
/// (`<id>_dp<rank>`), and routers that name that id send no rank, so the
/// id alone finds it, as vLLM's MooncakeConnector finds it. A rank given
/// is the rank asked for, never another.
fn engine_at(found: &QueryResponse, dp_rank: Option<u32>) -> Option<&EngineEntry> {
    match dp_rank {
        Some(rank) => found.get(&rank),
        None if found.len() == 1 => found.values().next(),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str) -> EngineEntry {
        EngineEntry {
            engine_id: id.into(),
            worker_addr: [(0, [(0, format!("tcp://{id}"))].into())].into(),
        }
    }

    #[test]
    fn an_engine_id_alone_finds_its_only_dp_rank() {
        let found: QueryResponse = [(1, entry("p_dp1"))].into();
        assert_eq!(engine_at(&found, None).unwrap().engine_id, "p_dp1");
        assert_eq!(engine_at(&found, Some(1)).unwrap().engine_id, "p_dp1");
        assert_eq!(
            engine_at(&found, Some(0)),
            None,
            "a rank given is that rank"
        );
    }

    #[test]
    fn an_engine_id_at_several_dp_ranks_needs_the_rank() {
        let found: QueryResponse = [(0, entry("p")), (1, entry("p"))].into();
        assert_eq!(engine_at(&found, Some(1)), Some(&found[&1]));
        assert_eq!(engine_at(&found, None), None);
        assert_eq!(engine_at(&found, Some(2)), None);
        assert_eq!(engine_at(&QueryResponse::new(), None), None);
    }
}
