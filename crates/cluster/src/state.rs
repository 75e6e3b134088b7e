//! The replicated state and the one function that changes it.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A node's id: its libp2p peer id, as text.
pub type NodeId = String;

/// How a model instance is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Contiguous layer ranges; hidden states pass rank to rank.
    Pipeline,
    /// Every layer cut into KV groups and FFN slices; two all-reduces per layer.
    Tensor,
    /// Whole model on every rank; prompts split across ranks (ring attention).
    Sequence,
}

impl Strategy {
    pub const ALL: [Strategy; 3] = [Self::Pipeline, Self::Tensor, Self::Sequence];

    pub fn name(self) -> &'static str {
        match self {
            Self::Pipeline => "pipeline",
            Self::Tensor => "tensor",
            Self::Sequence => "sequence",
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "pipeline" => Ok(Self::Pipeline),
            "tensor" => Ok(Self::Tensor),
            "sequence" => Ok(Self::Sequence),
            _ => Err(format!(
                "unknown strategy {s:?} (pipeline, tensor or sequence)"
            )),
        }
    }
}

/// What computes on a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Backend {
    Cpu,
    /// `count` GPUs alike; the memory figures are one GPU's (the free memory the least
    /// free of them). Each GPU takes a rank of its own.
    Cuda {
        name: String,
        memory_total: u64,
        memory_free: u64,
        #[serde(default = "one")]
        count: u32,
    },
}

fn one() -> u32 {
    1
}

/// A node's capacity, as it last reported it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    pub memory_total: u64,
    pub memory_free: u64,
    pub cores: u32,
    pub backend: Backend,
}

/// Measured link quality from a node to a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkStats {
    /// Round trip of a small message, microseconds.
    pub rtt_us: u64,
    /// Bytes per second of a bulk transfer.
    pub bandwidth: u64,
}

/// A node as the cluster knows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: NodeId,
    /// The node's HTTP control address (`shoal status --node` talks to it).
    pub http: String,
    /// The machine's host name, for people (not unique: only `id` is).
    #[serde(default)]
    pub hostname: String,
    pub resources: Resources,
    /// Models whose file this node holds, by name.
    pub models: Vec<String>,
    /// Links to peers, by peer id.
    pub links: BTreeMap<NodeId, LinkStats>,
    /// Model files on their way in (pulled from the registry or copied from a peer): the
    /// percent done, in steps of 5 so that a transfer makes few events.
    #[serde(default)]
    pub fetching: BTreeMap<String, u8>,
}

/// A runner's life, as its node reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", content = "detail", rename_all = "snake_case")]
pub enum RunnerStatus {
    Idle,
    /// Copying the model file from a peer (fraction done).
    Fetching(f32),
    Connecting,
    Loading(f32),
    WarmingUp,
    Ready,
    Running,
    ShuttingDown,
    Failed(String),
}

impl RunnerStatus {
    pub fn is_failed(&self) -> bool {
        matches!(self, Self::Failed(_))
    }
}

/// One rank of an instance: where it runs and how it is doing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankSlot {
    pub node: NodeId,
    /// The GPU of the node this rank computes on (`None`: the CPU).
    #[serde(default)]
    pub gpu: Option<u32>,
    /// The port this rank listens on for its peers, once its node has opened it. Only
    /// the port is shared: each node dials a peer's rank at the address it reaches that
    /// peer's node at, so every node sees an address that works from where it is.
    pub port: Option<u16>,
    pub status: RunnerStatus,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", content = "reason", rename_all = "snake_case")]
pub enum InstanceStatus {
    /// Ranks are starting.
    Starting,
    /// Every rank is ready; rank 0 takes requests.
    Ready,
    Failed(String),
}

/// A model served by a set of ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Instance {
    pub id: String,
    pub model: String,
    pub strategy: Strategy,
    pub context: usize,
    /// Ranks in order; rank 0 takes the requests.
    pub ranks: Vec<RankSlot>,
    /// The secret every rank presents to the others.
    pub token: String,
    pub status: InstanceStatus,
    /// How many times in a row the master has placed this model again after a failure:
    /// back to 0 once the instance is ready (so faults hours apart never use up the
    /// attempts), in the replicated state, so that a new master counts on.
    pub attempt: u32,
    /// KV positions the instance holds over all its sequences and kept prefixes, as
    /// placement counted them (0: a state from before the pool was counted).
    #[serde(default)]
    pub kv_positions: usize,
    /// Bytes placement counted for each rank, in rank order: what later placements leave
    /// to it on its node, whatever it holds at the moment.
    #[serde(default)]
    pub memory: Vec<u64>,
}

/// What happened, as the master orders it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A node joined, or reported new resources, models or links.
    NodeUp {
        info: NodeInfo,
    },
    /// A node stopped answering.
    NodeDown {
        id: NodeId,
    },
    InstancePlaced {
        instance: Instance,
    },
    /// A rank's node opened its port.
    RankPort {
        instance: String,
        rank: usize,
        port: u16,
    },
    RankStatus {
        instance: String,
        rank: usize,
        status: RunnerStatus,
    },
    InstanceRemoved {
        instance: String,
        reason: String,
    },
}

/// An event with its place in the master's log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Indexed {
    pub term: u64,
    pub index: u64,
    pub event: Event,
}

/// Everything every node agrees on.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterState {
    /// The last applied event's index (0: none).
    pub index: u64,
    /// The term of the master that wrote it.
    pub term: u64,
    pub nodes: BTreeMap<NodeId, NodeInfo>,
    pub instances: BTreeMap<String, Instance>,
}

impl ClusterState {
    /// Instances of `model` that take requests.
    pub fn ready_instances<'a>(&'a self, model: &'a str) -> impl Iterator<Item = &'a Instance> {
        self.instances
            .values()
            .filter(move |i| i.model == model && i.status == InstanceStatus::Ready)
    }
}

/// The state after `event`. Pure: the same state and event give the same result on
/// every replica. An event that refers to something unknown (a rank of an instance that
/// was removed meanwhile) changes nothing but the index.
pub fn apply(state: &ClusterState, e: &Indexed) -> ClusterState {
    let mut s = state.clone();
    s.index = e.index;
    s.term = s.term.max(e.term);
    match &e.event {
        Event::NodeUp { info } => {
            s.nodes.insert(info.id.clone(), info.clone());
        }
        Event::NodeDown { id } => {
            s.nodes.remove(id);
            for inst in s.instances.values_mut() {
                if inst.ranks.iter().any(|r| &r.node == id)
                    && !matches!(inst.status, InstanceStatus::Failed(_))
                {
                    inst.status = InstanceStatus::Failed(format!("node {id} is down"));
                }
            }
        }
        Event::InstancePlaced { instance } => {
            s.instances.insert(instance.id.clone(), instance.clone());
        }
        Event::RankPort {
            instance,
            rank,
            port,
        } => {
            if let Some(slot) = s
                .instances
                .get_mut(instance)
                .and_then(|i| i.ranks.get_mut(*rank))
            {
                slot.port = Some(*port);
            }
        }
        Event::RankStatus {
            instance,
            rank,
            status,
        } => {
            if let Some(inst) = s.instances.get_mut(instance) {
                if let Some(slot) = inst.ranks.get_mut(*rank) {
                    slot.status = status.clone();
                }
                if let RunnerStatus::Failed(why) = status {
                    inst.status = InstanceStatus::Failed(format!("rank {rank}: {why}"));
                } else if !matches!(inst.status, InstanceStatus::Failed(_))
                    && inst
                        .ranks
                        .iter()
                        .all(|r| matches!(r.status, RunnerStatus::Ready | RunnerStatus::Running))
                {
                    inst.status = InstanceStatus::Ready;
                    inst.attempt = 0;
                }
            }
        }
        Event::InstanceRemoved { instance, .. } => {
            s.instances.remove(instance);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn node(id: &str, memory: u64) -> NodeInfo {
        NodeInfo {
            id: id.into(),
            http: format!("127.0.0.1:{}", 1000 + id.len()),
            resources: Resources {
                memory_total: memory,
                memory_free: memory,
                cores: 2,
                backend: Backend::Cpu,
            },
            models: vec![],
            links: BTreeMap::new(),
            fetching: BTreeMap::new(),
            hostname: String::new(),
        }
    }

    fn instance(id: &str, nodes: &[&str]) -> Instance {
        Instance {
            id: id.into(),
            model: "m".into(),
            strategy: Strategy::Tensor,
            context: 512,
            ranks: nodes
                .iter()
                .map(|n| RankSlot {
                    node: n.to_string(),
                    gpu: None,
                    port: None,
                    status: RunnerStatus::Idle,
                })
                .collect(),
            token: "t".into(),
            status: InstanceStatus::Starting,
            attempt: 0,
            kv_positions: 0,
            memory: Vec::new(),
        }
    }

    fn run(events: Vec<Event>) -> ClusterState {
        events
            .into_iter()
            .enumerate()
            .fold(ClusterState::default(), |s, (i, event)| {
                apply(
                    &s,
                    &Indexed {
                        term: 1,
                        index: i as u64 + 1,
                        event,
                    },
                )
            })
    }

    #[test]
    fn an_instance_is_ready_when_every_rank_is_and_fails_with_any() {
        let mut events = vec![
            Event::NodeUp { info: node("a", 8) },
            Event::NodeUp { info: node("b", 8) },
            Event::InstancePlaced {
                instance: instance("i", &["a", "b"]),
            },
            Event::RankStatus {
                instance: "i".into(),
                rank: 0,
                status: RunnerStatus::Ready,
            },
        ];
        let s = run(events.clone());
        assert_eq!(s.instances["i"].status, InstanceStatus::Starting);
        assert_eq!(s.index, 4);
        events.push(Event::RankStatus {
            instance: "i".into(),
            rank: 1,
            status: RunnerStatus::Ready,
        });
        let s = run(events.clone());
        assert_eq!(s.instances["i"].status, InstanceStatus::Ready);
        assert_eq!(s.ready_instances("m").count(), 1);
        events.push(Event::NodeDown { id: "b".into() });
        let s = run(events);
        assert!(matches!(s.instances["i"].status, InstanceStatus::Failed(_)));
        assert!(!s.nodes.contains_key("b"));
    }

    #[test]
    fn a_ready_instance_counts_its_attempts_from_zero_again() {
        let mut again = instance("i", &["a"]);
        again.attempt = 2;
        let ready = |rank| Event::RankStatus {
            instance: "i".into(),
            rank,
            status: RunnerStatus::Ready,
        };
        let events = vec![
            Event::NodeUp { info: node("a", 8) },
            Event::InstancePlaced { instance: again },
        ];
        assert_eq!(run(events.clone()).instances["i"].attempt, 2);
        let s = run(events.into_iter().chain([ready(0)]).collect());
        assert_eq!(s.instances["i"].status, InstanceStatus::Ready);
        assert_eq!(s.instances["i"].attempt, 0);
    }

    #[test]
    fn events_about_unknown_things_change_only_the_index() {
        let s = run(vec![
            Event::RankPort {
                instance: "gone".into(),
                rank: 3,
                port: 5,
            },
            Event::RankStatus {
                instance: "gone".into(),
                rank: 0,
                status: RunnerStatus::Ready,
            },
            Event::InstanceRemoved {
                instance: "gone".into(),
                reason: "r".into(),
            },
        ]);
        assert_eq!(s.index, 3);
        assert!(s.instances.is_empty());
    }

    #[test]
    fn replicas_applying_the_same_log_converge_and_round_trip_through_json() {
        let events = vec![
            Event::NodeUp { info: node("a", 8) },
            Event::InstancePlaced {
                instance: instance("i", &["a"]),
            },
            Event::RankPort {
                instance: "i".into(),
                rank: 0,
                port: 5,
            },
        ];
        let a = run(events.clone());
        let b = run(events);
        assert_eq!(a, b);
        let text = serde_json::to_string(&a).expect("json");
        let back: ClusterState = serde_json::from_str(&text).expect("parse");
        assert_eq!(a, back);
    }
}
