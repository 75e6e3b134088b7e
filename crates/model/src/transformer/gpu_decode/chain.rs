//! Greedy decoding with the device feeding itself.
//!
//! A step of [`DecodePlan::step`] waits on the host between tokens: the host reads the
//! token's id back, looks its embedding row up, copies the row in, and only then launches
//! the next replay. The GPU idles through all of it, ~0.1 ms a token on llama-8B
//! (docs/GPU.md, "Inside the replayed graph"). A chained step begins with the embedding of
//! the token the step before it chose (`shoal_embed_token`, over the vocabulary's rows
//! held on the device) and ends with its own arg-max into that token's buffer. The host
//! queues step k + 1 before it reads token k back, so its work for a token overlaps the
//! device's work on the next. Stopping after token k wastes at most step k + 1, whose key
//! and value land past the cache's length.

use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaGraph, CudaSlice, PinnedHostSlice};
use candle_core::{DType, Device, Tensor};

use crate::Result;

use super::argmax::THREADS as ARGMAX_THREADS;
use super::kernels::cfg;
use super::weights::tensor_ptr;
use super::{CacheKey, DecodePlan, GRAPHS_KEPT, gpu_err};

/// Tokens whose rows are looked up (on the host) at a time while the table is built.
const TABLE_CHUNK: usize = 2048;

/// What chained steps add to a plan, built on the first chained decode.
pub(super) struct Chain {
    /// The vocabulary's embedding rows `(vocab, hidden)` on the device: bf16 where every
    /// value is one (a bf16 model's), else f32, so a row is the host's exactly.
    _table: Tensor,
    table: u64,
    bf16_rows: i32,
    /// The token a step embeds, and the one its arg-max chose.
    token: CudaSlice<u32>,
    token_ptr: u64,
    /// Two page-locked slots the chosen tokens come back through, one step apart, and
    /// the events that say each copy has landed. The slots' own events cannot: cudarc
    /// records them only while it manages the streams' synchronization, which candle
    /// turns off, so their reads would not wait.
    slots: [PinnedHostSlice<u32>; 2],
    landed: [CudaEvent; 2],
    graphs: Vec<(CacheKey, CudaGraph)>,
}

impl Chain {
    /// The table from `rows` (the host's f32 embedding rows of the given tokens), and the
    /// buffers.
    pub(super) fn new(
        plan: &DecodePlan,
        device: &Device,
        rows: &dyn Fn(&[u32]) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        let (vocab, hidden) = (plan.vocab as usize, plan.hidden as usize);
        let table = match bf16_table(vocab, hidden, rows)? {
            Some(bits) => Tensor::from_vec(bits, (vocab, hidden), &Device::Cpu)?,
            None => {
                let mut all = Vec::with_capacity(vocab * hidden);
                for chunk in token_chunks(vocab) {
                    all.extend(rows(&chunk)?);
                }
                Tensor::from_vec(all, (vocab, hidden), &Device::Cpu)?
            }
        }
        .to_device(device)?;
        let stream = &plan.stream;
        let token = stream.alloc_zeros::<u32>(1).map_err(gpu_err)?;
        let token_ptr = {
            use candle_core::cuda_backend::cudarc::driver::DevicePtr;
            token.device_ptr(stream).0
        };
        let slot = || {
            // SAFETY: a slot is read only after a copy into it has completed (its event).
            // Flags 0: cached host memory (the default write-combined memory is slow to read).
            unsafe { stream.context().alloc_pinned_with_flags::<u32>(1, 0) }.map_err(gpu_err)
        };
        // Waited on by spinning (the host has nothing else to do by then): no wake-up.
        let event = || stream.context().new_event(None).map_err(gpu_err);
        Ok(Self {
            table: tensor_ptr(&table, stream)?,
            bf16_rows: i32::from(table.dtype() == DType::BF16),
            _table: table,
            token,
            token_ptr,
            slots: [slot()?, slot()?],
            landed: [event()?, event()?],
            graphs: Vec::new(),
        })
    }
}

fn token_chunks(vocab: usize) -> impl Iterator<Item = Vec<u32>> {
    (0..vocab)
        .step_by(TABLE_CHUNK)
        .map(move |start| (start as u32..(start + TABLE_CHUNK).min(vocab) as u32).collect())
}

/// The table in bf16, or `None` where some value is not exactly a bf16 one.
fn bf16_table(
    vocab: usize,
    hidden: usize,
    rows: &dyn Fn(&[u32]) -> Result<Vec<f32>>,
) -> Result<Option<Vec<half::bf16>>> {
    let mut bits = Vec::with_capacity(vocab * hidden);
    for chunk in token_chunks(vocab) {
        for v in rows(&chunk)? {
            let b = half::bf16::from_f32(v);
            if b.to_f32() != v {
                return Ok(None);
            }
            bits.push(b);
        }
    }
    Ok(Some(bits))
}

impl DecodePlan {
    /// Whether chained steps are ready, building what they need on the first call;
    /// false (logged) where that failed, e.g. the table did not fit on the device.
    pub(super) fn chain_ready(
        &mut self,
        device: &Device,
        rows: &dyn Fn(&[u32]) -> Result<Vec<f32>>,
    ) -> bool {
        if self.chain.is_none() && !self.chain_failed {
            match Chain::new(self, device, rows) {
                Ok(chain) => self.chain = Some(chain),
                Err(e) => {
                    tracing::info!(error = %e, "greedy decoding steps one token at a time");
                    self.chain_failed = true;
                }
            }
        }
        self.chain.is_some()
    }

    /// Greedy decoding of up to `n` tokens after `token` at position `pos`, keys and
    /// values into `layers` (which hold at least `pos + n` positions): `sink` gets each
    /// chosen token as soon as the host has it and says whether to go on. Returns the
    /// tokens `sink` got, which is also how many positions the cache gained.
    pub(super) fn greedy(
        &mut self,
        token: u32,
        pos: usize,
        layers: &[(Tensor, Tensor)],
        n: usize,
        sink: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        if n == 0 {
            return Ok(0);
        }
        let cache = self.cache_key(layers)?;
        let chain = self.chain.as_ref().ok_or_else(|| gpu_err("no chain"))?;
        let at = match chain.graphs.iter().position(|(k, _)| *k == cache) {
            Some(i) => i,
            None => {
                let graph = self.capture_with(|| self.record_chained(&cache))?;
                let chain = self.chain.as_mut().ok_or_else(|| gpu_err("no chain"))?;
                if chain.graphs.len() == GRAPHS_KEPT {
                    chain.graphs.remove(0);
                }
                chain.graphs.push((cache, graph));
                chain.graphs.len() - 1
            }
        };
        let stream = self.stream.clone();
        let chain = self.chain.as_mut().ok_or_else(|| gpu_err("no chain"))?;
        stream
            .memcpy_htod(&[token], &mut chain.token)
            .map_err(gpu_err)?;
        // The first step's embedding kernel moves the position on to `pos`.
        stream
            .memcpy_htod(&[pos as i32 - 1], &mut self.bufs.pos)
            .map_err(gpu_err)?;
        let Chain {
            token,
            slots,
            landed,
            graphs,
            ..
        } = chain;
        let graph = &graphs[at].1;
        let queue = |slot: &mut PinnedHostSlice<u32>, landed: &CudaEvent| -> Result<()> {
            graph.launch().map_err(gpu_err)?;
            stream.memcpy_dtoh(token, slot).map_err(gpu_err)?;
            landed.record(&stream).map_err(gpu_err)
        };
        queue(&mut slots[0], &landed[0])?;
        for k in 0..n {
            let ahead = k + 1 < n;
            if ahead {
                let i = (k + 1) % 2;
                queue(&mut slots[i], &landed[i])?;
            }
            landed[k % 2].synchronize().map_err(gpu_err)?;
            let next = slots[k % 2].as_slice().map_err(gpu_err)?[0];
            if !sink(next) {
                if ahead {
                    // Step k + 1 still runs: nothing it writes may be freed under it.
                    stream.synchronize().map_err(gpu_err)?;
                }
                return Ok(k + 1);
            }
        }
        Ok(n)
    }

    /// A chained step: the embedding of the chosen token, the layers and head, the
    /// arg-max back into the token's buffer.
    fn record_chained(&self, cache: &CacheKey) -> Result<()> {
        let chain = self.chain.as_ref().ok_or_else(|| gpu_err("no chain"))?;
        let hidden = self.hidden;
        let blocks = (hidden as u32).div_ceil(256);
        self.chained.set(Some(false));
        let recorded = self
            .launch(
                &self.kernels.embed_token,
                cfg((blocks, 1), 256, 0),
                &[
                    &chain.table,
                    &chain.bf16_rows,
                    &chain.token_ptr,
                    &self.at.pos,
                    &self.at.x,
                    &hidden,
                ],
            )
            .and_then(|()| self.record_layers(cache));
        // The arg-max does not wait for the kernel ahead in `begin_step`: an ordinary
        // launch, after the head has finished.
        self.chained.set(None);
        recorded?;
        let vocab = self.vocab;
        let stride = i64::from(vocab);
        self.launch(
            &self.kernels.argmax,
            cfg((1, 1), ARGMAX_THREADS, 0),
            &[&self.at.logits, &vocab, &stride, &chain.token_ptr],
        )
    }
}
