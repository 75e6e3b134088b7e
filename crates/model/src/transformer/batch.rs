//! Continuous batching in the model: one forward pass over the new positions of several
//! sequences, each with its own cache. The projections and the FFN see all rows at once
//! (one matmul, and one all-reduce per half-layer on a tensor-parallel shard); attention
//! runs per sequence against its own keys and values.

use candle_core::Tensor;
use shoal_kernels::Rows;

use super::{DecoderLayer, Model, causal_mask};
use crate::{KvCache, ModelError, Result, ShardLinks};

/// Where a batch's sequences are: each one's first new position, attention mask, and
/// for decode rows on the CPU the rotary tables' rows ([`Model::decode_rope`]).
#[derive(Clone, Copy)]
struct Positions<'a> {
    starts: &'a [usize],
    masks: &'a [Option<Tensor>],
    rope: Option<&'a (Tensor, Tensor)>,
}

/// One sequence's share of a batched forward ([`Model::forward_layers_batch`]): its cache
/// and how many of the batch's rows are its new positions.
pub struct BatchPart<'c> {
    pub cache: &'c mut KvCache,
    pub rows: usize,
}

impl Model {
    /// Runs the decoder layers over the new positions of several sequences at once:
    /// `hidden` holds their rows one sequence after another, `parts` says whose they are
    /// (each part's cache gets its own rows' keys and values). The projections and the
    /// FFN are one matmul over all rows (and, for a tensor-parallel shard, one all-reduce
    /// each); attention runs per sequence. Equal to one [`Model::forward_layers_with`]
    /// per part, up to the order of float sums inside the batched matmuls.
    pub fn forward_layers_batch(
        &self,
        hidden: Tensor,
        parts: &mut [BatchPart<'_>],
        links: Option<&mut dyn ShardLinks>,
    ) -> Result<Tensor> {
        // Decode rows on a GPU: attention on the decode kernels, all sequences at once.
        #[cfg(feature = "cuda")]
        if links.is_none()
            && parts.iter().all(|p| p.rows == 1)
            && hidden.dim(0)? == parts.len()
            && let Some(x) = self.gpu_decode_rows(&hidden, parts)?
        {
            for p in parts.iter_mut() {
                p.cache.advance(1);
            }
            return Ok(x);
        }
        if let [one] = parts {
            return self.forward_layers_with(hidden, one.cache, links);
        }
        let mut links = links;
        if self.spec.tensor.is_some() && links.is_none() {
            return Err(ModelError::Invalid(
                "a tensor-parallel shard needs links to its peers".into(),
            ));
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        if rows != hidden.dim(0)? || parts.iter().any(|p| p.rows == 0) {
            return Err(ModelError::Invalid(format!(
                "a batch of {} rows for parts of {:?} rows",
                hidden.dim(0)?,
                parts.iter().map(|p| p.rows).collect::<Vec<_>>()
            )));
        }
        let starts: Vec<usize> = parts.iter().map(|p| p.cache.len()).collect();
        let mut masks = Vec::with_capacity(parts.len());
        for (p, &pos) in parts.iter().zip(&starts) {
            if pos + p.rows > self.max_len {
                return Err(ModelError::ContextFull {
                    positions: pos + p.rows,
                    context: self.max_len,
                });
            }
            masks.push(causal_mask(
                p.rows,
                pos,
                self.config.group_size(),
                &self.compute,
            )?);
        }
        // Prompt rows (parts of two rows or more) take the kernels' prompt paths, decode
        // rows the single-token ones, however many of each are together: every row is
        // computed as it would be alone (see `Model::forward_layers_with`). A batch with
        // both runs as two groups on a machine whose two paths round otherwise (AMX, AVX2
        // in GGUF's layout); elsewhere one pass serves all. (The scheduler never slices a
        // prompt into a lone row.)
        let long = |p: &BatchPart<'_>| p.rows >= 2;
        let both = parts.iter().any(long) && !parts.iter().all(long);
        let mixed = both && self.runs_apart(&mut links)?;
        let x = if mixed {
            self.forward_groups(hidden, parts, &starts, &masks, &mut links)?
        } else {
            let rows = if parts.iter().all(long) {
                Rows::Bf16
            } else {
                Rows::Int8
            };
            shoal_kernels::with_rows(rows, || {
                self.run_layers(hidden, parts, &starts, &masks, &mut links)
            })?
        };
        for p in parts.iter_mut() {
            p.cache.advance(p.rows);
        }
        Ok(x)
    }

    /// Whether a batch holding prompt and decode rows runs them as two groups. A
    /// tensor-parallel shard asks every rank (one all-reduce of a flag): each half-layer's
    /// all-reduce pairs up only if every rank groups alike, and the ranks' machines may
    /// differ (one with AMX, one without).
    fn runs_apart(&self, links: &mut Option<&mut dyn ShardLinks>) -> Result<bool> {
        let mut apart = [if self.rows_round_alike { 0.0 } else { 1.0 }];
        if let Some(links) = links.as_deref_mut() {
            links.all_reduce_sum(&mut apart)?;
        }
        Ok(apart[0] > 0.0)
    }

    /// Marks this model's machine as one whose prompt and decode rows round otherwise
    /// (as AMX's do): a test stands in for such a machine among ranks on one.
    pub fn with_rows_apart(mut self) -> Self {
        self.rows_round_alike = false;
        self
    }

    fn run_layers(
        &self,
        hidden: Tensor,
        parts: &mut [BatchPart<'_>],
        starts: &[usize],
        masks: &[Option<Tensor>],
        links: &mut Option<&mut dyn ShardLinks>,
    ) -> Result<Tensor> {
        let rope = self.decode_rope(parts, starts)?;
        let at = Positions {
            starts,
            masks,
            rope: rope.as_ref(),
        };
        let mut x = hidden;
        for layer in &self.layers {
            x = self.layer_forward_batch(layer, &x, parts, &at, links)?;
        }
        Ok(x)
    }

    /// For a batch of decode rows on the CPU (one row a sequence, two sequences or more):
    /// the rotary tables' rows at each sequence's position, `(sequences, 1, head_dim / 2)`,
    /// so that a layer ropes every sequence's heads in one operation (candle's rope with
    /// a table row per batch entry: the same arithmetic as one sequence alone). `None`
    /// otherwise.
    fn decode_rope(
        &self,
        parts: &[BatchPart<'_>],
        starts: &[usize],
    ) -> Result<Option<(Tensor, Tensor)>> {
        if !self.compute.device.is_cpu() || parts.len() < 2 || parts.iter().any(|p| p.rows != 1) {
            return Ok(None);
        }
        let at: Vec<u32> = starts.iter().map(|&p| p as u32).collect();
        let at = Tensor::new(at.as_slice(), &self.compute.device)?;
        let n = starts.len();
        let rows = |table: &Tensor| -> Result<Tensor> {
            let half = table.dim(1)?;
            Ok(table.index_select(&at, 0)?.reshape((n, 1, half))?)
        };
        Ok(Some((rows(&self.rope.cos)?, rows(&self.rope.sin)?)))
    }

    /// Every decode row's queries, keys and values as heads `(heads, 1, head_dim)`, normed
    /// where the model norms them, roped at its sequence's position (`rope`: the tables'
    /// rows, [`Self::decode_rope`]): a handful of operations for the whole batch where
    /// one sequence at a time took a dozen each.
    fn decode_heads(
        &self,
        layer: &DecoderLayer,
        (q, k, v): (Tensor, Tensor, Tensor),
        rope: &(Tensor, Tensor),
    ) -> Result<Vec<(Tensor, Tensor, Tensor)>> {
        let n = q.dim(0)?;
        let hd = self.config.head_dim;
        let (nh, nkv) = self.local_heads();
        let a = &layer.attn;
        // (n, heads * hd) -> (n, heads, 1, hd): one row a sequence, so no transpose.
        let mut q = q.reshape((n, nh, 1, hd))?;
        let mut k = k.reshape((n, nkv, 1, hd))?;
        let v = v.reshape((n, nkv, 1, hd))?;
        if let Some(norm) = &a.q_norm {
            q = norm.forward(&q)?;
        }
        if let Some(norm) = &a.k_norm {
            k = norm.forward(&k)?;
        }
        let (cos, sin) = rope;
        let (q, k) = (
            self.rope.rotate(&q, cos, sin)?,
            self.rope.rotate(&k, cos, sin)?,
        );
        (0..n)
            .map(|i| {
                let one = |x: &Tensor| -> Result<Tensor> { Ok(x.narrow(0, i, 1)?.squeeze(0)?) };
                Ok((one(&q)?, one(&k)?, one(&v)?))
            })
            .collect()
    }

    /// The decode rows as one batch (single-token paths), then the prompt rows, the
    /// outputs put back in the parts' row order.
    fn forward_groups(
        &self,
        hidden: Tensor,
        parts: &mut [BatchPart<'_>],
        starts: &[usize],
        masks: &[Option<Tensor>],
        links: &mut Option<&mut dyn ShardLinks>,
    ) -> Result<Tensor> {
        let mut offsets = Vec::with_capacity(parts.len());
        let mut at = 0;
        for p in parts.iter() {
            offsets.push(at);
            at += p.rows;
        }
        let mut out: Vec<Option<Tensor>> = vec![None; parts.len()];
        for long in [false, true] {
            let which: Vec<usize> = (0..parts.len())
                .filter(|&i| (parts[i].rows >= 2) == long)
                .collect();
            let rows: Vec<Tensor> = which
                .iter()
                .map(|&i| hidden.narrow(0, offsets[i], parts[i].rows))
                .collect::<std::result::Result<_, _>>()?;
            let h = Tensor::cat(&rows, 0)?;
            let group_starts: Vec<usize> = which.iter().map(|&i| starts[i]).collect();
            let group_masks: Vec<Option<Tensor>> =
                which.iter().map(|&i| masks[i].clone()).collect();
            let mut group: Vec<BatchPart<'_>> = parts
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| which.contains(i))
                .map(|(_, p)| BatchPart {
                    cache: &mut *p.cache,
                    rows: p.rows,
                })
                .collect();
            let rows = if long { Rows::Bf16 } else { Rows::Int8 };
            let y = shoal_kernels::with_rows(rows, || {
                self.run_layers(h, &mut group, &group_starts, &group_masks, links)
            })?;
            let mut row = 0;
            for (&i, p) in which.iter().zip(&group) {
                out[i] = Some(y.narrow(0, row, p.rows)?);
                row += p.rows;
            }
        }
        let rows: Vec<Tensor> = out.into_iter().flatten().collect();
        Ok(Tensor::cat(&rows, 0)?)
    }

    /// One layer over the rows of several sequences (`parts`, in row order, each at
    /// `starts[i]`): the projections and the FFN as one matmul over all rows, attention
    /// per sequence against its own cache.
    fn layer_forward_batch(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        parts: &mut [BatchPart<'_>],
        at: &Positions<'_>,
        links: &mut Option<&mut dyn ShardLinks>,
    ) -> Result<Tensor> {
        let Positions {
            starts,
            masks,
            rope,
        } = *at;
        let (q, k, v) = self.qkv_rows(layer, x)?;
        let new = match rope {
            Some(rope) => self.decode_heads(layer, (q, k, v), rope)?,
            None => {
                let mut new = Vec::with_capacity(parts.len());
                let mut row = 0;
                for (part, &pos) in parts.iter().zip(starts) {
                    let r = part.rows;
                    let rows = |y: &Tensor| y.narrow(0, row, r);
                    new.push(self.qkv_heads(
                        layer,
                        rows(&q)?,
                        rows(&k)?,
                        rows(&v)?,
                        std::slice::from_ref(&(pos..pos + r)),
                    )?);
                    row += r;
                }
                new
            }
        };
        let mut heads = Vec::with_capacity(parts.len());
        for (part, (qi, ki, vi)) in parts.iter_mut().zip(new) {
            let (k_all, v_all) = part.cache.append(layer.index, &ki, &vi)?;
            heads.push((qi, k_all, v_all));
        }
        let outs = self.attend_each(&heads, masks)?;
        let out = Tensor::cat(&outs, 0)?;
        self.finish_layer(layer, x, &out, links)
    }
}
