//! The environment's variants of the decode step: each switch runs another design of one
//! part of it (or leaves a part out), so that one process can be timed against another on
//! the same machine (`scripts/gpu-check.sh`'s MODES). The defaults are the measured best.

use super::kernels::ATTN_WARPS;

/// A part of the step that a timing variant may leave out (`SHOAL_GPU_OMIT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// The q/k/v projection (with rope and the KV append where they are fused in).
    Qkv,
    Attention,
    /// The output projection.
    Output,
    GateUp,
    Down,
    Head,
}

impl Stage {
    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "qkv" => Self::Qkv,
            "attn" => Self::Attention,
            "o" => Self::Output,
            "gate_up" => Self::GateUp,
            "down" => Self::Down,
            "head" => Self::Head,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug)]
pub(super) struct Variants {
    /// Warps per mat-vec row instead of the rule by row count: for every matrix
    /// (`SHOAL_GPU_SPLIT=1|2|4|8`) or a stage's (`SHOAL_GPU_SPLIT=qkv:2,down:8`; stages as
    /// `SHOAL_GPU_OMIT` names them), the first entry that names the stage or none.
    split: Vec<(Option<Stage>, i32)>,
    /// Launch a step's kernels after its first as programmatic dependents of the one
    /// ahead (`decode.cu`'s `begin_step`); `SHOAL_GPU_PDL=0` turns it off.
    pub(super) pdl: bool,
    /// The q/k/v projection rotates and appends its rows itself where it can;
    /// `SHOAL_GPU_ROPE=apart` launches `shoal_rope_append`.
    pub(super) fused_rope: bool,
    /// Dense mat-vecs whose segments all have even rows take two rows a team
    /// (`shoal_matvec2_bf16`); `SHOAL_GPU_PAIRS=0` keeps one.
    pub(super) pairs: bool,
    /// Warps a block of one token's attention kernel: ATTN_WARPS unless
    /// `SHOAL_GPU_ATTN_WARPS` says 1..=16.
    pub(super) attn_warps: u32,
    /// The attention asks L2 for its run of the cache before it waits for the kernel
    /// ahead (the keys and values of earlier positions do not depend on it);
    /// `SHOAL_GPU_ATTN_PREFETCH=0` does not.
    pub(super) attn_prefetch: bool,
    /// The attention asks L2 for the output projection's weights before it waits, so
    /// that the DRAM streams them while attention's latency-bound work runs
    /// (`SHOAL_GPU_PREFETCH_NEXT=1`). Off: on an H100, llama-8B bf16 tg128 after 512 ran
    /// 176.3 tok/s with it against 178.0 without (the attention waited behind the stream).
    pub(super) prefetch_next: bool,
    /// The cluster attention kernel does the output projection too (bf16, no bias),
    /// where `SHOAL_GPU_FUSE_O=1`; otherwise it is a mat-vec of its own. Off: on an H100,
    /// llama-8B bf16 tg128 after 512 ran 175.0 tok/s fused (its rows asked of L2 before
    /// the wait) against 177.9 apart: 128 blocks of 8 warps keep too few loads in flight.
    pub(super) fuse_o: bool,
    /// The output projection stages its weights in shared memory before it waits for the
    /// attention (`shoal_matvec_staged_bf16`), where `SHOAL_GPU_STAGED=1`. Off: on an
    /// H100, llama-8B bf16 tg128 ran 166.4 tok/s staged against 184.8 / 184.9 without,
    /// and with `Kernels::prefer_shared` 165.2 against 184.9.
    pub(super) staged_o: bool,
    /// With the staged projection, every decode kernel asks for the SM's largest shared
    /// memory (`Kernels::prefer_shared`) unless `SHOAL_GPU_CARVEOUT=0`.
    pub(super) carveout: bool,
    /// Timing only, the results are wrong: parts of the step left out
    /// (`SHOAL_GPU_OMIT=qkv,attn,o,gate_up,down,head`), to see what each costs inside the
    /// replayed graph, where programmatic launches overlap neighbours.
    pub(super) omit: Vec<Stage>,
    /// Greedy decoding chains its steps on the device (`chain.rs`) unless
    /// `SHOAL_GPU_CHAIN=0`, which steps a token at a time through the host. On an H100,
    /// llama-8B bf16 tg128: 183.1 / 183.2 tok/s chained against 181.9 stepping (the GPU
    /// test `chained_greedy_steps_equal_stepping_through_the_host` passed first).
    pub(super) chain: bool,
    /// Timing only: the graph replayed this many times a token (`SHOAL_GPU_REPEAT`), so
    /// that the difference between 1 and 2 is the graph's own time and the rest of a
    /// token's time the host's.
    pub(super) repeat: u32,
}

impl Variants {
    pub(super) fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok();
        let on = |name: &str| var(name).is_none_or(|v| v != "0");
        let omit = var("SHOAL_GPU_OMIT")
            .map(|v| v.split(',').filter_map(Stage::parse).collect())
            .unwrap_or_default();
        Self {
            split: var("SHOAL_GPU_SPLIT")
                .map(|v| v.split(',').filter_map(parse_split).collect())
                .unwrap_or_default(),
            pdl: on("SHOAL_GPU_PDL"),
            fused_rope: var("SHOAL_GPU_ROPE").as_deref() != Some("apart"),
            pairs: on("SHOAL_GPU_PAIRS"),
            attn_warps: var("SHOAL_GPU_ATTN_WARPS")
                .and_then(|v| v.parse().ok())
                .filter(|n| (1..=16).contains(n))
                .unwrap_or(ATTN_WARPS),
            attn_prefetch: on("SHOAL_GPU_ATTN_PREFETCH"),
            prefetch_next: var("SHOAL_GPU_PREFETCH_NEXT").as_deref() == Some("1"),
            fuse_o: var("SHOAL_GPU_FUSE_O").as_deref() == Some("1"),
            staged_o: var("SHOAL_GPU_STAGED").as_deref() == Some("1"),
            carveout: on("SHOAL_GPU_CARVEOUT"),
            omit,
            chain: on("SHOAL_GPU_CHAIN"),
            repeat: var("SHOAL_GPU_REPEAT")
                .and_then(|v| v.parse().ok())
                .filter(|n| (1..=8).contains(n))
                .unwrap_or(1),
        }
    }

    pub(super) fn runs(&self, stage: Stage) -> bool {
        !self.omit.contains(&stage)
    }

    /// Warps a row for `stage`'s mat-vec where the environment sets them.
    pub(super) fn split(&self, stage: Stage) -> Option<i32> {
        self.split
            .iter()
            .find(|(s, _)| s.is_none_or(|s| s == stage))
            .map(|&(_, n)| n)
    }
}

/// `N` or `STAGE:N`, N warps a row (1, 2, 4 or 8).
fn parse_split(entry: &str) -> Option<(Option<Stage>, i32)> {
    let (stage, n) = match entry.split_once(':') {
        Some((stage, n)) => (Some(Stage::parse(stage)?), n),
        None => (None, entry),
    };
    let n = n.parse().ok().filter(|n| [1, 2, 4, 8].contains(n))?;
    Some((stage, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_entry_naming_the_stage_or_none_sets_its_split() {
        let split = ["down:8", "4", "qkv:2", "o:3", "nope:2"]
            .into_iter()
            .filter_map(parse_split)
            .collect();
        let var = Variants {
            split,
            ..Variants::from_env()
        };
        assert_eq!(var.split(Stage::Down), Some(8));
        assert_eq!(var.split(Stage::Output), Some(4));
        assert_eq!(var.split(Stage::Qkv), Some(4));
        assert_eq!(
            Variants {
                split: vec![],
                ..var
            }
            .split(Stage::Qkv),
            None
        );
    }
}
