//! How a GPU rank that holds the whole model runs a step of decode rows only: each row's
//! captured single-token step replayed in turn, or one batched pass.
//!
//! Neither wins everywhere. A replay is one launch whose kernels read the weights for one
//! row (qwen2.5-1.5b Q4_K on an H100: 1.1 ms); the batched pass reads them once for every
//! row but launches candle's operations one by one and, for K-quants, dequantizes (9-16 ms
//! a step of 1-16 rows on that model). On llama-8B bf16 the batched pass's tensor-core
//! matmuls win from two rows on (docs/GPU.md: 3,504 tok/s at 32 sequences). So the rank
//! learns both costs as it runs and takes the cheaper: [`DecodeWays::choose`] is the rule
//! list, [`DecodeWays::observe`] the learning.

/// One way to run a step of decode rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeWay {
    /// Each row through the model's single-token step (a graph replay), in turn.
    Replays,
    /// All rows in one batched forward pass.
    Batch,
}

/// How far a new observation moves a learned cost: a cheaper one nearly all the way, a
/// dearer one a quarter. What disturbs a step (a first use's compilation or kernel choice,
/// a capture, another process on the device) only ever adds time, so a cheap measurement
/// is the stronger evidence; and both ways are learned alike, so the comparison is fair.
const LEARN_CHEAPER: f64 = 0.75;
const LEARN_DEARER: f64 = 0.25;

/// Steps of one size between probes of the way not taken, at first; each probe that
/// confirms the choice doubles it, up to [`PROBE_MOST`]; one that overturns it starts over.
const PROBE_FIRST: u32 = 8;
const PROBE_MOST: u32 = 1024;

/// What one row count has learned of the batched pass, and when it next looks again.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Size {
    /// Milliseconds a batched step of this many rows takes.
    batch: Option<f64>,
    /// Steps of this size since the way not taken was last measured.
    since_probe: u32,
    /// Steps between probes.
    probe_every: u32,
}

impl Default for Size {
    fn default() -> Self {
        Self {
            batch: None,
            since_probe: 0,
            probe_every: PROBE_FIRST,
        }
    }
}

/// Step costs learned by the rank, and the choice they imply.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodeWays {
    /// Milliseconds one replayed row takes (every row count alike: a replay does not
    /// know of the others).
    per_replay: Option<f64>,
    /// By row count.
    sizes: Vec<Size>,
}

fn learn(old: Option<f64>, new: f64) -> f64 {
    old.map_or(new, |o| {
        let weight = if new < o { LEARN_CHEAPER } else { LEARN_DEARER };
        o + weight * (new - o)
    })
}

impl DecodeWays {
    fn size(&self, rows: usize) -> Size {
        self.sizes.get(rows).copied().unwrap_or_default()
    }

    fn size_mut(&mut self, rows: usize) -> &mut Size {
        if self.sizes.len() <= rows {
            self.sizes.resize(rows + 1, Size::default());
        }
        &mut self.sizes[rows]
    }

    /// The way the learned costs favour for `rows` decode rows (ties go to the batch,
    /// which reads the weights once).
    fn cheaper(&self, rows: usize) -> Option<DecodeWay> {
        let (replay, batch) = (self.per_replay?, self.size(rows).batch?);
        Some(if rows as f64 * replay < batch {
            DecodeWay::Replays
        } else {
            DecodeWay::Batch
        })
    }

    /// How to run a step of `rows` decode rows: the first rule that answers decides.
    pub fn choose(&self, rows: usize) -> DecodeWay {
        let rules: [fn(&Self, usize) -> Option<DecodeWay>; 5] = [
            Self::one_row_replays,
            Self::learn_replays_first,
            Self::learn_batch_next,
            Self::probe_the_other,
            Self::cheaper,
        ];
        rules
            .iter()
            .find_map(|rule| rule(self, rows))
            .unwrap_or(DecodeWay::Batch)
    }

    /// One row: a batch of one only adds the batched pass's launches.
    fn one_row_replays(&self, rows: usize) -> Option<DecodeWay> {
        (rows <= 1).then_some(DecodeWay::Replays)
    }

    /// No replay measured yet (lone rows usually teach it first): measure one.
    fn learn_replays_first(&self, _rows: usize) -> Option<DecodeWay> {
        self.per_replay.is_none().then_some(DecodeWay::Replays)
    }

    /// No batch of this size measured yet: measure one.
    fn learn_batch_next(&self, rows: usize) -> Option<DecodeWay> {
        self.size(rows).batch.is_none().then_some(DecodeWay::Batch)
    }

    /// Now and then the way not taken, so that a cost measured once (a first batch of a
    /// size that paid for cuBLAS's first choice of kernel, a replay that paid a capture)
    /// or one that drifted with the context does not decide forever.
    fn probe_the_other(&self, rows: usize) -> Option<DecodeWay> {
        let size = self.size(rows);
        if size.since_probe + 1 < size.probe_every {
            return None;
        }
        Some(match self.cheaper(rows)? {
            DecodeWay::Replays => DecodeWay::Batch,
            DecodeWay::Batch => DecodeWay::Replays,
        })
    }

    /// A step of `rows` decode rows, run `way`, took `ms` (to its logits on the device).
    pub fn observe(&mut self, way: DecodeWay, rows: usize, ms: f64) {
        if rows == 0 || !ms.is_finite() || ms < 0.0 {
            return;
        }
        let before = self.cheaper(rows);
        match way {
            DecodeWay::Replays => self.per_replay = Some(learn(self.per_replay, ms / rows as f64)),
            DecodeWay::Batch => {
                let size = self.size_mut(rows);
                size.batch = Some(learn(size.batch, ms));
            }
        }
        if rows <= 1 {
            return;
        }
        let after = self.cheaper(rows);
        let size = self.size_mut(rows);
        // A step the way the costs did not favour was a probe: it either confirmed the
        // choice (look again later) or overturned it (look again soon).
        let probed = before.is_some_and(|b| b != way);
        if probed {
            size.since_probe = 0;
            size.probe_every = if after == before {
                (size.probe_every * 2).min(PROBE_MOST)
            } else {
                PROBE_FIRST
            };
        } else {
            size.since_probe = size.since_probe.saturating_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::DecodeWay::{Batch, Replays};
    use super::*;

    /// Runs `steps` steps of `rows` rows the way `choose` says, each costing what
    /// `cost(way)` says; returns how many went each way.
    fn run(
        ways: &mut DecodeWays,
        rows: usize,
        steps: usize,
        cost: impl Fn(DecodeWay) -> f64,
    ) -> (usize, usize) {
        let (mut replays, mut batches) = (0, 0);
        for _ in 0..steps {
            let way = ways.choose(rows);
            match way {
                Replays => replays += 1,
                Batch => batches += 1,
            }
            ways.observe(way, rows, cost(way));
        }
        (replays, batches)
    }

    #[test]
    fn a_lone_row_always_replays() {
        let mut ways = DecodeWays::default();
        assert_eq!(ways.choose(1), Replays);
        // Even where a batch of one had been measured cheaper.
        ways.observe(Batch, 1, 0.1);
        ways.observe(Replays, 1, 5.0);
        assert_eq!(ways.choose(1), Replays);
    }

    #[test]
    fn each_way_is_measured_once_before_the_costs_decide() {
        let mut ways = DecodeWays::default();
        assert_eq!(ways.choose(4), Replays, "no replay cost yet");
        ways.observe(Replays, 4, 4.4);
        assert_eq!(ways.choose(4), Batch, "no batch of four yet");
        ways.observe(Batch, 4, 12.0);
        assert_eq!(ways.choose(4), Replays, "4 × 1.1 ms against 12 ms");
        // A lone row's replay teaches the replay cost for every size.
        let mut ways = DecodeWays::default();
        ways.observe(Replays, 1, 1.1);
        assert_eq!(ways.choose(8), Batch);
    }

    #[test]
    fn the_cheaper_way_wins_by_the_rows_it_has() {
        // qwen2.5-1.5b Q4_K on an H100: a replay 1.1 ms, a batch 9-16 ms.
        let mut ways = DecodeWays::default();
        ways.observe(Replays, 1, 1.1);
        ways.observe(Batch, 4, 10.0);
        ways.observe(Batch, 16, 16.0);
        assert_eq!(ways.choose(4), Replays);
        assert_eq!(ways.choose(16), Batch, "16 × 1.1 ms is more than 16 ms");
        // llama-8B bf16: a replay 5.4 ms, a batch of 8 about 9 ms.
        let mut ways = DecodeWays::default();
        ways.observe(Replays, 1, 5.4);
        ways.observe(Batch, 8, 9.0);
        assert_eq!(ways.choose(8), Batch);
        assert_eq!(
            ways.choose(2),
            Batch,
            "a size not measured is measured first"
        );
    }

    #[test]
    fn most_steps_go_the_cheaper_way_and_probes_thin_out() {
        let mut ways = DecodeWays::default();
        ways.observe(Replays, 1, 1.1);
        let cost = |way| if way == Replays { 8.8 } else { 13.0 };
        let (replays, batches) = run(&mut ways, 8, 2000, cost);
        assert!(
            batches >= 3,
            "the batch is looked at again now and then: {batches}"
        );
        assert!(batches <= 12, "but seldom once it keeps losing: {batches}");
        assert_eq!(replays + batches, 2000);
    }

    #[test]
    fn a_first_measurement_that_misled_is_corrected_by_a_probe() {
        let mut ways = DecodeWays::default();
        ways.observe(Replays, 1, 5.4);
        // The first batch of 8 paid for cuBLAS picking its kernels: 400 ms.
        ways.observe(Batch, 8, 400.0);
        assert_eq!(ways.choose(8), Replays);
        let cost = |way| if way == Replays { 8.0 * 5.4 } else { 9.0 };
        let (_, batches) = run(&mut ways, 8, 200, cost);
        assert!(
            batches > 150,
            "the batch takes over once probed: {batches} of 200"
        );
        assert_eq!(ways.choose(8), Batch);
    }

    #[test]
    fn costs_that_cross_move_the_choice() {
        // The context grows: replays' attention grows with it until the batch is cheaper.
        let mut ways = DecodeWays::default();
        ways.observe(Replays, 1, 1.0);
        ways.observe(Batch, 6, 9.0);
        assert_eq!(ways.choose(6), Replays);
        let (_, batches) = run(
            &mut ways,
            6,
            300,
            |way| if way == Replays { 12.0 } else { 9.0 },
        );
        assert!(batches > 250, "{batches} of 300");
        assert_eq!(ways.choose(6), Batch);
    }

    #[test]
    fn nonsense_times_teach_nothing() {
        let mut ways = DecodeWays::default();
        ways.observe(Replays, 0, 1.0);
        ways.observe(Replays, 3, f64::NAN);
        ways.observe(Batch, 3, -1.0);
        assert_eq!(ways, DecodeWays::default());
    }
}
