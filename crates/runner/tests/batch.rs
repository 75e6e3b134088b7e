//! Continuous batching computes what each sequence computes alone (see
//! `common/batching.rs`), every strategy at 1, 2 and 3 ranks, on generated models.

mod common;

use candle_core::quantized::GgmlDType;
use common::batching::{alone, check_runs};
use common::model_file;
use shoal_model::Architecture;
use shoal_runner::Strategy;

fn check(strategy: Strategy) {
    for dtype in [GgmlDType::F32, GgmlDType::Q8_0] {
        let path = model_file(Architecture::Llama, dtype);
        let want = alone(&path);
        // f32: rounding only (a batched matmul sums in another order). Quantized:
        // activations are rounded to 8 bits before each product, so a last-bit
        // difference can move a value by a quantization step (see split.rs).
        let tolerance = if dtype == GgmlDType::F32 { 1e-4 } else { 3e-2 };
        check_runs(&path, &format!("{dtype:?}"), strategy, &want, tolerance);
    }
}

#[test]
fn batched_pipeline_matches_each_sequence_alone() {
    check(Strategy::Pipeline);
}

#[test]
fn batched_tensor_matches_each_sequence_alone() {
    check(Strategy::Tensor);
}

#[test]
fn batched_sequence_matches_each_sequence_alone() {
    check(Strategy::Sequence);
}
