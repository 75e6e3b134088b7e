//! One launch a kernel of the decode step: the grid, the block and the arguments each of
//! `decode.cu`'s kernels takes, as `DecodePlan::record_layers` calls them.

use super::kernels::{
    OInto, QSegments, RopeInto, STAGED_THREADS, Segments, StagedShape, attention_cluster_shared,
    attention_o_cluster_shared, attention_shared, cfg, matvec_cfg, norm_threads, split_for,
};
use super::variants::Stage;
use super::weights::Linear;
use super::{DecodePlan, Layer, Ptrs};
use crate::Result;

impl DecodePlan {
    /// RMSNorm of `x` into `out`, and quantized to 8 bits for the next mat-vec.
    pub(super) fn rmsnorm(&self, x: u64, w: u64, out: u64) -> Result<()> {
        let n = self.hidden;
        self.launch(
            &self.kernels.rmsnorm,
            cfg((1, 1), norm_threads(n), 0),
            &[&x, &w, &out, &n, &self.eps, &self.at.xq, &self.at.xd],
        )
    }

    pub(super) fn quantize(&self, x: u64, n: i32) -> Result<()> {
        let (q, qd) = (self.at.xq, self.at.xd);
        let blocks = (n as u32).div_ceil(32);
        self.launch(
            &self.kernels.quantize,
            cfg((blocks.div_ceil(8), 1), 256, 0),
            &[&x, &n, &q, &qd],
        )
    }

    /// Whether layer `l`'s q/k/v projection can rotate and append its own rows: bf16
    /// weights and no per-head norms (which need a whole head before rope).
    pub(super) fn rope_in_projection(&self, l: &Layer) -> bool {
        self.var.fused_rope
            && l.q_norm == 0
            && l.k_norm == 0
            && [&l.q, &l.k, &l.v].iter().all(|p| !p.w.is_quant())
    }

    /// `shoal_qkv_rope_bf16`: the normed q/k/v projection, rotated, q into `qkv` and k, v
    /// into the layer's cache at the step's position.
    pub(super) fn qkv_rope(&self, l: &Layer, cache: (u64, u64, i32)) -> Result<()> {
        let ls = [&l.q, &l.k, &l.v];
        let rows: i32 = ls.iter().map(|l| l.rows).sum();
        let k = l.q.k;
        // A team a pair of rows.
        let split = self
            .var
            .split(Stage::Qkv)
            .unwrap_or_else(|| split_for(rows / 2, k, false));
        let seg = Segments {
            w: ls.map(|l| l.w.ptr()),
            bias: ls.map(|l| l.bias),
            rows: ls.map(|l| l.rows),
        };
        let (k_cache, v_cache, cap) = cache;
        let rope = RopeInto {
            inv_freq: self.at.inv_freq,
            pos: self.at.pos,
            k_cache,
            v_cache,
            nh: self.nh,
            nkv: self.nkv,
            hd: self.hd,
            cap,
            interleaved: self.interleaved,
        };
        let (x, qkv) = (self.at.x, self.at.qkv);
        self.launch(
            &self.kernels.qkv_rope_bf16,
            matvec_cfg(rows / 2, split),
            &[&seg, &x, &l.attn_norm, &self.eps, &qkv, &k, &split, &rope],
        )
    }

    /// `y = [W0; W1; W2] norm(x) (+ bias) (+ residual)`; a dense `x` is f32 (normed in the
    /// kernel where `norm` is given), a quantized one the 8-bit row in `xq`.
    pub(super) fn matvec(
        &self,
        stage: Stage,
        ls: &[&Linear],
        x: u64,
        norm: u64,
        residual: u64,
        y: u64,
    ) -> Result<()> {
        let rows: i32 = ls.iter().map(|l| l.rows).sum();
        let k = ls[0].k;
        let split = self
            .var
            .split(stage)
            .unwrap_or_else(|| split_for(rows, k, ls[0].w.is_quant()));
        let mut w = [0u64; 3];
        let mut bias = [0u64; 3];
        let mut r = [0i32; 3];
        let mut kind = [0i32; 3];
        for (i, l) in ls.iter().enumerate() {
            w[i] = l.w.ptr();
            bias[i] = l.bias;
            r[i] = l.rows;
            kind[i] = l.w.kind();
        }
        if ls[0].w.is_quant() {
            let seg = QSegments {
                w,
                bias,
                rows: r,
                kind,
            };
            let (xq, xd) = (self.at.xq, self.at.xd);
            self.launch(
                &self.kernels.matvec_quant,
                matvec_cfg(rows, split),
                &[&seg, &xq, &xd, &residual, &y, &k, &split],
            )
        } else if self.var.pairs && r.iter().all(|n| n % 2 == 0) {
            let seg = Segments { w, bias, rows: r };
            let split = self
                .var
                .split(stage)
                .unwrap_or_else(|| split_for(rows / 2, k, false));
            self.launch(
                &self.kernels.matvec2_bf16,
                matvec_cfg(rows / 2, split),
                &[&seg, &x, &norm, &self.eps, &residual, &y, &k, &split],
            )
        } else {
            let seg = Segments { w, bias, rows: r };
            self.launch(
                &self.kernels.matvec_bf16,
                matvec_cfg(rows, split),
                &[&seg, &x, &norm, &self.eps, &residual, &y, &k, &split],
            )
        }
    }

    /// `y = W x + residual` by `shoal_matvec_staged_bf16`: one block an SM, its rows'
    /// weights asked for before the wait for the kernel ahead.
    pub(super) fn matvec_staged(
        &self,
        shape: StagedShape,
        l: &Linear,
        x: u64,
        residual: u64,
        y: u64,
    ) -> Result<()> {
        let (w, rows, k, staged) = (l.w.ptr(), l.rows, l.k, shape.staged);
        self.launch(
            &self.kernels.matvec_staged[shape.kernel],
            cfg(
                (shape.blocks, 1),
                STAGED_THREADS as u32,
                shape.shared_bytes(k),
            ),
            &[&w, &x, &residual, &y, &rows, &k, &staged],
        )
    }

    /// `ff = silu(gate norm(x)) * (up norm(x))`.
    pub(super) fn gate_up(&self, gate: &Linear, up: &Linear, norm: u64, y: u64) -> Result<()> {
        let (rows, k) = (gate.rows, gate.k);
        let split = self
            .var
            .split(Stage::GateUp)
            .unwrap_or_else(|| split_for(rows, k, gate.w.is_quant()));
        if gate.w.is_quant() {
            let (xq, xd) = (self.at.xq, self.at.xd);
            let (g, u, kg, ku) = (gate.w.ptr(), up.w.ptr(), gate.w.kind(), up.w.kind());
            self.launch(
                &self.kernels.gate_up_quant,
                matvec_cfg(rows, split),
                &[&g, &u, &kg, &ku, &xq, &xd, &y, &rows, &k, &split],
            )
        } else {
            let (g, u, x) = (gate.w.ptr(), up.w.ptr(), self.at.x);
            self.launch(
                &self.kernels.gate_up_bf16,
                matvec_cfg(rows, split),
                &[&g, &u, &x, &norm, &self.eps, &y, &rows, &k, &split],
            )
        }
    }

    /// `cache`: one layer's keys, values and capacity.
    pub(super) fn rope_append(
        &self,
        qkv: u64,
        q_norm: u64,
        k_norm: u64,
        cache: (u64, u64, i32),
    ) -> Result<()> {
        let (kc, vc, cap) = cache;
        let heads = (self.nh + 2 * self.nkv) as u32;
        let (inv, pos) = (self.at.inv_freq, self.at.pos);
        self.launch(
            &self.kernels.rope_append,
            cfg((heads, 1), self.hd as u32, 0),
            &[
                &qkv,
                &q_norm,
                &k_norm,
                &self.eps,
                &inv,
                &pos,
                &kc,
                &vc,
                &self.nh,
                &self.nkv,
                &self.hd,
                &cap,
                &self.interleaved,
            ],
        )
    }

    /// Attention of the rotated queries in `q` over the cache into `out` (and into the
    /// 8-bit row where the output projection `o` is quantized), asking L2 for `o`'s
    /// weights meanwhile.
    /// Whether the attention of a cache of `capacity` positions does the output
    /// projection `o` itself (`attention_o`).
    pub(super) fn fuses_o(&self, o: &Linear, capacity: i32) -> bool {
        self.fuse_o
            && capacity <= self.cluster_max_len
            && !o.w.is_quant()
            && o.bias == 0
            && o.rows == self.hidden
    }

    /// Attention of the query heads in `q` over the layer's cache, then the output
    /// projection `o` of the result added to the residual stream, as one kernel of
    /// clusters (`decode.cu`'s `shoal_attention_o_cluster`).
    pub(super) fn attention_o(&self, q: u64, cache: (u64, u64, i32), o: &Linear) -> Result<()> {
        let (kc, vc, cap) = cache;
        let group = self.nh / self.nkv;
        let scale = 1.0 / (self.hd as f32).sqrt();
        let prefetch = i32::from(self.var.attn_prefetch);
        let into = OInto {
            w: o.w.ptr(),
            partial: self.at.o_partial,
            count: self.at.o_count,
            y: self.at.x,
            hidden: self.hidden,
            ld: o.k,
        };
        let shared = attention_o_cluster_shared(self.var.attn_warps, group, self.hd);
        let grid = cfg(
            (self.nkv as u32, self.cluster),
            self.var.attn_warps * 32,
            shared,
        );
        self.launch_with(
            &self.kernels.attention_o_cluster,
            grid,
            &[
                &q,
                &kc,
                &vc,
                &self.at.pos,
                &into,
                &self.hd,
                &cap,
                &scale,
                &prefetch,
            ],
            Some(self.cluster),
        )
    }

    pub(super) fn attention(
        &self,
        q: u64,
        cache: (u64, u64, i32),
        out: u64,
        o: &Linear,
    ) -> Result<()> {
        let quantize = o.w.is_quant();
        let (next, next_bytes) = if self.var.prefetch_next && self.var.runs(Stage::Output) {
            o.span()
        } else {
            (0, 0)
        };
        let (kc, vc, cap) = cache;
        let group = self.nh / self.nkv;
        let scale = 1.0 / (self.hd as f32).sqrt();
        let prefetch = i32::from(self.var.attn_prefetch);
        let Ptrs {
            part_acc,
            part_ml,
            pos,
            ..
        } = self.at;
        let (xq, xd) = if quantize {
            (self.at.xq, self.at.xd)
        } else {
            (0, 0)
        };
        if self.cluster > 0 && cap <= self.cluster_max_len {
            let shared = attention_cluster_shared(self.var.attn_warps, group, self.hd);
            let grid = cfg(
                (self.nkv as u32, self.cluster),
                self.var.attn_warps * 32,
                shared,
            );
            return self.launch_with(
                &self.kernels.attention_cluster,
                grid,
                &[
                    &q,
                    &kc,
                    &vc,
                    &pos,
                    &out,
                    &xq,
                    &xd,
                    &self.hd,
                    &cap,
                    &scale,
                    &prefetch,
                    &next,
                    &next_bytes,
                ],
                Some(self.cluster),
            );
        }
        let shared = attention_shared(self.var.attn_warps, group, self.hd);
        self.launch(
            &self.kernels.attention,
            cfg(
                (self.nkv as u32, self.splits),
                self.var.attn_warps * 32,
                shared,
            ),
            &[
                &q,
                &kc,
                &vc,
                &pos,
                &part_acc,
                &part_ml,
                &group,
                &self.hd,
                &cap,
                &scale,
                &prefetch,
                &next,
                &next_bytes,
            ],
        )?;
        let splits = self.splits as i32;
        self.launch(
            &self.kernels.attn_merge,
            cfg((self.nh as u32, 1), self.hd as u32, 0),
            &[&part_acc, &part_ml, &pos, &out, &xq, &xd, &splits, &self.hd],
        )
    }
}
