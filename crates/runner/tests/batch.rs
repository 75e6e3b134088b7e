//! Continuous batching computes what each sequence computes alone (see
//! `common/batching.rs`), every strategy at 1, 2 and 3 ranks, on generated models.

mod common;

use candle_core::quantized::GgmlDType;
use common::batching::{alone, assert_same_rows, batched_with, check_runs};
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

#[test]
fn tensor_ranks_whose_machines_group_a_batch_otherwise_still_pair_up() {
    // Rank 1 stands in for a machine whose prompt and decode rows round otherwise (AMX):
    // alone it would run a batch holding both as two groups, where rank 0 runs one pass,
    // and their per-half-layer all-reduces would not pair up (a size mismatch at the
    // first mixed step). The ranks agree on the grouping; every row stays its own.
    let path = model_file(Architecture::Llama, GgmlDType::Q8_0);
    let want = alone(&path);
    let apart = |rank: usize, m: shoal_model::Model| {
        if rank == 1 { m.with_rows_apart() } else { m }
    };
    let got = batched_with(&path, Strategy::Tensor, 2, 1, apart);
    assert_same_rows("tensor, 2 ranks, rank 1 apart", &want, &got, 3e-2);
}
