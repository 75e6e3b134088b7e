//! A layer's element-wise work that is worth the kernel threads: SwiGLU's
//! `silu(gate) · up` over a batch's rows, one exponential a value.

use crate::{KernelError, ThreadPool};

/// Values from which the work is shared among the threads: below it, handing out pieces
/// costs about what it saves.
const PARALLEL_FROM: usize = 4096;

/// `out[i] = silu(gate[i]) · up[i]`, `silu(g) = g / (1 + e^−g)`: the same operations in
/// the same order as candle's `silu` then `mul`, so the same results, in one pass on the
/// process-wide pool.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    for (what, len) in [("up", up.len()), ("output", out.len())] {
        if len != gate.len() {
            return Err(KernelError::Size {
                what,
                expected: gate.len(),
                actual: len,
            });
        }
    }
    let apply = |range: std::ops::Range<usize>, out: &mut [f32]| {
        for ((o, &g), &u) in out.iter_mut().zip(&gate[range.clone()]).zip(&up[range]) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    };
    let pool = ThreadPool::global();
    if gate.len() < PARALLEL_FROM || pool.size() == 1 {
        apply(0..gate.len(), out);
        return Ok(());
    }
    let n = out.len();
    let addr = out.as_mut_ptr() as usize;
    let chunk = n.div_ceil(pool.size() * 4).next_multiple_of(16);
    pool.run_chunks(n, chunk, &|range| {
        // SAFETY: the pieces `range` are disjoint parts of `out`, which outlives the call.
        let piece = unsafe {
            std::slice::from_raw_parts_mut((addr as *mut f32).add(range.start), range.len())
        };
        apply(range, piece);
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_mul_is_silu_then_mul_on_any_length() {
        for n in [0, 7, 4096, 10_001] {
            let gate: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
            let up: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
            let mut out = vec![f32::NAN; n];
            silu_mul(&gate, &up, &mut out).unwrap();
            for i in 0..n {
                let g = gate[i];
                let silu = g / (1.0 + (-g).exp());
                assert_eq!(
                    out[i].to_bits(),
                    (silu * up[i]).to_bits(),
                    "value {i} of {n}"
                );
            }
        }
        let mut out = [0f32; 2];
        assert!(silu_mul(&[1.0; 2], &[1.0; 3], &mut out).is_err());
    }
}
