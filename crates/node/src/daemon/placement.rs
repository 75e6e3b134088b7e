//! The master's placement: instances created from the first plan that fits, failed
//! instances placed again with a back-off. A failed instance stays in the state until
//! its replacement is placed, so that whichever node leads carries on with it (a new
//! master finds it there) and requests wait for it rather than placing another shape;
//! one that failed on its last attempt stays, failed with its reason, for `shoal
//! status` to show, until the model is placed again.

use shoal_store::ModelCard;

use super::*;

/// When the master places a failed instance again, and which attempt that is.
pub(super) struct Retry {
    pub at: Instant,
    pub attempt: u32,
    /// The last try found no room; the next tries are quiet.
    pub waiting_for_room: bool,
}

/// A failed instance the master will not place again (kept for its reason to show).
pub(super) fn given_up(i: &Instance) -> bool {
    matches!(i.status, InstanceStatus::Failed(_)) && i.attempt >= MAX_ATTEMPTS
}

/// While no node has room for a failed instance, how often the master looks again.
const ROOM_WAIT: Duration = Duration::from_secs(1);

/// What the master does about a failed instance on this tick.
#[derive(Debug, PartialEq, Eq)]
enum RetryStep {
    Wait,
    GiveUp,
    Place,
}

impl Retry {
    /// The retry of an instance that has just failed on attempt `attempt` (failures in a
    /// row: the state sets it back to 0 once an instance is ready). Back off 1 s, 2 s,
    /// 4 s; the last attempt is given up at once.
    fn after_failure(attempt: u32, now: Instant) -> Retry {
        let attempt = attempt + 1;
        let wait = if attempt >= MAX_ATTEMPTS {
            Duration::ZERO
        } else {
            Duration::from_secs(1 << (attempt.clamp(1, 3) - 1))
        };
        Retry {
            at: now + wait,
            attempt,
            waiting_for_room: false,
        }
    }

    /// The next try after one that found no room: the same attempt, soon, quietly.
    fn no_room(&self, now: Instant) -> Retry {
        Retry {
            at: now + ROOM_WAIT,
            attempt: self.attempt,
            waiting_for_room: true,
        }
    }

    fn step(&self, now: Instant) -> RetryStep {
        if now < self.at {
            RetryStep::Wait
        } else if self.attempt >= MAX_ATTEMPTS {
            RetryStep::GiveUp
        } else {
            RetryStep::Place
        }
    }
}

impl Daemon {
    /// The master's periodic work: drop dead nodes, place failed instances again.
    pub(super) fn master_duties(&mut self) {
        let dead: Vec<NodeId> = self
            .state
            .nodes
            .keys()
            .filter(|id| **id != self.me && !self.alive.contains_key(*id))
            .cloned()
            .collect();
        for id in dead {
            tracing::warn!(node = %id, "node lost");
            self.emit(Event::NodeDown { id });
        }
        let failed: Vec<Instance> = self
            .state
            .instances
            .values()
            .filter(|i| matches!(i.status, InstanceStatus::Failed(_)) && !given_up(i))
            .cloned()
            .collect();
        self.retry
            .retain(|id, _| failed.iter().any(|i| &i.id == id));
        let now = Instant::now();
        for inst in failed {
            let reason = match &inst.status {
                InstanceStatus::Failed(r) => r.clone(),
                _ => String::new(),
            };
            let retry = self.retry.entry(inst.id.clone()).or_insert_with(|| {
                let r = Retry::after_failure(inst.attempt, now);
                let attempt = r.attempt;
                tracing::warn!(model = %inst.model, reason, attempt, "instance failed; placing it again");
                r
            });
            match retry.step(now) {
                RetryStep::Wait => continue,
                RetryStep::Place => {}
                RetryStep::GiveUp => {
                    // Kept, failed, so that the reason shows; the worker stops its runners.
                    tracing::error!(model = %inst.model, reason, "instance failed too often; not placing it again");
                    let last = Instance {
                        attempt: retry.attempt,
                        ..inst.clone()
                    };
                    self.retry.remove(&inst.id);
                    self.emit(Event::InstanceRemoved {
                        instance: inst.id.clone(),
                        reason,
                    });
                    self.emit(Event::InstancePlaced { instance: last });
                    continue;
                }
            }
            let (attempt, waiting_for_room) = (retry.attempt, retry.waiting_for_room);
            // The same shape if it still fits, else whatever fits at its context (a
            // placement removes the failed instance).
            let (model, context) = (inst.model.clone(), Some(inst.context));
            let (strategy, n) = (Some(inst.strategy), Some(inst.ranks.len()));
            let result = self
                .place_now(&model, strategy, n, context, attempt)
                .or_else(|_| self.place_now(&model, None, None, context, attempt));
            match result {
                Ok(_) => {
                    self.retry.remove(&inst.id);
                }
                Err(e) => {
                    // Kept, so that the model comes back as soon as the node it needs
                    // does (or another with room joins), without waiting for a request.
                    if waiting_for_room {
                        tracing::debug!(model, error = %e, "still no room to place it again");
                    } else {
                        tracing::warn!(model, error = %e, "no room to place it again; waiting for room");
                    }
                    if let Some(r) = self.retry.get_mut(&inst.id) {
                        *r = r.no_room(now);
                    }
                }
            }
        }
    }

    /// The master removes an instance a user deleted (a failed one with it: it is not
    /// placed again).
    pub(super) fn delete_now(&mut self, instance: &str) -> Result<(), String> {
        let Some(inst) = self.state.instances.get(instance) else {
            return Err(format!("no instance {instance}"));
        };
        let model = inst.model.clone();
        self.retry.remove(instance);
        tracing::info!(instance, model, "deleting");
        self.emit(Event::InstanceRemoved {
            instance: instance.to_string(),
            reason: "deleted".into(),
        });
        Ok(())
    }

    pub(super) fn facts(model: &str) -> Result<(ModelFacts, ModelCard), String> {
        let card = find_card(model).ok_or_else(|| {
            format!(
                "unknown model {model:?}: nodes serve the models `shoal models` lists \
                 (a file of your own runs on one machine with `shoal run -m FILE`)"
            )
        })?;
        Ok((
            ModelFacts {
                name: card.name.clone(),
                size: card.size,
                layers: card.layers as usize,
                hidden: card.hidden as usize,
                heads: card.heads as usize,
                kv_heads: card.kv_heads as usize,
                ffn: card.ffn as usize,
                vocab: card.vocab as usize,
            },
            card,
        ))
    }

    pub(super) fn request(
        model: &str,
        strategy: Option<shoal_cluster::Strategy>,
        nodes: Option<usize>,
        context: Option<usize>,
        batch: usize,
    ) -> Result<PlaceRequest, String> {
        let (facts, card) = Self::facts(model)?;
        Ok(PlaceRequest {
            model: facts,
            strategy,
            nodes,
            context: context.unwrap_or((card.context_length as usize).min(2048)),
            chunk: PREFILL_CHUNK,
            batch,
        })
    }

    /// The master creates an instance from the first plan.
    pub(super) fn place_now(
        &mut self,
        model: &str,
        strategy: Option<shoal_cluster::Strategy>,
        nodes: Option<usize>,
        context: Option<usize>,
        attempt: u32,
    ) -> Result<Instance, String> {
        let req = Self::request(model, strategy, nodes, context, self.config.max_batch)?;
        // A model no node has is pulled by the node of its first rank (the worker's plan).
        let plans = place(&self.state, &req).map_err(|r| r.0)?;
        let Plan {
            strategy,
            nodes,
            gpus,
            memory,
            kv_positions,
        } = plans.into_iter().next().ok_or("no plan")?;
        let id = format!("{model}-{}", self.state.index + 1);
        let instance = Instance {
            id,
            model: model.to_string(),
            strategy,
            context: req.context,
            ranks: nodes
                .into_iter()
                .zip(gpus.into_iter().chain(std::iter::repeat(None)))
                .map(|(node, gpu)| RankSlot {
                    node,
                    gpu,
                    port: None,
                    status: RunnerStatus::Idle,
                })
                .collect(),
            token: crate::keys::new_cluster_key().map_err(|e| e.to_string())?,
            status: InstanceStatus::Starting,
            attempt,
            kv_positions,
            memory,
        };
        // A fresh placement clears an earlier instance of the model that failed for good.
        let given_up: Vec<String> = self
            .state
            .instances
            .values()
            .filter(|i| i.model == model && matches!(i.status, InstanceStatus::Failed(_)))
            .map(|i| i.id.clone())
            .collect();
        for id in given_up {
            self.emit(Event::InstanceRemoved {
                instance: id,
                reason: "placed again".into(),
            });
        }
        tracing::info!(instance = %instance.id, %strategy, nodes = instance.ranks.len(), "placing");
        self.emit(Event::InstancePlaced {
            instance: instance.clone(),
        });
        Ok(instance)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_instance_is_placed_again_after_1_2_4_s_then_given_up() {
        let t = Instant::now();
        let first = Retry::after_failure(0, t);
        assert_eq!((first.attempt, first.at - t), (1, Duration::from_secs(1)));
        assert_eq!(first.step(t), RetryStep::Wait);
        assert_eq!(first.step(t + Duration::from_secs(1)), RetryStep::Place);
        let second = Retry::after_failure(1, t);
        assert_eq!((second.attempt, second.at - t), (2, Duration::from_secs(2)));
        // The last attempt: given up at once, its reason kept.
        let last = Retry::after_failure(2, t);
        assert_eq!(last.attempt, MAX_ATTEMPTS);
        assert_eq!(last.step(t), RetryStep::GiveUp);
    }

    #[test]
    fn no_room_keeps_the_attempt_and_looks_again_each_second_quietly() {
        let t = Instant::now();
        let r = Retry::after_failure(0, t).no_room(t + Duration::from_secs(1));
        assert_eq!(r.attempt, 1);
        assert!(r.waiting_for_room);
        assert_eq!(r.step(t + Duration::from_millis(1500)), RetryStep::Wait);
        assert_eq!(r.step(t + Duration::from_secs(2)), RetryStep::Place);
        // However long the node it needs stays away, it is never given up.
        let later = (0..100).fold(r, |r, i| r.no_room(t + Duration::from_secs(2 + i)));
        assert_eq!(later.attempt, 1);
        assert_eq!(later.step(t + Duration::from_secs(200)), RetryStep::Place);
    }
}
