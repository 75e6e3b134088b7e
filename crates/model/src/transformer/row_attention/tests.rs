//! The row attention against candle's masked softmax, and each way a row can go against
//! the others, bit for bit.

use candle_core::{DType, Device, Tensor};

use super::{row_attention, row_attention_each};
use crate::kv8::Part;

/// candle's masked softmax attention, the reference.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    let (heads, t, hd) = q.dims3()?;
    let (kv_heads, n, _) = k.dims3()?;
    let group = heads / kv_heads;
    let qg = q.reshape((kv_heads, group * t, hd))?;
    let scores = (qg.matmul(&k.t()?)? * scale)?;
    let mut mask = vec![0f32; group * t * n];
    for r in 0..group * t {
        for j in (n - t + r % t + 1)..n {
            mask[r * n + j] = f32::NEG_INFINITY;
        }
    }
    let mask = Tensor::from_vec(mask, (group * t, n), q.device())?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    probs
        .matmul(&v.contiguous()?)?
        .reshape((heads, t, hd))?
        .transpose(0, 1)?
        .reshape((t, heads * hd))
}

/// A tensor's values as bits, to hold two results equal exactly.
fn bits(t: &Tensor) -> candle_core::Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .map(|x| x.to_bits())
        .collect())
}

#[test]
fn equals_masked_softmax_attention_on_a_strided_cache_view() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    // A decode row on a short cache, a prompt slice (blocks and a remainder), and a
    // long cache (blocks shared among threads).
    for (t, n, capacity) in [(1, 5, 8), (11, 30, 32), (1, 2000, 2048), (20, 2000, 2048)] {
        let (heads, kv_heads, hd) = (6, 2, 16);
        let q = Tensor::randn(0f32, 1.0, (heads, t, hd), &dev)?;
        // The cache keeps a capacity; attention sees the first n positions (a view).
        let k = Tensor::randn(0f32, 1.0, (kv_heads, capacity, hd), &dev)?.narrow(1, 0, n)?;
        let v = Tensor::randn(0f32, 1.0, (kv_heads, capacity, hd), &dev)?.narrow(1, 0, n)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let got = row_attention(&q, &k, &v, scale as f32)?;
        let want = reference(&q, &k, &v, scale)?;
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            diff < 1e-5,
            "{t} rows, {n} positions: largest difference {diff}"
        );
    }
    Ok(())
}

#[test]
fn a_row_is_the_same_however_the_rows_are_sliced() -> candle_core::Result<()> {
    // Ten rows at once equal the same rows one step at a time, bit for bit: a
    // scheduler's slicing of a prompt does not change its arithmetic.
    let dev = Device::Cpu;
    let (heads, kv_heads, hd, n) = (6, 2, 16, 40);
    let q = Tensor::randn(0f32, 1.0, (heads, 10, hd), &dev)?;
    let k = Tensor::randn(0f32, 1.0, (kv_heads, n, hd), &dev)?;
    let v = Tensor::randn(0f32, 1.0, (kv_heads, n, hd), &dev)?;
    let all = row_attention(&q, &k, &v, 0.25)?.to_vec2::<f32>()?;
    for (i, row) in all.iter().enumerate() {
        let seen = n - 10 + i + 1;
        let one = row_attention(
            &q.narrow(1, i, 1)?.contiguous()?,
            &k.narrow(1, 0, seen)?,
            &v.narrow(1, 0, seen)?,
            0.25,
        )?
        .to_vec2::<f32>()?;
        let same = row
            .iter()
            .zip(&one[0])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "row {i}");
    }
    Ok(())
}

#[test]
fn sequences_together_equal_each_alone() -> candle_core::Result<()> {
    // Decode rows of many sequences (shared out together) and a prompt slice (on its
    // own) give what each gives alone, bit for bit.
    let dev = Device::Cpu;
    let (heads, kv_heads, hd) = (6, 2, 16);
    let mut items = Vec::new();
    for (t, n) in [(1, 5), (1, 1500), (1, 1), (12, 900), (1, 3000), (3, 3)] {
        items.push((
            Tensor::randn(0f32, 1.0, (heads, t, hd), &dev)?,
            Tensor::randn(0f32, 1.0, (kv_heads, n, hd), &dev)?,
            Tensor::randn(0f32, 1.0, (kv_heads, n, hd), &dev)?,
        ));
    }
    let refs: Vec<_> = items.iter().map(|(q, k, v)| (q, k, v)).collect();
    let together = row_attention_each(&refs, 0.25)?;
    assert_eq!(together.len(), items.len());
    for (i, ((q, k, v), got)) in items.iter().zip(&together).enumerate() {
        assert_eq!(
            bits(got)?,
            bits(&row_attention(q, k, v, 0.25)?)?,
            "sequence {i}"
        );
    }
    Ok(())
}

#[test]
fn keys_and_values_kept_in_f16_give_what_their_f32_values_give() -> candle_core::Result<()> {
    // The cache's f16 widened as it is loaded: the same result, bit for bit, as the
    // f32 path over the same values, for head sizes the vectors take and one they do
    // not, alone and among a batch.
    let dev = Device::Cpu;
    for hd in [16, 64, 20] {
        let (heads, kv_heads) = (6, 2);
        let mut items = Vec::new();
        for (t, n) in [(1, 5), (1, 700), (9, 40)] {
            let q = Tensor::randn(0f32, 1.0, (heads, t, hd), &dev)?;
            let k = Tensor::randn(0f32, 1.0, (kv_heads, n + 3, hd), &dev)?
                .to_dtype(DType::F16)?
                .narrow(1, 0, n)?;
            let v = Tensor::randn(0f32, 1.0, (kv_heads, n + 3, hd), &dev)?
                .to_dtype(DType::F16)?
                .narrow(1, 0, n)?;
            items.push((q, k, v));
        }
        let refs: Vec<_> = items.iter().map(|(q, k, v)| (q, k, v)).collect();
        let together = row_attention_each(&refs, 0.3)?;
        for ((q, k, v), got) in items.iter().zip(&together) {
            let wide = row_attention(q, &k.to_dtype(DType::F32)?, &v.to_dtype(DType::F32)?, 0.3)?;
            assert_eq!(bits(&row_attention(q, k, v, 0.3)?)?, bits(&wide)?, "{hd}");
            assert_eq!(bits(got)?, bits(&wide)?, "{hd}, in a batch");
        }
    }
    Ok(())
}

#[test]
fn keys_and_values_kept_in_8_bits_give_what_their_values_give() -> candle_core::Result<()> {
    // 8-bit rows with their scales folded into scores and weights: what the f32 path
    // gives over the values they stand for (to rounding: the scale is applied after
    // the sum), and among a batch bit for bit what each gives alone.
    let dev = Device::Cpu;
    let err = |e: crate::ModelError| candle_core::Error::msg(e.to_string());
    for hd in [16, 64, 20] {
        let (heads, kv_heads) = (6, 2);
        let mut items = Vec::new();
        for (t, n) in [(1, 5), (1, 700), (9, 40), (20, 2000), (2, 1500)] {
            let q = Tensor::randn(0f32, 1.0, (heads, t, hd), &dev)?;
            let mut kv = [Part::Keys, Part::Values].into_iter().map(|part| {
                let x = Tensor::randn(0f32, 1.0, (kv_heads, n + 3, hd), &dev)?;
                crate::kv8::quantize(&x, part).map_err(err)?.narrow(1, 0, n)
            });
            let (k, v) = (kv.next().expect("k")?, kv.next().expect("v")?);
            items.push((q, k, v));
        }
        let refs: Vec<_> = items.iter().map(|(q, k, v)| (q, k, v)).collect();
        let together = row_attention_each(&refs, 0.3)?;
        for ((q, k, v), got) in items.iter().zip(&together) {
            let alone = row_attention(q, k, v, 0.3)?;
            let wide = |x: &Tensor, part| crate::kv8::dequantize(x, part).map_err(err);
            let want = row_attention(q, &wide(k, Part::Keys)?, &wide(v, Part::Values)?, 0.3)?;
            let diff = (&alone - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "head size {hd}: {diff}");
            assert_eq!(bits(got)?, bits(&alone)?, "{hd}, in a batch");
        }
    }
    Ok(())
}

#[test]
fn the_vectorized_exponential_is_within_a_few_ulps_of_libm() {
    let mut xs: Vec<f32> = (0..2000).map(|i| -80.0 + i as f32 * 0.04).collect();
    let want: Vec<f32> = xs.iter().map(|x| (x - 0.5).exp()).collect();
    let sum = super::exp_minus(&mut xs, 0.5);
    for (x, w) in xs.iter().zip(&want) {
        assert!((x - w).abs() <= 4e-7 * w, "{x} vs {w}");
    }
    let total: f32 = want.iter().sum();
    assert!((sum - total).abs() <= 1e-5 * total);
}

#[test]
fn the_exponentials_eight_at_a_time_are_the_plain_ones() {
    // Lengths with and without a remainder; values down to where exp clamps.
    for len in [8, 29, 4000] {
        let xs: Vec<f32> = (0..len).map(|i| ((i * 37) % 1000) as f32 * -0.1).collect();
        let mut got = xs.clone();
        let sum = super::exp_minus(&mut got, 1.5);
        let want: Vec<f32> = xs.iter().map(|x| super::arith::exp(x - 1.5)).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{len} values");
        let mut lanes = [0f32; 8];
        for (i, x) in want.iter().enumerate().take(len / 8 * 8) {
            lanes[i % 8] += x;
        }
        let tail: f32 = want[len / 8 * 8..].iter().sum();
        assert_eq!(sum.to_bits(), (lanes.iter().sum::<f32>() + tail).to_bits());
    }
}

#[test]
fn the_largest_score_eight_lanes_at_a_time_is_the_plain_fold_s() {
    for len in [0, 1, 7, 8, 9, 100, 3001] {
        let xs: Vec<f32> = (0..len)
            .map(|i| ((i * 37 % 101) as f32 * 0.7).sin() * 9.0)
            .collect();
        let plain = xs.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        assert_eq!(
            super::max_of(&xs).to_bits(),
            plain.to_bits(),
            "{len} values"
        );
    }
}

#[test]
fn eight_keys_at_once_score_as_one_at_a_time() {
    let q: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
    let keys: Vec<Vec<f32>> = (0..8)
        .map(|k| {
            (0..64)
                .map(|i| ((i * 7 + k * 13) as f32 * 0.11).cos())
                .collect()
        })
        .collect();
    let got = super::arith::dot8(&q, std::array::from_fn(|c| keys[c].as_slice()));
    for (g, key) in got.iter().zip(&keys) {
        assert_eq!(g.to_bits(), super::dot(&q, key).to_bits());
    }
}

#[test]
fn queries_scored_together_score_as_each_alone() {
    for hd in [8, 64, 128] {
        let row = |seed: usize| -> Vec<f32> {
            (0..hd)
                .map(|i| ((i * 7 + seed * 13) as f32 * 0.11).cos())
                .collect()
        };
        let keys: Vec<Vec<f32>> = (0..8).map(row).collect();
        let keys: [&[f32]; 8] = std::array::from_fn(|c| keys[c].as_slice());
        let qs: Vec<Vec<f32>> = (100..103).map(row).collect();
        let qs: Vec<&[f32]> = qs.iter().map(Vec::as_slice).collect();
        for n in 1..=3 {
            let got = super::scores_of(&qs[..n], keys);
            for (g, q) in got.iter().zip(&qs[..n]) {
                let alone = super::arith::dot8(q, keys);
                assert_eq!(g.map(f32::to_bits), alone.map(f32::to_bits), "{n} of {hd}");
            }
        }
    }
}

#[test]
fn values_weighed_in_registers_equal_the_plain_loop() -> candle_core::Result<()> {
    // Head sizes of one to eight vectors, one that is not a multiple of eight, over
    // a strided view (the cache's capacity beyond the keys in use).
    for hd in [8, 24, 64, 96, 128, 20] {
        let v = Tensor::randn(0f32, 1.0, (2, 40, hd), &Device::Cpu)?.narrow(1, 3, 30)?;
        let (storage, layout) = v.storage_and_layout();
        let view = super::View::new(super::cpu(&storage)?, layout, "v")?;
        let probs: Vec<f32> = (0..25).map(|j| 1.0 / (j as f32 + 1.5)).collect();
        let mut got = vec![0f32; hd];
        super::weigh_values(&mut got, &probs, &view, 1);
        let mut want = vec![0f32; hd];
        for (j, &p) in probs.iter().enumerate() {
            for (acc, x) in want.iter_mut().zip(view.row(1, j)) {
                *acc = p.mul_add(*x, *acc);
            }
        }
        let bits = |xs: &[f32]| xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "head size {hd}");
    }
    Ok(())
}

#[test]
fn shapes_that_do_not_fit_are_errors() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::zeros((5, 1, 8), candle_core::DType::F32, &dev)?;
    let k = Tensor::zeros((2, 3, 8), candle_core::DType::F32, &dev)?;
    assert!(
        row_attention(&q, &k, &k, 1.0).is_err(),
        "5 heads over 2 KV heads"
    );
    let q = Tensor::zeros((2, 4, 8), candle_core::DType::F32, &dev)?;
    assert!(
        row_attention(&q, &k, &k, 1.0).is_err(),
        "4 rows over 3 positions"
    );
    Ok(())
}
