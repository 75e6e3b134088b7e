//! Weights repacked at load so that each 32-bit lane of a product holds one whole block
//! (Q4_0, Q4_1, Q5_0 and Q8_0; Q4_K's 32-weight sub-blocks in groups of 16, `lanes_k`):
//! groups of 16 blocks for AVX-512 VNNI's 512-bit products (this module's kernel), of 8
//! for AVX2's 256-bit ones (`lanes_avx2`).
//!
//! In GGUF's layout a `vpdpbusd` over 64 consecutive weights sums two blocks, each over
//! eight lanes, so every product is converted to floats and scaled at once: per 64
//! weights and token a product, a convert, a permute and an FMA (`wide`). Here the
//! blocks of a row go in groups of 16, and product `v` of a group takes bytes `4v..4v+4`
//! of each of its 16 blocks, lane `j` from block `j`: after the whole group (8 products
//! of 64 weights) lane `j` holds block `j`'s integer dot product, and one convert and two
//! FMAs (the scales, and the bias terms against the activations' block sums) finish 512
//! weights. The activations are transposed alike once per call ([`LaneActs`]).
//!
//! Every (row, token) pair is computed by the same operations in the same order, however
//! many rows and tokens share the call, so a token's result is bit for bit the one it
//! gets alone. A row's last group may hold fewer than 16 blocks: it is stored without
//! padding and read with masked loads. In groups of 16, a last group of at most 8 blocks
//! is packed with other rows' instead ([`Tails`]): smollm2's 576 columns are 18 blocks,
//! and a group of 2 cost almost what a full one does (its products are as wide).
//!
//! The AVX2 layout differs in one more way: Q8_0's bytes stay signed (AVX2's 8-bit
//! product saturates on an unsigned byte of 255, so it multiplies magnitudes and signs).

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::BlockType;
use crate::lanes_k::KScales;
use crate::matmul::Activations;

/// Blocks per group for AVX-512 (one per 32-bit lane of 512 bits).
pub(crate) const WIDE: usize = 16;
/// Blocks per group for AVX2 (one per 32-bit lane of 256 bits).
pub(crate) const NARROW: usize = 8;

/// Whether `ty` can be repacked in groups of `width` (Q4_K in groups of 16 only:
/// [`crate::lanes_k`]).
pub(crate) fn takes(ty: BlockType, width: usize) -> bool {
    match ty {
        BlockType::Q4_0 | BlockType::Q4_1 | BlockType::Q5_0 | BlockType::Q8_0 => true,
        BlockType::Q4K => width == WIDE,
        _ => false,
    }
}

/// A matrix of 32-weight blocks in the lane layout: `w = d·u + c` per block, `u` the
/// unsigned quant (Q8_0: its bytes offset by 128 in groups of 16; in groups of 8 they stay
/// signed, `c = 0`).
#[derive(Clone, Debug)]
pub(crate) struct Lanes {
    pub(crate) ty: BlockType,
    pub(crate) rows: usize,
    pub(crate) blocks: usize,
    pub(crate) groups: usize,
    /// Blocks per group: [`WIDE`] or [`NARROW`].
    pub(crate) width: usize,
    /// Quant bytes per block: 16 (two 4-bit weights a byte) or 32.
    pub(crate) qbytes: usize,
    pub(crate) q: Vec<u8>,
    /// Per row, per group: the blocks' f16 scales, then (Q4_1) their f16 offsets. With
    /// `q`, as many bytes as GGUF's.
    pub(crate) h: Vec<u16>,
    /// f16 values per block: 1, or 2 with Q4_1's offset.
    pub(crate) hpb: usize,
    /// Q5_0's fifth bits, per row and group ([`bit_slot`]): for each product `v`, the bits
    /// of the low nibbles' bytes, then the high ones' (bit `4j + i`: lane `j`, byte `i`) —
    /// in two words of 64 bits a product in groups of 16, in one word's two halves in
    /// groups of 8. GGUF's 4 bytes a block for a full group, more for a row's last one.
    pub(crate) bits: Vec<u64>,
    /// The rows' last blocks, where they are packed across rows (`blocks` then counts
    /// only the whole groups before them).
    pub(crate) tails: Option<Box<Tails>>,
    /// For Q4_K: its sub-blocks held as Q4_1 blocks (`ty`), whose scales and offsets
    /// come from these instead of `h` (empty).
    pub(crate) k: Option<Box<KScales>>,
}

/// The last `n` blocks of every row (a partial group of at most 8), `per` rows' to a
/// group: a matrix of its own in the lane layout whose row `p` holds, as blocks
/// `k·n..k·n + n`, row `p·per + k`'s last blocks. One pass of products then serves
/// `per` rows, where each row's partial group took a full-width pass of its own; each
/// row's share is summed from its own lanes in a fixed order.
#[derive(Clone, Debug)]
pub(crate) struct Tails {
    pub(crate) n: usize,
    pub(crate) per: usize,
    pub(crate) lanes: Lanes,
}

/// Matrices with fewer rows keep each row's last blocks in its own partial group: their
/// extra pass over the packs costs more than it saves (`kernel_bench 192 576 1 2`, Q4_1:
/// 3.5 µs a call with the partial groups, 4.6 µs with packs; 576 rows and more gain).
const TAIL_MIN_ROWS: usize = 512;

/// `(n, per)` of [`Tails`] for rows of `blocks` blocks in groups of `width`: packed when
/// at least two rows' last blocks share a group.
fn tail_pack(blocks: usize, width: usize) -> Option<(usize, usize)> {
    let n = blocks % width;
    (width == WIDE && n > 0 && width / n >= 2).then(|| (n, width / n))
}

/// Where Q5_0's fifth bit of byte `i` of lane (block) `j`'s product `v` lies in
/// [`Lanes::bits`] (its low nibble's, or with `high` its high nibble's): the word and the
/// bit. Groups of 16: two words a product (low, high), bit `4j + i`; groups of 8: one word
/// a product, bit `4j + i` of its low half or its high half.
#[allow(clippy::too_many_arguments)]
fn bit_slot(
    width: usize,
    groups: usize,
    r: usize,
    g: usize,
    v: usize,
    high: bool,
    j: usize,
    i: usize,
) -> (usize, u32) {
    let base = (r * groups + g) * width / 2;
    if width == WIDE {
        (base + 2 * v + high as usize, (4 * j + i) as u32)
    } else {
        (base + v, (4 * j + i + 32 * high as usize) as u32)
    }
}

/// Which inner loop a block type takes.
pub(crate) const BYTES: u8 = 0;
pub(crate) const NIBBLES: u8 = 1;
pub(crate) const NIBBLES_AND_BITS: u8 = 2;

impl Lanes {
    /// Repacks `rows` rows of GGUF blocks of type `ty` (one of [`takes`]) in groups of
    /// `width` blocks ([`WIDE`] or [`NARROW`]).
    pub(crate) fn pack(ty: BlockType, rows: usize, cols: usize, data: &[u8], width: usize) -> Self {
        debug_assert!(width == WIDE || width == NARROW);
        let blocks = cols / 32;
        if ty == BlockType::Q4K {
            let (q41, k) = crate::lanes_k::split(rows, cols, data);
            let mut lanes = Self::pack_groups(BlockType::Q4_1, rows, blocks, &q41, width);
            (lanes.h, lanes.hpb, lanes.k) = (Vec::new(), 0, Some(Box::new(k)));
            return lanes;
        }
        let Some((n, per)) = tail_pack(blocks, width).filter(|_| rows >= TAIL_MIN_ROWS) else {
            return Self::pack_groups(ty, rows, blocks, data, width);
        };
        let bb = ty.block_bytes();
        let whole = blocks - n;
        let head: Vec<u8> = (0..rows)
            .flat_map(|r| &data[r * blocks * bb..(r * blocks + whole) * bb])
            .copied()
            .collect();
        let mut lanes = Self::pack_groups(ty, rows, whole, &head, width);
        // Rows past the last (a partial pack) stay zero blocks: scale 0, never read out.
        let packs = rows.div_ceil(per);
        let mut tail = vec![0u8; packs * per * n * bb];
        for r in 0..rows {
            let from = (r * blocks + whole) * bb;
            tail[r * n * bb..(r + 1) * n * bb].copy_from_slice(&data[from..from + n * bb]);
        }
        let tail = Self::pack_groups(ty, packs, per * n, &tail, width);
        lanes.tails = Some(Box::new(Tails {
            n,
            per,
            lanes: tail,
        }));
        lanes
    }

    /// [`Lanes::pack`] of rows of `blocks` blocks, every group (the last one partial)
    /// in the row's own groups.
    fn pack_groups(ty: BlockType, rows: usize, blocks: usize, data: &[u8], width: usize) -> Self {
        let groups = blocks.div_ceil(width);
        let flip = Self::flips(ty, width);
        let qbytes = if ty == BlockType::Q8_0 { 32 } else { 16 };
        let bb = ty.block_bytes();
        let mut q = vec![0u8; rows * blocks * qbytes];
        let hpb = if ty == BlockType::Q4_1 { 2 } else { 1 };
        let mut h = vec![0u16; rows * blocks * hpb];
        let q5 = ty == BlockType::Q5_0;
        let mut bits = vec![0u64; if q5 { rows * groups * width / 2 } else { 0 }];
        for r in 0..rows {
            let row = &data[r * blocks * bb..(r + 1) * blocks * bb];
            for b in 0..blocks {
                let blk = &row[b * bb..(b + 1) * bb];
                let (g, j) = (b / width, b % width);
                let n = (blocks - g * width).min(width);
                let half = |i: usize| u16::from_le_bytes([blk[i], blk[i + 1]]);
                let quants = match ty {
                    BlockType::Q4_0 => &blk[2..18],
                    BlockType::Q4_1 => &blk[4..20],
                    BlockType::Q5_0 => &blk[6..22],
                    _ => &blk[2..34],
                };
                if q5 {
                    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                    for v in 0..4 {
                        for i in 0..4 {
                            for high in [false, true] {
                                let bit = (qh >> (4 * v + i + if high { 16 } else { 0 })) & 1;
                                let (at, shift) = bit_slot(width, groups, r, g, v, high, j, i);
                                bits[at] |= (bit as u64) << shift;
                            }
                        }
                    }
                }
                let at = r * blocks * hpb + g * width * hpb;
                h[at + j] = half(0);
                if hpb == 2 {
                    h[at + n + j] = half(2);
                }
                let base = r * blocks * qbytes + g * width * qbytes;
                for v in 0..qbytes / 4 {
                    for i in 0..4 {
                        q[base + v * n * 4 + j * 4 + i] = quants[4 * v + i] ^ flip;
                    }
                }
            }
        }
        Self {
            ty,
            rows,
            blocks,
            groups,
            width,
            qbytes,
            q,
            h,
            hpb,
            bits,
            tails: None,
            k: None,
        }
    }

    /// What each quant byte is XORed with when packed: Q8_0's bytes become unsigned
    /// (`q + 128`) for VNNI's unsigned-by-signed product, and stay as they are for AVX2.
    fn flips(ty: BlockType, width: usize) -> u8 {
        if ty == BlockType::Q8_0 && width == WIDE {
            0x80
        } else {
            0
        }
    }

    pub(crate) fn inner_loop(&self) -> u8 {
        match self.ty {
            BlockType::Q8_0 => BYTES,
            BlockType::Q5_0 => NIBBLES_AND_BITS,
            _ => NIBBLES,
        }
    }

    /// Row `r` in GGUF's layout again (the other kernels and the embedding read it).
    pub(crate) fn gguf_row(&self, r: usize, out: &mut Vec<u8>) {
        if let Some(k) = &self.k {
            let mut q41 = Vec::new();
            self.gguf_groups(r, &mut q41);
            return crate::lanes_k::join(k, r, &q41, out);
        }
        self.gguf_groups(r, out);
        if let Some(t) = &self.tails {
            let bb = self.ty.block_bytes();
            let mut pack = Vec::new();
            t.lanes.gguf_groups(r / t.per, &mut pack);
            let k = r % t.per;
            out.extend_from_slice(&pack[k * t.n * bb..(k + 1) * t.n * bb]);
        }
    }

    /// The blocks of row `r` held in its own groups, in GGUF's layout.
    fn gguf_groups(&self, r: usize, out: &mut Vec<u8>) {
        let bb = self.ty.block_bytes();
        out.clear();
        out.resize(self.blocks * bb, 0);
        let (width, flip) = (self.width, Self::flips(self.ty, self.width));
        for b in 0..self.blocks {
            let (g, j) = (b / width, b % width);
            let n = (self.blocks - g * width).min(width);
            let at = r * self.blocks * self.hpb + g * width * self.hpb;
            let blk = &mut out[b * bb..(b + 1) * bb];
            if self.hpb > 0 {
                blk[0..2].copy_from_slice(&self.h[at + j].to_le_bytes());
            }
            let first = if self.ty == BlockType::Q4_1 {
                if self.hpb == 2 {
                    blk[2..4].copy_from_slice(&self.h[at + n + j].to_le_bytes());
                }
                4
            } else if self.ty == BlockType::Q5_0 {
                let mut qh = 0u32;
                for v in 0..4 {
                    for i in 0..4 {
                        for high in [false, true] {
                            let (at, shift) = bit_slot(width, self.groups, r, g, v, high, j, i);
                            let bit = (self.bits[at] >> shift) & 1;
                            qh |= (bit as u32) << (4 * v + i + if high { 16 } else { 0 });
                        }
                    }
                }
                blk[2..6].copy_from_slice(&qh.to_le_bytes());
                6
            } else {
                2
            };
            let base = r * self.blocks * self.qbytes + g * width * self.qbytes;
            for v in 0..self.qbytes / 4 {
                for i in 0..4 {
                    blk[first + 4 * v + i] = self.q[base + v * n * 4 + j * 4 + i] ^ flip;
                }
            }
        }
    }

    pub(crate) fn size_in_bytes(&self) -> usize {
        let tails = self.tails.as_ref().map_or(0, |t| t.lanes.size_in_bytes());
        let k = self.k.as_ref().map_or(0, |k| k.size_in_bytes());
        self.q.len() + 2 * self.h.len() + 8 * self.bits.len() + tails + k
    }
}

/// Activations transposed as [`Lanes`] reads them: per token and group, 8 vectors of
/// `4·width` bytes (vector `v`, lane `j`: bytes `4v..4v+4` of block `j`), zeros past the
/// last block; the blocks' scales and `d·Σq` sums, `width` per group (zeros past the
/// last block).
pub(crate) struct LaneActs {
    pub(crate) groups: usize,
    pub(crate) width: usize,
    pub(crate) q: Vec<i8>,
    pub(crate) d: Vec<f32>,
    pub(crate) sum: Vec<f32>,
    /// For matrices whose last blocks are packed across rows ([`Tails`]): each token's
    /// last `n` blocks repeated `per` times, one group a token.
    pub(crate) tail: Option<Box<LaneActs>>,
}

impl LaneActs {
    pub(crate) fn of(acts: &Activations, width: usize) -> Self {
        let blocks = acts.cols() / 32;
        let mut lane_acts =
            Self::place(acts, width, blocks.div_ceil(width), 0..blocks, 1, |b, _| {
                (b / width, b % width)
            });
        if let Some((n, per)) = tail_pack(blocks, width) {
            let first = blocks - n;
            lane_acts.tail = Some(Box::new(Self::place(
                acts,
                width,
                1,
                first..blocks,
                per,
                |b, k| (0, k * n + b - first),
            )));
        }
        lane_acts
    }

    /// `groups` groups a token; each block `b` of `blocks`, `copies` times, at the (group,
    /// lane) `at(b, copy)`.
    fn place(
        acts: &Activations,
        width: usize,
        groups: usize,
        blocks: std::ops::Range<usize>,
        copies: usize,
        at: impl Fn(usize, usize) -> (usize, usize),
    ) -> Self {
        let t = acts.rows();
        let group_bytes = 32 * width;
        let mut q = vec![0i8; t * groups * group_bytes];
        let mut d = vec![0f32; t * groups * width];
        let mut sum = vec![0f32; t * groups * width];
        for tok in 0..t {
            let (xq, xd, _) = acts.row(tok);
            for b in blocks.clone() {
                let src = &xq[b * 32..b * 32 + 32];
                let s: i32 = src.iter().map(|&v| v as i32).sum();
                for copy in 0..copies {
                    let (g, j) = at(b, copy);
                    let base = (tok * groups + g) * group_bytes;
                    for v in 0..8 {
                        let at = base + v * 4 * width + j * 4;
                        q[at..at + 4].copy_from_slice(&src[4 * v..4 * v + 4]);
                    }
                    let at = (tok * groups + g) * width + j;
                    d[at] = xd[b];
                    sum[at] = xd[b] * s as f32;
                }
            }
        }
        Self {
            groups,
            width,
            q,
            d,
            sum,
            tail: None,
        }
    }

    pub(crate) fn tokens(&self) -> usize {
        self.q.len() / (self.groups * 32 * self.width).max(1)
    }
}

/// Rows `range` of `w` times every token of `x` into `out[tok * w.rows + row]`, by the
/// kernel of `w`'s width.
///
/// # Safety
/// The CPU has the kernel's features (AVX-512 F/BW/VNNI for [`WIDE`], AVX2 and FMA for
/// [`NARROW`]); `x` was made from activations of `w`'s width with `w`'s group width;
/// `out` points at `tokens * w.rows` floats of which no other thread writes `range`.
pub(crate) unsafe fn rows(w: &Lanes, x: &LaneActs, range: std::ops::Range<usize>, out: *mut f32) {
    debug_assert_eq!(w.width, x.width);
    // SAFETY: forwarded.
    unsafe {
        if w.width == NARROW {
            crate::lanes_avx2::rows(w, x, range, out)
        } else {
            rows_wide(w, x, range, out)
        }
    }
}

/// The pass loop both widths share: rows `range` of `w` times every token of `x` into
/// `out[tok * w.rows + row]`, rows two at a time, tokens four at a time (a lone token
/// takes four rows), each pass by `$dot::<ROWS, TOKENS, KIND>` (in the caller's scope).
/// Expands inside an `unsafe fn` whose contract covers `$dot`'s features and `out`.
macro_rules! pass_rows {
    ($dot:ident, $w:expr, $x:expr, $range:expr, $out:expr) => {{
        let (w, x, range, out): (&Lanes, &LaneActs, std::ops::Range<usize>, *mut f32) =
            ($w, $x, $range, $out);
        let tokens = x.tokens();
        let n = w.rows;
        let last = range.end.saturating_sub(1);
        macro_rules! run {
            ($r:literal, $t:literal, $row:expr, $tok:expr) => {{
                let rows: [usize; $r] = std::array::from_fn(|i| ($row + i).min(last));
                let mut vals = [[0f32; $r]; $t];
                // SAFETY: the features are the caller's contract; rows and tokens in range.
                unsafe {
                    match w.inner_loop() {
                        BYTES => $dot::<$r, $t, BYTES>(w, rows, x, $tok, &mut vals),
                        NIBBLES => $dot::<$r, $t, NIBBLES>(w, rows, x, $tok, &mut vals),
                        _ => $dot::<$r, $t, NIBBLES_AND_BITS>(w, rows, x, $tok, &mut vals),
                    }
                }
                for (j, row) in vals.iter().enumerate() {
                    for (i, v) in row.iter().enumerate() {
                        if $row + i < range.end {
                            // SAFETY: this thread's rows of `out` (the contract).
                            unsafe { *out.add(($tok + j) * n + $row + i) = *v };
                        }
                    }
                }
            }};
        }
        if tokens == 1 {
            let mut r = range.start;
            while r < range.end {
                run!(4, 1, r, 0);
                r += 4;
            }
        } else {
            let mut r = range.start;
            while r < range.end {
                let mut tok = 0;
                while tok < tokens {
                    match tokens - tok {
                        1 => run!(2, 1, r, tok),
                        2 => run!(2, 2, r, tok),
                        3 => run!(2, 3, r, tok),
                        _ => run!(2, 4, r, tok),
                    }
                    tok += 4;
                }
                r += 2;
            }
        }
    }};
}
pub(crate) use pass_rows;

/// [`pass_rows`] with the AVX-512 kernel.
///
/// # Safety
/// The CPU has AVX-512 F/BW and VNNI; `x` was made from activations of `w`'s width;
/// `out` points at `tokens * w.rows` floats of which no other thread writes `range`.
unsafe fn rows_wide(w: &Lanes, x: &LaneActs, range: std::ops::Range<usize>, out: *mut f32) {
    pass_rows!(dot, w, x, range.clone(), out);
    if let (Some(tails), Some(xt)) = (&w.tails, &x.tail) {
        // SAFETY: forwarded (the same features, `out` and rows).
        unsafe { add_tails(w.rows, tails, xt, range, out) }
    }
}

/// Adds each row's share of its [`Tails`] pack to `out`, for rows `range` and every
/// token of `x` (the tail activations).
///
/// # Safety
/// As [`rows_wide`]'s.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn add_tails(
    rows: usize,
    tails: &Tails,
    x: &LaneActs,
    range: std::ops::Range<usize>,
    out: *mut f32,
) {
    if range.is_empty() {
        return;
    }
    let (tokens, w, n, per) = (x.tokens(), &tails.lanes, tails.n, tails.per);
    let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // Lane k·n of each pack row's segment, where its sum lands.
    let leads = (0..per).fold(0u16, |m, k| m | (1 << (k * n)));
    macro_rules! pack {
        ($t:literal, $p:expr, $tok:expr) => {{
            // SAFETY: the features are the caller's contract; pack and tokens in range.
            let acc = unsafe {
                match w.inner_loop() {
                    BYTES => dot_acc::<1, $t, BYTES>(w, [$p], x, $tok),
                    NIBBLES => dot_acc::<1, $t, NIBBLES>(w, [$p], x, $tok),
                    _ => dot_acc::<1, $t, NIBBLES_AND_BITS>(w, [$p], x, $tok),
                }
            };
            // The pack's rows this thread writes.
            let mine = (0..per).fold(0u16, |m, k| {
                m | ((range.contains(&($p * per + k)) as u16) << k)
            });
            for (t, &v) in acc[0].iter().enumerate() {
                // Each segment's lanes summed in order into its first lane, the sums
                // side by side, then added to the rows' outputs.
                let mut seg = v;
                for j in 1..n {
                    let next = _mm512_add_epi32(iota, _mm512_set1_epi32(j as i32));
                    seg = _mm512_add_ps(seg, _mm512_permutexvar_ps(next, v));
                }
                let shares = _mm512_maskz_compress_ps(leads, seg);
                // SAFETY: the masked lanes are this thread's rows of `out` (the contract).
                unsafe {
                    let o = out.add(($tok + t) * rows + $p * per);
                    let sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mine, o), shares);
                    _mm512_mask_storeu_ps(o, mine, sum);
                }
            }
        }};
    }
    for p in range.start / tails.per..=(range.end - 1) / tails.per {
        let mut tok = 0;
        while tok < tokens {
            match tokens - tok {
                1 => pack!(1, p, tok),
                2 => pack!(2, p, tok),
                3 => pack!(3, p, tok),
                _ => pack!(4, p, tok),
            }
            tok += 4;
        }
    }
}

/// `R` rows times tokens `first..first + T`; `KIND`: a weight a byte, two, or two with
/// their fifth bits beside.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot<const R: usize, const T: usize, const KIND: u8>(
    w: &Lanes,
    rows: [usize; R],
    x: &LaneActs,
    first: usize,
    out: &mut [[f32; R]; T],
) {
    // SAFETY: forwarded.
    let acc = unsafe { dot_acc::<R, T, KIND>(w, rows, x, first) };
    for r in 0..R {
        for t in 0..T {
            out[t][r] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
}

/// [`dot`]'s per-lane sums before the lanes are added up (lane `j`: the blocks in lane
/// `j` of every group).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_acc<const R: usize, const T: usize, const KIND: u8>(
    w: &Lanes,
    rows: [usize; R],
    x: &LaneActs,
    first: usize,
) -> [[__m512; T]; R] {
    let m4 = _mm512_set1_epi8(0x0F);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let (blocks, groups, qb, hpb) = (w.blocks, w.groups, w.qbytes, w.hpb);
    // Q4_0's and Q8_0's offsets are fixed multiples of the scale (exact in f32).
    let offset_of_d = _mm512_set1_ps(match w.ty {
        BlockType::Q4_0 => -8.0,
        BlockType::Q5_0 => -16.0,
        _ => -128.0,
    });
    let fifth = _mm512_set1_epi8(0x10);
    for g in 0..groups {
        let n = (blocks - g * WIDE).min(WIDE);
        let mask: u64 = if n == WIDE {
            u64::MAX
        } else {
            (1u64 << (4 * n)) - 1
        };
        let mask16 = ((1u32 << n) - 1) as u16;
        let mut dots = [[_mm512_setzero_si512(); T]; R];
        // The activations' groups: the matrix's whole groups then, where its last blocks
        // are packed apart ([`Tails`]), one more.
        let xg: [*const i8; T] = std::array::from_fn(|t| unsafe {
            x.q.as_ptr().add(((first + t) * x.groups + g) * 512)
        });
        for v in 0..qb / 4 {
            for r in 0..R {
                // SAFETY: the mask keeps the load inside the group's `n * 4` bytes of
                // vector `v`; activations hold 512 bytes per group.
                unsafe {
                    let p =
                        w.q.as_ptr()
                            .add(rows[r] * blocks * qb + g * WIDE * qb + v * n * 4);
                    let raw = _mm512_maskz_loadu_epi8(mask, p as *const i8);
                    if KIND != BYTES {
                        let mut lo = _mm512_and_si512(raw, m4);
                        let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4);
                        if KIND == NIBBLES_AND_BITS {
                            let planes = w.bits.as_ptr().add((rows[r] * groups + g) * 8 + 2 * v);
                            lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(*planes, fifth));
                            hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(*planes.add(1), fifth));
                        }
                        for t in 0..T {
                            let xl = _mm512_loadu_si512(xg[t].add(v * 64) as *const _);
                            let xh = _mm512_loadu_si512(xg[t].add((4 + v) * 64) as *const _);
                            dots[r][t] = _mm512_dpbusd_epi32(dots[r][t], lo, xl);
                            dots[r][t] = _mm512_dpbusd_epi32(dots[r][t], hi, xh);
                        }
                    } else {
                        for t in 0..T {
                            let xv = _mm512_loadu_si512(xg[t].add(v * 64) as *const _);
                            dots[r][t] = _mm512_dpbusd_epi32(dots[r][t], raw, xv);
                        }
                    }
                }
            }
        }
        for r in 0..R {
            // SAFETY: the masks keep the loads inside the group's `n` scales (and offsets).
            unsafe {
                let (d, c) = if let Some(k) = &w.k {
                    crate::lanes_k::lane_scales(k, blocks, rows[r], g, n)
                } else {
                    let at = w.h.as_ptr().add(rows[r] * blocks * hpb + g * WIDE * hpb);
                    let d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask16, at as *const i16));
                    let c = if hpb == 2 {
                        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask16, at.add(n) as *const i16))
                    } else {
                        _mm512_mul_ps(d, offset_of_d)
                    };
                    (d, c)
                };
                for t in 0..T {
                    let xat = ((first + t) * x.groups + g) * WIDE;
                    let dx = _mm512_loadu_ps(x.d.as_ptr().add(xat));
                    let sum = _mm512_loadu_ps(x.sum.as_ptr().add(xat));
                    acc[r][t] = _mm512_fmadd_ps(c, sum, acc[r][t]);
                    let scale = _mm512_mul_ps(d, dx);
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][t]), scale, acc[r][t]);
                }
            }
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;

    #[test]
    fn rows_come_back_in_gguf_layout_byte_for_byte() {
        for ty in [
            BlockType::Q4_0,
            BlockType::Q4_1,
            BlockType::Q5_0,
            BlockType::Q8_0,
        ] {
            // 1, 16, 17 and 35 blocks: a lone group, a full one, tails of 1 and 3.
            // Too few rows for packs, and enough.
            for (blocks, rows) in [1, 16, 17, 35].into_iter().flat_map(|b| [(b, 3), (b, 517)]) {
                let bb = ty.block_bytes();
                let mut data: Vec<u8> = (0..rows * blocks * bb)
                    .map(|i| (i * 37 % 253) as u8)
                    .collect();
                for (k, blk) in data.chunks_exact_mut(bb).enumerate() {
                    let d = f16::from_f32(0.01 * (k + 1) as f32);
                    blk[0..2].copy_from_slice(&d.to_le_bytes());
                    if ty == BlockType::Q4_1 {
                        blk[2..4].copy_from_slice(&f16::from_f32(-0.5).to_le_bytes());
                    }
                }
                for width in [WIDE, NARROW] {
                    let lanes = Lanes::pack(ty, rows, blocks * 32, &data, width);
                    let mut row = Vec::new();
                    for r in 0..rows {
                        lanes.gguf_row(r, &mut row);
                        let want = &data[r * blocks * bb..(r + 1) * blocks * bb];
                        assert_eq!(&row[..], want, "{ty:?}, {blocks} blocks, row {r}, {width}");
                    }
                }
            }
        }
    }

    #[test]
    fn q4_k_rows_come_back_byte_for_byte() {
        // 1, 2 and 3 super-blocks: half a group, a full one, one and a half. Every bit
        // of a super-block is used (scales included), so any bytes must come back.
        for supers in [1, 2, 3] {
            let (rows, bb) = (5, BlockType::Q4K.block_bytes());
            let data: Vec<u8> = (0..rows * supers * bb)
                .map(|i| (i * 131 % 251) as u8)
                .collect();
            let lanes = Lanes::pack(BlockType::Q4K, rows, supers * 256, &data, WIDE);
            assert!(lanes.k.is_some() && lanes.h.is_empty());
            let mut row = Vec::new();
            for r in 0..rows {
                lanes.gguf_row(r, &mut row);
                let want = &data[r * supers * bb..(r + 1) * supers * bb];
                assert_eq!(&row[..], want, "{supers} super-blocks, row {r}");
            }
        }
    }
}
