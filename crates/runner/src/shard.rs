//! Shard plans: which part of the model each rank holds.

pub use shoal_cluster::Strategy;
use shoal_cluster::placement::{pipeline_layers, transformer_params};
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
            let (layer, head) = transformer_params(
                config.hidden_size,
                config.num_heads,
                config.num_kv_heads,
                config.head_dim,
                config.ffn_size,
                config.vocab_size,
            );
            let split = pipeline_layers(n, layer, head, shares).map_err(RankError::Plan)?;
            let mut first = 0;
            split
                .into_iter()
                .enumerate()
                .map(|(r, l)| {
                    let layers = first..first + l;
                    first += l;
                    // Rank 0 holds the head: the last stage sends it hidden rows.
                    LoadSpec {
                        embed: r == 0,
                        layers,
                        head: r == 0,
                        tensor: None,
                    }
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
