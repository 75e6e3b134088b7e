//! The lane kernel on AVX2 ([`crate::lanes`]'s layout in groups of 8 blocks): each
//! 32-bit lane of a 256-bit product sums one block, so a group of 8 blocks ends in one
//! convert and two FMAs per token instead of a convert and an FMA per block.
//!
//! AVX2 has no 8-bit dot product into 32 bits: `vpmaddubsw` multiplies unsigned by
//! signed bytes into 16-bit pair sums (saturating), `vpmaddwd` against ones widens them.
//! The widening is the costly half, so the 16-bit sums are added up first as far as they
//! cannot overflow: a 4-bit weight's pair sum is at most 2·15·127 = 3,810 and a whole
//! group's eight products at most 30,480, so Q4_0 and Q4_1 widen once a group; Q5_0's
//! 5-bit weights (7,874 a product) every four products; Q8_0 multiplies magnitudes by
//! signed activations (`vpsignb`), at most 2·128·127 = 32,512, and widens every product.
//! Q4_K's sub-blocks are Q4_1's nibbles (widened once a group); Q6_K's 6-bit weights
//! (16,002 a product) are widened at every product, by `vpmaddwd` against each
//! half-block's 8-bit scale rather than ones, so both halves share one sum (at most
//! 2·16,002·128 a widening, 8 a group: 33 M).
//! The integer sums are exact, so the order of additions does not change a result.
//!
//! Every (row, token) pair is computed by the same operations in the same order, however
//! many rows and tokens share the call, so a token's result is bit for bit the one it gets
//! alone.
//!
//! A batch of tokens takes [`dot_tokens`]: one row and up to 8 tokens a pass, every sum
//! in a register (two rows of four tokens spilled AVX2's 16 registers to the stack at
//! every product). A lone token keeps [`dot`]'s four rows a pass.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::BlockType;
use crate::lanes::{BYTES, LaneActs, Lanes, NARROW, NIBBLES, NIBBLES_AND_BITS, SIX_BITS, fetch};

/// Rows `range` of `w` times every token of `x` into `out[tok * w.rows + row]`: a lone
/// token by [`crate::lanes::pass_rows`] with [`dot`] (four rows a pass), a batch by
/// [`dot_tokens`] (a row and up to 8 tokens a pass).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `x` was made from activations of `w`'s width in groups
/// of [`NARROW`]; `out` points at `tokens * w.rows` floats of which no other thread
/// writes `range`.
pub(crate) unsafe fn rows(w: &Lanes, x: &LaneActs, range: std::ops::Range<usize>, out: *mut f32) {
    let kind = w.inner_loop();
    let tokens = x.tokens();
    if tokens == 1 {
        crate::lanes::pass_rows!(dot, w, x, range, out);
        return;
    }
    let n = w.rows;
    for row in range {
        let mut tok = 0;
        while tok < tokens {
            macro_rules! run {
                ($t:literal) => {{
                    let mut vals = [0f32; $t];
                    // SAFETY: the features are the caller's contract; row and tokens in
                    // range.
                    unsafe {
                        match kind {
                            BYTES => dot_tokens::<$t, BYTES>(w, row, x, tok, &mut vals),
                            SIX_BITS => dot_tokens::<$t, SIX_BITS>(w, row, x, tok, &mut vals),
                            NIBBLES => dot_tokens::<$t, NIBBLES>(w, row, x, tok, &mut vals),
                            _ => dot_tokens::<$t, NIBBLES_AND_BITS>(w, row, x, tok, &mut vals),
                        }
                    }
                    for (j, v) in vals.iter().enumerate() {
                        // SAFETY: this thread's rows of `out` (the contract).
                        unsafe { *out.add((tok + j) * n + row) = *v };
                    }
                    $t
                }};
            }
            tok += match tokens - tok {
                1 => run!(1),
                2 => run!(2),
                3 => run!(3),
                4 => run!(4),
                5 => run!(5),
                6 => run!(6),
                7 => run!(7),
                _ => run!(8),
            };
        }
    }
}

/// How far ahead of the group in hand the quants are prefetched, in bytes (smollm2 on two
/// AVX2 cores, tokens/s of one stream: none 56–68, 1024 80–97, 2048 89–101, 4096 82–95;
/// of 8 together: none 126–173, 2048 169–194).
const AHEAD: usize = 2048;

/// A group's f16 values (scales or offsets) as floats, zeros past its `n` blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves(at: *const u16, n: usize) -> __m256 {
    // SAFETY: `n` readable values at `at` (the caller's contract).
    unsafe {
        if n == NARROW {
            _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i))
        } else {
            // Copies of constant size: a copy of `n` became a call to memcpy, around
            // which every vector register in use was saved.
            let mut tail = [0u16; NARROW];
            macro_rules! copy {
                ($($k:literal)*) => {
                    match n {
                        $($k => std::ptr::copy_nonoverlapping(at, tail.as_mut_ptr(), $k),)*
                        _ => unreachable!("a partial group of {n} blocks"),
                    }
                };
            }
            copy!(1 2 3 4 5 6 7);
            _mm256_cvtph_ps(_mm_loadu_si128(tail.as_ptr() as *const __m128i))
        }
    }
}

/// `R` rows times tokens `first..first + T`; `KIND`: a weight a byte, two, or two with
/// their fifth (and sixth) bits beside.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot<const R: usize, const T: usize, const KIND: u8>(
    w: &Lanes,
    rows: [usize; R],
    x: &LaneActs,
    first: usize,
    out: &mut [[f32; R]; T],
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let (blocks, groups) = (w.blocks, w.groups);
    let (qb, vectors, widen_every) = (quant_bytes(KIND), vectors(KIND), widen_every(KIND));
    debug_assert_eq!(qb, w.qbytes);
    for g in 0..groups {
        let n = (blocks - g * NARROW).min(NARROW);
        // Lanes past a row's last block are not loaded (their activations are zero).
        let mask = _mm256_cmpgt_epi32(
            _mm256_set1_epi32(n as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        let mut dots = [[_mm256_setzero_si256(); T]; R];
        let mut part = [[_mm256_setzero_si256(); T]; R];
        // SAFETY: activations hold 32·NARROW bytes per token and group.
        let xg: [*const i8; T] = std::array::from_fn(|t| unsafe {
            x.q.as_ptr().add(((first + t) * groups + g) * 32 * NARROW)
        });
        for &row in &rows {
            prefetch::<KIND>(w, row, g);
        }
        // Q6_K: each half's products widened at once, scaled by its 8-bit scale as they
        // are (`vpmaddwd`), into one sum a lane: no second set of sums to hold.
        let scales6: [(__m256i, __m256i); R] = std::array::from_fn(|r| match &w.k {
            // SAFETY: row `rows[r]`'s record for group `g`.
            Some(k) if KIND == SIX_BITS => unsafe {
                crate::lanes::k::narrow_scales6_i16(k, rows[r], g)
            },
            _ => (ones, ones),
        });
        // A constant trip count: the loop unrolls and the widenings fall in place.
        for v in 0..vectors {
            for r in 0..R {
                // SAFETY: vector `v` of the group is `n * 4` bytes, loaded whole (a full
                // group) or by the mask; activations hold 8 vectors of 32 bytes a group.
                unsafe {
                    let at = rows[r] * blocks * qb + g * NARROW * qb + v * n * 4;
                    let raw = quants(w, at, n, mask);
                    if KIND != BYTES {
                        let (lo, hi) = weights::<KIND>(w, (rows[r] * groups + g) * 4 + v, raw);
                        for t in 0..T {
                            let xl = _mm256_loadu_si256(xg[t].add(v * 32) as *const __m256i);
                            let xh = _mm256_loadu_si256(xg[t].add((4 + v) * 32) as *const __m256i);
                            if KIND == SIX_BITS {
                                // Q6_K: the high nibbles are the block's second sub-block.
                                let (sl, sh) = scales6[r];
                                let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), sl);
                                let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), sh);
                                dots[r][t] = _mm256_add_epi32(dots[r][t], _mm256_add_epi32(pl, ph));
                            } else {
                                let p = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(lo, xl),
                                    _mm256_maddubs_epi16(hi, xh),
                                );
                                part[r][t] = _mm256_add_epi16(part[r][t], p);
                            }
                        }
                    } else {
                        let mag = _mm256_sign_epi8(raw, raw);
                        for t in 0..T {
                            let xv = _mm256_loadu_si256(xg[t].add(v * 32) as *const __m256i);
                            part[r][t] = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(xv, raw));
                        }
                    }
                    if KIND != SIX_BITS && (v + 1) % widen_every == 0 {
                        for t in 0..T {
                            dots[r][t] =
                                _mm256_add_epi32(dots[r][t], _mm256_madd_epi16(part[r][t], ones));
                            part[r][t] = _mm256_setzero_si256();
                        }
                    }
                }
            }
        }
        for r in 0..R {
            // SAFETY: the group's `n` scales (and offsets) of row `rows[r]`; `width`
            // activation scales and sums per group.
            unsafe {
                let scales = group_scales::<KIND>(w, rows[r], g, n);
                for t in 0..T {
                    let xat = ((first + t) * groups + g) * NARROW;
                    acc[r][t] = add_group(acc[r][t], &scales, dots[r][t], x, xat);
                }
            }
        }
    }
    for r in 0..R {
        for t in 0..T {
            out[t][r] = crate::fused::hsum(acc[r][t]);
        }
    }
}

/// Row `row` of `w` times tokens `first..first + T`, one row at a time: a group's
/// weights are decoded once into two registers and every token's sums stay in registers
/// too (up to 8 tokens: 8 sums, the weights, the constants and the loads fit AVX2's 16
/// registers, where [`dot`]'s two rows of four tokens spilled them).
///
/// Per (row, token) the same operations in the same order as [`dot`] (the integer sums
/// are exact; the float steps are [`dot`]'s), so a token's result is bit for bit its
/// lone run's.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_tokens<const T: usize, const KIND: u8>(
    w: &Lanes,
    row: usize,
    x: &LaneActs,
    first: usize,
    out: &mut [f32; T],
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    let (blocks, groups) = (w.blocks, w.groups);
    let (qb, vectors, widen_every) = (quant_bytes(KIND), vectors(KIND), widen_every(KIND));
    debug_assert_eq!(qb, w.qbytes);
    let row_q = row * blocks * qb;
    // SAFETY: activations hold 32·NARROW bytes per token and group.
    let x_first = unsafe { x.q.as_ptr().add(first * groups * 32 * NARROW) };
    for g in 0..groups {
        let n = (blocks - g * NARROW).min(NARROW);
        let mask = _mm256_cmpgt_epi32(
            _mm256_set1_epi32(n as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        let at = row_q + g * NARROW * qb;
        prefetch::<KIND>(w, row, g);
        // SAFETY: token `t`'s group `g` (activations hold 32·NARROW bytes per token and
        // group).
        let xg = |t: usize| unsafe { x_first.add((t * groups + g) * 32 * NARROW) };
        // Q6_K: each half's products widened at once by its 8-bit scale (as in [`dot`]).
        let (s6l, s6h) = match &w.k {
            // SAFETY: row `row`'s record for group `g`.
            Some(k) if KIND == SIX_BITS => unsafe {
                crate::lanes::k::narrow_scales6_i16(k, row, g)
            },
            _ => (ones, ones),
        };
        let mut dots = [_mm256_setzero_si256(); T];
        let mut part = [_mm256_setzero_si256(); T];
        for v in 0..vectors {
            // SAFETY: vector `v` of the group is `n * 4` bytes, loaded whole (a full group)
            // or by the mask; activations hold 8 vectors of 32 bytes a group; the bit
            // planes hold a word a product.
            unsafe {
                let raw = quants(w, at + v * n * 4, n, mask);
                if KIND == BYTES {
                    let mag = _mm256_sign_epi8(raw, raw);
                    for (t, dot) in dots.iter_mut().enumerate() {
                        let xv = _mm256_loadu_si256(xg(t).add(v * 32) as *const __m256i);
                        let p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(xv, raw));
                        *dot = settled(_mm256_add_epi32(*dot, _mm256_madd_epi16(p, ones)));
                    }
                    continue;
                }
                let (lo, hi) = weights::<KIND>(w, (row * groups + g) * 4 + v, raw);
                for t in 0..T {
                    let xl = _mm256_loadu_si256(xg(t).add(v * 32) as *const __m256i);
                    let xh = _mm256_loadu_si256(xg(t).add((4 + v) * 32) as *const __m256i);
                    if KIND == SIX_BITS {
                        let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), s6l);
                        let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), s6h);
                        dots[t] = settled(_mm256_add_epi32(dots[t], _mm256_add_epi32(pl, ph)));
                    } else {
                        let p = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, xl),
                            _mm256_maddubs_epi16(hi, xh),
                        );
                        part[t] = settled(_mm256_add_epi16(part[t], p));
                    }
                }
                if KIND != SIX_BITS && (v + 1) % widen_every == 0 {
                    for t in 0..T {
                        dots[t] = _mm256_add_epi32(dots[t], _mm256_madd_epi16(part[t], ones));
                        part[t] = _mm256_setzero_si256();
                    }
                }
            }
        }
        // SAFETY: the group's `n` scales (and offsets) of `row`; `width` activation scales
        // and sums per group.
        unsafe {
            let scales = group_scales::<KIND>(w, row, g, n);
            for t in 0..T {
                let xat = ((first + t) * groups + g) * NARROW;
                acc[t] = add_group(acc[t], &scales, dots[t], x, xat);
            }
        }
    }
    for t in 0..T {
        out[t] = crate::fused::hsum(acc[t]);
    }
}

/// Product `slot`'s weights of a nibble kind as two vectors of bytes: the low nibbles of
/// `raw` and its high nibbles, with their fifth (Q5_0, Q6_K) and sixth (Q6_K) bits from
/// the planes.
///
/// # Safety
/// The CPU has AVX2; `slot` is a product of the matrix (its planes hold a word there).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weights<const KIND: u8>(w: &Lanes, slot: usize, raw: __m256i) -> (__m256i, __m256i) {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut lo = _mm256_and_si256(raw, m4);
    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
    if KIND == NIBBLES_AND_BITS || KIND == SIX_BITS {
        // This product's word: the low nibbles' bits, then the high ones'.
        // SAFETY: the caller's contract.
        let planes = unsafe { *w.bits.as_ptr().add(slot) };
        lo = _mm256_or_si256(lo, crate::fused::high_bits(planes as u32));
        hi = _mm256_or_si256(hi, crate::fused::high_bits((planes >> 32) as u32));
        if KIND == SIX_BITS {
            // 0x10 doubled: the sixth bit.
            // SAFETY: the caller's contract.
            let planes = unsafe { *w.bits6.as_ptr().add(slot) };
            let six = crate::fused::high_bits(planes as u32);
            lo = _mm256_or_si256(lo, _mm256_add_epi8(six, six));
            let six = crate::fused::high_bits((planes >> 32) as u32);
            hi = _mm256_or_si256(hi, _mm256_add_epi8(six, six));
        }
    }
    (lo, hi)
}

/// Quant bytes a block of kind `kind` holds in the lane layout: 32 (a weight a byte) or
/// 16 (two a byte). Known from the kind, so the passes' addresses and prefetch distances
/// take no division and the prefetch loop unrolls (a lone token's pass had divided by
/// the matrix's own field for every row).
const fn quant_bytes(kind: u8) -> usize {
    if kind == BYTES { 32 } else { 16 }
}

/// Products (vectors of 4 bytes a block) in a group of kind `kind`.
const fn vectors(kind: u8) -> usize {
    quant_bytes(kind) / 4
}

/// Products whose 16-bit sums are added before one widening (see the module comment).
const fn widen_every(kind: u8) -> usize {
    match kind {
        NIBBLES => 4,
        NIBBLES_AND_BITS => 2,
        _ => 1,
    }
}

/// Prefetches what row `row` reads a stretch past group `g`. A decode step reads every
/// weight once, from memory, and the loads come too late to hide its latency: the
/// quants AHEAD bytes ahead, and the scales (Q4_K's and Q6_K's records of two groups)
/// and bit planes as far ahead in rows (rows follow one another, so this runs on into
/// the next rows'). Prefetching never faults: the address may lie past the end.
#[inline]
fn prefetch<const KIND: u8>(w: &Lanes, row: usize, g: usize) {
    let qb = quant_bytes(KIND);
    let ahead = AHEAD / (NARROW * qb);
    let at = (row * w.blocks + g * NARROW) * qb;
    for line in (0..NARROW * qb).step_by(64) {
        fetch(w.q.as_ptr(), at + line + AHEAD);
    }
    if let Some(k) = &w.k {
        fetch(k.meta_ptr(), k.meta_ahead(row, g / 2, ahead / 2));
    } else {
        let at = (row * w.blocks + g * NARROW) * w.hpb * 2;
        fetch(w.h.as_ptr() as *const u8, at + AHEAD * w.hpb * 2 / qb);
    }
    for plane in [&w.bits, &w.bits6] {
        if !plane.is_empty() {
            fetch(
                plane.as_ptr() as *const u8,
                (row * w.groups + g + ahead) * 32,
            );
        }
    }
}

/// One product's quant bytes at `at` in the matrix: 32 of a full group, or the `n · 4`
/// the mask selects of a partial one.
///
/// # Safety
/// The CPU has AVX2; the group's `n · 4` bytes from `at` are the matrix's.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quants(w: &Lanes, at: usize, n: usize, mask: __m256i) -> __m256i {
    // SAFETY: the caller's contract.
    unsafe {
        let p = w.q.as_ptr().add(at);
        if n == NARROW {
            _mm256_loadu_si256(p as *const __m256i)
        } else {
            _mm256_maskload_epi32(p as *const i32, mask)
        }
    }
}

/// A group's lane scales, by which its integer sums become floats.
enum GroupScales {
    /// `w = d·u + c` per block (`c` none for Q8_0).
    Plain { d: __m256, c: Option<__m256> },
    /// Q6_K: `w = d·sc·(q − 32)` a half-block; the integer sums already hold `sc·Σq·x`,
    /// and each half's offset is `−32·d·sc`.
    Six { d: __m256, clo: __m256, chi: __m256 },
}

/// Group `g` (of `n` blocks) of row `row`'s [`GroupScales`].
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `row` and `g` are the matrix's.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_scales<const KIND: u8>(w: &Lanes, row: usize, g: usize, n: usize) -> GroupScales {
    // SAFETY: the caller's contract: the group's `n` scales (and offsets).
    unsafe {
        match &w.k {
            Some(k) if KIND == SIX_BITS => {
                let (lo, hi) = crate::lanes::k::narrow_scales6(k, row, g);
                let minus32 = _mm256_set1_ps(-32.0);
                GroupScales::Six {
                    d: _mm256_set1_ps(crate::lanes::k::number(k, row, g, 0)),
                    clo: _mm256_mul_ps(lo, minus32),
                    chi: _mm256_mul_ps(hi, minus32),
                }
            }
            Some(k) => {
                let (d, c) = crate::lanes::k::narrow_scales(k, row, g);
                GroupScales::Plain { d, c: Some(c) }
            }
            None => {
                let (blocks, hpb) = (w.blocks, w.hpb);
                let at = w.h.as_ptr().add(row * blocks * hpb + g * NARROW * hpb);
                let d = halves(at, n);
                // Q4_0's and Q5_0's offsets are fixed multiples of the scale (exact in f32).
                let c = match w.ty {
                    BlockType::Q4_1 => Some(halves(at.add(n), n)),
                    BlockType::Q8_0 => None,
                    BlockType::Q4_0 => Some(_mm256_mul_ps(d, _mm256_set1_ps(-8.0))),
                    _ => Some(_mm256_mul_ps(d, _mm256_set1_ps(-16.0))),
                };
                GroupScales::Plain { d, c }
            }
        }
    }
}

/// `acc` plus a group's share of one token: its integer sums `dots` scaled, and the
/// offsets against the activations' block sums (at `xat`). Every kernel here ends a
/// group by this, so a token's float steps do not depend on the pass it is in.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `xat` is a token's group in `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_group(
    acc: __m256,
    scales: &GroupScales,
    dots: __m256i,
    x: &LaneActs,
    xat: usize,
) -> __m256 {
    // SAFETY: the caller's contract: `NARROW` values at `xat`.
    unsafe {
        let dx = _mm256_loadu_ps(x.d.as_ptr().add(xat));
        match *scales {
            GroupScales::Six { d, clo, chi } => {
                let slo = _mm256_loadu_ps(x.sum_lo.as_ptr().add(xat));
                let shi = _mm256_loadu_ps(x.sum_hi.as_ptr().add(xat));
                let a = _mm256_fmadd_ps(clo, slo, acc);
                let a = _mm256_fmadd_ps(chi, shi, a);
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(d, dx), a)
            }
            GroupScales::Plain { d, c } => {
                let a = match c {
                    Some(c) => _mm256_fmadd_ps(c, _mm256_loadu_ps(x.sum.as_ptr().add(xat)), acc),
                    None => acc,
                };
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(d, dx), a)
            }
        }
    }
}

/// `v` unchanged, through an empty instruction the compiler cannot see into: a sum
/// accumulated through it is added in the order written. Integer additions reassociate,
/// and without this LLVM computed a whole vector's products for every token before adding
/// any, which needed more registers than AVX2 has and spilled them to the stack.
#[inline(always)]
fn settled(mut v: __m256i) -> __m256i {
    // SAFETY: the instruction is empty: it reads and writes nothing.
    unsafe {
        std::arch::asm!("/* {0} */", inout(ymm_reg) v, options(pure, nomem, nostack, preserves_flags));
    }
    v
}
