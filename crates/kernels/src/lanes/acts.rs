//! Activations in the lane layout: each token's 8-bit blocks transposed as [`super::Lanes`]
//! reads them, with their scales and sums.

use super::tail_pack;
use crate::matmul::Activations;

/// Activations transposed as [`super::Lanes`] reads them: per token and group, 8 vectors of
/// `4·width` bytes (vector `v`, lane `j`: bytes `4v..4v+4` of block `j`), zeros past the
/// last block; the blocks' scales and `d·Σq` sums, `width` per group (zeros past the
/// last block).
pub(crate) struct LaneActs {
    pub(crate) groups: usize,
    pub(crate) width: usize,
    pub(crate) q: Vec<i8>,
    pub(crate) d: Vec<f32>,
    pub(crate) sum: Vec<f32>,
    /// `d·Σq` over each block's first 16 bytes and over its last 16 (Q6_K's halves).
    pub(crate) sum_lo: Vec<f32>,
    pub(crate) sum_hi: Vec<f32>,
    /// For matrices whose last blocks are packed across rows ([`super::Tails`]): each token's
    /// last `n` blocks repeated `per` times, one group a token.
    pub(crate) tail: Option<Box<LaneActs>>,
}

impl LaneActs {
    /// With `halves`, the sums over each block's halves too (a Q6_K matrix reads them).
    pub(crate) fn of(acts: &Activations, width: usize, halves: bool) -> Self {
        let blocks = acts.cols() / 32;
        let mut lane_acts =
            Self::place(acts, width, blocks.div_ceil(width), 0..blocks, 1, |b, _| {
                (b / width, b % width)
            });
        if halves {
            lane_acts.add_halves(acts, blocks);
        }
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
            sum_lo: Vec::new(),
            sum_hi: Vec::new(),
            tail: None,
        }
    }

    /// [`Self::sum_lo`] and [`Self::sum_hi`] of every block of the `blocks` a token.
    fn add_halves(&mut self, acts: &Activations, blocks: usize) {
        let len = self.sum.len();
        let (mut lo_sums, mut hi_sums) = (vec![0f32; len], vec![0f32; len]);
        for tok in 0..acts.rows() {
            let (xq, xd, _) = acts.row(tok);
            for b in 0..blocks {
                let half = |h: usize| -> f32 {
                    let s: i32 = xq[b * 32 + 16 * h..b * 32 + 16 * h + 16]
                        .iter()
                        .map(|&v| v as i32)
                        .sum();
                    xd[b] * s as f32
                };
                let at = (tok * self.groups + b / self.width) * self.width + b % self.width;
                (lo_sums[at], hi_sums[at]) = (half(0), half(1));
            }
        }
        (self.sum_lo, self.sum_hi) = (lo_sums, hi_sums);
    }

    pub(crate) fn tokens(&self) -> usize {
        self.q.len() / (self.groups * 32 * self.width).max(1)
    }
}
