//! Continuous batching in the model: one forward pass over the new positions of several
//! sequences, each with its own cache. The projections and the FFN see all rows at once
//! (one matmul, and one all-reduce per half-layer on a tensor-parallel shard); attention
//! runs per sequence against its own keys and values.

use candle_core::Tensor;
use shoal_kernels::Rows;

use super::{DecoderLayer, Model, causal_mask};
use crate::{KvCache, ModelError, Result, ShardLinks};

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
        // both runs as two groups, the same way on every rank, on a machine whose two
        // paths round otherwise (AVX2, AMX); elsewhere one pass serves all. (The
        // scheduler never slices a prompt into a lone row.)
        let long = |p: &BatchPart<'_>| p.rows >= 2;
        let mixed = !shoal_kernels::Isa::detect().rows_round_alike()
            && parts.iter().any(long)
            && !parts.iter().all(long);
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

    fn run_layers(
        &self,
        hidden: Tensor,
        parts: &mut [BatchPart<'_>],
        starts: &[usize],
        masks: &[Option<Tensor>],
        links: &mut Option<&mut dyn ShardLinks>,
    ) -> Result<Tensor> {
        let mut x = hidden;
        for layer in &self.layers {
            x = self.layer_forward_batch(layer, &x, parts, starts, masks, links)?;
        }
        Ok(x)
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
        starts: &[usize],
        masks: &[Option<Tensor>],
        links: &mut Option<&mut dyn ShardLinks>,
    ) -> Result<Tensor> {
        let (q, k, v) = self.qkv_rows(layer, x)?;
        let mut heads = Vec::with_capacity(parts.len());
        let mut row = 0;
        for (i, part) in parts.iter_mut().enumerate() {
            let (r, pos) = (part.rows, starts[i]);
            let rows = |y: &Tensor| y.narrow(0, row, r);
            let (qi, ki, vi) = self.qkv_heads(
                layer,
                rows(&q)?,
                rows(&k)?,
                rows(&v)?,
                std::slice::from_ref(&(pos..pos + r)),
            )?;
            let (k_all, v_all) = part.cache.append(layer.index, &ki, &vi)?;
            heads.push((qi, k_all, v_all));
            row += r;
        }
        let outs = self.attend_each(&heads, masks)?;
        let out = Tensor::cat(&outs, 0)?;
        self.finish_layer(layer, x, &out, links)
    }
}
