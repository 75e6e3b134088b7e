//! A sequence being computed: the engine's generation, scoring and benchmark loops run on
//! a [`Session`], whether the model lives in this process ([`LocalSession`]) or is split
//! across ranks (the runner's sessions).

use shoal_model::{KvCache, Model, Tensor};

use crate::Result;

/// One sequence's state on whatever computes it.
pub trait Session {
    /// Appends `tokens` to the sequence and returns logits: `(t, vocab)` for every new
    /// position when `all_logits`, else `(1, vocab)` for the last one.
    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Tensor>;
    /// Appends `tokens` without computing any logits (a prefill chunk before the last).
    fn append(&mut self, tokens: &[u32]) -> Result<()> {
        self.forward(tokens, false).map(|_| ())
    }
    /// Greedy decoding of up to `n` tokens after `token`, each handed to `sink` (false
    /// stops it), on a path that needs no host round trip between tokens
    /// ([`Model::greedy`]); how many `sink` got, or `None` where there is no such path
    /// and the caller steps with `forward`.
    fn greedy(
        &mut self,
        token: u32,
        n: usize,
        sink: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Option<usize>> {
        let _ = (token, n, sink);
        Ok(None)
    }
    /// Forgets the sequence: the next `forward` starts at position 0.
    fn reset(&mut self) -> Result<()>;
    /// Positions the sequence holds.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A whole model in this process and one KV cache.
pub struct LocalSession<'m> {
    model: &'m Model,
    cache: KvCache,
}

impl<'m> LocalSession<'m> {
    pub fn new(model: &'m Model) -> Self {
        Self {
            model,
            cache: model.new_cache(),
        }
    }
}

impl Session for LocalSession<'_> {
    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> Result<Tensor> {
        Ok(self.model.forward(tokens, &mut self.cache, all_logits)?)
    }

    fn append(&mut self, tokens: &[u32]) -> Result<()> {
        let h = self.model.embed(tokens)?;
        self.model.forward_layers(h, &mut self.cache)?;
        Ok(())
    }

    fn greedy(
        &mut self,
        token: u32,
        n: usize,
        sink: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Option<usize>> {
        Ok(self.model.greedy(token, &mut self.cache, n, sink)?)
    }

    fn reset(&mut self) -> Result<()> {
        self.cache.clear();
        Ok(())
    }

    fn len(&self) -> usize {
        self.cache.len()
    }
}
