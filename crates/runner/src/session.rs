//! Rank 0's side of a split model: engine sessions that lead the other ranks.
//!
//! [`SplitModel`] owns rank 0 and hands out [`SplitSession`]s, one per sequence; several
//! may be alive at once (a new prompt arrives while others decode), and their steps go
//! out one at a time, in the order rank 0 makes them, on rank 0's one compute thread.

use std::cell::{Cell, RefCell};

use shoal_collectives::Transport;
use shoal_engine::{EngineError, Session};
use shoal_model::Tensor;

use crate::rank::{Rank, RankError};
use crate::step::{Logits, Part, Step};

/// A model split across ranks, led from this process (rank 0).
pub struct SplitModel<T: Transport> {
    rank: RefCell<Rank<T>>,
    /// Set once a step failed: the ranks may be out of step, so the instance is done.
    broken: RefCell<Option<String>>,
    next_seq: Cell<u64>,
}

fn engine_err(e: RankError) -> EngineError {
    match e {
        RankError::Invalid(m) => EngineError::Invalid(m),
        other => EngineError::Invalid(format!("split model failed: {other}")),
    }
}

impl<T: Transport> SplitModel<T> {
    pub fn new(rank: Rank<T>) -> Self {
        Self {
            rank: RefCell::new(rank),
            broken: RefCell::new(None),
            next_seq: Cell::new(0),
        }
    }

    /// A new, empty sequence.
    pub fn session(&self) -> SplitSession<'_, T> {
        SplitSession {
            model: self,
            seq: self.open(),
        }
    }

    /// A new sequence id for [`SplitModel::forward_batch`] (its caches are made on every
    /// rank by its first step).
    pub fn open(&self) -> u64 {
        let seq = self.next_seq.get();
        self.next_seq.set(seq + 1);
        seq
    }

    /// One forward pass over several sequences at once (continuous batching): the logits
    /// rows the parts want, in part order; `None` when no part wants any.
    pub fn forward_batch(&self, parts: Vec<Part>) -> shoal_engine::Result<Option<Tensor>> {
        self.lead(&Step::Batch { parts })
    }

    /// A new sequence holding a copy of the first `len` positions of `from`, on every rank.
    pub fn fork(&self, from: u64, len: usize) -> shoal_engine::Result<u64> {
        let to = self.open();
        self.lead(&Step::Fork {
            from,
            to,
            len: len as u32,
        })?;
        Ok(to)
    }

    /// Frees sequence `seq`'s caches on every rank.
    pub fn release(&self, seq: u64) -> shoal_engine::Result<()> {
        self.lead(&Step::Release { seq }).map(|_| ())
    }

    /// Why the model is broken, once a step has failed past repair.
    pub fn broken(&self) -> Option<String> {
        self.broken.borrow().clone()
    }

    /// Sequences the ranks hold caches for.
    pub fn sequences(&self) -> usize {
        self.rank.borrow().sequences()
    }

    fn lead(&self, step: &Step) -> shoal_engine::Result<Option<Tensor>> {
        if let Some(why) = self.broken.borrow().as_ref() {
            return Err(EngineError::Invalid(format!(
                "the split model failed earlier: {why}"
            )));
        }
        let result = self.rank.borrow_mut().lead(step);
        match result {
            Ok(v) => Ok(v),
            // Refused before any rank started: the instance is intact.
            Err(e @ RankError::Invalid(_)) => Err(engine_err(e)),
            Err(e) => {
                *self.broken.borrow_mut() = Some(e.to_string());
                Err(engine_err(e))
            }
        }
    }

    /// Tells every rank to leave its loop.
    pub fn shutdown(self) -> shoal_engine::Result<()> {
        self.lead(&Step::Shutdown).map(|_| ())
    }
}

/// One sequence of a [`SplitModel`]; its caches are freed on every rank when dropped.
pub struct SplitSession<'m, T: Transport> {
    model: &'m SplitModel<T>,
    seq: u64,
}

impl<T: Transport> Session for SplitSession<'_, T> {
    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> shoal_engine::Result<Tensor> {
        let step = Step::Forward {
            seq: self.seq,
            tokens: tokens.to_vec(),
            logits: if all_logits {
                Logits::All
            } else {
                Logits::Last
            },
        };
        self.model
            .lead(&step)?
            .ok_or_else(|| EngineError::Invalid("rank 0 produced no logits".into()))
    }

    fn append(&mut self, tokens: &[u32]) -> shoal_engine::Result<()> {
        let step = Step::Forward {
            seq: self.seq,
            tokens: tokens.to_vec(),
            logits: Logits::None,
        };
        self.model.lead(&step).map(|_| ())
    }

    fn reset(&mut self) -> shoal_engine::Result<()> {
        self.model.lead(&Step::Reset { seq: self.seq }).map(|_| ())
    }

    fn len(&self) -> usize {
        self.model.rank.borrow().len(self.seq)
    }
}

impl<T: Transport> Drop for SplitSession<'_, T> {
    fn drop(&mut self) {
        if self.model.broken.borrow().is_none() {
            // A failure here marks the model broken; the next call reports it.
            let _ = self.model.lead(&Step::Release { seq: self.seq });
        }
    }
}
