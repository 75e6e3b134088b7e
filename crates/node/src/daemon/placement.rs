//! The master's placement: instances created from the first plan that fits, failed
//! instances removed and placed again with a back-off. An instance that failed on its
//! last attempt stays in the state, failed with its reason, for `shoal status` to show,
//! until the model is placed again.

use shoal_store::ModelCard;

use super::*;

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
            .filter(|i| matches!(i.status, InstanceStatus::Failed(_)))
            .filter(|i| i.attempt < MAX_ATTEMPTS)
            .cloned()
            .collect();
        for inst in failed {
            let reason = match &inst.status {
                InstanceStatus::Failed(r) => r.clone(),
                _ => String::new(),
            };
            let attempt = inst.attempt + 1;
            if attempt >= MAX_ATTEMPTS {
                // Kept, failed, so that the reason shows; the worker stops its runners.
                tracing::error!(model = %inst.model, reason, "instance failed too often; not placing it again");
                let last = Instance {
                    attempt,
                    ..inst.clone()
                };
                self.emit(Event::InstanceRemoved {
                    instance: inst.id.clone(),
                    reason: reason.clone(),
                });
                self.emit(Event::InstancePlaced { instance: last });
                continue;
            }
            self.emit(Event::InstanceRemoved {
                instance: inst.id.clone(),
                reason: reason.clone(),
            });
            // Back off: 1 s, 2 s, 4 s.
            let wait = Duration::from_secs(1 << (attempt - 1));
            self.retry
                .insert(inst.model.clone(), (Instant::now() + wait, attempt));
            self.retry_strategy.insert(
                inst.model.clone(),
                (inst.strategy, inst.ranks.len(), inst.context),
            );
            tracing::warn!(model = %inst.model, reason, attempt, "instance failed; placing it again");
        }
        let due: Vec<String> = self
            .retry
            .iter()
            .filter(|(_, (at, _))| Instant::now() >= *at)
            .map(|(m, _)| m.clone())
            .collect();
        for model in due {
            let Some((_, attempt)) = self.retry.remove(&model) else {
                continue;
            };
            let (strategy, n, context) = self
                .retry_strategy
                .remove(&model)
                .map_or((None, None, None), |(s, n, c)| (Some(s), Some(n), Some(c)));
            // The same shape if it still fits, else whatever fits.
            let result = self
                .place_now(&model, strategy, n, context, attempt)
                .or_else(|_| self.place_now(&model, None, None, context, attempt));
            if let Err(e) = result {
                tracing::error!(model, error = %e, "cannot place again");
            }
        }
    }

    /// The master removes an instance a user deleted (and forgets any retry of its
    /// model, so it is not placed again).
    pub(super) fn delete_now(&mut self, instance: &str) -> Result<(), String> {
        let Some(inst) = self.state.instances.get(instance) else {
            return Err(format!("no instance {instance}"));
        };
        let model = inst.model.clone();
        self.retry.remove(&model);
        self.retry_strategy.remove(&model);
        tracing::info!(instance, model, "deleting");
        self.emit(Event::InstanceRemoved {
            instance: instance.to_string(),
            reason: "deleted".into(),
        });
        Ok(())
    }

    pub(super) fn facts(model: &str) -> Result<(ModelFacts, ModelCard), String> {
        let card = find_card(model).ok_or_else(|| format!("unknown model {model:?}"))?;
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
    ) -> Result<PlaceRequest, String> {
        let (facts, card) = Self::facts(model)?;
        Ok(PlaceRequest {
            model: facts,
            strategy,
            nodes,
            context: context.unwrap_or((card.context_length as usize).min(2048)),
            chunk: PREFILL_CHUNK,
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
        let req = Self::request(model, strategy, nodes, context)?;
        // A model no node has is pulled by the node of its first rank (the worker's plan).
        let plans = place(&self.state, &req).map_err(|r| r.0)?;
        let Plan {
            strategy,
            nodes,
            gpus,
            ..
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
