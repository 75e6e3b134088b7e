//! shoal's CPU kernels: matrix products of GGUF-quantized weights with f32 activations.
//!
//! The approach, the same for every block type:
//! 1. activations are quantized once per call to 8 bits in blocks of 32 (a scale per
//!    block and the sum of each half-block, as llama.cpp's `q8` formats do);
//! 2. a weight row is unpacked into unsigned small integers `q` (one byte each) with a
//!    scale and a bias per 16 weights, so that `w = scale·q + bias` — every block type
//!    (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) fits that form exactly;
//! 3. one integer dot-product kernel per instruction set (AVX-512 VNNI, AVX2, portable)
//!    multiplies the unpacked row with every activation row: unpacking costs once per
//!    weight row however many tokens the batch holds.
//!
//! `Σ w·x = Σ_h scale_h·d_x·Σ_{i∈h} q_i·x_i + Σ_h bias_h·d_x·Σ_{i∈h} x_i`, where `h` runs over
//! groups of 16 and `d_x` is the activation block's scale.

mod activation;
mod amx;
mod blocks;
mod dot;
mod fused;
mod lanes;
mod lanes_avx2;
mod matmul;
mod pool;
mod tile;
mod wide;

pub use activation::silu_mul;
pub use blocks::{BlockType, dequantize_row};
pub use dot::Isa;
pub use matmul::{
    AMX_MIN_TOKENS, Activations, QuantMatrix, Rows, matmul, matmul_many, matmul_many_with,
    matmul_with, with_rows,
};
pub use pool::ThreadPool;

/// Errors from malformed inputs to the kernels.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    #[error("{what}: expected {expected}, got {actual}")]
    Size {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("{0} is not a multiple of the block size {1}")]
    Alignment(usize, usize),
}
