//! Quantized weight matrices, quantized activations, and the threaded product.

use std::borrow::Cow;
use std::cell::RefCell;

use crate::blocks::{BlockType, Unpacked, unpack_row_with};
use crate::dot::{Isa, dot, dot_many};
use crate::{KernelError, ThreadPool};

/// A `(rows, cols)` weight matrix in a GGUF block type, rows stored one after another.
#[derive(Clone, Debug)]
pub struct QuantMatrix {
    ty: BlockType,
    rows: usize,
    cols: usize,
    /// GGUF's blocks, row after row (empty when `lanes` holds the weights).
    data: Vec<u8>,
    /// The same weights repacked for the lane kernel, on machines that run it.
    #[cfg(target_arch = "x86_64")]
    lanes: Option<crate::lanes::Lanes>,
}

/// The lane kernel's group width for `isa`, if it has one.
#[cfg(target_arch = "x86_64")]
fn lane_width(isa: Isa) -> Option<usize> {
    match isa {
        Isa::Avx512Vnni | Isa::Amx => Some(crate::lanes::WIDE),
        Isa::Avx2 => Some(crate::lanes::NARROW),
        Isa::Scalar => None,
    }
}

/// The group width matrices of `ty` are repacked in for the lane kernel: on AVX-512 VNNI
/// and AVX2 machines, unless `SHOAL_LANES=0` (to compare with GGUF's layout).
#[cfg(target_arch = "x86_64")]
fn repack(ty: BlockType) -> Option<usize> {
    if !lanes_on() {
        return None;
    }
    lane_width(Isa::detect()).filter(|&width| crate::lanes::takes(ty, width))
}

/// Whether quantized matrices are repacked for the lane kernels (`SHOAL_LANES=0` keeps
/// GGUF's layout).
pub(crate) fn lanes_on() -> bool {
    std::env::var("SHOAL_LANES").map_or(true, |v| v != "0")
}

impl QuantMatrix {
    pub fn new(
        ty: BlockType,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<Self, KernelError> {
        Self::build(ty, rows, cols, Cow::Owned(data))
    }

    /// [`QuantMatrix::new`] from borrowed bytes, copied only where the matrix keeps GGUF's
    /// layout: a matrix repacked for the lane kernels is read where it lies, so a load
    /// does not hold a copy of it beside the repacked one (qwen2.5-coder-0.5b's 145 MB
    /// head).
    pub fn from_bytes(
        ty: BlockType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Self, KernelError> {
        Self::build(ty, rows, cols, Cow::Borrowed(data))
    }

    fn build(
        ty: BlockType,
        rows: usize,
        cols: usize,
        data: Cow<'_, [u8]>,
    ) -> Result<Self, KernelError> {
        if !cols.is_multiple_of(ty.block_size()) {
            return Err(KernelError::Alignment(cols, ty.block_size()));
        }
        let expected = rows * ty.row_bytes(cols);
        if data.len() != expected {
            return Err(KernelError::Size {
                what: "weight bytes",
                expected,
                actual: data.len(),
            });
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(width) = repack(ty) {
            let lanes = crate::lanes::Lanes::pack(ty, rows, cols, &data, width);
            return Ok(Self {
                ty,
                rows,
                cols,
                data: Vec::new(),
                lanes: Some(lanes),
            });
        }
        Ok(Self {
            ty,
            rows,
            cols,
            data: data.into_owned(),
            #[cfg(target_arch = "x86_64")]
            lanes: None,
        })
    }

    pub fn block_type(&self) -> BlockType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn size_in_bytes(&self) -> usize {
        #[cfg(target_arch = "x86_64")]
        if let Some(l) = &self.lanes {
            return l.size_in_bytes();
        }
        self.data.len()
    }

    /// The GGUF bytes of row `r` (rebuilt from the lane layout when the matrix is in it).
    pub fn row(&self, r: usize) -> Cow<'_, [u8]> {
        #[cfg(target_arch = "x86_64")]
        if let Some(l) = &self.lanes {
            let mut out = Vec::new();
            l.gguf_row(r, &mut out);
            return Cow::Owned(out);
        }
        let n = self.ty.row_bytes(self.cols);
        Cow::Borrowed(&self.data[r * n..(r + 1) * n])
    }

    /// Row `r` as f32.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        crate::dequantize_row(self.ty, &self.row(r), out);
    }

    /// The lane layout, when the matrix is in it and `isa` runs the lane kernel of its
    /// width.
    #[cfg(target_arch = "x86_64")]
    fn lanes_for(&self, isa: Isa) -> Option<&crate::lanes::Lanes> {
        self.lanes
            .as_ref()
            .filter(|l| lane_width(isa) == Some(l.width))
    }
}

/// `t` rows of `k` activations quantized to 8 bits in blocks of 32: `x ≈ d·q`.
#[derive(Clone, Debug)]
pub struct Activations {
    t: usize,
    k: usize,
    q: Vec<i8>,
    /// One scale per block of 32.
    d: Vec<f32>,
    /// `d · Σ q` per group of 16 (for the weight biases).
    sum16: Vec<f32>,
}

impl Activations {
    /// Quantizes `x` (`t` rows of `k`, `k` a multiple of 32) with round-to-nearest.
    pub fn quantize(x: &[f32], t: usize, k: usize) -> Result<Self, KernelError> {
        if !k.is_multiple_of(32) {
            return Err(KernelError::Alignment(k, 32));
        }
        if x.len() != t * k {
            return Err(KernelError::Size {
                what: "activations",
                expected: t * k,
                actual: x.len(),
            });
        }
        let mut q = vec![0i8; t * k];
        let mut d = vec![0f32; t * k / 32];
        let mut sum16 = vec![0f32; t * k / 16];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: AVX2 and FMA are available (checked).
            unsafe { quantize_blocks_avx2(x, &mut q, &mut d, &mut sum16) };
            return Ok(Self { t, k, q, d, sum16 });
        }
        quantize_blocks(x, &mut q, &mut d, &mut sum16);
        Ok(Self { t, k, q, d, sum16 })
    }

    pub fn rows(&self) -> usize {
        self.t
    }

    pub(crate) fn cols(&self) -> usize {
        self.k
    }

    #[inline]
    pub(crate) fn row(&self, i: usize) -> (&[i8], &[f32], &[f32]) {
        let k = self.k;
        (
            &self.q[i * k..(i + 1) * k],
            &self.d[i * k / 32..(i + 1) * k / 32],
            &self.sum16[i * k / 16..(i + 1) * k / 16],
        )
    }
}

/// Each block of 32 of `x` as 8-bit values `q` with its scale `d` (round to nearest, half
/// away from zero) and `d·Σq` over each half (`sum16`).
#[inline(always)]
fn quantize_blocks(x: &[f32], q: &mut [i8], d: &mut [f32], sum16: &mut [f32]) {
    for (b, (xs, qs)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for (o, v) in qs.iter_mut().zip(xs) {
            *o = (v * inv).round() as i8;
        }
        d[b] = scale;
        for h in 0..2 {
            let s: i32 = qs[h * 16..h * 16 + 16].iter().map(|&v| v as i32).sum();
            sum16[2 * b + h] = scale * s as f32;
        }
    }
}

/// [`quantize_blocks`] in AVX2 vectors, with the same results: the baseline target
/// calls `roundf` per value and finds each block's maximum one value at a time (a sixth
/// of a batched decode step's serial work).
///
/// # Safety
/// AVX2 and FMA are available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_blocks_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], sum16: &mut [f32]) {
    use std::arch::x86_64::*;
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let half = _mm256_set1_ps(0.5);
    let one = _mm256_set1_ps(1.0);
    let sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let hsum = |v: __m256i| -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    };
    for (b, (xs, qs)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
        // SAFETY: a chunk holds 32 floats, read as four unaligned vectors.
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(xs.as_ptr().add(8 * i)) });
        // The largest magnitude (max is exact, so the order of the comparisons is free).
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
            _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m));
        let amax = _mm_cvtss_f32(m);
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        let inv = _mm256_set1_ps(inv);
        // Round half away from zero, as `f32::round`: truncate, then step away from zero
        // where the dropped fraction (exact) is at least a half.
        let q32: [__m256i; 4] = std::array::from_fn(|i| {
            let y = _mm256_mul_ps(v[i], inv);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
            let frac = _mm256_and_ps(_mm256_sub_ps(y, t), abs_mask);
            let away = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), one);
            let away = _mm256_or_ps(away, _mm256_and_ps(y, sign_mask));
            _mm256_cvttps_epi32(_mm256_add_ps(t, away))
        });
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(q32[0], q32[1]),
            _mm256_packs_epi32(q32[2], q32[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(bytes, order);
        // SAFETY: a chunk of `q` holds 32 bytes.
        unsafe { _mm256_storeu_si256(qs.as_mut_ptr().cast(), bytes) };
        d[b] = scale;
        sum16[2 * b] = scale * hsum(_mm256_add_epi32(q32[0], q32[1])) as f32;
        sum16[2 * b + 1] = scale * hsum(_mm256_add_epi32(q32[2], q32[3])) as f32;
    }
}

/// Batches at least this large take the AVX-512 register tiles; smaller ones, the
/// single-token kernel a few tokens at a time (the same arithmetic either way).
const TILE_MIN_TOKENS: usize = 6;

/// Batches at least this large take the AMX tiles (when the Isa is [`Isa::Amx`]): below
/// it, dequantizing the weights to bf16 costs more than the VNNI tiles' whole product
/// (`kernel_bench 1536 1536 T 1`: the two meet between 8 and 16 tokens).
pub const AMX_MIN_TOKENS: usize = 12;

/// Which arithmetic a batch of rows gets on a machine with AMX tiles. The bf16 tiles
/// round activations otherwise than the 8-bit paths, so a row's result depends on the
/// path; a server that batches many sequences pins the path per sequence (prompt rows
/// bf16, decode rows 8-bit), so that each row is computed as it would be alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// By the number of rows (bf16 tiles from [`AMX_MIN_TOKENS`]).
    ByCount,
    /// 8-bit, however many rows.
    Int8,
    /// bf16 tiles, however few rows (on a machine with them).
    Bf16,
}

thread_local! {
    static ROW: RefCell<Unpacked> = RefCell::new(Unpacked::default());
    static ROWS: std::cell::Cell<Rows> = const { std::cell::Cell::new(Rows::ByCount) };
}

/// Runs `f` with every matmul this thread starts computing its rows as `rows` says.
pub fn with_rows<R>(rows: Rows, f: impl FnOnce() -> R) -> R {
    struct Reset(Rows);
    impl Drop for Reset {
        fn drop(&mut self) {
            ROWS.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(ROWS.with(|c| c.replace(rows)));
    f()
}

/// Whether a matmul of `t` rows takes the bf16 tiles.
fn bf16_tiles(isa: Isa, t: usize) -> bool {
    match ROWS.with(|c| c.get()) {
        Rows::ByCount => isa.batches_in_bf16(t),
        Rows::Int8 => false,
        Rows::Bf16 => isa == Isa::Amx && t >= 2,
    }
}

/// `out (t, rows) = x (t, cols) · wᵀ` with the best instruction set of this machine on the
/// process-wide thread pool.
pub fn matmul(w: &QuantMatrix, x: &[f32], t: usize, out: &mut [f32]) -> Result<(), KernelError> {
    matmul_with(Isa::detect(), ThreadPool::global(), w, x, t, out)
}

/// [`matmul`] with a chosen instruction set (which must be available) and pool.
pub fn matmul_with(
    isa: Isa,
    pool: &ThreadPool,
    w: &QuantMatrix,
    x: &[f32],
    t: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let isa = if isa.is_available() { isa } else { Isa::Scalar };
    if out.len() != t * w.rows {
        return Err(KernelError::Size {
            what: "output",
            expected: t * w.rows,
            actual: out.len(),
        });
    }
    if x.len() != t * w.cols {
        return Err(KernelError::Size {
            what: "activations",
            expected: t * w.cols,
            actual: x.len(),
        });
    }
    #[cfg(target_arch = "x86_64")]
    if bf16_tiles(isa, t) {
        crate::amx::matmul(pool, w, x, t, out);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(lanes) = w.lanes_for(isa) {
        let acts = Activations::quantize(x, t, w.cols)?;
        let acts = crate::lanes::LaneActs::of(&acts, lanes.width, lanes.halves());
        let out_addr = out.as_mut_ptr() as usize;
        pool.run_chunks(w.rows, chunk_rows(pool, w.rows, w.cols, t), &|range| {
            // SAFETY: the Isa is available (checked above) and runs the kernel of the
            // layout's width; each piece of rows is one thread's, of every token's output.
            unsafe { crate::lanes::rows(lanes, &acts, range, out_addr as *mut f32) };
        });
        return Ok(());
    }
    let acts = Activations::quantize(x, t, w.cols)?;
    // The AVX-512 register tiles compute every row as the single-token kernel does, bit
    // for bit; elsewhere, rows pinned to the 8-bit paths (different sequences' decode
    // steps) go through the single-token kernel, a few weight rows at a time kept in
    // cache while every token passes over them.
    let wide = matches!(isa, Isa::Avx512Vnni | Isa::Amx);
    // A few tokens share the single-token kernel's decoded blocks faster than the tiles
    // unpack rows for them (`kernel_bench 1536 576 T 1`: the two meet between 4 and 8).
    let few = wide && t < TILE_MIN_TOKENS;
    let batch_of_tokens = (ROWS.with(|c| c.get()) == Rows::Int8 || few) && t > 1;
    if crate::tile::applies(isa, w, t) && !few {
        crate::tile::matmul(pool, w, &acts, out);
        return Ok(());
    }
    let n = w.rows;
    let threads = pool.size().min(n).max(1);
    let per = n.div_ceil(threads);
    let out_addr = out.as_mut_ptr() as usize;
    let signed = w.ty.signed();
    pool.run(&|i| {
        let start = (i * per).min(n);
        let end = ((i + 1) * per).min(n);
        #[cfg(target_arch = "x86_64")]
        if (t == 1 || batch_of_tokens) && isa != Isa::Scalar {
            // SAFETY: the Isa is available; this thread owns rows start..end of `out`.
            unsafe { decode_rows(isa, w, &acts, start..end, out_addr as *mut f32) };
            return;
        }
        ROW.with(|cell| {
            let mut row = cell.borrow_mut();
            if row.q.len() != w.cols {
                *row = Unpacked::with_cols(w.cols);
            }
            for r in start..end {
                unpack_row_with(isa, w.ty, &w.row(r), &mut row);
                let mut tok = 0;
                while tok < t {
                    let take = (t - tok).min(4);
                    let mut vals = [0f32; 4];
                    if take == 4 {
                        let xs: [(&[i8], &[f32]); 4] = std::array::from_fn(|j| {
                            let (q, d, _) = acts.row(tok + j);
                            (q, d)
                        });
                        dot_many(isa, &row, signed, &xs, &mut vals);
                    } else {
                        for (j, v) in vals.iter_mut().enumerate().take(take) {
                            let (xq, xd, _) = acts.row(tok + j);
                            *v = dot(isa, &row, signed, xq, xd);
                        }
                    }
                    for (j, v) in vals.iter().enumerate().take(take) {
                        let (_, _, xs) = acts.row(tok + j);
                        let v = v + bias_dot(&row.bias, xs);
                        // SAFETY: each thread writes only column range start..end of every
                        // output row, disjoint from the others; `out` outlives `run`.
                        unsafe { *(out_addr as *mut f32).add((tok + j) * n + r) = v };
                    }
                    tok += take;
                }
            }
        });
    });
    Ok(())
}

/// Rows per piece of a matmul shared out as it goes ([`ThreadPool::run_chunks`]): at least
/// eight pieces a thread, and none much over ~8k weight blocks times tokens (a few
/// microseconds), so a thread that loses its core for a while holds up little; a
/// multiple of sixteen rows: of the decode kernels' pass (four), and of the rows whose
/// last blocks share a pack in the lane layout (`lanes::Tails`, 2 to 16 rows a pack), so
/// that no pack is computed by two threads, each keeping its own rows (with pieces of 36
/// rows, one pack in five of a 576-row matrix was).
fn chunk_rows(pool: &ThreadPool, rows: usize, cols: usize, t: usize) -> usize {
    let work = rows * (cols / 32).max(1) * t.max(1);
    let pieces = (pool.size() * 8).max(work / 8192).max(1);
    rows.div_ceil(pieces).next_multiple_of(16)
}

/// Each token of `acts` with each block decoded in registers (no unpacked row): rows
/// `range` of `w` into `out[tok * w.rows + range]`. A token's result does not depend on
/// the others: on AVX-512 up to four tokens share each decoded block, each computed by the
/// single-token arithmetic; on AVX2 (the K-quants here, the 32-weight types being in the
/// lane layout) one token at a time.
///
/// # Safety
/// `isa` is available and not `Scalar`; `acts` holds rows of `w.cols` values; `out`
/// points at `acts.rows() * w.rows` writable floats of which no other thread writes
/// `range` of any token's row.
#[cfg(target_arch = "x86_64")]
unsafe fn decode_rows(
    isa: Isa,
    w: &QuantMatrix,
    acts: &Activations,
    range: std::ops::Range<usize>,
    out: *mut f32,
) {
    let n = w.rows;
    let mut r = range.start;
    while r < range.end {
        let take = (range.end - r).min(crate::fused::rows_per_pass());
        let owned: [Cow<'_, [u8]>; crate::fused::ROWS] =
            std::array::from_fn(|i| w.row(r + i.min(take - 1)));
        let rows: [&[u8]; crate::fused::ROWS] = std::array::from_fn(|i| &*owned[i]);
        let mut tok = 0;
        while tok < acts.rows() {
            let with = match isa {
                Isa::Avx512Vnni | Isa::Amx => crate::wide::TOKENS,
                _ => 1,
            };
            let tokens = (acts.rows() - tok).min(with);
            let mut vals = [[0f32; crate::fused::ROWS]; crate::wide::TOKENS];
            // SAFETY: the Isa is available (the caller's contract); the activation rows
            // cover the weight rows (all have `cols` values).
            unsafe {
                match isa {
                    Isa::Avx512Vnni | Isa::Amx => {
                        crate::wide::dot(w.ty, &rows[..take], acts, tok, tokens, &mut vals)
                    }
                    _ => {
                        let (xq, xd, xs) = acts.row(tok);
                        crate::fused::dot_avx2(w.ty, &rows[..take], xq, xd, xs, &mut vals[0])
                    }
                }
            };
            for (j, row) in vals.iter().enumerate().take(tokens) {
                for (i, v) in row.iter().enumerate().take(take) {
                    // SAFETY: `r + i < range.end ≤ w.rows`, this thread's rows (the
                    // contract).
                    unsafe { *out.add((tok + j) * n + r + i) = *v };
                }
            }
            tok += tokens;
        }
        r += take;
    }
}

/// Several matrices of one width applied to the same activations (a layer's query, key
/// and value projections; its gate and up projections): `outs[i] = x · ws[i]ᵀ`. A single
/// token is quantized once and all rows are shared out among the threads in one call;
/// batches run one [`matmul`] per matrix.
pub fn matmul_many(
    ws: &[&QuantMatrix],
    x: &[f32],
    t: usize,
    outs: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    matmul_many_with(Isa::detect(), ThreadPool::global(), ws, x, t, outs)
}

/// [`matmul_many`] with a chosen instruction set and pool.
pub fn matmul_many_with(
    isa: Isa,
    pool: &ThreadPool,
    ws: &[&QuantMatrix],
    x: &[f32],
    t: usize,
    outs: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    if ws.len() != outs.len() {
        return Err(KernelError::Size {
            what: "outputs",
            expected: ws.len(),
            actual: outs.len(),
        });
    }
    let isa = if isa.is_available() { isa } else { Isa::Scalar };
    let cols = ws.first().map_or(0, |w| w.cols);
    for (w, out) in ws.iter().zip(outs.iter()) {
        if w.cols != cols {
            return Err(KernelError::Size {
                what: "matrix width",
                expected: cols,
                actual: w.cols,
            });
        }
        if out.len() != t * w.rows {
            return Err(KernelError::Size {
                what: "output",
                expected: t * w.rows,
                actual: out.len(),
            });
        }
    }
    // Batches share the call only when every matrix is in the lane layout (the other
    // batch kernels are per matrix) and the rows take the 8-bit kernels (`bf16_tiles`:
    // AMX batches, and rows pinned to bf16, go through `matmul` as alone).
    #[cfg(target_arch = "x86_64")]
    let shared = !bf16_tiles(isa, t) && (t == 1 || ws.iter().all(|w| w.lanes_for(isa).is_some()));
    #[cfg(not(target_arch = "x86_64"))]
    let shared = false;
    if !shared || isa == Isa::Scalar {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            matmul_with(isa, pool, w, x, t, out)?;
        }
        return Ok(());
    }
    let acts = Activations::quantize(x, t, cols)?;
    #[cfg(target_arch = "x86_64")]
    let lane_acts = ws.iter().find_map(|w| w.lanes_for(isa)).map(|l| {
        let halves = ws
            .iter()
            .any(|w| w.lanes_for(isa).is_some_and(|l| l.halves()));
        crate::lanes::LaneActs::of(&acts, l.width, halves)
    });
    let total: usize = ws.iter().map(|w| w.rows).sum();
    let outs: Vec<usize> = outs.iter_mut().map(|o| o.as_mut_ptr() as usize).collect();
    pool.run_chunks(total, chunk_rows(pool, total, cols, t), &|piece| {
        let mut first = 0;
        for (w, &out) in ws.iter().zip(&outs) {
            let (lo, hi) = (piece.start.max(first), piece.end.min(first + w.rows));
            if lo < hi {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the Isa is available and not Scalar (checked above); each piece
                // of the concatenated rows is one thread's.
                unsafe {
                    let range = lo - first..hi - first;
                    match (w.lanes_for(isa), &lane_acts) {
                        (Some(l), Some(x)) => crate::lanes::rows(l, x, range, out as *mut f32),
                        _ => decode_rows(isa, w, &acts, range, out as *mut f32),
                    }
                };
            }
            first += w.rows;
        }
    });
    Ok(())
}

/// `Σ bias_h · sum_h`, with eight independent partial sums so it vectorizes.
fn bias_dot(bias: &[f32], sums: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut b = bias.chunks_exact(8);
    let mut s = sums.chunks_exact(8);
    for (bc, sc) in (&mut b).zip(&mut s) {
        for i in 0..8 {
            acc[i] += bc[i] * sc[i];
        }
    }
    let tail: f32 = b
        .remainder()
        .iter()
        .zip(s.remainder())
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn quantizing_on_avx2_equals_the_baseline_bit_for_bit() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        // Values that land on halves after scaling (127 · k/254) as well as random ones,
        // zero blocks, and one block with a single non-zero value.
        let mut seed = 9u32;
        let mut x: Vec<f32> = (0..32 * 64)
            .map(|i| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let r = (seed >> 8) as f32 / (1 << 24) as f32 - 0.5;
                match i / 32 % 4 {
                    0 => (i % 32) as f32 / 254.0 * if i % 2 == 0 { 1.0 } else { -1.0 },
                    1 => r * 1e-3,
                    2 => r * 40.0,
                    _ => 0.0,
                }
            })
            .collect();
        x[32 * 3 + 5] = -2.5;
        let n = x.len();
        let (mut q, mut d, mut s) = (vec![0i8; n], vec![0f32; n / 32], vec![0f32; n / 16]);
        quantize_blocks(&x, &mut q, &mut d, &mut s);
        let (mut q2, mut d2, mut s2) = (vec![0i8; n], vec![0f32; n / 32], vec![0f32; n / 16]);
        // SAFETY: checked above.
        unsafe { quantize_blocks_avx2(&x, &mut q2, &mut d2, &mut s2) };
        assert_eq!(q, q2);
        assert_eq!(d, d2);
        assert_eq!(s, s2);
        assert!(q.contains(&127) && q.contains(&-127));
    }
}
