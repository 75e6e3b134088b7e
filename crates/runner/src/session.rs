//! Rank 0's side of a split model: engine sessions that lead the other ranks.
//!
//! [`SplitModel`] owns rank 0 and hands out [`SplitSession`]s, one per sequence; several
//! may be alive at once (a new prompt arrives while others decode), and their steps go
//! out one at a time, in the order rank 0 makes them, on rank 0's one compute thread.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

use shoal_collectives::Transport;
use shoal_engine::{EngineError, Session};
use shoal_model::Tensor;

use crate::rank::{Pending, Rank, RankError};
use crate::shard::Strategy;
use crate::step::{Logits, Part, Step};

/// A model split across ranks, led from this process (rank 0).
pub struct SplitModel<T: Transport> {
    rank: RefCell<Rank<T>>,
    /// Set once a step failed: the ranks may be out of step, so the instance is done.
    broken: RefCell<Option<String>>,
    next_seq: Cell<u64>,
    /// Batched steps started and not yet finished, oldest first.
    in_flight: RefCell<VecDeque<Pending>>,
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
            in_flight: RefCell::new(VecDeque::new()),
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

    /// How many batched steps may be in flight at once to keep every rank busy: a
    /// pipeline's stages work on different micro-batches at the same time; the other
    /// strategies run each step on all ranks together.
    pub fn stages(&self) -> usize {
        let rank = self.rank.borrow();
        match rank.spec().strategy {
            Strategy::Pipeline => rank.spec().world,
            Strategy::Tensor | Strategy::Sequence => 1,
        }
    }

    /// [`SplitModel::forward_batch`] without waiting for the logits: rank 0 does its
    /// share and returns; [`SplitModel::collect`] gives the logits of the oldest step
    /// started. A sequence in a started step must not be in another before it is
    /// collected, unless the first step wants none of its logits.
    pub fn submit(&self, parts: Vec<Part>) -> shoal_engine::Result<()> {
        let pending = self.guarded(|rank| rank.start(&Step::Batch { parts }))?;
        self.in_flight.borrow_mut().push_back(pending);
        Ok(())
    }

    /// The logits of the oldest step [`SplitModel::submit`] started (`None`: it wanted
    /// none, or none is in flight).
    pub fn collect(&self) -> shoal_engine::Result<Option<Tensor>> {
        let Some(pending) = self.in_flight.borrow_mut().pop_front() else {
            return Ok(None);
        };
        self.guarded(|rank| rank.finish(pending))
    }

    /// Steps submitted and not collected.
    pub fn in_flight(&self) -> usize {
        self.in_flight.borrow().len()
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
        let wants_logits = matches!(step, Step::Forward { .. } | Step::Batch { .. });
        if wants_logits && self.in_flight() > 0 {
            // Its logits would be read before those of the steps already in flight.
            return Err(EngineError::Invalid(
                "a forward step cannot be led while batched steps are in flight".into(),
            ));
        }
        self.guarded(|rank| rank.lead(step))
    }

    /// Runs `f` on rank 0 unless the model is broken, and marks it broken when `f` fails
    /// past repair (every step in flight is lost with it).
    fn guarded<R>(
        &self,
        f: impl FnOnce(&mut Rank<T>) -> Result<R, RankError>,
    ) -> shoal_engine::Result<R> {
        if let Some(why) = self.broken.borrow().as_ref() {
            return Err(EngineError::Invalid(format!(
                "the split model failed earlier: {why}"
            )));
        }
        let result = f(&mut self.rank.borrow_mut());
        match result {
            Ok(v) => Ok(v),
            // Refused before any rank started: the instance is intact.
            Err(e @ RankError::Invalid(_)) => Err(engine_err(e)),
            Err(e) => {
                *self.broken.borrow_mut() = Some(e.to_string());
                self.in_flight.borrow_mut().clear();
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
