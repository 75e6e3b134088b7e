//! One model instance split across ranks (processes, possibly on different machines).
//!
//! - [`shard`]: which part of the model each rank holds, per strategy (pipeline: layer
//!   ranges; tensor: KV groups and FFN slices of every layer; sequence: everything, with
//!   the prompt split across ranks).
//! - [`step`]: what rank 0 tells every rank to do next. Rank 0 alone decides (which
//!   tokens, reset, shutdown) and broadcasts the decision, so every rank runs the same
//!   tensor work and the same collectives in the same order, on one compute thread.
//! - [`rank`]: the program every rank runs: receive a step, execute it, repeat.
//! - [`session`]: rank 0's side, an engine [`shoal_engine::Session`], so generation,
//!   scoring and benchmarks run unchanged on a split model.
//! - [`launch`]: starting N ranks as local processes (`--ranks N`).
//! - [`control`]: the typed protocol between a node and its runner; [`link`] the
//!   runner's end of it; [`serve`] rank 0's loop serving many requests at once, each step
//!   decided by the pure [`scheduler`].
//! - `nccl` (feature `nccl`): the all-reduce between the GPUs of one machine.

pub mod control;
pub mod launch;
pub mod link;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod rank;
pub mod scheduler;
pub mod serve;
pub mod session;
pub mod shard;
pub mod step;

pub use rank::{Rank, RankError};
pub use session::{SplitModel, SplitSession};
pub use shard::{ShardSpec, Strategy, plan};
pub use step::{Logits, Part, Step};
