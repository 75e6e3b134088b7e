//! Attention of one new token against the cache, on the CPU in f32, as one custom op.
//!
//! candle's path for this is eight ops (a batched gemm with its packing, a scale, a
//! softmax, a second gemm, a copy of V to contiguous memory, reshapes and a transpose),
//! each allocating; for a decode step of a small model that bookkeeping cost as much as
//! the arithmetic. Here the keys and values are read where the cache keeps them (a view
//! of its capacity), and the output comes out already as `(1, heads · head_dim)`.

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

/// `softmax(q·Kᵀ·scale)·V` for `q` `(heads, 1, head_dim)` and `k`, `v`
/// `(kv_heads, n, head_dim)`, query heads grouped by KV head (`heads = kv_heads · group`).
pub(crate) fn decode_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    q.apply_op3_no_bwd(k, v, &DecodeAttention { scale })
}

struct DecodeAttention {
    scale: f32,
}

/// A `(a, b, c)` f32 tensor whose last dimension is contiguous: base offset and the
/// strides of the first two dimensions.
struct View<'a> {
    data: &'a [f32],
    dims: [usize; 3],
    offset: usize,
    strides: [usize; 2],
}

impl<'a> View<'a> {
    fn new(storage: &'a CpuStorage, layout: &Layout, what: &str) -> Result<Self> {
        let data = storage.as_slice::<f32>()?;
        let (dims, stride) = (layout.dims(), layout.stride());
        if dims.len() != 3 || stride[2] != 1 {
            candle_core::bail!(
                "decode attention: {what} must be (_, _, head_dim) with unit stride, got {dims:?} / {stride:?}"
            );
        }
        let view = Self {
            data,
            dims: [dims[0], dims[1], dims[2]],
            offset: layout.start_offset(),
            strides: [stride[0], stride[1]],
        };
        let last = view.at(dims[0].saturating_sub(1), dims[1].saturating_sub(1)) + dims[2];
        if dims.iter().product::<usize>() > 0 && last > data.len() {
            candle_core::bail!("decode attention: {what} reaches past its storage");
        }
        Ok(view)
    }

    fn at(&self, i: usize, j: usize) -> usize {
        self.offset + i * self.strides[0] + j * self.strides[1]
    }

    fn row(&self, i: usize, j: usize) -> &'a [f32] {
        let at = self.at(i, j);
        &self.data[at..at + self.dims[2]]
    }
}

/// Eight partial sums, so the compiler keeps the products in vector registers.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

impl CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "decode-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v) = (
            View::new(qs, ql, "q")?,
            View::new(ks, kl, "k")?,
            View::new(vs, vl, "v")?,
        );
        let [heads, one, hd] = q.dims;
        let [kv_heads, n, khd] = k.dims;
        if one != 1 || khd != hd || v.dims != k.dims || kv_heads == 0 || heads % kv_heads != 0 {
            candle_core::bail!(
                "decode attention: q {:?}, k {:?}, v {:?} do not fit",
                q.dims,
                k.dims,
                v.dims
            );
        }
        let group = heads / kv_heads;
        let mut out = vec![0f32; heads * hd];
        let mut scores = vec![0f32; n];
        for h in 0..heads {
            let kvh = h / group;
            let qh = q.row(h, 0);
            let mut max = f32::NEG_INFINITY;
            for (i, s) in scores.iter_mut().enumerate() {
                *s = dot(qh, k.row(kvh, i)) * self.scale;
                max = max.max(*s);
            }
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let o = &mut out[h * hd..(h + 1) * hd];
            for (i, s) in scores.iter().enumerate() {
                let p = s / sum;
                for (acc, x) in o.iter_mut().zip(v.row(kvh, i)) {
                    *acc += p * x;
                }
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((1, heads * hd))))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::decode_attention;

    #[test]
    fn equals_the_generic_path_on_a_strided_cache_view() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (heads, kv_heads, n, hd, capacity) = (6, 2, 5, 16, 8);
        let q = Tensor::randn(0f32, 1.0, (heads, 1, hd), &dev)?;
        // The cache keeps a capacity; attention sees the first n positions (a view).
        let k = Tensor::randn(0f32, 1.0, (kv_heads, capacity, hd), &dev)?.narrow(1, 0, n)?;
        let v = Tensor::randn(0f32, 1.0, (kv_heads, capacity, hd), &dev)?.narrow(1, 0, n)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let got = decode_attention(&q, &k, &v, scale as f32)?;
        let group = heads / kv_heads;
        let qg = q.reshape((kv_heads, group, hd))?;
        let scores = (qg.matmul(&k.t()?)? * scale)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let want = probs.matmul(&v.contiguous()?)?.reshape((1, heads * hd))?;
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "largest difference {diff}");
        Ok(())
    }

    #[test]
    fn shapes_that_do_not_fit_are_errors() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::zeros((5, 1, 8), candle_core::DType::F32, &dev)?;
        let k = Tensor::zeros((2, 3, 8), candle_core::DType::F32, &dev)?;
        assert!(
            decode_attention(&q, &k, &k, 1.0).is_err(),
            "5 heads over 2 KV heads"
        );
        Ok(())
    }
}
