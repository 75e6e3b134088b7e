//! Every kernel against independent references, on every instruction set this machine
//! has (each forced in turn) and the portable one: random blocks, odd sizes, all-zero
//! blocks and extreme scales.

use std::borrow::Cow;

use candle_core::Device;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use half::f16;
use shoal_kernels::{
    BlockType, Isa, QuantMatrix, Rows, ThreadPool, dequantize_row, matmul_many_with, matmul_with,
    with_rows,
};

struct Rng(u64);
impl Rng {
    fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn f32(&mut self) -> f32 {
        (self.u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn candle_type(ty: BlockType) -> GgmlDType {
    match ty {
        BlockType::Q4_0 => GgmlDType::Q4_0,
        BlockType::Q4_1 => GgmlDType::Q4_1,
        BlockType::Q5_0 => GgmlDType::Q5_0,
        BlockType::Q8_0 => GgmlDType::Q8_0,
        BlockType::Q4K => GgmlDType::Q4K,
        BlockType::Q6K => GgmlDType::Q6K,
    }
}

/// Byte offsets of the f16 scale fields in a block.
fn scale_offsets(ty: BlockType) -> &'static [usize] {
    match ty {
        BlockType::Q4_0 | BlockType::Q5_0 | BlockType::Q8_0 => &[0],
        BlockType::Q4_1 | BlockType::Q4K => &[0, 2],
        BlockType::Q6K => &[208],
    }
}

#[derive(Clone, Copy)]
enum Fill {
    Random,
    Zero,
    /// Largest finite f16 scales.
    Huge,
    /// Subnormal f16 scales.
    Tiny,
}

fn make_matrix(ty: BlockType, rows: usize, cols: usize, fill: Fill, rng: &mut Rng) -> Vec<u8> {
    let mut data: Vec<u8> = (0..rows * ty.row_bytes(cols))
        .map(|_| rng.u64() as u8)
        .collect();
    if let Fill::Zero = fill {
        data.fill(0);
        return data;
    }
    for blk in data.chunks_exact_mut(ty.block_bytes()) {
        for &o in scale_offsets(ty) {
            let v = match fill {
                Fill::Random => f16::from_f32(rng.f32() * 0.05),
                Fill::Huge => f16::from_f32(if rng.u64().is_multiple_of(2) {
                    65504.0
                } else {
                    -65504.0
                }),
                Fill::Tiny => f16::from_bits(1 + (rng.u64() % 8) as u16),
                Fill::Zero => f16::ZERO,
            };
            blk[o..o + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    data
}

/// candle's own dequantization: an implementation independent of shoal's.
fn candle_dequantize(ty: BlockType, rows: usize, cols: usize, data: &[u8]) -> Vec<f32> {
    let storage =
        QStorage::from_data(Cow::Borrowed(data), &Device::Cpu, candle_type(ty)).expect("storage");
    let q = QTensor::new(storage, (rows, cols)).expect("qtensor");
    q.dequantize(&Device::Cpu)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("dequantize")
}

/// The activations as the kernels must see them: 8-bit, blocks of 32, round to nearest.
fn quantized_activations(x: &[f32]) -> Vec<f64> {
    x.chunks(32)
        .flat_map(|b| {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            b.iter()
                .map(move |v| {
                    if d > 0.0 {
                        (v / d).round() as f64 * d as f64
                    } else {
                        0.0
                    }
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn unpacking_matches_candle_dequantization() {
    let mut rng = Rng(1);
    for ty in BlockType::ALL {
        for fill in [Fill::Random, Fill::Zero, Fill::Huge, Fill::Tiny] {
            let (rows, cols) = (3, 2 * ty.block_size());
            let data = make_matrix(ty, rows, cols, fill, &mut rng);
            let want = candle_dequantize(ty, rows, cols, &data);
            let m = QuantMatrix::new(ty, rows, cols, data).expect("matrix");
            for r in 0..rows {
                let mut got = vec![0f32; cols];
                m.dequantize_row(r, &mut got);
                for (c, (g, w)) in got.iter().zip(&want[r * cols..]).enumerate() {
                    let tol = 1e-6 * w.abs().max(1e-30);
                    assert!((g - w).abs() <= tol, "{ty:?} row {r} col {c}: {g} vs {w}");
                }
            }
        }
    }
}

/// The kernels accumulate in f32 and split each product into a scaled integer sum and a
/// bias term that partly cancel, so they are held to 1e-4 of the sum of those terms'
/// sizes: one weight off by a single quantization step in a row of 128 misses by ~1e-3.
#[allow(clippy::too_many_arguments)] // one line per dimension of the test grid
fn check_matmul(
    isa: Isa,
    pool: &ThreadPool,
    ty: BlockType,
    rows: usize,
    blocks: usize,
    t: usize,
    fill: Fill,
    seed: u64,
) {
    let mut rng = Rng(seed);
    let cols = blocks * ty.block_size();
    let data = make_matrix(ty, rows, cols, fill, &mut rng);
    let w = candle_dequantize(ty, rows, cols, &data);
    let m = QuantMatrix::new(ty, rows, cols, data).expect("matrix");
    let mut x: Vec<f32> = (0..t * cols).map(|_| rng.f32() * 3.0).collect();
    // Some all-zero activation blocks and an extreme one.
    let first = 32.min(x.len());
    x[..first].fill(0.0);
    if x.len() > 64 {
        x[40] = 1e4;
    }
    let mut out = vec![0f32; t * rows];
    matmul_with(isa, pool, &m, &x, t, &mut out).expect("matmul");
    if isa.batches_in_bf16(t) {
        // bf16 keeps 8 significant bits of each weight and activation: every product is
        // off by up to 2⁻⁸ of its size from the inputs alone; the tile unit's own
        // accumulation adds some (worst seen over this grid: 5.4e-3 of the sum of the
        // products' sizes, median 1.9e-4), so the bound is 2⁻⁷.
        for tok in 0..t {
            let xr = &x[tok * cols..(tok + 1) * cols];
            for r in 0..rows {
                let wr = &w[r * cols..(r + 1) * cols];
                let want: f64 = wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                let size: f64 = wr
                    .iter()
                    .zip(xr)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                let got = out[tok * rows + r] as f64;
                assert!(
                    (got - want).abs() <= 8.0e-3 * size + 1e-30,
                    "{isa:?} {ty:?} rows {rows} blocks {blocks} t {t} (tok {tok}, row {r}): {got} vs {want} (size {size})"
                );
            }
        }
        return;
    }
    for tok in 0..t {
        let xq = quantized_activations(&x[tok * cols..(tok + 1) * cols]);
        for r in 0..rows {
            let wr = &w[r * cols..(r + 1) * cols];
            let want: f64 = wr.iter().zip(&xq).map(|(a, b)| *a as f64 * b).sum();
            // Each product is computed as scale·q·x + bias·x, whose two terms are bounded
            // by the largest weight of the 16-group; that bounds the rounding too.
            let magnitude: f64 = wr
                .iter()
                .zip(&xq)
                .enumerate()
                .map(|(i, (a, b))| {
                    let group = &wr[i / 16 * 16..i / 16 * 16 + 16];
                    let range = group.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
                    (a.abs() as f64 + range) * b.abs()
                })
                .sum();
            let got = out[tok * rows + r] as f64;
            assert!(
                (got - want).abs() <= 1e-4 * magnitude + 1e-30,
                "{isa:?} {ty:?} rows {rows} blocks {blocks} t {t} (tok {tok}, row {r}): {got} vs {want} (magnitude {magnitude})"
            );
        }
    }
}

#[test]
fn every_block_type_on_every_instruction_set_matches_the_reference() {
    let isas = Isa::available();
    assert!(isas.contains(&Isa::Scalar));
    eprintln!("instruction sets on this machine: {isas:?}");
    let pools = [ThreadPool::new(1), ThreadPool::new(2), ThreadPool::new(3)];
    let mut seed = 10;
    for &isa in &isas {
        for ty in BlockType::ALL {
            for (rows, blocks, t) in [
                (1, 1, 1),
                (3, 2, 1),
                // Single tokens take the decode kernels: several passes of four rows,
                // runs of blocks past a multiple of eight with one or two left over.
                (9, 9, 1),
                (6, 17, 1),
                (5, 10, 1),
                (7, 3, 2),
                (33, 1, 5),
                (16, 4, 3),
                (9, 2, 6),
                (5, 6, 9),
                // Batches past one AMX panel (32 rows) and one step (32 tokens).
                (37, 2, 35),
                (20, 3, 12),
                // Tall enough for each row's last blocks packed across rows: one block
                // left (16 rows a pack), two (8 a pack, the last pack partial).
                (520, 17, 1),
                (530, 18, 5),
                // K-quant matrices are repacked 1024 rows at a time.
                (1100, 3, 2),
            ] {
                for fill in [Fill::Random, Fill::Zero, Fill::Huge, Fill::Tiny] {
                    seed += 1;
                    let pool = &pools[seed as usize % pools.len()];
                    check_matmul(isa, pool, ty, rows, blocks, t, fill, seed);
                }
            }
        }
    }
}

#[test]
fn quantized_activations_stay_close_to_f32_activations() {
    // The only approximation the kernels add on top of the weights' own.
    let mut rng = Rng(77);
    let isa = Isa::detect();
    let pool = ThreadPool::new(2);
    for ty in BlockType::ALL {
        let (rows, cols) = (8, 4 * ty.block_size());
        let data = make_matrix(ty, rows, cols, Fill::Random, &mut rng);
        let w = candle_dequantize(ty, rows, cols, &data);
        let m = QuantMatrix::new(ty, rows, cols, data).expect("matrix");
        let x: Vec<f32> = (0..cols).map(|_| rng.f32()).collect();
        let mut out = vec![0f32; rows];
        matmul_with(isa, &pool, &m, &x, 1, &mut out).expect("matmul");
        for r in 0..rows {
            let wr = &w[r * cols..(r + 1) * cols];
            let exact: f64 = wr.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let magnitude: f64 = wr
                .iter()
                .zip(&x)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            assert!(
                (out[r] as f64 - exact).abs() <= 0.01 * magnitude,
                "{ty:?} row {r}: {} vs {exact}",
                out[r]
            );
        }
    }
}

#[test]
fn several_matrices_in_one_call_equal_one_call_each() {
    // Mixed block types and row counts (a layer's q, k, v can differ), so the threads'
    // shares of the concatenated rows cross matrix boundaries.
    let mut rng = Rng(5);
    let cols = 512;
    let shapes = [
        (BlockType::Q4K, 13),
        (BlockType::Q6K, 5),
        (BlockType::Q5_0, 9),
        (BlockType::Q8_0, 1),
    ];
    let mats: Vec<QuantMatrix> = shapes
        .iter()
        .map(|&(ty, rows)| {
            let data = make_matrix(ty, rows, cols, Fill::Random, &mut rng);
            QuantMatrix::new(ty, rows, cols, data).expect("matrix")
        })
        .collect();
    let ws: Vec<&QuantMatrix> = mats.iter().collect();
    for isa in Isa::available() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for t in [1, 3] {
                let x: Vec<f32> = (0..t * cols).map(|_| rng.f32()).collect();
                let mut many: Vec<Vec<f32>> =
                    mats.iter().map(|m| vec![0f32; t * m.rows()]).collect();
                let mut outs: Vec<&mut [f32]> = many.iter_mut().map(|o| o.as_mut_slice()).collect();
                matmul_many_with(isa, &pool, &ws, &x, t, &mut outs).expect("matmul_many");
                for (m, got) in mats.iter().zip(&many) {
                    let mut one = vec![0f32; t * m.rows()];
                    matmul_with(isa, &pool, m, &x, t, &mut one).expect("matmul");
                    assert_eq!(
                        got,
                        &one,
                        "{isa:?} {:?} threads {threads} t {t}",
                        m.block_type()
                    );
                }
            }
        }
    }
    let pool = ThreadPool::new(1);
    let narrow = QuantMatrix::new(BlockType::Q8_0, 1, 32, vec![0; 34]).expect("matrix");
    let mut a = vec![0f32; 13];
    let mut b = vec![0f32; 1];
    let err = matmul_many_with(
        Isa::Scalar,
        &pool,
        &[ws[0], &narrow],
        &[0.0; 512],
        1,
        &mut [&mut a, &mut b],
    );
    assert!(err.is_err(), "matrices of different widths are refused");
}

#[test]
fn rows_in_a_batch_equal_each_alone_bit_for_bit() {
    // Decode rows (`Rows::Int8`: up to four tokens share each decoded weight block) and
    // prompt rows (the register tiles, `Rows::ByCount` without AMX) must both give every
    // token exactly what it gets alone, whatever its place in the batch (odd token counts
    // leave remainders; 17 blocks of 32 leave a lone one): a scheduler may slice a
    // prompt any way and batch it with anything.
    let mut rng = Rng(11);
    for (ty, cols, rows) in BlockType::ALL.into_iter().flat_map(|ty| {
        let widths: &[usize] = if ty.block_size() == 256 {
            &[768]
        } else {
            &[576, 544]
        };
        // 517 rows: tall enough for the lane layout to pack the rows' last blocks.
        widths
            .iter()
            .flat_map(move |&c| [(ty, c, 11), (ty, c, 517)])
    }) {
        let data = make_matrix(ty, rows, cols, Fill::Random, &mut rng);
        let m = QuantMatrix::new(ty, rows, cols, data).expect("matrix");
        for isa in Isa::available().into_iter().filter(|&i| i != Isa::Amx) {
            for (pinned, threads) in [
                (Rows::Int8, 1),
                (Rows::Int8, 2),
                (Rows::ByCount, 1),
                (Rows::ByCount, 2),
            ] {
                let pool = ThreadPool::new(threads);
                let t = 9;
                let x: Vec<f32> = (0..t * cols).map(|_| rng.f32()).collect();
                let mut together = vec![0f32; t * rows];
                with_rows(pinned, || {
                    matmul_with(isa, &pool, &m, &x, t, &mut together).expect("matmul")
                });
                for tok in 0..t {
                    let mut alone = vec![0f32; rows];
                    let xi = &x[tok * cols..(tok + 1) * cols];
                    matmul_with(isa, &pool, &m, xi, 1, &mut alone).expect("matmul");
                    let got = &together[tok * rows..(tok + 1) * rows];
                    let same = got
                        .iter()
                        .zip(&alone)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    // The tiles take widths of whole 64s; others go the portable way.
                    let exact = exact_in_batches(isa)
                        && (pinned == Rows::Int8 || cols % 64 == 0 || isa == Isa::Avx2);
                    assert!(
                        same || !exact,
                        "{isa:?} {ty:?} {pinned:?} threads {threads} token {tok}: {got:?} vs {alone:?}"
                    );
                }
            }
        }
    }
}

/// Where the batch kernels keep the single-token arithmetic: AVX-512, and AVX2's lane
/// kernel (every block type, repacked when AVX2 is the machine's instruction set); AVX2's
/// other batch loops and the portable ones sum in another order.
fn exact_in_batches(isa: Isa) -> bool {
    let repacked = std::env::var("SHOAL_LANES").map_or(true, |v| v != "0");
    isa == Isa::Avx512Vnni || (isa == Isa::Avx2 && Isa::detect() == Isa::Avx2 && repacked)
}

#[test]
fn malformed_inputs_are_errors() {
    assert!(QuantMatrix::new(BlockType::Q4_0, 2, 48, vec![0; 36]).is_err());
    assert!(QuantMatrix::new(BlockType::Q4_0, 2, 32, vec![0; 35]).is_err());
    let m = QuantMatrix::new(BlockType::Q8_0, 2, 32, vec![0; 68]).expect("matrix");
    let pool = ThreadPool::new(1);
    let mut out = vec![0f32; 3];
    assert!(matmul_with(Isa::Scalar, &pool, &m, &[0.0; 32], 1, &mut out).is_err());
    let mut out = vec![0f32; 2];
    assert!(matmul_with(Isa::Scalar, &pool, &m, &[0.0; 31], 1, &mut out).is_err());
    let _ = dequantize_row;
}
