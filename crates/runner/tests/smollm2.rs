//! The real smollm2-135m split across 2 and 3 ranks with every strategy computes one
//! process's logits: a 1-token prompt, a prompt in one chunk, a prompt over several
//! chunks, 20 greedy decode steps. Run with f32 activations (`SHOAL_KERNELS=dense`), so
//! the comparison is of the split itself, not of 8-bit activation rounding (which
//! `docs/CORRECTNESS.md` measures separately). The model is installed into the store on
//! first use.

mod common;

use common::{compare, single, split};
use shoal_runner::Strategy;

#[test]
fn every_strategy_on_smollm2_matches_one_process() {
    // SAFETY: the only test of this binary sets it before any thread reads it.
    unsafe { std::env::set_var("SHOAL_KERNELS", "dense") };
    let path = shoal_store::Store::from_env()
        .resolve_or_pull("smollm2-135m")
        .unwrap_or_else(|e| panic!("cannot install smollm2-135m: {e}"));
    let (want, tokens) = single(&path);
    for strategy in [Strategy::Pipeline, Strategy::Tensor, Strategy::Sequence] {
        for world in [2, 3] {
            let got = split(&path, strategy, world, &tokens);
            compare(
                &format!("smollm2 {strategy} {world} ranks"),
                &want,
                &got,
                1e-4,
            );
        }
    }
}
