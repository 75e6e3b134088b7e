//! Placement: which strategies and node sets can hold a model instance, and what each
//! node would need. Pure: the same state and request give the same plans everywhere.
//!
//! Per-rank memory = its share of the weights + its KV cache at the instance's context
//! length (f32 keys and values) + the working set of one prefill chunk (activations and
//! the attention scores of the chunk against the whole context). A node fits when the sum
//! over its ranks is at most 90% of its free memory (GPU memory on GPU nodes).

use serde::{Deserialize, Serialize};

use crate::state::{Backend, ClusterState, NodeId, NodeInfo, Strategy};

/// The facts placement needs about a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelFacts {
    pub name: String,
    /// Bytes of the weights file.
    pub size: u64,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub vocab: usize,
}

impl ModelFacts {
    fn head_dim(&self) -> usize {
        self.hidden / self.heads.max(1)
    }

    /// Parameters of one decoder layer and of the embedding.
    fn params(&self) -> (u64, u64) {
        let (h, hd) = (self.hidden as u64, self.head_dim() as u64);
        let attn = h * hd * (2 * self.heads as u64 + 2 * self.kv_heads as u64);
        let layer = attn + 3 * h * self.ffn as u64;
        (layer, self.vocab as u64 * h)
    }

    /// Bytes per parameter in the file.
    fn bytes_per_param(&self) -> f64 {
        let (layer, embed) = self.params();
        self.size as f64 / (layer * self.layers as u64 + embed).max(1) as f64
    }
}

/// What to place.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlaceRequest {
    pub model: ModelFacts,
    /// Only this strategy (any when `None`).
    pub strategy: Option<Strategy>,
    /// Exactly this many nodes (any when `None`).
    pub nodes: Option<usize>,
    /// Context length of the instance.
    pub context: usize,
    /// Positions per prefill chunk.
    pub chunk: usize,
}

/// One way to place the model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub strategy: Strategy,
    /// Nodes in rank order (one rank per node).
    pub nodes: Vec<NodeId>,
    /// Bytes each rank needs.
    pub memory: Vec<u64>,
}

/// Why nothing fits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal(pub String);

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Memory a node can give to ranks.
pub fn usable_memory(node: &NodeInfo) -> u64 {
    let free = match &node.resources.backend {
        Backend::Cpu => node.resources.memory_free,
        Backend::Cuda { memory_free, .. } => *memory_free,
    };
    free / 10 * 9
}

/// Even split of `total` into `n` parts (the first ones one larger).
fn even(total: usize, n: usize) -> Vec<usize> {
    (0..n)
        .map(|i| total / n + usize::from(i < total % n))
        .collect()
}

/// Bytes each of `n` ranks needs under `strategy`, or why the model cannot be split so.
pub fn rank_memory(
    m: &ModelFacts,
    strategy: Strategy,
    n: usize,
    context: usize,
    chunk: usize,
) -> Result<Vec<u64>, String> {
    let bpp = m.bytes_per_param();
    let (layer_params, embed_params) = m.params();
    let hd = m.head_dim() as u64;
    let ctx = context as u64;
    let chunk = chunk.min(context).max(1) as u64;
    let kv = |layers: u64, kv_heads: u64| 2 * ctx * layers * kv_heads * hd * 4;
    let work = |heads: u64, ffn: u64| {
        chunk * 4 * (4 * m.hidden as u64 + 3 * ffn + heads * hd) + heads * chunk * ctx * 4
    };
    let weights = |params: f64| (params * bpp) as u64;
    let (layers, heads, kvh, ffn) = (
        m.layers as u64,
        m.heads as u64,
        m.kv_heads as u64,
        m.ffn as u64,
    );
    match strategy {
        Strategy::Pipeline => {
            if n > m.layers {
                return Err(format!(
                    "pipeline needs a layer per rank: {} layers, {n} ranks",
                    m.layers
                ));
            }
            Ok(even(m.layers, n)
                .into_iter()
                .enumerate()
                .map(|(r, l)| {
                    let l = l as u64;
                    let ends = if r == 0 || r == n - 1 {
                        embed_params
                    } else {
                        0
                    };
                    weights((l * layer_params + ends) as f64) + kv(l, kvh) + work(heads, ffn)
                })
                .collect())
        }
        Strategy::Tensor => {
            if n > m.kv_heads {
                return Err(format!(
                    "tensor parallelism splits whole KV heads: {} KV heads, {n} ranks",
                    m.kv_heads
                ));
            }
            Ok(even(m.kv_heads, n)
                .into_iter()
                .map(|k| {
                    let share = k as f64 / m.kv_heads as f64;
                    let k = k as u64;
                    let h = heads * k / kvh;
                    weights(layers as f64 * layer_params as f64 * share + embed_params as f64)
                        + kv(layers, k)
                        + work(h, (ffn as f64 * share) as u64)
                })
                .collect())
        }
        Strategy::Sequence => {
            let per_rank_chunk = chunk.div_ceil(n as u64);
            let whole = weights((layers * layer_params + embed_params) as f64)
                + kv(layers, kvh)
                + per_rank_chunk * 4 * (4 * m.hidden as u64 + 3 * ffn + heads * hd)
                + heads * per_rank_chunk * ctx * 4;
            Ok(vec![whole; n])
        }
    }
}

/// Every valid plan, fewest nodes first, then pipeline, tensor, sequence; or why none.
pub fn place(state: &ClusterState, req: &PlaceRequest) -> Result<Vec<Plan>, Refusal> {
    let mut nodes: Vec<&NodeInfo> = state.nodes.values().collect();
    // Most usable memory first; ties by id, so every replica orders alike.
    nodes.sort_by(|a, b| {
        usable_memory(b)
            .cmp(&usable_memory(a))
            .then(a.id.cmp(&b.id))
    });
    if nodes.is_empty() {
        return Err(Refusal("the cluster has no nodes".into()));
    }
    let counts: Vec<usize> = match req.nodes {
        Some(n) if n == 0 || n > nodes.len() => {
            return Err(Refusal(format!(
                "{n} nodes asked for; the cluster has {}",
                nodes.len()
            )));
        }
        Some(n) => vec![n],
        None => (1..=nodes.len()).collect(),
    };
    let strategies: Vec<Strategy> = match req.strategy {
        Some(s) => vec![s],
        None => Strategy::ALL.to_vec(),
    };
    let mut plans = Vec::new();
    let mut reasons = Vec::new();
    for &n in &counts {
        for &strategy in &strategies {
            // One node runs one rank: any strategy is the whole model there.
            if n == 1 && strategy != Strategy::Pipeline {
                continue;
            }
            let need = match rank_memory(&req.model, strategy, n, req.context, req.chunk) {
                Ok(m) => m,
                Err(why) => {
                    reasons.push(why);
                    continue;
                }
            };
            // The largest rank on the node with the most room, and so on down.
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| need[b].cmp(&need[a]).then(a.cmp(&b)));
            let mut chosen = vec![String::new(); n];
            let mut fits = true;
            for (slot, &rank) in order.iter().enumerate() {
                let node = nodes[slot];
                if need[rank] > usable_memory(node) {
                    fits = false;
                    reasons.push(format!(
                        "{strategy} over {n} nodes needs {} MiB on a node; {} has {} MiB usable",
                        need[rank] >> 20,
                        node.id,
                        usable_memory(node) >> 20
                    ));
                    break;
                }
                chosen[rank] = node.id.clone();
            }
            if fits {
                plans.push(Plan {
                    strategy,
                    nodes: chosen,
                    memory: need,
                });
            }
        }
    }
    if plans.is_empty() {
        reasons.dedup();
        return Err(Refusal(format!(
            "{} fits nowhere: {}",
            req.model.name,
            reasons.join("; ")
        )));
    }
    Ok(plans)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::state::{Event, Indexed, Resources, apply};

    fn smollm2() -> ModelFacts {
        ModelFacts {
            name: "smollm2-135m".into(),
            size: 98_362_432,
            layers: 30,
            hidden: 576,
            heads: 9,
            kv_heads: 3,
            ffn: 1536,
            vocab: 49152,
        }
    }

    fn cluster(memories: &[(&str, u64)]) -> ClusterState {
        memories
            .iter()
            .enumerate()
            .fold(ClusterState::default(), |s, (i, (id, mib))| {
                let info = NodeInfo {
                    id: id.to_string(),
                    http: String::new(),
                    resources: Resources {
                        memory_total: mib << 20,
                        memory_free: mib << 20,
                        cores: 2,
                        backend: Backend::Cpu,
                    },
                    models: vec![],
                    links: BTreeMap::new(),
                };
                apply(
                    &s,
                    &Indexed {
                        term: 1,
                        index: i as u64 + 1,
                        event: Event::NodeUp { info },
                    },
                )
            })
    }

    fn req(strategy: Option<Strategy>, nodes: Option<usize>) -> PlaceRequest {
        PlaceRequest {
            model: smollm2(),
            strategy,
            nodes,
            context: 2048,
            chunk: 256,
        }
    }

    #[test]
    fn a_big_node_holds_the_model_alone_and_splits_use_less_per_node() {
        let s = cluster(&[("a", 4096), ("b", 4096), ("c", 4096)]);
        let plans = place(&s, &req(None, None)).expect("plans");
        assert_eq!(plans[0].nodes.len(), 1, "fewest nodes first");
        let whole = plans[0].memory[0];
        let tensor3 = plans
            .iter()
            .find(|p| p.strategy == Strategy::Tensor && p.nodes.len() == 3)
            .expect("tensor over 3");
        assert!(tensor3.memory.iter().all(|&m| m < whole));
        let pipeline2 = plans
            .iter()
            .find(|p| p.strategy == Strategy::Pipeline && p.nodes.len() == 2)
            .expect("pipeline over 2");
        assert!(pipeline2.memory.iter().all(|&m| m < whole));
        // Sequence holds everything on every rank.
        let seq = plans
            .iter()
            .find(|p| p.strategy == Strategy::Sequence)
            .expect("sequence");
        assert!(seq.memory.iter().all(|&m| m >= whole * 9 / 10));
        // The same request gives the same plans (pure, ordered).
        assert_eq!(plans, place(&s, &req(None, None)).expect("again"));
    }

    #[test]
    fn refusals_say_why() {
        let s = cluster(&[("a", 64), ("b", 64)]);
        let e = place(&s, &req(None, None)).expect_err("too small");
        assert!(e.0.contains("fits nowhere") && e.0.contains("MiB"), "{e}");
        let s = cluster(&[("a", 4096), ("b", 4096), ("c", 4096), ("d", 4096)]);
        let e = place(&s, &req(Some(Strategy::Tensor), Some(4))).expect_err("4 > 3 KV heads");
        assert!(e.0.contains("KV heads"), "{e}");
        let e = place(&s, &req(None, Some(9))).expect_err("9 nodes");
        assert!(e.0.contains("9 nodes"), "{e}");
        assert!(place(&ClusterState::default(), &req(None, None)).is_err());
    }

    #[test]
    fn splitting_lets_small_nodes_hold_what_none_holds_alone() {
        // Each node holds less than the whole model but more than a third of it.
        let whole = rank_memory(&smollm2(), Strategy::Pipeline, 1, 2048, 256).expect("one")[0];
        let mib = (whole * 10 / 9 / 2 + (8 << 20)) >> 20;
        let s = cluster(&[("a", mib), ("b", mib), ("c", mib)]);
        let plans = place(&s, &req(None, None)).expect("plans");
        assert!(plans.iter().all(|p| p.nodes.len() >= 2), "{plans:?}");
        assert!(
            plans
                .iter()
                .any(|p| p.strategy == Strategy::Tensor && p.nodes.len() == 3)
        );
        assert!(plans.iter().all(|p| p.strategy != Strategy::Sequence));
    }
}
