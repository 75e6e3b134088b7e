//! The program every rank runs: one compute thread executing rank 0's steps, the tensor
//! work and the collectives in the same order on every rank.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use shoal_collectives::{CollectiveError, Group, Transport, f32s_from_bytes, f32s_to_bytes};
use shoal_model::{BatchPart, KvCache, Model, ModelError, ShardLinks, zigzag_pieces};

use crate::shard::{ShardSpec, Strategy};
use crate::step::{Logits, Part, Step};

mod decode_ways;
mod devices;

use decode_ways::{DecodeWay, DecodeWays};
use devices::{DeviceFacts, Reductions, reductions};

/// Why a rank stopped or a step failed.
#[derive(Debug, thiserror::Error)]
pub enum RankError {
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("tensor operation failed: {0}")]
    Tensor(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("cannot split the model: {0}")]
    Plan(String),
    #[error("invalid request: {0}")]
    Invalid(String),
}

impl From<candle_core::Error> for RankError {
    fn from(e: candle_core::Error) -> Self {
        Self::Tensor(shoal_model::candle_message(&e))
    }
}

pub type Result<T, E = RankError> = std::result::Result<T, E>;

/// How long a rank other than 0 waits for the next step. Long: a rank is idle between
/// requests; a dead or frozen rank 0 is still noticed in seconds by the heartbeats.
pub const IDLE_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);

/// The long prompt a GPU rank reads before it says it is ready ([`Rank::warm_up`]): past
/// the 128 rows from which a prompt's products take the dequantize-and-cuBLAS path.
const WARM_LONG_PROMPT: usize = 160;

/// What rank 0 still has to do for a step it started: a pipeline's rank 0 sends the
/// hidden rows on and is free for the next micro-batch while the later stages work.
#[derive(Debug)]
pub enum Pending {
    /// Finished here: the logits, if any were wanted.
    Done(Option<Tensor>),
    /// The last stage sends the hidden rows of the `rows` wanted positions; rank 0's head
    /// turns them into logits (`many`: the rows are several sequences').
    Head { rows: usize, many: bool },
}

/// One rank of a model instance: its shard, the KV caches of its sequences, its links.
pub struct Rank<T: Transport> {
    spec: ShardSpec,
    model: Arc<Model>,
    caches: HashMap<u64, KvCache>,
    group: Group<T>,
    /// NCCL between the GPUs of one machine, when every rank computes on one of them.
    gpus: Option<Gpus>,
    /// On a GPU rank that holds the whole model: what steps of decode rows cost each way.
    ways: DecodeWays,
}

/// An NCCL communicator with its watchdog; a build without NCCL has none.
#[cfg(feature = "nccl")]
type Gpus = (
    shoal_collectives::nccl::Communicator,
    shoal_collectives::nccl::Watchdog,
);
#[cfg(not(feature = "nccl"))]
type Gpus = std::convert::Infallible;

/// The model's view of the rank's links.
struct Links<'a, T: Transport> {
    group: &'a mut Group<T>,
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    gpus: Option<&'a Gpus>,
}

fn link_err(e: CollectiveError) -> ModelError {
    ModelError::Link(e.to_string())
}

impl<T: Transport> ShardLinks for Links<'_, T> {
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> shoal_model::Result<()> {
        self.group.all_reduce_sum(data).map_err(link_err)
    }

    #[cfg(feature = "nccl")]
    fn all_reduce_tensor(&mut self, t: Tensor) -> shoal_model::Result<Tensor> {
        match self.gpus {
            Some((comm, _)) => Ok(crate::nccl::all_reduce(comm, &t)?),
            None => shoal_model::all_reduce_through_host(self, t),
        }
    }

    fn ring_send(&mut self, data: &[f32]) -> shoal_model::Result<()> {
        let next = (self.group.rank() + 1) % self.group.world();
        self.group
            .send(next, &f32s_to_bytes(data))
            .map_err(link_err)
    }

    fn ring_recv(&mut self) -> shoal_model::Result<Vec<f32>> {
        let world = self.group.world();
        let prev = (self.group.rank() + world - 1) % world;
        let b = self.group.recv(prev).map_err(link_err)?;
        f32s_from_bytes(&b).map_err(|e| ModelError::Link(format!("rank {prev}: {e}")))
    }

    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn world(&self) -> usize {
        self.group.world()
    }
}

fn to_tensor(bytes: &[u8], rows: usize, cols: usize, from: usize) -> Result<Tensor> {
    let v = f32s_from_bytes(bytes).map_err(|e| RankError::Protocol(format!("rank {from}: {e}")))?;
    if v.len() != rows * cols {
        return Err(RankError::Protocol(format!(
            "rank {from} sent {} values, expected {rows}×{cols}",
            v.len()
        )));
    }
    Ok(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?)
}

fn to_bytes(t: &Tensor) -> Result<Vec<u8>> {
    Ok(f32s_to_bytes(
        &t.to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?,
    ))
}

impl<T: Transport> Rank<T> {
    pub fn new(spec: ShardSpec, model: impl Into<Arc<Model>>, group: Group<T>) -> Result<Self> {
        let model = model.into();
        if group.rank() != spec.rank || group.world() != spec.world {
            return Err(RankError::Plan(format!(
                "shard {} of {} on link rank {} of {}",
                spec.rank,
                spec.world,
                group.rank(),
                group.world()
            )));
        }
        Ok(Self {
            spec,
            model,
            caches: HashMap::new(),
            group,
            gpus: None,
            ways: DecodeWays::default(),
        })
    }

    /// Joins the GPUs of the ranks with NCCL when every rank computes on a GPU of this
    /// machine, for tensor parallelism; otherwise the reductions stay on the group.
    /// Every rank must call this at the same point (after `new`, before any step): the
    /// ranks exchange what they run on and all decide alike. Returns whether NCCL is on.
    pub fn connect_devices(&mut self) -> Result<bool> {
        let facts: Vec<Option<DeviceFacts>> = self
            .group
            .all_gather(&DeviceFacts::of(&self.model, self.spec.strategy).encode())?
            .iter()
            .map(|f| DeviceFacts::decode(f))
            .collect();
        let wanted = std::env::var("SHOAL_NCCL").map_or(true, |v| v != "0");
        match reductions(&facts, wanted) {
            Reductions::Host => return Ok(false),
            Reductions::HostInstead {
                all_nccl,
                distinct_gpus,
                wanted,
            } => {
                tracing::warn!(
                    all_nccl,
                    distinct_gpus,
                    wanted,
                    "every rank is on a GPU of this machine, but NCCL cannot join them; \
                     reducing through the host"
                );
                return Ok(false);
            }
            Reductions::Nccl => {}
        }
        #[cfg(feature = "nccl")]
        {
            let comm = crate::nccl::join(&mut self.group, &self.model.compute().device)?;
            let dog = comm.watch(self.group.health(), self.group.deadline())?;
            self.gpus = Some((comm, dog));
            Ok(true)
        }
        #[cfg(not(feature = "nccl"))]
        Ok(false)
    }

    /// On a GPU rank that holds the whole model, runs each kind of step once on scratch
    /// caches before the runner says it is ready: a prompt long enough for the many-row
    /// path (GGUF blocks dequantized for cuBLAS from 128 rows), a short one, a lone decode
    /// row (its captured graph), and a decode row beside a short and beside a long prompt
    /// slice. The driver compiles a kernel module's PTX on its first use, and cuBLAS sets
    /// itself up on its first product, inside whichever request comes first otherwise: on
    /// a fresh H100 the first step through a node waited 35 s; with only short prompts
    /// warmed, the first step of four 64-token prompts took 1.6 s on an H200; with no
    /// long slice beside a decode row warmed, such a first step took 3.9 s on an H100
    /// (whose warm-up itself took 42.6 s). Elsewhere (a CPU, a split model, whose steps
    /// need the other ranks) nothing is run.
    pub fn warm_up(&self) -> Result<()> {
        if self.spec.world != 1 || !self.model.compute().device.is_cuda() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let long = WARM_LONG_PROMPT.min(self.model.max_len().saturating_sub(2));
        let tokens: Vec<u32> = (0..long as u32).map(|i| 1 + i % 64).collect();
        self.model
            .forward(&tokens, &mut self.model.new_cache(), false)?;
        let mut cache = self.model.new_cache();
        self.model
            .forward(&[1, 2, 3, 4, 5, 6, 7, 8], &mut cache, false)?;
        let beside = cache.clone();
        self.model.forward(&[9], &mut cache, false)?;
        for prompt in [&[1, 2][..], &tokens[..]] {
            let (mut fresh, mut beside) = (self.model.new_cache(), beside.clone());
            let h = self.model.embed(&[prompt, &[9]].concat())?;
            let mut parts = [
                BatchPart {
                    cache: &mut fresh,
                    rows: prompt.len(),
                },
                BatchPart {
                    cache: &mut beside,
                    rows: 1,
                },
            ];
            let h = self.model.forward_layers_batch(h, &mut parts, None)?;
            self.model.head_each(&h)?;
        }
        tracing::info!(
            ms = started.elapsed().as_millis() as u64,
            "kernels warmed up before the first request"
        );
        Ok(())
    }

    pub fn spec(&self) -> &ShardSpec {
        &self.spec
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Positions sequence `seq` holds.
    pub fn len(&self, seq: u64) -> usize {
        self.caches.get(&seq).map_or(0, KvCache::len)
    }

    /// Sequences with a cache.
    pub fn sequences(&self) -> usize {
        self.caches.len()
    }

    /// Rank 0: checks the step, tells every rank, and executes it; returns the logits of
    /// a forward step.
    pub fn lead(&mut self, step: &Step) -> Result<Option<Tensor>> {
        let pending = self.start(step)?;
        self.finish(pending)
    }

    /// Rank 0: [`Rank::lead`] up to where rank 0's own share of the step is done. Steps
    /// started must be finished in the order they were started.
    pub fn start(&mut self, step: &Step) -> Result<Pending> {
        if self.spec.rank != 0 {
            return Err(RankError::Protocol("only rank 0 leads".into()));
        }
        // Refuse bad input here, before any rank starts: every rank would fail alike,
        // and a failed rank leaves the instance.
        match step {
            Step::Forward { seq, tokens, .. } => self.check_part(*seq, tokens)?,
            Step::Fork { from, to, len }
                if self.len(*from) < *len as usize || self.caches.contains_key(to) =>
            {
                return Err(RankError::Invalid(format!(
                    "cannot fork {len} positions of sequence {from} into {to}"
                )));
            }
            Step::Batch { parts } => {
                let mut seen = std::collections::HashSet::new();
                for p in parts {
                    if !seen.insert(p.seq) {
                        return Err(RankError::Invalid(format!(
                            "sequence {} twice in one batch",
                            p.seq
                        )));
                    }
                    self.check_part(p.seq, &p.tokens)?;
                }
            }
            _ => {}
        }
        let mut bytes = step.encode();
        self.group.broadcast(0, &mut bytes)?;
        self.execute(step)
    }

    /// Rank 0: the rest of a started step; its logits.
    pub fn finish(&mut self, pending: Pending) -> Result<Option<Tensor>> {
        match pending {
            Pending::Done(logits) => Ok(logits),
            Pending::Head { rows, many } => {
                let last = self.spec.world - 1;
                let b = self.group.recv(last)?;
                let c = self.model.compute();
                let h = to_tensor(&b, rows, self.model.config().hidden_size, last)?
                    .to_dtype(c.dtype)?
                    .to_device(&c.device)?;
                Ok(Some(self.logits_of_rows(&h, many)?))
            }
        }
    }

    /// Refuses what every rank would fail on alike: no tokens, a token outside the
    /// vocabulary, a sequence past the context.
    fn check_part(&self, seq: u64, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.config().vocab_size;
        if tokens.is_empty() {
            return Err(RankError::Invalid("no tokens to run".into()));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(RankError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let len = self.len(seq);
        if len + tokens.len() > self.model.max_len() {
            return Err(RankError::Invalid(format!(
                "sequence of {} positions exceeds the context of {}",
                len + tokens.len(),
                self.model.max_len()
            )));
        }
        Ok(())
    }

    /// Ranks other than 0: executes rank 0's steps until it says to shut down. Any
    /// failure ends the loop with an error (the instance is broken; the caller exits).
    pub fn follow(&mut self) -> Result<()> {
        loop {
            let mut bytes = Vec::new();
            self.group.broadcast_within(0, &mut bytes, IDLE_WAIT)?;
            let step = Step::decode(&bytes)
                .map_err(|e| RankError::Protocol(format!("rank 0 sent a bad step: {e}")))?;
            if step == Step::Shutdown {
                tracing::info!(rank = self.spec.rank, "shutting down");
                return Ok(());
            }
            self.execute(&step)?;
        }
    }

    fn execute(&mut self, step: &Step) -> Result<Pending> {
        match step {
            Step::Forward {
                seq,
                tokens,
                logits,
            } => self.execute_batch(&[Part {
                seq: *seq,
                tokens: tokens.clone(),
                logits: *logits,
                reserve: 0,
            }]),
            Step::Batch { parts } => self.execute_batch(parts),
            Step::Fork { from, to, len } => {
                let source = self
                    .caches
                    .get(from)
                    .ok_or_else(|| RankError::Protocol(format!("no sequence {from} to fork")))?;
                let copy = source.fork(*len as usize)?;
                self.caches.insert(*to, copy);
                Ok(Pending::Done(None))
            }
            Step::Reset { seq } => {
                if let Some(c) = self.caches.get_mut(seq) {
                    c.clear();
                }
                Ok(Pending::Done(None))
            }
            Step::Release { seq } => {
                self.caches.remove(seq);
                Ok(Pending::Done(None))
            }
            Step::Shutdown => Ok(Pending::Done(None)),
        }
    }

    /// One forward pass over the parts' new tokens; the wanted logits rows in part order.
    fn execute_batch(&mut self, parts: &[Part]) -> Result<Pending> {
        if parts.is_empty() {
            return Ok(Pending::Done(None));
        }
        let mut caches: Vec<KvCache> = parts
            .iter()
            .map(|p| {
                let mut cache = self
                    .caches
                    .remove(&p.seq)
                    .unwrap_or_else(|| self.model.new_cache());
                cache.reserve(p.reserve as usize);
                cache
            })
            .collect();
        let tokens: usize = parts.iter().map(|p| p.tokens.len()).sum();
        let _span =
            tracing::debug_span!("step", rank = self.spec.rank, parts = parts.len(), tokens)
                .entered();
        #[cfg(feature = "nccl")]
        if let Some((comm, _)) = &self.gpus {
            comm.step_started();
        }
        #[cfg(feature = "nccl")]
        let started = std::time::Instant::now();
        let result = match self.spec.strategy {
            Strategy::Pipeline => self.forward_pipeline(&mut caches, parts),
            Strategy::Tensor => self.forward_tensor(&mut caches, parts).map(Pending::Done),
            Strategy::Sequence => self
                .forward_sequence_batch(&mut caches, parts)
                .map(Pending::Done),
        };
        // NCCL work is queued on the GPU: wait for it, so that a step ends when its
        // reductions did, and an abort by the watchdog fails this step.
        #[cfg(feature = "nccl")]
        let result = match &self.gpus {
            Some((comm, _)) => {
                let queued = started.elapsed();
                let synced = comm
                    .stream()
                    .synchronize()
                    .map_err(|e| RankError::Tensor(format!("CUDA: {e}")));
                let finished = comm.step_finished().map_err(RankError::from);
                tracing::debug!(
                    rank = self.spec.rank,
                    tokens,
                    queued_us = queued.as_micros() as u64,
                    done_us = started.elapsed().as_micros() as u64,
                    "step on the GPU"
                );
                finished.and(synced).and(result)
            }
            None => result,
        };
        for (p, c) in parts.iter().zip(caches) {
            self.caches.insert(p.seq, c);
        }
        result
    }

    /// The logits of the rows `parts` want (none: nothing is computed).
    fn head_rows(&self, h: Tensor, parts: &[Part]) -> Result<Option<Tensor>> {
        match wanted_hidden(h, parts)? {
            Some(h) => Ok(Some(self.logits_of_rows(&h, parts.len() > 1)?)),
            None => Ok(None),
        }
    }

    /// The head over hidden rows: several sequences' last rows (`many`) each as it would
    /// be alone; one part's rows (a prompt scored whole) as one matmul.
    fn logits_of_rows(&self, h: &Tensor, many: bool) -> Result<Tensor> {
        Ok(if many {
            self.model.head_each(h)?
        } else {
            self.model.head(h)?
        })
    }

    /// The logits `want` asks for, of one sequence's rows.
    fn head(&self, h: Tensor, want: Logits) -> Result<Option<Tensor>> {
        let t = h.dim(0)?;
        let h = match want {
            Logits::None => return Ok(None),
            Logits::All => h,
            Logits::Last => h.narrow(0, t - 1, 1)?,
        };
        Ok(Some(self.model.head(&h)?))
    }

    /// Every part's cache and rows, for the model's batched forward.
    fn batch_parts<'c>(caches: &'c mut [KvCache], parts: &[Part]) -> Vec<BatchPart<'c>> {
        caches
            .iter_mut()
            .zip(parts)
            .map(|(cache, p)| BatchPart {
                cache,
                rows: p.tokens.len(),
            })
            .collect()
    }

    /// Hidden states flow rank 0 → 1 → … → last; the last rank sends rank 0 the hidden
    /// rows of the wanted positions, and rank 0's head makes their logits (a few KB a
    /// token, where logits rows are hundreds). Rank 0 is done with its share once it has
    /// sent its layers' output on: it can start the next micro-batch meanwhile.
    fn forward_pipeline(&mut self, caches: &mut [KvCache], parts: &[Part]) -> Result<Pending> {
        let (r, n) = (self.spec.rank, self.spec.world);
        let on_gpu = self.model.compute().device.is_cuda();
        let decode = decode_rows(n, parts, on_gpu).map(|rows| (rows, self.ways.choose(rows)));
        let started = std::time::Instant::now();
        if let Some((rows, DecodeWay::Replays)) = decode {
            let logits = self.replay_rows(caches, parts)?;
            self.learn_step(DecodeWay::Replays, rows, started)?;
            return Ok(Pending::Done(Some(logits)));
        }
        let t: usize = parts.iter().map(|p| p.tokens.len()).sum();
        let hidden = self.model.config().hidden_size;
        let h = if r == 0 {
            self.model.embed(&all_tokens(parts))?
        } else {
            let b = self.group.recv(r - 1)?;
            let c = self.model.compute();
            to_tensor(&b, t, hidden, r - 1)?
                .to_dtype(c.dtype)?
                .to_device(&c.device)?
        };
        let mut batch = Self::batch_parts(caches, parts);
        let h = self.model.forward_layers_batch(h, &mut batch, None)?;
        if r + 1 < n {
            self.group.send(r + 1, &to_bytes(&h)?)?;
            let rows = wanted_rows(parts).len();
            return Ok(if r == 0 && rows > 0 {
                Pending::Head {
                    rows,
                    many: parts.len() > 1,
                }
            } else {
                Pending::Done(None)
            });
        }
        if r == 0 {
            let logits = self.head_rows(h, parts)?;
            if let Some((rows, way)) = decode {
                self.learn_step(way, rows, started)?;
            }
            return Ok(Pending::Done(logits));
        }
        if let Some(h) = wanted_hidden(h, parts)? {
            self.group.send(0, &to_bytes(&h)?)?;
        }
        Ok(Pending::Done(None))
    }

    /// Each decode row through the model's single-token step (its captured graph, one
    /// replay a row) rather than the batched pass, whose projections are candle's launches
    /// (on an H100, a qwen2.5-1.5b Q4_K stream through the node took 9.1 ms a token that
    /// way against 1.1 ms for the replay). The logits rows in part order.
    fn replay_rows(&self, caches: &mut [KvCache], parts: &[Part]) -> Result<Tensor> {
        let rows = parts
            .iter()
            .zip(caches)
            .map(|(p, cache)| self.model.forward(&p.tokens, cache, false))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Tensor::cat(&rows, 0)?)
    }

    /// Waits for a step of decode rows to finish on the device and learns its cost (the
    /// wait costs nothing: the logits are read right after).
    fn learn_step(
        &mut self,
        way: DecodeWay,
        rows: usize,
        started: std::time::Instant,
    ) -> Result<()> {
        self.model.compute().device.synchronize()?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        self.ways.observe(way, rows, ms);
        tracing::debug!(?way, rows, ms, "decode rows on the GPU");
        Ok(())
    }

    /// Every rank runs its slice of every layer on the same hidden states; the partial
    /// outputs are summed by all-reduces inside the layers (one per half-layer for the
    /// whole batch). Rank 0 holds the head.
    fn forward_tensor(&mut self, caches: &mut [KvCache], parts: &[Part]) -> Result<Option<Tensor>> {
        let h = self.model.embed(&all_tokens(parts))?;
        let mut links = Links {
            group: &mut self.group,
            gpus: self.gpus.as_ref(),
        };
        let mut batch = Self::batch_parts(caches, parts);
        let h = self
            .model
            .forward_layers_batch(h, &mut batch, Some(&mut links))?;
        if self.spec.rank == 0 {
            return self.head_rows(h, parts);
        }
        Ok(None)
    }

    /// Parts long enough for ring attention run one at a time as a ring; the others
    /// (decode steps) run together, on every rank alike, without communication.
    fn forward_sequence_batch(
        &mut self,
        caches: &mut [KvCache],
        parts: &[Part],
    ) -> Result<Option<Tensor>> {
        let n = self.spec.world;
        let ring = |p: &Part| n > 1 && p.tokens.len() >= 2 * n;
        let mut out: Vec<Option<Tensor>> = vec![None; parts.len()];
        let short: Vec<usize> = (0..parts.len()).filter(|&i| !ring(&parts[i])).collect();
        if !short.is_empty() {
            let sub: Vec<Part> = short.iter().map(|&i| parts[i].clone()).collect();
            let mut sub_caches: Vec<KvCache> = short
                .iter()
                .map(|&i| std::mem::replace(&mut caches[i], KvCache::new(0, 0, 0)))
                .collect();
            let h = self.model.embed(&all_tokens(&sub))?;
            let mut batch = Self::batch_parts(&mut sub_caches, &sub);
            let result = self.model.forward_layers_batch(h, &mut batch, None);
            for (&i, c) in short.iter().zip(sub_caches) {
                caches[i] = c;
            }
            let h = result?;
            if self.spec.rank == 0
                && let Some(logits) = self.head_rows(h, &sub)?
            {
                let mut row = 0;
                for (&i, p) in short.iter().zip(&sub) {
                    let k = wanted_rows(std::slice::from_ref(p)).len();
                    if k > 0 {
                        out[i] = Some(logits.narrow(0, row, k)?);
                        row += k;
                    }
                }
            }
        }
        for i in (0..parts.len()).filter(|&i| ring(&parts[i])) {
            out[i] = self.forward_sequence(&mut caches[i], &parts[i].tokens, parts[i].logits)?;
        }
        let rows: Vec<Tensor> = out.into_iter().flatten().collect();
        Ok(if rows.is_empty() {
            None
        } else {
            Some(Tensor::cat(&rows, 0)?)
        })
    }

    /// Chunks of at least two positions per piece run as ring attention: every rank
    /// computes its zigzag pieces and the KV blocks travel around the ring. Shorter
    /// steps (decode) run on every rank alike, without communication: the caches are
    /// whole and identical on every rank.
    fn forward_sequence(
        &mut self,
        cache: &mut KvCache,
        tokens: &[u32],
        want: Logits,
    ) -> Result<Option<Tensor>> {
        let (r, n) = (self.spec.rank, self.spec.world);
        let t = tokens.len();
        if n == 1 || t < 2 * n {
            let h = self.model.embed(tokens)?;
            let h = self.model.forward_layers(h, cache)?;
            return if r == 0 { self.head(h, want) } else { Ok(None) };
        }
        let start = cache.len();
        let pieces = zigzag_pieces(start, t, r, n);
        let mine: Vec<u32> = pieces
            .iter()
            .flat_map(|p| tokens[p.start - start..p.end - start].iter().copied())
            .collect();
        let h = self.model.embed(&mine)?;
        let mut links = Links {
            group: &mut self.group,
            gpus: self.gpus.as_ref(),
        };
        let h = self
            .model
            .forward_layers_ring(h, &pieces, t, cache, &mut links)?;
        if want != Logits::All {
            // The last position is in the last piece, which rank 0 holds.
            return if r == 0 { self.head(h, want) } else { Ok(None) };
        }
        let logits = self.model.head(&h)?;
        if r != 0 {
            self.group.send(0, &to_bytes(&logits)?)?;
            return Ok(None);
        }
        let vocab = self.model.config().vocab_size;
        let mut rows: Vec<Option<Tensor>> = vec![None; t];
        let mut place = |pieces: &[std::ops::Range<usize>], logits: &Tensor| -> Result<()> {
            let mut i = 0;
            for p in pieces {
                for pos in p.clone() {
                    rows[pos - start] = Some(logits.narrow(0, i, 1)?);
                    i += 1;
                }
            }
            Ok(())
        };
        place(&pieces, &logits)?;
        for peer in 1..n {
            let theirs = zigzag_pieces(start, t, peer, n);
            let count: usize = theirs.iter().map(|p| p.len()).sum();
            let b = self.group.recv(peer)?;
            place(&theirs, &to_tensor(&b, count, vocab, peer)?)?;
        }
        let rows: Vec<Tensor> = rows
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| RankError::Protocol("a position's logits are missing".into()))?;
        Ok(Some(Tensor::cat(&rows, 0)?))
    }
}

/// The tokens of all parts, one part after another.
fn all_tokens(parts: &[Part]) -> Vec<u32> {
    parts
        .iter()
        .flat_map(|p| p.tokens.iter().copied())
        .collect()
}

/// The hidden rows whose logits `parts` want, in order (`None`: no part wants any).
fn wanted_hidden(h: Tensor, parts: &[Part]) -> Result<Option<Tensor>> {
    let rows = wanted_rows(parts);
    Ok(match rows[..] {
        [] => None,
        _ if rows.len() == h.dim(0)? => Some(h),
        [only] => Some(h.narrow(0, only as usize, 1)?),
        _ => {
            let idx = Tensor::new(rows.as_slice(), h.device())?;
            Some(h.index_select(&idx, 0)?)
        }
    })
}

/// How many rows a step has when it is decode rows only (one token each, logits wanted)
/// on a GPU rank that holds the whole model, which then chooses how to run them
/// ([`DecodeWays`]); `None` for every other step.
fn decode_rows(world: usize, parts: &[Part], on_gpu: bool) -> Option<usize> {
    let decoding = |p: &Part| p.tokens.len() == 1 && p.logits != Logits::None;
    (on_gpu && world == 1 && !parts.is_empty() && parts.iter().all(decoding)).then_some(parts.len())
}

/// The rows of a batch whose logits its parts want, in order.
fn wanted_rows(parts: &[Part]) -> Vec<u32> {
    let mut rows = Vec::new();
    let mut at = 0u32;
    for p in parts {
        let t = p.tokens.len() as u32;
        match p.logits {
            Logits::None => {}
            Logits::Last => rows.push(at + t - 1),
            Logits::All => rows.extend(at..at + t),
        }
        at += t;
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(tokens: usize, logits: Logits) -> Part {
        Part {
            seq: 1,
            tokens: vec![7; tokens],
            logits,
            reserve: 64,
        }
    }

    #[test]
    fn only_decode_rows_on_a_whole_model_gpu_rank_choose_their_way() {
        let decode = part(1, Logits::Last);
        assert_eq!(decode_rows(1, std::slice::from_ref(&decode), true), Some(1));
        assert_eq!(
            decode_rows(1, &[decode.clone(), part(1, Logits::All)], true),
            Some(2)
        );
        // A CPU rank, a split model, a prompt among them, no logits wanted, nothing: the batch.
        assert_eq!(decode_rows(1, std::slice::from_ref(&decode), false), None);
        assert_eq!(decode_rows(2, std::slice::from_ref(&decode), true), None);
        assert_eq!(
            decode_rows(1, &[decode.clone(), part(5, Logits::Last)], true),
            None
        );
        assert_eq!(
            decode_rows(1, &[decode.clone(), part(1, Logits::None)], true),
            None
        );
        assert_eq!(decode_rows(1, &[], true), None);
    }
}
