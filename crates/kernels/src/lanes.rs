//! Weights repacked at load so that each 32-bit lane of a product holds one whole block
//! (Q4_0, Q4_1, Q5_0 and Q8_0; Q4_K's and Q6_K's 32-weight sub-blocks, [`k`]):
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

mod acts;
pub(crate) mod k;
pub(crate) use acts::LaneActs;
use k::KScales;

/// Blocks per group for AVX-512 (one per 32-bit lane of 512 bits).
pub(crate) const WIDE: usize = 16;
/// Blocks per group for AVX2 (one per 32-bit lane of 256 bits).
pub(crate) const NARROW: usize = 8;

/// Whether `ty` can be repacked in groups of `width`: every block type shoal's kernels
/// read, at both widths (a type added to [`BlockType`] must be decided here).
pub(crate) fn takes(ty: BlockType, width: usize) -> bool {
    debug_assert!(width == WIDE || width == NARROW);
    match ty {
        BlockType::Q4_0
        | BlockType::Q4_1
        | BlockType::Q5_0
        | BlockType::Q8_0
        | BlockType::Q4K
        | BlockType::Q6K => true,
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
    /// Q6_K's sixth bits, as `bits` holds its fifth (empty for the other types).
    pub(crate) bits6: Vec<u64>,
    /// The rows' last blocks, where they are packed across rows (`blocks` then counts
    /// only the whole groups before them).
    pub(crate) tails: Option<Box<Tails>>,
    /// For Q4_K and Q6_K: their blocks held as Q4_1 blocks (`ty`; Q6_K's fifth and
    /// sixth bits in `bits` and `bits6`), whose scales and offsets come from these
    /// instead of `h` (empty).
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

/// [`bit_slot`] of weight `l` (0..32) of row `r`'s block `b`, in a nibble layout (weight
/// `l < 16` the low nibble of byte `l`, the others the high nibble of byte `l − 16`).
fn weight_slot(width: usize, groups: usize, r: usize, b: usize, l: usize) -> (usize, u32) {
    let (v, i, high) = (l % 16 / 4, l % 4, l >= 16);
    bit_slot(width, groups, r, b / width, v, high, b % width, i)
}

/// Prefetches the line at `base + at`; never faults, so it may lie past the end.
#[inline(always)]
pub(crate) fn fetch(base: *const u8, at: usize) {
    // SAFETY: SSE is part of every x86_64; a prefetch reads nothing the program sees.
    unsafe { _mm_prefetch(base.wrapping_add(at) as *const i8, _MM_HINT_T0) };
}

/// Rows of a K-quant matrix repacked at a time.
const K_CHUNK_ROWS: usize = 1024;

/// Bytes of quants fetched ahead of the loads.
const AHEAD: usize = 2048;

/// Which inner loop a block type takes.
pub(crate) const BYTES: u8 = 0;
pub(crate) const NIBBLES: u8 = 1;
pub(crate) const NIBBLES_AND_BITS: u8 = 2;
/// Nibbles with a fifth and a sixth bit from planes, each block's first and last 16
/// weights (its low and high nibbles) summed apart (Q6_K).
pub(crate) const SIX_BITS: u8 = 3;

impl Lanes {
    /// Repacks `rows` rows of GGUF blocks of type `ty` (one of [`takes`]) in groups of
    /// `width` blocks ([`WIDE`] or [`NARROW`]).
    pub(crate) fn pack(ty: BlockType, rows: usize, cols: usize, data: &[u8], width: usize) -> Self {
        debug_assert!(width == WIDE || width == NARROW);
        let blocks = cols / 32;
        if matches!(ty, BlockType::Q4K | BlockType::Q6K) && rows > K_CHUNK_ROWS {
            // In pieces of rows, so that the split's temporary copies stay small (the
            // whole matrix's raised the load's peak by 330 MB on a 1.5B Q4_K model).
            let row_bytes = ty.row_bytes(cols);
            let mut pieces = data
                .chunks(K_CHUNK_ROWS * row_bytes)
                .map(|d| Self::pack(ty, d.len() / row_bytes, cols, d, width));
            let mut all = pieces.next().expect("rows");
            for p in pieces {
                all.rows += p.rows;
                all.q.extend_from_slice(&p.q);
                all.bits.extend_from_slice(&p.bits);
                all.bits6.extend_from_slice(&p.bits6);
                if let (Some(k), Some(pk)) = (all.k.as_mut(), p.k.as_ref()) {
                    k.append(pk);
                }
            }
            return all;
        }
        if ty == BlockType::Q4K {
            let (q41, k) = k::split(rows, cols, data);
            let mut lanes = Self::pack_groups(BlockType::Q4_1, rows, blocks, &q41, width);
            (lanes.h, lanes.hpb, lanes.k) = (Vec::new(), 0, Some(Box::new(k)));
            return lanes;
        }
        if ty == BlockType::Q6K {
            let (q41, high, k) = k::split6(rows, cols, data);
            let mut lanes = Self::pack_groups(BlockType::Q4_1, rows, blocks, &q41, width);
            (lanes.h, lanes.hpb, lanes.k) = (Vec::new(), 0, Some(Box::new(k)));
            let groups = lanes.groups;
            lanes.bits = vec![0u64; rows * groups * width / 2];
            lanes.bits6 = vec![0u64; rows * groups * width / 2];
            for (at, &h) in high.iter().enumerate() {
                let (r, b, l) = (at / (blocks * 32), at / 32 % blocks, at % 32);
                let (slot, shift) = weight_slot(width, groups, r, b, l);
                lanes.bits[slot] |= ((h & 1) as u64) << shift;
                lanes.bits6[slot] |= ((h >> 1) as u64) << shift;
            }
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
            bits6: Vec::new(),
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

    /// Whether the kernel reads the activations' half-block sums ([`LaneActs::of`]).
    pub(crate) fn halves(&self) -> bool {
        self.inner_loop() == SIX_BITS
    }

    pub(crate) fn inner_loop(&self) -> u8 {
        if self.k.as_ref().is_some_and(|k| k.six) {
            return SIX_BITS;
        }
        match self.ty {
            BlockType::Q8_0 => BYTES,
            BlockType::Q5_0 => NIBBLES_AND_BITS,
            _ => NIBBLES,
        }
    }

    /// Row `r` in GGUF's layout again (the other kernels and the embedding read it).
    pub(crate) fn gguf_row(&self, r: usize, out: &mut Vec<u8>) {
        if let Some(k) = &self.k {
            let mut blocks = Vec::new();
            self.gguf_groups(r, &mut blocks);
            return if k.six {
                let high: Vec<u8> = (0..self.blocks * 32)
                    .map(|at| {
                        let (b, l) = (at / 32, at % 32);
                        let (slot, shift) = weight_slot(self.width, self.groups, r, b, l);
                        let bit = |plane: &[u64]| ((plane[slot] >> shift) & 1) as u8;
                        bit(&self.bits) | (bit(&self.bits6) << 1)
                    })
                    .collect();
                k::join6(k, r, &blocks, &high, out)
            } else {
                k::join(k, r, &blocks, out)
            };
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
        self.q.len() + 2 * self.h.len() + 8 * (self.bits.len() + self.bits6.len()) + tails + k
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
    assert!(
        !w.halves() || x.sum_lo.len() == x.sum.len(),
        "Q6_K without half sums"
    );
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
                        SIX_BITS => $dot::<$r, $t, SIX_BITS>(w, rows, x, $tok, &mut vals),
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
    if let Some(tails) = &w.tails {
        fetch_tails(tails, range.clone());
    }
    pass_rows!(dot, w, x, range.clone(), out);
    if let (Some(tails), Some(xt)) = (&w.tails, &x.tail) {
        // SAFETY: forwarded (the same features, `out` and rows).
        unsafe { add_tails(w.rows, tails, xt, range, out) }
    }
}

/// Prefetches the packs of [`Tails`] that rows `range` take, all of them, before the pass
/// over the rows' whole groups, which hides their latency: the packs' own fetching ahead
/// starts only within the range, so the first packs of every piece of a matmul came from
/// memory as they were needed. (With the pieces' alignment, `matmul::chunk_rows`, this
/// took `add_tails` from 15–18% of a batch-8 step's samples to 8% on smollm2; neither
/// was measured alone.)
fn fetch_tails(tails: &Tails, range: std::ops::Range<usize>) {
    if range.is_empty() {
        return;
    }
    let l = &tails.lanes;
    let packs = range.start / tails.per..(range.end - 1) / tails.per + 1;
    let q = l.blocks * l.qbytes;
    for at in (packs.start * q..packs.end * q).step_by(64) {
        fetch(l.q.as_ptr(), at);
    }
    // The scales (u16) and Q5_0's fifth bits: a pack's are a group's worth.
    let h = l.blocks * l.hpb * 2;
    if !l.h.is_empty() {
        for at in (packs.start * h..packs.end * h).step_by(64) {
            fetch(l.h.as_ptr() as *const u8, at);
        }
    }
    for plane in [&l.bits, &l.bits6] {
        if !plane.is_empty() {
            let b = l.groups * 8 * 8;
            for at in (packs.start * b..packs.end * b).step_by(64) {
                fetch(plane.as_ptr() as *const u8, at);
            }
        }
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
/// their fifth (and sixth) bits beside.
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
    let sixth = _mm512_set1_epi8(0x20);
    let minus32 = _mm512_set1_ps(-32.0);
    for g in 0..groups {
        let n = (blocks - g * WIDE).min(WIDE);
        let mask: u64 = if n == WIDE {
            u64::MAX
        } else {
            (1u64 << (4 * n)) - 1
        };
        let mask16 = ((1u32 << n) - 1) as u16;
        let mut dots = [[_mm512_setzero_si512(); T]; R];
        // Q6_K's second halves (SIX_BITS).
        let mut dots_hi = [[_mm512_setzero_si512(); T]; R];
        // The activations' groups: the matrix's whole groups then, where its last blocks
        // are packed apart ([`Tails`]), one more.
        let xg: [*const i8; T] = std::array::from_fn(|t| unsafe {
            x.q.as_ptr().add(((first + t) * x.groups + g) * 512)
        });
        // As in `lanes_avx2`: the loads of a row read from memory come too late to hide
        // its latency (one thread read 12 GB/s of Q4_1 out of cache, 9 of Q4_K): fetch
        // AHEAD bytes of quants ahead, and the scales as far ahead in rows. Prefetching
        // never faults: the address may lie past the end.
        for &row in &rows {
            let at = row * blocks * qb + g * WIDE * qb;
            for line in (0..n * qb).step_by(64) {
                fetch(w.q.as_ptr(), at + line + AHEAD);
            }
            let ahead = AHEAD / (WIDE * qb);
            for plane in [&w.bits, &w.bits6] {
                if !plane.is_empty() {
                    fetch(
                        plane.as_ptr() as *const u8,
                        ((row * groups + g + ahead) * 8) * 8,
                    );
                }
            }
            if let Some(k) = &w.k {
                fetch(k.meta_ptr(), k.meta_ahead(row, g, ahead));
            } else {
                let at = (row * blocks + g * WIDE) * hpb * 2;
                fetch(w.h.as_ptr() as *const u8, at + AHEAD * hpb * 2 / qb);
            }
        }
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
                        if KIND == NIBBLES_AND_BITS || KIND == SIX_BITS {
                            let slot = (rows[r] * groups + g) * 8 + 2 * v;
                            let planes = w.bits.as_ptr().add(slot);
                            lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(*planes, fifth));
                            hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(*planes.add(1), fifth));
                            if KIND == SIX_BITS {
                                let planes = w.bits6.as_ptr().add(slot);
                                lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(*planes, sixth));
                                hi = _mm512_or_si512(
                                    hi,
                                    _mm512_maskz_mov_epi8(*planes.add(1), sixth),
                                );
                            }
                        }
                        for t in 0..T {
                            let xl = _mm512_loadu_si512(xg[t].add(v * 64) as *const _);
                            let xh = _mm512_loadu_si512(xg[t].add((4 + v) * 64) as *const _);
                            dots[r][t] = _mm512_dpbusd_epi32(dots[r][t], lo, xl);
                            // Q6_K: the high nibbles are the block's second sub-block.
                            let d = if KIND == SIX_BITS {
                                &mut dots_hi
                            } else {
                                &mut dots
                            };
                            d[r][t] = _mm512_dpbusd_epi32(d[r][t], hi, xh);
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
                if let Some(k) = w.k.as_ref().filter(|_| KIND == SIX_BITS) {
                    // Q6_K: w = d·sc·(q − 32) a half, q unsigned.
                    let (lo, hi) = k::lane_scales6(k, rows[r], g, n);
                    let (clo, chi) = (_mm512_mul_ps(lo, minus32), _mm512_mul_ps(hi, minus32));
                    for t in 0..T {
                        let xat = ((first + t) * x.groups + g) * WIDE;
                        let dx = _mm512_loadu_ps(x.d.as_ptr().add(xat));
                        let slo = _mm512_loadu_ps(x.sum_lo.as_ptr().add(xat));
                        let shi = _mm512_loadu_ps(x.sum_hi.as_ptr().add(xat));
                        let a = &mut acc[r][t];
                        *a = _mm512_fmadd_ps(clo, slo, *a);
                        *a = _mm512_fmadd_ps(chi, shi, *a);
                        let lo_dot = _mm512_cvtepi32_ps(dots[r][t]);
                        *a = _mm512_fmadd_ps(lo_dot, _mm512_mul_ps(lo, dx), *a);
                        let hi_dot = _mm512_cvtepi32_ps(dots_hi[r][t]);
                        *a = _mm512_fmadd_ps(hi_dot, _mm512_mul_ps(hi, dx), *a);
                    }
                    continue;
                }
                let (d, c) = if let Some(k) = &w.k {
                    k::lane_scales(k, rows[r], g, n)
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
mod tests;
