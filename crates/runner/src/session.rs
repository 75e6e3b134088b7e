//! Rank 0's side of a split model: an engine session that leads the other ranks.

use shoal_collectives::Transport;
use shoal_engine::{EngineError, Session};
use shoal_model::Tensor;

use crate::rank::{Rank, RankError};
use crate::step::Step;

/// A sequence computed by every rank of an instance, led by rank 0.
pub struct SplitSession<T: Transport> {
    rank: Rank<T>,
    /// Set once a step failed: the ranks may be out of step, so the instance is done.
    broken: Option<String>,
}

fn engine_err(e: RankError) -> EngineError {
    match e {
        RankError::Invalid(m) => EngineError::Invalid(m),
        other => EngineError::Invalid(format!("split model failed: {other}")),
    }
}

impl<T: Transport> SplitSession<T> {
    pub fn new(rank: Rank<T>) -> Self {
        Self { rank, broken: None }
    }

    pub fn rank(&self) -> &Rank<T> {
        &self.rank
    }

    fn lead(&mut self, step: &Step) -> shoal_engine::Result<Option<Tensor>> {
        if let Some(why) = &self.broken {
            return Err(EngineError::Invalid(format!(
                "the split model failed earlier: {why}"
            )));
        }
        match self.rank.lead(step) {
            Ok(v) => Ok(v),
            // Refused before any rank started: the instance is intact.
            Err(e @ RankError::Invalid(_)) => Err(engine_err(e)),
            Err(e) => {
                self.broken = Some(e.to_string());
                Err(engine_err(e))
            }
        }
    }

    /// Tells every rank to leave its loop.
    pub fn shutdown(mut self) -> shoal_engine::Result<()> {
        self.lead(&Step::Shutdown).map(|_| ())
    }
}

impl<T: Transport> Session for SplitSession<T> {
    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> shoal_engine::Result<Tensor> {
        let step = Step::Forward {
            tokens: tokens.to_vec(),
            all_logits,
        };
        self.lead(&step)?
            .ok_or_else(|| EngineError::Invalid("rank 0 produced no logits".into()))
    }

    fn reset(&mut self) -> shoal_engine::Result<()> {
        self.lead(&Step::Reset).map(|_| ())
    }

    fn len(&self) -> usize {
        self.rank.len()
    }
}
