//! Shard plans: which part of the model each rank holds.

use std::fmt;
use std::str::FromStr;

use shoal_model::{LoadSpec, ModelConfig, tensor_slices};

use crate::RankError;

/// How a model is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// Contiguous layer ranges; hidden states pass rank to rank.
    Pipeline,
    /// Every layer cut into KV groups and FFN slices; two all-reduces per layer.
    Tensor,
    /// Every rank holds the whole model; a prompt is split across ranks (ring
    /// attention) and decode runs on every rank without communication.
    Sequence,
}

impl Strategy {
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

/// One rank's part of a model instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    pub strategy: Strategy,
    pub rank: usize,
    pub world: usize,
    /// What the loader reads for this rank.
    pub load: LoadSpec,
}

/// Splits `config` over `world` equal ranks.
pub fn plan(
    config: &ModelConfig,
    strategy: Strategy,
    world: usize,
) -> Result<Vec<ShardSpec>, RankError> {
    plan_weighted(config, strategy, &vec![1.0; world.max(1)]).and_then(|p| {
        if world == 0 {
            Err(RankError::Plan("no ranks".into()))
        } else {
            Ok(p)
        }
    })
}

/// Splits `config` over ranks whose speeds are `shares` (a faster rank takes more).
pub fn plan_weighted(
    config: &ModelConfig,
    strategy: Strategy,
    shares: &[f64],
) -> Result<Vec<ShardSpec>, RankError> {
    let world = shares.len();
    let n = config.num_layers;
    let loads: Vec<LoadSpec> = match strategy {
        Strategy::Pipeline => {
            if world > n {
                return Err(RankError::Plan(format!(
                    "pipeline over {world} ranks needs at least {world} layers; the model has {n}"
                )));
            }
            let total: f64 = shares.iter().sum();
            let mut bounds = vec![0];
            let mut acc = 0.0;
            for (i, s) in shares.iter().enumerate().take(world - 1) {
                acc += s;
                let b = ((n as f64 * acc / total).round() as usize)
                    .clamp(bounds[i] + 1, n - (world - 1 - i));
                bounds.push(b);
            }
            bounds.push(n);
            bounds
                .windows(2)
                .enumerate()
                .map(|(r, w)| LoadSpec {
                    embed: r == 0,
                    layers: w[0]..w[1],
                    head: r == world - 1,
                    tensor: None,
                })
                .collect()
        }
        Strategy::Tensor => tensor_slices(config, shares)
            .map_err(|e| RankError::Plan(e.to_string()))?
            .into_iter()
            .enumerate()
            .map(|(r, slice)| LoadSpec {
                embed: true,
                layers: 0..n,
                head: r == 0,
                tensor: Some(slice),
            })
            .collect(),
        Strategy::Sequence => (0..world).map(|_| LoadSpec::full(n)).collect(),
    };
    Ok(loads
        .into_iter()
        .enumerate()
        .map(|(rank, load)| ShardSpec {
            strategy,
            rank,
            world,
            load,
        })
        .collect())
}
