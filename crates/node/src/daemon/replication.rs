//! Election and replication: who leads, the master's numbered log, replicas that apply
//! it in order and catch up from a snapshot when they miss something.

use super::*;

impl Daemon {
    pub(super) fn elect(&mut self) {
        let mut alive: BTreeSet<NodeId> = self.alive.keys().cloned().collect();
        alive.insert(self.me.clone());
        let leading = self.leading.then_some(self.state.term);
        match decide(&self.me, leading, self.highest_term, &alive) {
            Decision::KeepLeading => {}
            Decision::Lead { term } => {
                // Take over only with the newest state any live node has seen.
                let ahead = self
                    .alive
                    .iter()
                    .filter(|(_, (_, hb))| {
                        hb.index > self.state.index && hb.term >= self.state.term
                    })
                    .max_by_key(|(_, (_, hb))| (hb.term, hb.index))
                    .map(|(id, _)| id.clone());
                if let Some(peer) = ahead {
                    self.catch_up_from(&peer);
                    return;
                }
                tracing::info!(term, "elected master");
                self.leading = true;
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
            Decision::Follow(m) => {
                if self.leading {
                    tracing::info!(master = %m, "stepping down");
                }
                self.leading = false;
                if self.master.as_ref() != Some(&m) {
                    tracing::info!(master = %m, "following");
                    self.master = Some(m.clone());
                    self.catch_up_from(&m);
                }
            }
        }
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
        let e = Indexed {
            term: self.highest_term,
            index: self.state.index + 1,
            event,
        };
        self.state = apply(&self.state, &e);
        self.persist(Some(&e));
        self.publish(EVENTS_TOPIC, &Published::Event(e));
    }

    pub(super) fn persist(&mut self, e: Option<&Indexed>) {
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

    pub(super) fn on_published(&mut self, source: &NodeId, p: Published) {
        match p {
            Published::Snapshot { term, state } => {
                if term >= self.highest_term && source != &self.me {
                    if self.leading && term == self.highest_term && source < &self.me {
                        return; // a lower id with the same term: ours stands
                    }
                    self.highest_term = term;
                    self.leading = false;
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
                if e.index == self.state.index + 1 {
                    self.state = apply(&self.state, &e);
                    self.persist(Some(&e));
                } else if e.index > self.state.index + 1 {
                    let m = source.clone();
                    self.catch_up_from(&m);
                }
            }
        }
    }
}
