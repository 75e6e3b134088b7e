//! Shard plans: which part of the model each rank holds.

pub use shoal_cluster::Strategy;
use shoal_model::{LoadSpec, ModelConfig, tensor_slices};

use crate::RankError;

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
