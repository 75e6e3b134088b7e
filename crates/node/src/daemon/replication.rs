//! Election and replication: who leads, the master's numbered log, replicas that apply
//! it in order and catch up from a snapshot when they miss something.

use super::*;

impl Daemon {
    pub(super) fn elect(&mut self) {
        let mut alive: BTreeSet<NodeId> = self.alive.keys().cloned().collect();
        alive.insert(self.me.clone());
        let leading = self.leading.then_some(self.state.term);
        match decide(&self.me, leading, self.highest_term, &alive) {
            Decision::KeepLeading | Decision::Lead { .. } if self.take_heavier_state() => {}
            Decision::KeepLeading => {}
            Decision::Lead { term } => self.take_office(term),
            Decision::Follow(m) => {
                if self.leading {
                    tracing::info!(master = %m, "stepping down");
                }
                self.leading = false;
                self.adopting = None;
                if self.master.as_ref() != Some(&m) {
                    self.master = Some(m.clone());
                    let theirs = self.alive.get(&m).map(|s| s.hb.standing);
                    if theirs.is_some_and(|t| self.standing().outweighs(&t)) {
                        // A healed partition: this side's state is the one to keep; the
                        // master takes it from here and publishes it.
                        tracing::info!(master = %m, "following; it will take this side's state");
                        self.awaiting = Some((m, Instant::now()));
                    } else {
                        tracing::info!(master = %m, "following");
                        self.awaiting = None;
                        self.catch_up_from(&m);
                    }
                }
                // A master that never takes the state: take its own after all.
                if let Some((m, since)) = self.awaiting.clone()
                    && since.elapsed() > SETTLE
                {
                    self.awaiting = None;
                    self.catch_up_from(&m);
                }
            }
        }
    }

    /// As master (or about to be): when a live peer holds a state that outweighs this
    /// node's (the events a dead master's successor missed; the bigger side of a healed
    /// partition), fetch it first, then lead with it. True while that is under way.
    fn take_heavier_state(&mut self) -> bool {
        if self.catching_up {
            return true;
        }
        let mine = self.standing();
        let adopted = self.adopted;
        let peers = self
            .alive
            .iter()
            .filter(|(_, s)| Some(s.hb.standing) != adopted)
            .map(|(id, s)| (id, &s.hb.standing));
        let Some(peer) = heaviest(&mine, peers).cloned() else {
            return false;
        };
        let theirs = self.alive.get(&peer).map(|s| s.hb.standing);
        tracing::info!(%peer, ?theirs, ?mine, "taking the state of a peer that outweighs this one");
        // No events from here until it leads with that state.
        self.leading = false;
        self.adopting = theirs;
        self.catch_up_from(&peer);
        true
    }

    /// Leads with `term`, announcing the state this node holds.
    pub(super) fn take_office(&mut self, term: u64) {
        let peers: Vec<(&NodeId, Standing)> = self
            .alive
            .iter()
            .map(|(id, s)| (id, s.hb.standing))
            .collect();
        tracing::info!(term, standing = ?self.standing(), ?peers, "elected master");
        self.leading = true;
        self.adopting = None;
        self.awaiting = None;
        self.highest_term = term;
        self.master = Some(self.me.clone());
        self.state.term = term;
        let snap = Published::Snapshot {
            term,
            state: self.state.clone(),
        };
        self.publish(EVENTS_TOPIC, &snap);
        self.persist(None);
    }

    pub(super) fn catch_up_from(&mut self, peer: &NodeId) {
        if self.catching_up {
            return;
        }
        let Ok(p) = peer.parse::<PeerId>() else {
            return;
        };
        let id = self
            .swarm
            .behaviour_mut()
            .rpc
            .send_request(&p, Request::CatchUp);
        self.pending.insert(id, Pending::CatchUp);
        self.catching_up = true;
    }

    pub(super) fn emit(&mut self, event: Event) {
        // The term this master leads with, not the highest heard: a master that has
        // just heard of a later term must not write into it before it has decided.
        let e = Indexed {
            term: self.state.term,
            index: self.state.index + 1,
            event,
        };
        self.applied(&e);
        self.persist(Some(&e));
        self.publish(EVENTS_TOPIC, &Published::Event(e));
    }

    /// Applies one event to the state, keeping why instances go.
    fn applied(&mut self, e: &Indexed) {
        if let Event::InstanceRemoved { instance, reason } = &e.event {
            if self.removed.len() >= 256 {
                self.removed.clear();
            }
            self.removed.insert(instance.clone(), reason.clone());
        }
        self.state = apply(&self.state, e);
        let _ = self.events.send(public_event(e));
    }

    /// Tells `/events` listeners that the whole state was replaced.
    pub(super) fn announce_snapshot(&self) {
        let notice = serde_json::json!({
            "term": self.state.term, "index": self.state.index, "event": { "event": "snapshot" },
        });
        let _ = self.events.send(notice.to_string());
    }

    pub(super) fn persist(&mut self, e: Option<&Indexed>) {
        // Without an event the whole state was taken (or led under a new term).
        if e.is_none() {
            self.announce_snapshot();
        }
        if let (Some(log), Some(e)) = (self.log.as_mut(), e)
            && let Ok(line) = serde_json::to_string(e)
        {
            let _ = writeln!(log, "{line}");
        }
        let dir = &self.config.data_dir;
        if let Ok(text) = serde_json::to_string(&self.state) {
            let tmp = dir.join("state.json.tmp");
            if std::fs::write(&tmp, text).is_ok() {
                let _ = std::fs::rename(&tmp, dir.join("state.json"));
            }
        }
    }

    pub(super) fn command(&mut self, cmd: Command) {
        if self.leading {
            self.on_command(cmd);
        } else if self.master.is_some() {
            self.publish(COMMANDS_TOPIC, &cmd);
        }
    }

    pub(super) fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Report(info) => {
                if self.state.nodes.get(&info.id) != Some(&info) {
                    self.emit(Event::NodeUp { info });
                }
            }
            Command::RankPort {
                instance,
                rank,
                port,
            } => {
                let new = self
                    .state
                    .instances
                    .get(&instance)
                    .and_then(|i| i.ranks.get(rank))
                    .is_some_and(|s| s.port != Some(port));
                if new {
                    self.emit(Event::RankPort {
                        instance,
                        rank,
                        port,
                    });
                }
            }
            Command::RankStatus {
                instance,
                rank,
                status,
            } => {
                let changed = self
                    .state
                    .instances
                    .get(&instance)
                    .and_then(|i| i.ranks.get(rank))
                    .is_some_and(|s| s.status != status);
                if changed {
                    self.emit(Event::RankStatus {
                        instance,
                        rank,
                        status,
                    });
                }
            }
        }
    }

    /// The node that should lead by this node's view of who is alive.
    fn designated(&self) -> Option<NodeId> {
        let mut alive: BTreeSet<NodeId> = self.alive.keys().cloned().collect();
        alive.insert(self.me.clone());
        shoal_cluster::election::master_of(&alive).cloned()
    }

    pub(super) fn on_published(&mut self, source: &NodeId, p: Published) {
        match p {
            Published::Snapshot { term, state } => {
                if term >= self.highest_term && source != &self.me {
                    if self.leading && term == self.highest_term && source < &self.me {
                        return; // a lower id with the same term: ours stands
                    }
                    // Only from the node this one sees as the one to lead: a cut TCP
                    // connection delivers what was queued in it when the cable is back,
                    // and a snapshot from minutes ago must not decide the merge.
                    if self.designated().as_ref() != Some(source) {
                        return;
                    }
                    self.highest_term = term;
                    self.leading = false;
                    self.adopting = None;
                    self.awaiting = None;
                    self.master = Some(source.clone());
                    self.state = state;
                    self.state.term = term;
                    self.persist(None);
                }
            }
            Published::Event(e) => {
                if e.term < self.highest_term || Some(source) != self.master.as_ref() {
                    return;
                }
                if self.awaiting.as_ref().is_some_and(|(m, _)| m == source) {
                    return; // its branch is about to be replaced by this side's
                }
                if e.index == self.state.index + 1 {
                    self.applied(&e);
                    self.persist(Some(&e));
                } else if e.index > self.state.index + 1 {
                    let m = source.clone();
                    self.catch_up_from(&m);
                }
            }
        }
    }
}

/// An event as `/events` shows it: an instance's token stays inside the cluster.
fn public_event(e: &Indexed) -> String {
    let mut v = serde_json::to_value(e).unwrap_or_default();
    if let Some(i) = v["event"]["instance"].as_object_mut() {
        i.remove("token");
    }
    v.to_string()
}
