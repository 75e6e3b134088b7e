//! Micro-benchmark of the quantized matmul on one matrix shape, every block type and
//! instruction set: `cargo run --release -p shoal-kernels --example kernel_bench -- ROWS COLS T THREADS`.
//! Prints nanoseconds per call and per 32 weights (the fastest of several rounds). `KERNEL_BENCH_ISA=Amx` (or another
//! instruction set's name) and `KERNEL_BENCH_TYPE=Q4_1` (a block type) narrow it down;
//! `KERNEL_BENCH_ROWS=int8` pins the serving path's decode rows (`shoal_kernels::Rows`).

use std::time::Instant;

use shoal_kernels::{BlockType, Isa, QuantMatrix, Rows, ThreadPool, matmul_with, with_rows};

/// Timed rounds per measurement; the fastest is reported.
const ROUNDS: usize = 7;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let rows = args.first().copied().unwrap_or(1536);
    let cols = args.get(1).copied().unwrap_or(576).max(256) / 32 * 32;
    let t = args.get(2).copied().unwrap_or(1);
    let threads = args.get(3).copied().unwrap_or(1);
    let pool = ThreadPool::new(threads);
    let x: Vec<f32> = (0..t * cols)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut out = vec![0f32; t * rows];
    println!("rows {rows} cols {cols} tokens {t} threads {threads}");
    let only_type = std::env::var("KERNEL_BENCH_TYPE").ok();
    // KERNEL_BENCH_ROWS=int8: the serving path's decode rows (each token as alone).
    let pinned = match std::env::var("KERNEL_BENCH_ROWS").as_deref() {
        Ok("int8") => Rows::Int8,
        Ok("bf16") => Rows::Bf16,
        _ => Rows::ByCount,
    };
    for ty in BlockType::ALL {
        if only_type.as_ref().is_some_and(|o| *o != format!("{ty:?}")) {
            continue;
        }
        if cols % ty.block_size() != 0 {
            println!(
                "{ty:?}: skipped ({cols} columns are not whole blocks of {})",
                ty.block_size()
            );
            continue;
        }
        let mut data: Vec<u8> = (0..rows * ty.row_bytes(cols))
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        // Keep scales finite and small.
        for blk in data.chunks_exact_mut(ty.block_bytes()) {
            let at = if ty == BlockType::Q6K { 208 } else { 0 };
            blk[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
        let m = QuantMatrix::new(ty, rows, cols, data).expect("matrix");
        let only = std::env::var("KERNEL_BENCH_ISA").ok();
        for isa in Isa::available() {
            if only.as_ref().is_some_and(|o| *o != format!("{isa:?}")) {
                continue;
            }
            // The best of several rounds: a VM's stolen time inflates some rounds, never
            // deflates one.
            let iters = (2e8 as usize / (rows * cols * t) / ROUNDS).max(3);
            let ns = with_rows(pinned, || {
                matmul_with(isa, &pool, &m, &x, t, &mut out).expect("warm");
                (0..ROUNDS)
                    .map(|_| {
                        let start = Instant::now();
                        for _ in 0..iters {
                            matmul_with(isa, &pool, &m, &x, t, &mut out).expect("matmul");
                        }
                        start.elapsed().as_nanos() as f64 / iters as f64
                    })
                    .fold(f64::INFINITY, f64::min)
            });
            let per_block = ns / (rows * cols * t / 32) as f64 * threads as f64;
            println!(
                "{ty:?} {isa:?}: {:.1} us per call, {:.2} ns per 32 weights per thread, {:.1} GB/s of weights",
                ns / 1e3,
                per_block,
                m.size_in_bytes() as f64 / ns
            );
        }
    }
}
