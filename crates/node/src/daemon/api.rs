//! The loop's side of the HTTP API: status, placement and routing calls.

use super::*;

impl Daemon {
    pub(super) fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "node_id": self.me,
            "master_id": self.master,
            "term": self.highest_term,
            "index": self.state.index,
            "leading": self.leading,
            "peers": self.swarm.connected_peers().map(|p| p.to_string()).collect::<Vec<_>>(),
            "nodes": self.state.nodes.values().collect::<Vec<_>>(),
            // This node's rank-0 runners: sequences admitted and waiting.
            "serving": self.runners.iter().filter(|((_, rank), _)| *rank == 0).map(|((instance, _), r)| {
                serde_json::json!({
                    "instance": instance,
                    "running": r.load.running.load(std::sync::atomic::Ordering::Relaxed),
                    "prefilling": r.load.prefilling.load(std::sync::atomic::Ordering::Relaxed),
                    "waiting": r.load.waiting.load(std::sync::atomic::Ordering::Relaxed),
                })
            }).collect::<Vec<_>>(),
            // This node's model files on their way in, and the last failure of each.
            "fetches": self.fetch_progress,
            "fetch_failures": self.fetch_failures,
            // On the master: failed instances it will place again.
            "placing_again": self.retry.iter().map(|(instance, r)| serde_json::json!({
                "instance": instance,
                "attempt": r.attempt,
                "waiting_for_room": r.waiting_for_room,
            })).collect::<Vec<_>>(),
            "instances": self.state.instances.values().map(|i| {
                // The token stays inside the cluster's state, out of status output.
                let mut v = serde_json::to_value(i).unwrap_or_default();
                if let Some(o) = v.as_object_mut() {
                    o.remove("token");
                    o.insert("memory".into(), serde_json::json!(Self::instance_memory(i)));
                }
                v
            }).collect::<Vec<_>>(),
        })
    }

    /// Placement's estimate of the bytes each rank of `i` holds: as counted when it was
    /// placed, or for a state from before that, at one context (empty for a model
    /// without a card).
    fn instance_memory(i: &Instance) -> Vec<u64> {
        if !i.memory.is_empty() {
            return i.memory.clone();
        }
        Self::facts(&i.model)
            .ok()
            .and_then(|(facts, _)| {
                shoal_cluster::placement::rank_memory(
                    &facts,
                    i.strategy,
                    i.ranks.len(),
                    i.context,
                    PREFILL_CHUNK,
                    i.context,
                )
                .ok()
            })
            .unwrap_or_default()
    }

    pub(super) fn on_api(&mut self, call: ApiCall) {
        match call {
            ApiCall::Status(reply) => {
                let _ = reply.send(self.status());
            }
            ApiCall::Place {
                model,
                strategy,
                nodes,
                context,
                preview,
                if_absent,
                reply,
            } => {
                let req =
                    match Self::request(&model, strategy, nodes, context, self.config.max_batch) {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = reply.send(Err(e));
                            return;
                        }
                    };
                if preview {
                    let r = place(&self.state, &req)
                        .map_err(|r| r.0)
                        .and_then(|p| serde_json::to_value(p).map_err(|e| e.to_string()));
                    let _ = reply.send(r);
                } else if self.leading {
                    let r = if if_absent {
                        self.place_if_absent(&model, strategy, nodes, context)
                    } else {
                        self.place_now(&model, strategy, nodes, context, 0)
                    };
                    let r = r.and_then(|i| serde_json::to_value(i).map_err(|e| e.to_string()));
                    let _ = reply.send(r);
                } else if let Some(m) = self.master_peer() {
                    let request = if if_absent {
                        Request::PlaceIfAbsent(req)
                    } else {
                        Request::Place(req)
                    };
                    let id = self.swarm.behaviour_mut().rpc.send_request(&m, request);
                    self.pending.insert(id, Pending::Place(reply));
                } else {
                    let _ = reply.send(Err("no master yet; try again in a moment".into()));
                }
            }
            ApiCall::Pull { model, reply } => {
                let _ = reply.send(self.pull(&model));
            }
            ApiCall::Delete { instance, reply } => {
                if self.leading {
                    let r = self
                        .delete_now(&instance)
                        .map(|()| serde_json::json!({ "deleted": instance }));
                    let _ = reply.send(r);
                } else if let Some(m) = self.master_peer() {
                    let request = Request::Delete(instance);
                    let id = self.swarm.behaviour_mut().rpc.send_request(&m, request);
                    self.pending.insert(id, Pending::Place(reply));
                } else {
                    let _ = reply.send(Err("no master yet; try again in a moment".into()));
                }
            }
            ApiCall::Route {
                model,
                local_only,
                reply,
            } => {
                let _ = reply.send(self.route(model.as_deref(), local_only));
            }
        }
    }

    /// Starts pulling `model` here unless some node has it or it is on its way already.
    fn pull(&mut self, model: &str) -> Result<(), String> {
        if shoal_store::find_card(model).is_none() {
            return Err(format!("unknown model {model} (see `shoal models`)"));
        }
        let somewhere = self
            .state
            .nodes
            .values()
            .any(|n| n.models.iter().any(|m| m == model));
        if !somewhere && !self.fetches.contains_key(model) {
            self.start_pull(model);
        }
        Ok(())
    }

    /// An instance of `model` in the state, whatever its status.
    /// The master's answer to a request for a model nothing may serve yet: its instance
    /// if it has one (a failed one is being placed again, in its own shape: the request
    /// waits for that rather than placing another), unless it was given up; else a new
    /// one.
    pub(super) fn place_if_absent(
        &mut self,
        model: &str,
        strategy: Option<shoal_cluster::Strategy>,
        nodes: Option<usize>,
        context: Option<usize>,
    ) -> Result<Instance, String> {
        match self.placed(model) {
            Some(i) if !placement::given_up(&i) => Ok(i),
            _ => self.place_now(model, strategy, nodes, context, 0),
        }
    }

    pub(super) fn placed(&self, model: &str) -> Option<Instance> {
        self.state
            .instances
            .values()
            .find(|i| i.model == model)
            .cloned()
    }

    /// A ready instance of `model` (any model when `None`): one whose rank 0 runs here if
    /// there is one, else the first; `local_only` for requests forwarded from a peer.
    pub(super) fn route(&self, model: Option<&str>, local_only: bool) -> Result<Route, RouteError> {
        if let Some(m) = model {
            let placed = self.state.instances.values().any(|i| i.model == m);
            if !placed && shoal_store::find_card(m).is_none() {
                return Err(RouteError::UnknownModel(m.to_string()));
            }
            if !placed {
                return Err(RouteError::NotPlaced(m.to_string()));
            }
        }
        self.route_ready(model, local_only)
            .map_err(RouteError::NotReady)
    }

    fn route_ready(&self, model: Option<&str>, local_only: bool) -> Result<Route, String> {
        let ready: Vec<&Instance> = self
            .state
            .instances
            .values()
            .filter(|i| i.status == InstanceStatus::Ready)
            .filter(|i| model.is_none_or(|m| i.model == m))
            .collect();
        let here = |i: &&&Instance| i.ranks.first().is_some_and(|r| r.node == self.me);
        let inst = ready
            .iter()
            .find(here)
            .or(if local_only { None } else { ready.first() })
            .ok_or_else(|| match model {
                Some(m) => format!("no ready instance of {m} (see `shoal status`)"),
                None => "no ready instance (place one with `shoal place MODEL`)".into(),
            })?;
        let head = inst.ranks.first().ok_or("an instance without ranks")?;
        if head.node == self.me {
            let h = self
                .runners
                .get(&(inst.id.clone(), 0))
                .ok_or("rank 0 is not running here yet")?;
            return Ok(Route::Local(h.jobs.clone()));
        }
        let peer = head
            .node
            .parse::<PeerId>()
            .map_err(|e| format!("rank 0's node id {}: {e}", head.node))?;
        Ok(Route::Remote(peer))
    }
}
