//! Few query rows against a long cache (a decode step deep in a context, a prompt's row
//! or two read beside streams), shared among the threads by keys and by values instead
//! of by query rows.
//!
//! [`super::Problem::block`] gives a unit whole queries. A decode row has one query head
//! per head of a KV group, so a unit either takes a KV head's whole group (each key read
//! and widened once for all of them, but only as many units as KV heads: three on
//! smollm2, for two threads) or one head (every key read and widened once per head).
//! Deep in a context that is most of a step. Here the same arithmetic runs in three
//! passes, each cut where it has many units of equal cost:
//! 1. scores: a KV head's keys in chunks, each key read once for every query of the head;
//! 2. the softmax, a query at a time;
//! 3. the values: a KV head's value rows in pieces of 32, each piece read once for up to
//!    three queries.
//!
//! A query's scores, weights and sums are the operations `block` does, in its order, so
//! a row's result is the same bit for bit whichever way it went.

use super::arith::Elem;
use super::{BLOCK_ROWS, KeysValues, Problem, View, normalize, score_eight, share_out};

/// Keys a unit of the score pass takes: a multiple of 8, so its passes of eight keys are
/// `block`'s.
const KEY_CHUNK: usize = 256;
/// Values of a row a unit of the value pass takes: four vectors, so that three queries'
/// sums and the four vectors of a row fit in sixteen registers.
const PIECE: usize = 32;
/// Queries that share a value row's load.
const QUERIES: usize = 3;

/// Whether [`attend`] takes a problem: rows that `block` would take as one block, keys
/// enough for several chunks, a head size of whole pieces.
pub(super) fn applies(p: &Problem) -> bool {
    p.t <= BLOCK_ROWS && p.n >= 4 * KEY_CHUNK && p.hd.is_multiple_of(PIECE)
}

/// The attention of `p` into `out` (`(t, heads · hd)`), over the kernel threads.
pub(super) fn attend(p: &Problem, scale: f32, out: &mut [f32]) {
    match &p.kv {
        KeysValues::F32(k, v) => attend_over(p, k, v, scale, out),
        KeysValues::F16(k, v) => attend_over(p, k, v, scale, out),
        KeysValues::Q8(k, v) => attend_over(p, k, v, scale, out),
    }
}

fn attend_over<T: Elem>(p: &Problem, k: &View<T>, v: &View<T>, scale: f32, out: &mut [f32]) {
    let (t, n, hd, heads, group) = (p.t, p.n, p.hd, p.heads, p.group);
    let kv_heads = heads / group;
    // A KV head's queries are numbered a = head of the group · t + row; query `a` of KV
    // head `kvh` keeps its scores at `(kvh · group · t + a) · n`.
    let per_kv = group * t;
    let seen = |a: usize| n - t + a % t + 1;
    let query = |kvh: usize, a: usize| p.q.row(kvh * group + a / t, a % t);
    let mut scores = vec![0f32; heads * t * n];
    let scores_at = scores.as_mut_ptr() as usize;
    assert!(out.len() >= t * heads * hd);
    let out_at = out.as_mut_ptr() as usize;

    let chunks = n.div_ceil(KEY_CHUNK);
    share_out(kv_heads * chunks, true, None, &|u, _| {
        let (kvh, chunk) = (u / chunks, u % chunks);
        let queries: Vec<&[f32]> = (0..per_kv).map(|a| query(kvh, a)).collect();
        let keys_end = ((chunk + 1) * KEY_CHUNK).min(n);
        for j0 in (chunk * KEY_CHUNK..keys_end).step_by(8) {
            let put = |b: usize, j: usize, s: f32| {
                // SAFETY: score `j` of query `b` of this KV head is this unit's alone
                // (its chunk of keys); the buffer holds `heads · t · n`.
                unsafe { *(scores_at as *mut f32).add((kvh * per_kv + b) * n + j) = s };
            };
            score_eight(&queries, seen, k, kvh, j0, n, scale, put);
        }
    });

    share_out(heads * t, true, None, &|u, _| {
        let (kvh, a) = (u / per_kv, u % per_kv);
        // SAFETY: query `u`'s scores are this unit's alone, written by the pass before.
        let row =
            unsafe { std::slice::from_raw_parts_mut((scores_at as *mut f32).add(u * n), seen(a)) };
        normalize(row, v, kvh);
    });

    let pieces = hd / PIECE;
    share_out(kv_heads * pieces, true, None, &|u, _| {
        let (kvh, start) = (u / pieces, (u % pieces) * PIECE);
        // SAFETY: the weights are written; this pass only reads them.
        let weights = |a: usize| unsafe {
            std::slice::from_raw_parts(
                (scores_at as *const f32).add((kvh * per_kv + a) * n),
                seen(a),
            )
        };
        for row in 0..t {
            // The heads of the group for this row see the same keys: up to three at a time.
            for first in (0..group).step_by(QUERIES) {
                let count = QUERIES.min(group - first);
                let head = |i: usize| first + i.min(count - 1);
                let probs: [&[f32]; QUERIES] = std::array::from_fn(|i| weights(head(i) * t + row));
                let outs: [usize; QUERIES] = std::array::from_fn(|i| {
                    let h = kvh * group + head(i);
                    out_at + ((row * heads + h) * hd + start) * size_of::<f32>()
                });
                // SAFETY: each output piece (row, head, start..start + PIECE) is this
                // unit's alone; `out` holds `t · heads · hd`.
                unsafe { weigh_piece(&outs[..count], &probs[..count], v, kvh, start) };
            }
        }
    });
}

/// `out[a][e] = Σ_j probs[a][j] · v[j][start + e]` for `e < PIECE`, for up to three
/// queries at once (all of the same length), one fused multiply-add per term in key
/// order from zero: each sum is the one `weigh_values` makes.
///
/// # Safety
/// Each of `outs` must be the address of `PIECE` writable floats no one else touches.
unsafe fn weigh_piece<T: Elem>(
    outs: &[usize],
    probs: &[&[f32]],
    v: &View<T>,
    kvh: usize,
    start: usize,
) {
    let seen = probs[0].len();
    assert!(
        outs.len() == probs.len()
            && probs.len() <= QUERIES
            && probs.iter().all(|p| p.len() == seen)
            && seen <= v.dims[1]
            && start + PIECE <= v.dims[2]
    );
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        use std::arch::x86_64::*;
        // SAFETY: the lengths are checked above, `View::new` checked that every row lies
        // inside its storage, and the caller owns the outputs.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 4]; QUERIES];
            let q = probs.len();
            for j in 0..seen {
                let row = v.data.as_ptr().add(v.at(kvh, j) + start);
                let x: [__m256; 4] = std::array::from_fn(|i| T::load8(row.add(8 * i)));
                for (a, acc) in acc.iter_mut().enumerate().take(q) {
                    let p = _mm256_set1_ps(*probs[a].get_unchecked(j));
                    for i in 0..4 {
                        acc[i] = _mm256_fmadd_ps(p, x[i], acc[i]);
                    }
                }
            }
            for (a, &o) in outs.iter().enumerate() {
                for (i, acc) in acc[a].iter().enumerate() {
                    _mm256_storeu_ps((o as *mut f32).add(8 * i), *acc);
                }
            }
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    for (&o, probs) in outs.iter().zip(probs) {
        let mut acc = [0f32; PIECE];
        for (j, &p) in probs.iter().enumerate() {
            for (s, x) in acc.iter_mut().zip(&v.row(kvh, j)[start..start + PIECE]) {
                *s = p.mul_add(x.to_f32(), *s);
            }
        }
        // SAFETY: the caller's.
        unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), o as *mut f32, PIECE) };
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::super::{KeysValues, Problem, View, cpu, share_out};
    use crate::kv8::Part;

    /// `q`, `k`, `v` through the passes here and through `block`, as bits.
    fn both_ways(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
    ) -> candle_core::Result<(Vec<u32>, Vec<u32>)> {
        let ((qs, ql), (ks, kl), (vs, vl)) = (
            q.storage_and_layout(),
            k.storage_and_layout(),
            v.storage_and_layout(),
        );
        let p = Problem::new(
            View::new(cpu(&qs)?, ql, "q")?,
            KeysValues::new((cpu(&ks)?, kl), (cpu(&vs)?, vl))?,
            false,
        )?;
        assert!(super::applies(&p));
        let mut spread = vec![0f32; p.t * p.heads * p.hd];
        super::attend(&p, scale, &mut spread);
        let mut block = vec![0f32; p.t * p.heads * p.hd];
        let at = block.as_mut_ptr() as usize;
        share_out(p.units, true, None, &|u, scratch| {
            p.block(u, scale, scratch, at as *mut f32)
        });
        let bits = |xs: Vec<f32>| xs.into_iter().map(f32::to_bits).collect();
        Ok((bits(spread), bits(block)))
    }

    #[test]
    fn spread_by_keys_and_values_a_row_is_what_a_block_of_rows_gives() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let err = |e: crate::ModelError| candle_core::Error::msg(e.to_string());
        // smollm2's groups of 3 and qwen2.5-0.5b's of 7; decode rows and short slices;
        // key counts that end inside a chunk and inside a pass of eight.
        for (heads, kv_heads, hd) in [(9, 3, 64), (14, 2, 64), (4, 2, 128)] {
            for (t, n) in [(1, 1024), (1, 1501), (2, 1100), (8, 2049), (5, 3000)] {
                let q = Tensor::randn(0f32, 1.0, (heads, t, hd), &dev)?;
                let k = Tensor::randn(0f32, 1.0, (kv_heads, n + 5, hd), &dev)?;
                let v = Tensor::randn(0f32, 1.0, (kv_heads, n + 5, hd), &dev)?;
                for kind in ["f32", "f16", "q8"] {
                    let kept = |x: &Tensor, part| -> candle_core::Result<Tensor> {
                        let x = match kind {
                            "f32" => x.clone(),
                            "f16" => x.to_dtype(DType::F16)?,
                            _ => crate::kv8::quantize(x, part).map_err(err)?,
                        };
                        x.narrow(1, 0, n)
                    };
                    let (k, v) = (kept(&k, Part::Keys)?, kept(&v, Part::Values)?);
                    let (spread, block) = both_ways(&q, &k, &v, 0.125)?;
                    assert!(
                        spread == block,
                        "{heads}/{kv_heads} heads of {hd}, {t} rows over {n} keys in {kind}"
                    );
                }
            }
        }
        Ok(())
    }
}
