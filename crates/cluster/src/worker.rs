//! The worker's decision: what this node must do with its runners, given the state.
//! Pure, and it never waits: the node carries the actions out and reports back through
//! events, and the next `plan` sees the result.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::state::{ClusterState, InstanceStatus, NodeId};

/// One runner of this node: an instance's rank.
pub type RunnerKey = (String, usize);

/// What this node has, apart from the state.
#[derive(Clone, Debug, Default)]
pub struct Local {
    /// Runner processes alive here.
    pub runners: BTreeSet<RunnerKey>,
    /// Ranks whose port this node has opened.
    pub ports: BTreeSet<RunnerKey>,
    /// Model files present here, by name.
    pub models: BTreeSet<String>,
    /// Models being copied from a peer.
    pub fetching: BTreeSet<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// Copy the model file from a peer that has it.
    Fetch { model: String, from: NodeId },
    /// Open the port this rank will listen on and report it.
    OpenPort { instance: String, rank: usize },
    /// Start the runner: every rank has an address and the model is here.
    Start { instance: String, rank: usize },
    /// Stop a runner whose instance failed or is gone.
    Stop { instance: String, rank: usize },
}

/// The actions node `me` should take now.
pub fn plan(state: &ClusterState, me: &NodeId, local: &Local) -> Vec<Action> {
    let mut actions = Vec::new();
    let mut wanted: BTreeSet<RunnerKey> = BTreeSet::new();
    for inst in state.instances.values() {
        if matches!(inst.status, InstanceStatus::Failed(_)) {
            continue;
        }
        for (rank, slot) in inst.ranks.iter().enumerate() {
            if &slot.node != me {
                continue;
            }
            let key = (inst.id.clone(), rank);
            wanted.insert(key.clone());
            if local.runners.contains(&key) {
                continue;
            }
            if !local.models.contains(&inst.model) {
                if !local.fetching.contains(&inst.model) {
                    // The first node (by id) that has it: every replica picks the same.
                    if let Some(from) = state
                        .nodes
                        .values()
                        .find(|n| &n.id != me && n.models.contains(&inst.model))
                    {
                        let a = Action::Fetch {
                            model: inst.model.clone(),
                            from: from.id.clone(),
                        };
                        if !actions.contains(&a) {
                            actions.push(a);
                        }
                    }
                }
                continue;
            }
            if slot.addr.is_none() {
                if !local.ports.contains(&key) {
                    actions.push(Action::OpenPort {
                        instance: inst.id.clone(),
                        rank,
                    });
                }
                continue;
            }
            if inst.ranks.iter().all(|r| r.addr.is_some()) {
                actions.push(Action::Start {
                    instance: inst.id.clone(),
                    rank,
                });
            }
        }
    }
    for (instance, rank) in &local.runners {
        if !wanted.contains(&(instance.clone(), *rank)) {
            actions.push(Action::Stop {
                instance: instance.clone(),
                rank: *rank,
            });
        }
    }
    actions
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::state::{Backend, Instance, NodeInfo, RankSlot, Resources, RunnerStatus, Strategy};

    fn state(models_on_a: bool, addrs: [Option<&str>; 2]) -> ClusterState {
        let mut s = ClusterState::default();
        for (id, models) in [("a", models_on_a), ("b", false)] {
            s.nodes.insert(
                id.into(),
                NodeInfo {
                    id: id.into(),
                    http: String::new(),
                    resources: Resources {
                        memory_total: 1 << 30,
                        memory_free: 1 << 30,
                        cores: 2,
                        backend: Backend::Cpu,
                    },
                    models: if models { vec!["m".into()] } else { vec![] },
                    links: BTreeMap::new(),
                },
            );
        }
        s.instances.insert(
            "i".into(),
            Instance {
                id: "i".into(),
                model: "m".into(),
                strategy: Strategy::Pipeline,
                context: 256,
                ranks: ["a", "b"]
                    .iter()
                    .zip(addrs)
                    .map(|(n, a)| RankSlot {
                        gpu: None,
                        node: n.to_string(),
                        addr: a.map(str::to_string),
                        status: RunnerStatus::Idle,
                    })
                    .collect(),
                token: "t".into(),
                status: InstanceStatus::Starting,
                attempt: 0,
            },
        );
        s
    }

    #[test]
    fn a_node_fetches_then_opens_its_port_then_starts_once_every_rank_has_one() {
        let s = state(true, [None, None]);
        let b = "b".to_string();
        let mut local = Local::default();
        assert_eq!(
            plan(&s, &b, &local),
            vec![Action::Fetch {
                model: "m".into(),
                from: "a".into()
            }]
        );
        local.fetching.insert("m".into());
        assert!(
            plan(&s, &b, &local).is_empty(),
            "fetch in flight: nothing more"
        );
        local.fetching.clear();
        local.models.insert("m".into());
        assert_eq!(
            plan(&s, &b, &local),
            vec![Action::OpenPort {
                instance: "i".into(),
                rank: 1
            }]
        );
        local.ports.insert(("i".into(), 1));
        let s = state(true, [None, Some("x:1")]);
        assert!(plan(&s, &b, &local).is_empty(), "rank 0 has no address yet");
        let s = state(true, [Some("x:0"), Some("x:1")]);
        assert_eq!(
            plan(&s, &b, &local),
            vec![Action::Start {
                instance: "i".into(),
                rank: 1
            }]
        );
        local.runners.insert(("i".into(), 1));
        assert!(plan(&s, &b, &local).is_empty());
    }

    #[test]
    fn runners_of_failed_or_removed_instances_stop() {
        let mut s = state(true, [Some("x:0"), Some("x:1")]);
        let mut local = Local::default();
        local.models.insert("m".into());
        local.runners.insert(("i".into(), 1));
        local.runners.insert(("old".into(), 0));
        assert_eq!(
            plan(&s, &"b".to_string(), &local),
            vec![Action::Stop {
                instance: "old".into(),
                rank: 0
            }]
        );
        if let Some(i) = s.instances.get_mut("i") {
            i.status = InstanceStatus::Failed("x".into());
        }
        let actions = plan(&s, &"b".to_string(), &local);
        assert!(actions.contains(&Action::Stop {
            instance: "i".into(),
            rank: 1
        }));
    }
}
