//! Sequence parallelism: ring attention over a chunk of positions split across ranks.
//!
//! Every rank holds the whole model and computes its own positions of the chunk through
//! every layer. Attention needs every earlier key, so at each layer the ranks pass their
//! key/value blocks around the ring: a rank sends the block in hand to the next rank,
//! attends to it while the transfer runs, then takes the block the previous rank sent.
//! Partial results over blocks merge exactly with the online softmax (running maximum,
//! running sum). After the ring each rank has seen every block of the chunk and appends
//! them all, in position order, to its KV cache: the caches stay whole and identical, so
//! decode needs no communication.
//!
//! The layout is zigzag: the chunk is cut into `2·world` pieces and rank `r` takes pieces
//! `r` and `2·world − 1 − r`, so every rank has as many early (cheap) as late (costly)
//! causal positions.

use std::ops::Range;

use candle_core::{D, DType, Device, Tensor};

use super::{DecoderLayer, Model};
use crate::kv8::Part;
use crate::shard::ShardLinks;
use crate::{KvCache, ModelError, Result};

/// The positions of the chunk `start..start + t` that `rank` of `world` computes, as
/// ascending non-empty runs.
pub fn zigzag_pieces(start: usize, t: usize, rank: usize, world: usize) -> Vec<Range<usize>> {
    let n = 2 * world.max(1);
    let bound = |i: usize| start + i * t / n;
    [rank, n - 1 - rank]
        .into_iter()
        .map(|i| bound(i)..bound(i + 1))
        .filter(|r| !r.is_empty())
        .collect()
}

/// Running softmax state over blocks: maximum, sum and weighted values per query row.
struct Online {
    m: Tensor,
    l: Tensor,
    o: Tensor,
}

/// A finite floor for the running maximum: a row that has seen only masked keys keeps
/// `exp(score - m) = 0` instead of `exp(-inf + inf) = NaN`.
const FLOOR: f64 = -1e30;

impl Online {
    /// The running state is kept in f32 whatever the model's type.
    fn new(nkv: usize, rows: usize, hd: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            m: Tensor::full(FLOOR as f32, (nkv, rows, 1), device)?,
            l: Tensor::zeros((nkv, rows, 1), DType::F32, device)?,
            o: Tensor::zeros((nkv, rows, hd), DType::F32, device)?,
        })
    }

    /// Folds in attention of `q (nkv, rows, hd)` over keys/values `(nkv, n, hd)`, with an
    /// additive mask `(rows, n)` when some keys are in a query's future.
    fn add(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f64,
    ) -> Result<()> {
        let s = (q.matmul(&k.t()?)? * scale)?;
        let s = match mask {
            Some(m) => s.broadcast_add(m)?,
            None => s,
        };
        let m_b = s.max_keepdim(D::Minus1)?.maximum(FLOOR)?;
        let m_new = self.m.maximum(&m_b)?;
        let p = s.broadcast_sub(&m_new)?.exp()?;
        let alpha = (&self.m - &m_new)?.exp()?;
        self.l = ((&self.l * &alpha)? + p.sum_keepdim(D::Minus1)?)?;
        self.o = (self.o.broadcast_mul(&alpha)? + p.matmul(&v.contiguous()?)?)?;
        self.m = m_new;
        Ok(())
    }

    fn finish(&self) -> Result<Tensor> {
        Ok(self.o.broadcast_div(&self.l)?)
    }
}

/// A key/value block on the wire: `[n, positions…, k…, v…]` as f32 (positions are
/// exact in f32 below 2²⁴).
fn encode_block(pos: &[usize], k: &Tensor, v: &Tensor) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(1 + pos.len() + 2 * k.elem_count());
    out.push(pos.len() as f32);
    out.extend(pos.iter().map(|&p| p as f32));
    if !pos.is_empty() {
        out.extend(k.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        out.extend(v.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(out)
}

type Block = (Vec<usize>, Option<(Tensor, Tensor)>);

fn decode_block(
    data: &[f32],
    nkv: usize,
    hd: usize,
    device: &Device,
    dtype: DType,
) -> Result<Block> {
    let bad = || {
        ModelError::Link(format!(
            "malformed key/value block of {} values",
            data.len()
        ))
    };
    let n = *data.first().ok_or_else(bad)? as usize;
    let need = 1 + n + 2 * nkv * n * hd;
    if data.len() != need {
        return Err(bad());
    }
    let pos: Vec<usize> = data[1..1 + n].iter().map(|&p| p as usize).collect();
    if n == 0 {
        return Ok((pos, None));
    }
    let kv = nkv * n * hd;
    let k = Tensor::from_slice(&data[1 + n..1 + n + kv], (nkv, n, hd), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?;
    let v = Tensor::from_slice(&data[1 + n + kv..], (nkv, n, hd), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?;
    Ok((pos, Some((k, v))))
}

/// `(group·rows, n)` additive mask: query row `i` (position `qpos[i % rows]`) may not see
/// keys after it.
fn causal(qpos: &[usize], kpos: &[usize], group: usize, device: &Device) -> Result<Option<Tensor>> {
    let rows = qpos.len();
    if kpos.iter().max() <= qpos.iter().min() {
        return Ok(None);
    }
    let n = kpos.len();
    let mut m = vec![0f32; group * rows * n];
    for r in 0..group * rows {
        let q = qpos[r % rows];
        for (j, &k) in kpos.iter().enumerate() {
            if k > q {
                m[r * n + j] = f32::NEG_INFINITY;
            }
        }
    }
    Ok(Some(
        Tensor::from_vec(m, (group * rows, n), &Device::Cpu)?.to_device(device)?,
    ))
}

impl Model {
    /// Runs every layer of this (whole) model over this rank's part of a chunk: hidden
    /// states `(rows, hidden)` at the positions of `pieces` (from [`zigzag_pieces`]) of the
    /// chunk of `total` positions that starts at `cache.len()`. Every rank of the ring must
    /// call it for the same chunk. Appends the whole chunk to `cache`.
    pub fn forward_layers_ring(
        &self,
        hidden: Tensor,
        pieces: &[Range<usize>],
        total: usize,
        cache: &mut KvCache,
        links: &mut dyn ShardLinks,
    ) -> Result<Tensor> {
        if self.spec.tensor.is_some() {
            return Err(ModelError::Invalid(
                "ring attention needs whole layers on every rank".into(),
            ));
        }
        let start = cache.len();
        let qpos: Vec<usize> = pieces.iter().flat_map(|p| p.clone()).collect();
        if qpos.len() != hidden.dim(0)? || qpos.iter().any(|&p| p < start || p >= start + total) {
            return Err(ModelError::Invalid(format!(
                "{} rows for positions {pieces:?} of the chunk {start}..{}",
                hidden.dim(0)?,
                start + total
            )));
        }
        if start + total > self.max_len {
            return Err(ModelError::ContextFull {
                positions: start + total,
                context: self.max_len,
            });
        }
        let mut x = hidden;
        for layer in &self.layers {
            x = self.ring_layer(layer, &x, pieces, &qpos, total, cache, links)?;
        }
        cache.advance(total);
        Ok(x)
    }

    #[allow(clippy::too_many_arguments)] // one layer of the ring: all of it is needed
    fn ring_layer(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        pieces: &[Range<usize>],
        qpos: &[usize],
        total: usize,
        cache: &mut KvCache,
        links: &mut dyn ShardLinks,
    ) -> Result<Tensor> {
        let c = &self.config;
        let (hd, g) = (c.head_dim, c.group_size());
        let (nh, nkv) = self.local_heads();
        let rows = qpos.len();
        let start = cache.len();
        let scale = 1.0 / (hd as f64).sqrt();
        let (device, dtype) = (self.compute.device.clone(), self.compute.dtype);
        // Keys and values as the cache will keep them (f16 on a CPU), so that every query
        // sees what a rank computing the chunk alone would read back from its cache.
        let kept = |t: Tensor, part| cache.round_trip(&t, part);
        let local = match rows {
            0 => None,
            _ => {
                let (q, k, v) = self.project_qkv(layer, x, pieces)?;
                Some((q, kept(k, Part::Keys)?, kept(v, Part::Values)?))
            }
        };
        let mut state = Online::new(nkv, g * rows, hd, &device)?;
        let q = match &local {
            Some((q, _, _)) => Some(q.reshape((nkv, g * rows, hd))?),
            None => None,
        };
        // Everything before the chunk: every query sees all of it.
        if let (Some(q), Some((k, v))) = (&q, cache.stored(layer.index)?) {
            let (k, v) = (
                cache.widened(&k, Part::Keys, dtype)?,
                cache.widened(&v, Part::Values, dtype)?,
            );
            state.add(q, &k, &v, None, scale)?;
        }
        // The chunk, block by block around the ring.
        let mut in_hand = match &local {
            Some((_, k, v)) => encode_block(qpos, k, v)?,
            None => vec![0.0],
        };
        let world = links.world();
        let mut blocks: Vec<(Vec<usize>, Tensor, Tensor)> = Vec::with_capacity(world);
        for step in 0..world {
            if step + 1 < world {
                links.ring_send(&in_hand)?;
            }
            let (kpos, kv) = decode_block(&in_hand, nkv, hd, &device, dtype)?;
            if let Some((k, v)) = kv {
                if let Some(q) = &q {
                    let mask = causal(qpos, &kpos, g, &device)?;
                    state.add(q, &k, &v, mask.as_ref(), scale)?;
                }
                blocks.push((kpos, k, v));
            }
            if step + 1 < world {
                in_hand = links.ring_recv()?;
            }
        }
        // The whole chunk, in position order, into the cache.
        let mut order: Vec<(usize, usize)> = Vec::with_capacity(total);
        let mut offset = 0;
        for (kpos, _, _) in &blocks {
            order.extend(kpos.iter().enumerate().map(|(j, &p)| (p, offset + j)));
            offset += kpos.len();
        }
        order.sort_unstable();
        if order.len() != total || order.iter().enumerate().any(|(i, &(p, _))| p != start + i) {
            return Err(ModelError::Link(format!(
                "the ring delivered positions that do not tile the chunk {start}..{}",
                start + total
            )));
        }
        let index = Tensor::from_vec(
            order.iter().map(|&(_, j)| j as u32).collect::<Vec<_>>(),
            total,
            &device,
        )?;
        let ks: Vec<&Tensor> = blocks.iter().map(|b| &b.1).collect();
        let vs: Vec<&Tensor> = blocks.iter().map(|b| &b.2).collect();
        let k_all = Tensor::cat(&ks, 1)?.index_select(&index, 1)?;
        let v_all = Tensor::cat(&vs, 1)?.index_select(&index, 1)?;
        cache.append(layer.index, &k_all, &v_all)?;
        if rows == 0 {
            return Ok(x.clone());
        }
        let out = state
            .finish()?
            .to_dtype(dtype)?
            .reshape((nh, rows, hd))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((rows, nh * hd))?;
        self.finish_layer(layer, x, &out, &mut None)
    }
}

#[cfg(test)]
mod tests {
    use super::zigzag_pieces;

    #[test]
    fn zigzag_pieces_tile_the_chunk() {
        for world in 1..5 {
            for t in [1, 2, 7, 16, 45] {
                let mut all: Vec<usize> = (0..world)
                    .flat_map(|r| zigzag_pieces(10, t, r, world))
                    .flat_map(|p| p.collect::<Vec<_>>())
                    .collect();
                all.sort_unstable();
                assert_eq!(all, (10..10 + t).collect::<Vec<_>>(), "world {world} t {t}");
            }
        }
        // Rank 0 holds the first and the last piece.
        assert_eq!(zigzag_pieces(0, 8, 0, 2), vec![0..2, 6..8]);
        assert_eq!(zigzag_pieces(0, 8, 1, 2), vec![2..4, 4..6]);
    }
}
