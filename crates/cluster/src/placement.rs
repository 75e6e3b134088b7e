//! Placement: which strategies and node sets can hold a model instance, and what each
//! node would need. Pure: the same state and request give the same plans everywhere.
//!
//! Per-rank memory = its share of the weights + its share of the instance's KV pool (f32
//! keys and values of every position its sequences and kept prefixes may hold) + the
//! working set of one prefill chunk (activations and the attention scores of the chunk
//! against the whole context). The pool is as large as a full batch of full-context
//! sequences where that fits, halved until it does, and never below one full context:
//! the rank 0 scheduler admits within it. A slot's room is 90% of the lesser of its free
//! memory and its total less what placement counted for the instances already on it
//! (their pools grow as they serve; the free memory does not show it yet).
//!
//! A rank needs a slot: a CPU node is one slot, a GPU node one slot per GPU, each with
//! that GPU's memory. Tensor parallelism prefers the GPUs of one node, where the ranks
//! reduce over NCCL instead of TCP (docs/GPU.md).

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
        let (heads, kv_heads, hd) = (self.heads, self.kv_heads, self.head_dim());
        transformer_params(self.hidden, heads, kv_heads, hd, self.ffn, self.vocab)
    }

    /// Bytes per parameter in the file.
    fn bytes_per_param(&self) -> f64 {
        let (layer, embed) = self.params();
        self.size as f64 / (layer * self.layers as u64 + embed).max(1) as f64
    }
}

/// Parameters of one decoder layer (q, k, v, o and the gated FFN) and of the embedding
/// (and of an untied head, the same): the weights placement counts, and the costs a
/// pipeline's stages are balanced by (the runner's split and this estimate agree).
pub fn transformer_params(
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
) -> (u64, u64) {
    let (h, hd) = (hidden as u64, head_dim as u64);
    let attn = h * hd * (2 * heads as u64 + 2 * kv_heads as u64);
    (attn + 3 * h * ffn as u64, vocab as u64 * h)
}

/// What to place.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlaceRequest {
    pub model: ModelFacts,
    /// Only this strategy (any when `None`).
    pub strategy: Option<Strategy>,
    /// Exactly this many ranks (any when `None`); a GPU of a node is a rank.
    pub nodes: Option<usize>,
    /// Context length of the instance.
    pub context: usize,
    /// Positions per prefill chunk.
    pub chunk: usize,
    /// Sequences the instance serves at once: its KV pool holds this many full contexts
    /// where they fit.
    #[serde(default = "one_sequence")]
    pub batch: usize,
}

fn one_sequence() -> usize {
    1
}

/// One way to place the model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub strategy: Strategy,
    /// The node of each rank, in rank order.
    pub nodes: Vec<NodeId>,
    /// The GPU of each rank on its node (`None`: the CPU), in rank order.
    #[serde(default)]
    pub gpus: Vec<Option<u32>>,
    /// Bytes each rank needs.
    pub memory: Vec<u64>,
    /// KV positions of the instance's pool (see the module comment).
    #[serde(default)]
    pub kv_positions: usize,
}

/// Why nothing fits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal(pub String);

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Memory a node can give to one rank (one GPU's, on a GPU node).
pub fn usable_memory(node: &NodeInfo) -> u64 {
    let free = match &node.resources.backend {
        Backend::Cpu => node.resources.memory_free,
        Backend::Cuda { memory_free, .. } => *memory_free,
    };
    free / 10 * 9
}

/// Where a rank can run: a node's CPU, or one of its GPUs.
#[derive(Clone, Debug)]
struct Slot<'a> {
    node: &'a NodeInfo,
    gpu: Option<u32>,
    room: u64,
}

/// What placement counted for the instances already on `node`'s CPU or GPU `gpu` (a
/// failed one is being placed again or gone: its memory is not held for it).
fn counted(state: &ClusterState, node: &NodeId, gpu: Option<u32>) -> u64 {
    state
        .instances
        .values()
        .filter(|i| !matches!(i.status, crate::state::InstanceStatus::Failed(_)))
        .flat_map(|i| i.ranks.iter().zip(&i.memory))
        .filter(|(r, _)| &r.node == node && r.gpu == gpu)
        .map(|(_, m)| *m)
        .sum()
}

/// Room for a rank in `node`'s CPU or GPU `gpu`: 90% of the lesser of its free memory
/// and its total less what is counted for the instances on it.
fn room(state: &ClusterState, node: &NodeInfo, gpu: Option<u32>) -> u64 {
    let total = match &node.resources.backend {
        Backend::Cpu => node.resources.memory_total,
        Backend::Cuda { memory_total, .. } => *memory_total,
    };
    let left = total.saturating_sub(counted(state, &node.id, gpu));
    usable_memory(node).min(left / 10 * 9)
}

/// Every slot of the cluster: roomiest first, a node's GPUs together, ties by node id,
/// so that every replica orders alike.
fn slots(state: &ClusterState) -> Vec<Slot<'_>> {
    let all: Vec<Slot<'_>> = state
        .nodes
        .values()
        .flat_map(|node| {
            let gpus = match &node.resources.backend {
                Backend::Cpu => vec![None],
                Backend::Cuda { count, .. } => (0..(*count).max(1)).map(Some).collect(),
            };
            gpus.into_iter().map(move |gpu| Slot {
                node,
                gpu,
                room: room(state, node, gpu),
            })
        })
        .collect();
    // A node's slots stay together, in GPU order; nodes roomiest first.
    let best = |id: &NodeId| {
        all.iter()
            .filter(|s| &s.node.id == id)
            .map(|s| s.room)
            .max()
            .unwrap_or(0)
    };
    let keys: Vec<u64> = all.iter().map(|s| best(&s.node.id)).collect();
    let mut keyed: Vec<(u64, Slot<'_>)> = keys.into_iter().zip(all).collect();
    keyed.sort_by(|(ra, a), (rb, b)| {
        rb.cmp(ra)
            .then(a.node.id.cmp(&b.node.id))
            .then(a.gpu.cmp(&b.gpu))
    });
    keyed.into_iter().map(|(_, s)| s).collect()
}

/// The slots `n` ranks of `strategy` should try: for tensor parallelism the GPUs of one
/// node when a node has enough of them (NCCL), else the roomiest slots.
fn candidates<'a>(all: &[Slot<'a>], strategy: Strategy, n: usize) -> Vec<Slot<'a>> {
    if strategy == Strategy::Tensor && n > 1 {
        let one_node = all.iter().filter(|s| s.gpu == Some(0)).find_map(|first| {
            let same: Vec<Slot<'a>> = all
                .iter()
                .filter(|o| o.node.id == first.node.id)
                .take(n)
                .cloned()
                .collect();
            (same.len() == n).then_some(same)
        });
        if let Some(same) = one_node {
            return same;
        }
    }
    all.iter().take(n).cloned().collect()
}

/// Even split of `total` into `n` parts (the first ones one larger).
fn even(total: usize, n: usize) -> Vec<usize> {
    (0..n)
        .map(|i| total / n + usize::from(i < total % n))
        .collect()
}

/// Layers of each pipeline rank, in rank order, for ranks whose speeds are `shares`.
///
/// Rank 0 holds the embedding and the head (the last stage sends it the hidden rows of
/// the wanted positions, not whole logits rows), and the head's matmul runs for every
/// answer token: on a small model it is a fifth of the work. A pipeline keeps pace with
/// its slowest stage, so rank 0 takes fewer layers, until every stage costs about its
/// share of `layers * layer_cost + head_cost`. Every rank keeps at least one layer.
pub fn pipeline_layers(
    layers: usize,
    layer_cost: u64,
    head_cost: u64,
    shares: &[f64],
) -> Result<Vec<usize>, String> {
    let n = shares.len();
    if n == 0 {
        return Err("no ranks".into());
    }
    if n > layers {
        return Err(format!(
            "pipeline needs a layer per rank: {layers} layers, {n} ranks"
        ));
    }
    if n == 1 {
        return Ok(vec![layers]);
    }
    let sum: f64 = shares.iter().sum();
    let total = (layers as u64 * layer_cost + head_cost) as f64;
    let lc = layer_cost.max(1) as f64;
    let first = ((total * shares[0] / sum - head_cost as f64) / lc).round();
    let first = (first.max(1.0) as usize).min(layers - (n - 1));
    // The rest by their shares, each at least one layer.
    let rest = layers - first;
    let rest_sum: f64 = shares[1..].iter().sum();
    let mut out = vec![first];
    let (mut acc, mut placed) = (0.0, 0);
    for (i, s) in shares[1..].iter().enumerate() {
        let left = n - 2 - i;
        acc += s;
        let upto = if left == 0 {
            rest
        } else {
            ((rest as f64 * acc / rest_sum).round() as usize).clamp(placed + 1, rest - left)
        };
        out.push(upto - placed);
        placed = upto;
    }
    Ok(out)
}

/// Bytes each of `n` ranks needs under `strategy` with a KV pool of `kv_positions` (at
/// least the context), or why the model cannot be split so.
pub fn rank_memory(
    m: &ModelFacts,
    strategy: Strategy,
    n: usize,
    context: usize,
    chunk: usize,
    kv_positions: usize,
) -> Result<Vec<u64>, String> {
    let bpp = m.bytes_per_param();
    let (layer_params, embed_params) = m.params();
    let hd = m.head_dim() as u64;
    let ctx = context as u64;
    let pool = kv_positions.max(context) as u64;
    let chunk = chunk.min(context).max(1) as u64;
    // Keys and values are kept in 16 bits: f16 on a CPU, bf16 on a GPU.
    let kv = |layers: u64, kv_heads: u64| 2 * pool * layers * kv_heads * hd * 2;
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
            let split = pipeline_layers(m.layers, layer_params, embed_params, &vec![1.0; n])?;
            Ok(split
                .into_iter()
                .enumerate()
                .map(|(r, l)| {
                    let l = l as u64;
                    // Rank 0 holds the embedding and, split, the head beside it.
                    let ends = match (r, n) {
                        (0, 1) => embed_params,
                        (0, _) => 2 * embed_params,
                        _ => 0,
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

/// The KV pools to try, largest first: `batch` full contexts, halved down to one.
fn pools(context: usize, batch: usize) -> Vec<usize> {
    let mut out = vec![context.saturating_mul(batch.max(1))];
    while let Some(&last) = out.last() {
        if last <= context {
            break;
        }
        out.push((last / 2).max(context));
    }
    out
}

/// Slots for ranks needing `need` bytes each: the largest rank in the roomiest slot, and
/// so on down; in rank order, or why one does not fit.
fn fit<'s, 'a>(
    slots: &'s [Slot<'a>],
    need: &[u64],
    strategy: Strategy,
) -> Result<Vec<&'s Slot<'a>>, String> {
    let n = need.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| need[b].cmp(&need[a]).then(a.cmp(&b)));
    let mut chosen: Vec<Option<&Slot>> = vec![None; n];
    for (slot, &rank) in slots.iter().zip(&order) {
        if need[rank] > slot.room {
            return Err(format!(
                "{strategy} over {n} ranks needs {} MiB for a rank; {}{} has {} MiB usable",
                need[rank] >> 20,
                slot.node.id,
                slot.gpu.map(|g| format!(" GPU {g}")).unwrap_or_default(),
                slot.room >> 20
            ));
        }
        chosen[rank] = Some(slot);
    }
    Ok(chosen.into_iter().flatten().collect())
}

/// Every valid plan, fewest ranks first, then pipeline, tensor, sequence; or why none.
pub fn place(state: &ClusterState, req: &PlaceRequest) -> Result<Vec<Plan>, Refusal> {
    let all = slots(state);
    if all.is_empty() {
        return Err(Refusal("the cluster has no nodes".into()));
    }
    let counts: Vec<usize> = match req.nodes {
        Some(n) if n == 0 || n > all.len() => {
            return Err(Refusal(format!(
                "{n} ranks asked for; the cluster has {} (a node's CPU or each of its GPUs)",
                all.len()
            )));
        }
        Some(n) => vec![n],
        None => (1..=all.len()).collect(),
    };
    let strategies: Vec<Strategy> = match req.strategy {
        Some(s) => vec![s],
        None => Strategy::ALL.to_vec(),
    };
    let mut plans = Vec::new();
    let mut reasons = Vec::new();
    for &n in &counts {
        for &asked in &strategies {
            // One rank holds the whole model: any strategy is the same there, so a
            // request for one gets the one-rank plan (called a pipeline of one stage).
            if n == 1 && asked != Strategy::Pipeline && req.strategy.is_none() {
                continue;
            }
            let strategy = if n == 1 { Strategy::Pipeline } else { asked };
            let slots = candidates(&all, strategy, n);
            // The largest pool that fits, down to one full context.
            let mut last_why = None;
            for pool in pools(req.context, req.batch) {
                let need = match rank_memory(&req.model, strategy, n, req.context, req.chunk, pool)
                {
                    Ok(m) => m,
                    Err(why) => {
                        last_why = Some(why);
                        break;
                    }
                };
                match fit(&slots, &need, strategy) {
                    Ok(chosen) => {
                        plans.push(Plan {
                            strategy,
                            nodes: chosen.iter().map(|s| s.node.id.clone()).collect(),
                            gpus: chosen.iter().map(|s| s.gpu).collect(),
                            memory: need,
                            kv_positions: pool,
                        });
                        last_why = None;
                        break;
                    }
                    Err(why) => last_why = Some(why),
                }
            }
            reasons.extend(last_why);
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
                    fetching: BTreeMap::new(),
                    hostname: String::new(),
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
            batch: 1,
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
    fn one_rank_of_any_strategy_is_the_whole_model() {
        let s = cluster(&[("a", 4096), ("b", 4096)]);
        for strategy in Strategy::ALL {
            let plans = place(&s, &req(Some(strategy), Some(1))).expect("one rank fits");
            assert_eq!(plans.len(), 1, "{strategy}");
            assert_eq!(plans[0].strategy, Strategy::Pipeline, "{strategy}");
            assert_eq!(plans[0].nodes.len(), 1, "{strategy}");
        }
    }

    #[test]
    fn refusals_say_why() {
        let s = cluster(&[("a", 64), ("b", 64)]);
        let e = place(&s, &req(None, None)).expect_err("too small");
        assert!(e.0.contains("fits nowhere") && e.0.contains("MiB"), "{e}");
        let s = cluster(&[("a", 4096), ("b", 4096), ("c", 4096), ("d", 4096)]);
        let e = place(&s, &req(Some(Strategy::Tensor), Some(4))).expect_err("4 > 3 KV heads");
        assert!(e.0.contains("KV heads"), "{e}");
        let e = place(&s, &req(None, Some(9))).expect_err("9 ranks");
        assert!(e.0.contains("9 ranks"), "{e}");
        assert!(place(&ClusterState::default(), &req(None, None)).is_err());
    }

    #[test]
    fn pipeline_stages_cost_alike_with_the_head_on_rank_0() {
        // smollm2-135m: 30 layers of 3.54M parameters, a 28.3M head.
        let split = pipeline_layers(30, 3_540_000, 28_300_000, &[1.0, 1.0]).expect("2");
        assert_eq!(split, vec![11, 19]);
        let cost = |r: usize, l: usize| l as u64 * 3_540_000 + if r == 0 { 28_300_000 } else { 0 };
        let (a, b) = (cost(0, split[0]), cost(1, split[1]));
        assert!(a.abs_diff(b) <= 3_540_000, "{a} vs {b}");
        // Without a head to carry, an even split; shares move layers to the faster.
        assert_eq!(pipeline_layers(30, 10, 0, &[1.0, 1.0]), Ok(vec![15, 15]));
        assert_eq!(pipeline_layers(30, 10, 0, &[2.0, 1.0]), Ok(vec![20, 10]));
        assert_eq!(pipeline_layers(9, 10, 0, &[1.0; 3]), Ok(vec![3, 3, 3]));
        // A head heavier than a stage's share leaves rank 0 one layer, never none.
        assert_eq!(pipeline_layers(4, 10, 1000, &[1.0, 1.0]), Ok(vec![1, 3]));
        assert_eq!(pipeline_layers(3, 10, 1000, &[1.0; 3]), Ok(vec![1, 1, 1]));
        assert_eq!(pipeline_layers(7, 10, 0, &[1.0]), Ok(vec![7]));
        for n in 1..=7 {
            let split = pipeline_layers(7, 10, 25, &vec![1.0; n]).expect("fits");
            assert_eq!(split.len(), n);
            assert_eq!(split.iter().sum::<usize>(), 7);
            assert!(split.iter().all(|&l| l >= 1), "{split:?}");
        }
        assert!(pipeline_layers(2, 10, 0, &[1.0; 3]).is_err());
        assert!(pipeline_layers(2, 10, 0, &[]).is_err());
    }

    #[test]
    fn splitting_lets_small_nodes_hold_what_none_holds_alone() {
        // Each node holds less than the whole model but more than a third of it.
        let whole =
            rank_memory(&smollm2(), Strategy::Pipeline, 1, 2048, 256, 2048).expect("one")[0];
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

    fn with_gpu_node(mut s: ClusterState, id: &str, gpus: u32, gib_each: u64) -> ClusterState {
        let info = NodeInfo {
            id: id.into(),
            http: String::new(),
            resources: Resources {
                memory_total: 64 << 30,
                memory_free: 64 << 30,
                cores: 32,
                backend: Backend::Cuda {
                    name: "H200".into(),
                    memory_total: gib_each << 30,
                    memory_free: gib_each << 30,
                    count: gpus,
                },
            },
            models: vec![],
            links: BTreeMap::new(),
            fetching: BTreeMap::new(),
            hostname: String::new(),
        };
        s.nodes.insert(id.into(), info);
        s
    }

    /// A model of about `gib` GiB with smollm2's proportions scaled up.
    fn big(gib: u64) -> ModelFacts {
        ModelFacts {
            name: "big".into(),
            size: gib << 30,
            layers: 80,
            hidden: 8192,
            heads: 64,
            kv_heads: 8,
            ffn: 28672,
            vocab: 128_256,
        }
    }

    #[test]
    fn each_gpu_is_a_rank_and_tensor_parallelism_stays_on_one_node() {
        // Two CPU nodes with much more memory than a GPU, and a node with 4 GPUs.
        let s = with_gpu_node(cluster(&[("a", 512 << 10), ("b", 512 << 10)]), "g", 4, 141);
        let r = PlaceRequest {
            model: big(140),
            strategy: Some(Strategy::Tensor),
            nodes: Some(2),
            context: 4096,
            chunk: 256,
            batch: 1,
        };
        let plans = place(&s, &r).expect("plans");
        assert_eq!(plans[0].nodes, ["g", "g"], "{plans:?}");
        assert_eq!(plans[0].gpus, [Some(0), Some(1)]);
        // Four ranks: the four GPUs of g.
        let r4 = PlaceRequest {
            nodes: Some(4),
            ..r.clone()
        };
        let plans = place(&s, &r4).expect("plans");
        assert_eq!(plans[0].nodes, ["g"; 4]);
        assert_eq!(plans[0].gpus, [Some(0), Some(1), Some(2), Some(3)]);
        // A model too large for one GPU: the fewest ranks that hold it are GPUs of g
        // when only g is in the cluster.
        let only_g = with_gpu_node(ClusterState::default(), "g", 4, 141);
        let any = PlaceRequest {
            strategy: None,
            nodes: None,
            ..r.clone()
        };
        let plans = place(&only_g, &any).expect("plans");
        assert!(
            plans[0].nodes.len() >= 2,
            "140 GiB does not fit one 141 GiB GPU beside its cache"
        );
        assert!(plans.iter().all(|p| p.nodes.iter().all(|n| n == "g")));
        assert!(plans.iter().all(|p| p.gpus.iter().all(Option::is_some)));
        // Ranks beyond the slots are refused with the count.
        let e = place(
            &only_g,
            &PlaceRequest {
                nodes: Some(5),
                ..r
            },
        )
        .expect_err("5 > 4 GPUs");
        assert!(e.0.contains("5 ranks") && e.0.contains("4"), "{e}");
    }

    #[test]
    fn cpu_nodes_are_one_rank_each() {
        let s = cluster(&[("a", 4096), ("b", 4096)]);
        let plans = place(&s, &req(Some(Strategy::Tensor), Some(2))).expect("plans");
        assert_eq!(plans[0].gpus, [None, None]);
        let mut nodes = plans[0].nodes.clone();
        nodes.sort();
        assert_eq!(nodes, ["a", "b"]);
    }

    #[test]
    fn the_kv_pool_holds_the_batch_where_it_fits_and_one_context_at_least() {
        assert_eq!(pools(2048, 16), [32768, 16384, 8192, 4096, 2048]);
        assert_eq!(pools(2048, 1), [2048]);
        assert_eq!(pools(3000, 3), [9000, 4500, 3000]);
        let batch = |batch| PlaceRequest {
            batch,
            ..req(None, Some(1))
        };
        let one = rank_memory(&smollm2(), Strategy::Pipeline, 1, 2048, 256, 2048).expect("1")[0];
        let per_context =
            rank_memory(&smollm2(), Strategy::Pipeline, 1, 2048, 256, 4096).expect("2")[0] - one;
        // Room for the weights and about five contexts: the pool of 16 is halved to 4.
        let roomy = (one + 4 * per_context + per_context / 2) / 9 * 10;
        let s = cluster(&[("a", (roomy >> 20) + 1)]);
        let plan = &place(&s, &batch(16)).expect("fits")[0];
        assert_eq!(plan.kv_positions, 4 * 2048);
        assert_eq!(plan.memory[0], one + 3 * per_context);
        // A batch of one is one context; so is a node with room for nothing more.
        assert_eq!(place(&s, &batch(1)).expect("fits")[0].kv_positions, 2048);
        let tight = cluster(&[("a", ((one / 9 * 10) >> 20) + 1)]);
        assert_eq!(
            place(&tight, &batch(16)).expect("fits")[0].kv_positions,
            2048
        );
    }

    #[test]
    fn what_an_instance_was_counted_is_not_given_again_though_it_is_still_free() {
        let s = cluster(&[("a", 4096), ("b", 4096)]);
        let r = PlaceRequest {
            batch: 1,
            ..req(Some(Strategy::Pipeline), Some(1))
        };
        let first = place(&s, &r).expect("plans")[0].clone();
        // An instance counted at nearly all of a's memory, which it does not use yet: a's
        // free memory is unchanged, but the next instance goes to b.
        let mut with = s.clone();
        with.instances.insert(
            "big".into(),
            crate::state::Instance {
                id: "big".into(),
                model: "m".into(),
                strategy: Strategy::Pipeline,
                context: 2048,
                ranks: vec![crate::state::RankSlot {
                    node: first.nodes[0].clone(),
                    gpu: None,
                    port: None,
                    status: crate::state::RunnerStatus::Idle,
                }],
                token: String::new(),
                status: crate::state::InstanceStatus::Starting,
                attempt: 0,
                kv_positions: 2048,
                memory: vec![4000 << 20],
            },
        );
        let next = place(&with, &r).expect("plans");
        assert_ne!(next[0].nodes, first.nodes, "{next:?}");
        // A failed instance holds nothing: it is being placed again, or gone.
        let mut failed = with.clone();
        if let Some(i) = failed.instances.get_mut("big") {
            i.status = crate::state::InstanceStatus::Failed("rank lost".into());
        }
        assert_eq!(place(&failed, &r).expect("plans")[0].nodes, first.nodes);
        // Both nodes so counted: nothing fits, and the refusal says how much is usable.
        let other = next[0].nodes[0].clone();
        let mut full = with.clone();
        let mut second = full.instances["big"].clone();
        second.id = "big2".into();
        second.ranks[0].node = other;
        full.instances.insert("big2".into(), second);
        let e = place(&full, &r).expect_err("no room");
        assert!(e.0.contains("MiB usable"), "{e}");
    }
}
