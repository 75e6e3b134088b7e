//! Causal attention of new rows against the cache, on the CPU in f32, as one custom op:
//! decode steps (one row) and prompt slices (many) alike.
//!
//! Each query row is computed by the same operations in the same order whatever else is
//! computed beside it: its scores against every key up to its own position (one dot
//! product each), their exponentials and sum, then the values weighted in position
//! order. A prompt row's result therefore does not depend on how its prompt was sliced
//! into steps, nor a decode row's on the batch: with the kernels' batch products equal to
//! their single-token ones, a sequence served among others gets what it gets alone.
//!
//! candle's path for this is a batched gemm with its packing, a scale, a mask, a softmax, a
//! second gemm, a copy of V to contiguous memory, reshapes and a transpose, each
//! allocating, and its sums run in an order that depends on the shapes. Here keys and
//! values are read where the cache keeps them (a view of its capacity), the query rows of
//! one KV head are taken in blocks so each key and value read from memory serves them all,
//! and the output comes out already as `(rows, heads · head_dim)`.

mod arith;
mod spread;

use arith::{Elem, dot, exp_minus, max_of, scores_of, weigh_values};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use half::f16;

/// `softmax(q·Kᵀ·scale + causal)·V` for `q` `(heads, t, head_dim)` and `k`, `v`
/// `(kv_heads, n, head_dim)`: query row `i` is at position `n − t + i` and sees keys
/// `0..=n − t + i`. Query heads are grouped by KV head (`heads = kv_heads · group`).
pub(crate) fn row_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    q.apply_op3_no_bwd(k, v, &RowAttention { scale })
}

/// Work (query rows × keys, over all heads) from which the blocks are shared among the
/// kernel threads.
const PARALLEL_FROM: usize = 8192;
/// The same for a batch's decode rows together ([`row_attention_many`]): their units are
/// already many (a KV head of a sequence each), so sharing pays from less work — a batch
/// of 8 short contexts (smollm2, ~80 keys) ran on one thread while the other waited.
const PARALLEL_MANY_FROM: usize = 2048;
/// Query positions per block: with the group's heads, the queries one key serves.
const BLOCK_ROWS: usize = 8;

struct RowAttention {
    scale: f32,
}

/// One thread's buffers for a block of queries.
#[derive(Default)]
struct Scratch {
    /// (head, row, keys it sees).
    queries: Vec<(usize, usize, usize)>,
    scores: Vec<f32>,
    outs: Vec<f32>,
}

/// A `(a, b, c)` tensor of `T` whose last dimension is contiguous: base offset and the
/// strides of the first two dimensions.
struct View<'a, T = f32> {
    data: &'a [T],
    dims: [usize; 3],
    offset: usize,
    strides: [usize; 2],
}

impl<'a, T: Elem> View<'a, T> {
    fn new(storage: &'a CpuStorage, layout: &Layout, what: &str) -> Result<Self> {
        let data = storage.as_slice::<T>()?;
        let (dims, stride) = (layout.dims(), layout.stride());
        if dims.len() != 3 || stride[2] != 1 {
            candle_core::bail!(
                "row attention: {what} must be (_, _, head_dim) with unit stride, got {dims:?} / {stride:?}"
            );
        }
        let view = Self {
            data,
            dims: [dims[0], dims[1], dims[2]],
            offset: layout.start_offset(),
            strides: [stride[0], stride[1]],
        };
        let last = view.at(dims[0].saturating_sub(1), dims[1].saturating_sub(1)) + dims[2];
        if dims.iter().product::<usize>() > 0 && last > data.len() {
            candle_core::bail!("row attention: {what} reaches past its storage");
        }
        Ok(view)
    }

    fn at(&self, i: usize, j: usize) -> usize {
        self.offset + i * self.strides[0] + j * self.strides[1]
    }

    fn row(&self, i: usize, j: usize) -> &'a [T] {
        let at = self.at(i, j);
        &self.data[at..at + self.dims[2]]
    }
}

/// Keys and values as the cache keeps them.
enum KeysValues<'a> {
    F32(View<'a, f32>, View<'a, f32>),
    F16(View<'a, f16>, View<'a, f16>),
    /// 8-bit rows (`crate::kv8`): the views' rows are the values, their scales after them.
    Q8(View<'a, u8>, View<'a, u8>),
}

impl<'a> View<'a, u8> {
    /// The view of 8-bit rows `(_, _, head_dim + 4)` as rows of their `head_dim` values.
    fn of_values(mut self, what: &str) -> Result<Self> {
        self.dims[2] = match self.dims[2].checked_sub(crate::kv8::SCALE_BYTES) {
            Some(hd) if hd > 0 => hd,
            _ => candle_core::bail!("row attention: 8-bit {what} rows hold no values"),
        };
        Ok(self)
    }
}

impl<'a> KeysValues<'a> {
    fn new(
        (ks, kl): (&'a CpuStorage, &Layout),
        (vs, vl): (&'a CpuStorage, &Layout),
    ) -> Result<Self> {
        Ok(match (ks, vs) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => {
                Self::F32(View::new(ks, kl, "k")?, View::new(vs, vl, "v")?)
            }
            (CpuStorage::F16(_), CpuStorage::F16(_)) => {
                Self::F16(View::new(ks, kl, "k")?, View::new(vs, vl, "v")?)
            }
            (CpuStorage::U8(_), CpuStorage::U8(_)) => Self::Q8(
                View::new(ks, kl, "k")?.of_values("k")?,
                View::new(vs, vl, "v")?.of_values("v")?,
            ),
            _ => candle_core::bail!(
                "row attention: keys {:?} and values {:?} must both be f32, f16 or 8-bit",
                ks.dtype(),
                vs.dtype()
            ),
        })
    }

    /// `(kv_heads, n, head_dim)` of the keys and of the values.
    fn dims(&self) -> ([usize; 3], [usize; 3]) {
        match self {
            Self::F32(k, v) => (k.dims, v.dims),
            Self::F16(k, v) => (k.dims, v.dims),
            Self::Q8(k, v) => (k.dims, v.dims),
        }
    }
}

/// One sequence's attention: the views, its shape, and how its work is cut into units
/// (a block of rows and some of a KV head's query heads).
struct Problem<'a> {
    q: View<'a>,
    kv: KeysValues<'a>,
    heads: usize,
    t: usize,
    hd: usize,
    n: usize,
    group: usize,
    blocks_per_head: usize,
    heads_per_unit: usize,
    slices: usize,
    units: usize,
}

impl<'a> Problem<'a> {
    /// `split_heads`: one query head per unit (for a decode step alone, to keep the
    /// threads evenly busy); otherwise all of a KV head's (each key read serves them all).
    /// A query's arithmetic is the same either way.
    fn new(q: View<'a>, kv: KeysValues<'a>, split_heads: bool) -> Result<Self> {
        let [heads, t, hd] = q.dims;
        let (kdims, vdims) = kv.dims();
        let [kv_heads, n, khd] = kdims;
        if t == 0 || t > n || khd != hd || vdims != kdims || kv_heads == 0 || heads % kv_heads != 0
        {
            candle_core::bail!(
                "row attention: q {:?}, k {kdims:?}, v {vdims:?} do not fit",
                q.dims
            );
        }
        let group = heads / kv_heads;
        let blocks_per_head = t.div_ceil(BLOCK_ROWS);
        let heads_per_unit = if split_heads { 1 } else { group };
        let slices = group / heads_per_unit;
        Ok(Self {
            q,
            kv,
            heads,
            t,
            hd,
            n,
            group,
            blocks_per_head,
            heads_per_unit,
            slices,
            units: kv_heads * blocks_per_head * slices,
        })
    }

    /// Work of the whole problem (query rows × keys × heads).
    fn work(&self) -> usize {
        self.t * self.n * self.heads
    }

    /// Computes unit `unit` into `out` (`(t, heads · hd)`, owned by the caller; each
    /// unit writes its own rows and heads).
    fn block(&self, unit: usize, scale: f32, scratch: &mut Scratch, out: *mut f32) {
        match &self.kv {
            KeysValues::F32(k, v) => self.block_over(k, v, unit, scale, scratch, out),
            KeysValues::F16(k, v) => self.block_over(k, v, unit, scale, scratch, out),
            KeysValues::Q8(k, v) => self.block_over(k, v, unit, scale, scratch, out),
        }
    }

    /// [`Problem::block`] over keys and values kept as `T`.
    fn block_over<T: Elem>(
        &self,
        k: &View<T>,
        v: &View<T>,
        unit: usize,
        scale: f32,
        scratch: &mut Scratch,
        out: *mut f32,
    ) {
        let q = &self.q;
        let (t, n, hd, heads, group) = (self.t, self.n, self.hd, self.heads, self.group);
        let (slices, heads_per_unit) = (self.slices, self.heads_per_unit);
        let (kvh, rest) = (
            unit / (self.blocks_per_head * slices),
            unit % (self.blocks_per_head * slices),
        );
        let (i0, slice) = ((rest / slices) * BLOCK_ROWS, rest % slices);
        let rows = (t - i0).min(BLOCK_ROWS);
        // Queries of the block: (head, row), each seeing `n − t + row + 1` keys.
        scratch.queries.clear();
        let first = kvh * group + slice * heads_per_unit;
        for h in first..first + heads_per_unit {
            for i in i0..i0 + rows {
                scratch.queries.push((h, i, n - t + i + 1));
            }
        }
        let queries = &scratch.queries;
        let qrows: Vec<&[f32]> = queries.iter().map(|&(h, i, _)| q.row(h, i)).collect();
        let longest = n - t + i0 + rows;
        let scores = &mut scratch.scores;
        scores.clear();
        scores.resize(queries.len() * longest, 0.0);
        let factor = |j: usize| key_factor(k, kvh, j, scale);
        if hd.is_multiple_of(8) {
            for j0 in (0..longest).step_by(8) {
                let put = |b: usize, j: usize, s: f32| scores[b * longest + j] = s;
                score_eight(&qrows, |b| queries[b].2, k, kvh, j0, longest, scale, put);
            }
        } else {
            for j in 0..longest {
                let key = k.row(kvh, j);
                for (a, (qr, &(_, _, seen))) in qrows.iter().zip(queries).enumerate() {
                    if j < seen {
                        scores[a * longest + j] = dot(qr, key) * factor(j);
                    }
                }
            }
        }
        let outs = &mut scratch.outs;
        outs.clear();
        outs.resize(queries.len() * hd, 0.0);
        for (a, &(_, _, seen)) in queries.iter().enumerate() {
            let row = &mut scores[a * longest..a * longest + seen];
            normalize(row, v, kvh);
            weigh_values(&mut outs[a * hd..(a + 1) * hd], row, v, kvh);
        }
        for (a, &(h, i, _)) in queries.iter().enumerate() {
            // SAFETY: row `i`, head `h` of the output belongs to this block alone (the
            // caller's contract); `out` holds `t · heads · hd` floats.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    outs[a * hd..].as_ptr(),
                    out.add((i * heads + h) * hd),
                    hd,
                )
            };
        }
    }
}

/// The scores of `queries` (query `b` sees the first `seen(b)` keys) against the eight
/// keys of KV head `kvh` from `j0` (the last of the `keys` repeated past them): the
/// queries in twos (threes where their count is odd), each group's scores from one pass
/// over the keys; `put(b, j, score)` for every key a query sees.
#[allow(clippy::too_many_arguments)]
fn score_eight<T: Elem>(
    queries: &[&[f32]],
    seen: impl Fn(usize) -> usize,
    k: &View<T>,
    kvh: usize,
    j0: usize,
    keys: usize,
    scale: f32,
    mut put: impl FnMut(usize, usize, f32),
) {
    let at = |c: usize| (j0 + c).min(keys - 1);
    let rows: [&[T]; 8] = std::array::from_fn(|c| k.row(kvh, at(c)));
    let factors: [f32; 8] = std::array::from_fn(|c| key_factor(k, kvh, at(c), scale));
    let mut a = 0;
    while a < queries.len() {
        let take = match queries.len() - a {
            1 => 1,
            3 => 3,
            _ => 2,
        };
        if (a..a + take).any(|b| j0 < seen(b)) {
            let got = scores_of(&queries[a..a + take], rows);
            for (b, got) in (a..a + take).zip(got) {
                let end = seen(b).min(j0 + 8);
                for ((j, g), f) in (j0..end).zip(got).zip(factors) {
                    put(b, j, g * f);
                }
            }
        }
        a += take;
    }
}

/// What key `j`'s dot product with a query is multiplied by to make its score: `scale`,
/// times the row's own scale where the rows are 8-bit.
fn key_factor<T: Elem>(k: &View<T>, kvh: usize, j: usize, scale: f32) -> f32 {
    if T::SCALED {
        T::row_scale(k, kvh, j) * scale
    } else {
        scale
    }
}

/// A query's scores over the keys it sees into the weights of their values: the softmax,
/// and where the rows are 8-bit, each value row's scale folded into its weight.
fn normalize<T: Elem>(row: &mut [f32], v: &View<T>, kvh: usize) {
    let inv = 1.0 / exp_minus(row, max_of(row));
    for s in row.iter_mut() {
        *s *= inv;
    }
    if T::SCALED {
        for (j, s) in row.iter_mut().enumerate() {
            *s *= T::row_scale(v, kvh, j);
        }
    }
}

/// The queries `q` as the keys are kept: 8-bit keys are rotated (`crate::kv8`), so the
/// queries take the same rotation, which leaves each score as it was (a copy in `store`);
/// otherwise `q` itself.
fn turned<'a>(q: View<'a>, kv: &KeysValues, store: &'a mut Vec<f32>) -> View<'a> {
    let [heads, t, hd] = q.dims;
    if !matches!(kv, KeysValues::Q8(..)) || !crate::kv8::rotates(hd) {
        return q;
    }
    store.clear();
    store.reserve(heads * t * hd);
    for h in 0..heads {
        for i in 0..t {
            store.extend_from_slice(q.row(h, i));
        }
    }
    store.chunks_exact_mut(hd).for_each(crate::kv8::hadamard);
    let store: &'a Vec<f32> = store;
    View {
        data: store,
        dims: q.dims,
        offset: 0,
        strides: [t * hd, hd],
    }
}

fn cpu(s: &candle_core::Storage) -> Result<&CpuStorage> {
    match s {
        candle_core::Storage::Cpu(c) => Ok(c),
        _ => candle_core::bail!("row attention runs on the CPU"),
    }
}

/// Runs `units` (numbered `0..units`) over the kernel threads, or on this thread alone
/// when `parallel` is false: in shares of about equal cost when `cost` (a unit's cost,
/// by number) is given, else of equal count.
fn share_out(
    units: usize,
    parallel: bool,
    cost: Option<&dyn Fn(usize) -> usize>,
    unit: &(dyn Fn(usize, &mut Scratch) + Sync),
) {
    let pool = shoal_kernels::ThreadPool::global();
    let threads = if parallel && pool.size() > 1 {
        pool.size().min(units)
    } else {
        1
    };
    // Thread i takes units bounds[i]..bounds[i + 1].
    let bounds: Vec<usize> = match cost {
        Some(cost) if threads > 1 => {
            let costs: Vec<usize> = (0..units).map(cost).collect();
            let total: usize = costs.iter().sum();
            let mut bounds = vec![0];
            let mut acc = 0;
            for (u, c) in costs.iter().enumerate() {
                acc += c;
                if bounds.len() < threads && acc * threads >= total * bounds.len() {
                    bounds.push(u + 1);
                }
            }
            bounds.resize(threads + 1, units);
            bounds
        }
        _ => {
            let per = units.div_ceil(threads.max(1));
            (0..=threads).map(|i| (i * per).min(units)).collect()
        }
    };
    let run = |thread: usize| {
        let mut scratch = Scratch::default();
        for u in bounds[thread]..bounds[thread + 1] {
            unit(u, &mut scratch);
        }
    };
    if threads > 1 {
        pool.run(&|i| {
            if i < threads {
                run(i)
            }
        });
    } else {
        run(0);
    }
}

/// [`row_attention`] of several sequences at once (a batch's decode rows): each as it is
/// alone, bit for bit, their units shared out among the kernel threads together, where
/// one decode row alone is too little work to share. Each item is `(q, k, v)` as
/// [`row_attention`] takes them.
pub(crate) fn row_attention_many(
    items: &[(&Tensor, &Tensor, &Tensor)],
    scale: f32,
) -> Result<Vec<Tensor>> {
    let guards: Vec<_> = items
        .iter()
        .map(|(q, k, v)| {
            (
                q.storage_and_layout(),
                k.storage_and_layout(),
                v.storage_and_layout(),
            )
        })
        .collect();
    let mut stores: Vec<Vec<f32>> = items.iter().map(|_| Vec::new()).collect();
    let mut problems = Vec::with_capacity(items.len());
    for (((qs, ql), (ks, kl), (vs, vl)), store) in guards.iter().zip(&mut stores) {
        let kv = KeysValues::new((cpu(ks)?, kl), (cpu(vs)?, vl))?;
        let q = turned(View::new(cpu(qs)?, ql, "q")?, &kv, store);
        problems.push(Problem::new(q, kv, false)?);
    }
    let mut outs: Vec<Vec<f32>> = problems
        .iter()
        .map(|p| vec![0f32; p.t * p.heads * p.hd])
        .collect();
    let addrs: Vec<usize> = outs.iter_mut().map(|o| o.as_mut_ptr() as usize).collect();
    // Unit u of the whole batch: problem `owner[u]`'s unit `u − first[owner[u]]`.
    let mut first = Vec::with_capacity(problems.len());
    let mut total = 0;
    for p in &problems {
        first.push(total);
        total += p.units;
    }
    let work: usize = problems.iter().map(Problem::work).sum();
    let owner = |u: usize| first.partition_point(|&f| f <= u) - 1;
    // A unit's cost: the keys its rows see.
    let cost = |u: usize| problems[owner(u)].n + BLOCK_ROWS;
    share_out(
        total,
        work >= PARALLEL_MANY_FROM,
        Some(&cost),
        &|u, scratch| {
            let i = owner(u);
            problems[i].block(u - first[i], scale, scratch, addrs[i] as *mut f32);
        },
    );
    drop(problems);
    drop(guards);
    outs.into_iter()
        .zip(items)
        .map(|(o, (q, _, _))| {
            let [heads, t, hd] = [q.dim(0)?, q.dim(1)?, q.dim(2)?];
            Tensor::from_vec(o, (t, heads * hd), q.device())
        })
        .collect()
}

/// [`row_attention`] of every item: those with work enough to share on their own one at
/// a time, the small ones (decode rows) together through [`row_attention_many`].
pub(crate) fn row_attention_each(
    items: &[(&Tensor, &Tensor, &Tensor)],
    scale: f32,
) -> Result<Vec<Tensor>> {
    let work = |(q, k, _): &(&Tensor, &Tensor, &Tensor)| -> Result<usize> {
        Ok(q.dim(0)? * q.dim(1)? * k.dim(1)?)
    };
    let mut small = Vec::new();
    let mut outs: Vec<Option<Tensor>> = vec![None; items.len()];
    for (i, item) in items.iter().enumerate() {
        if work(item)? >= PARALLEL_FROM {
            outs[i] = Some(row_attention(item.0, item.1, item.2, scale)?);
        } else {
            small.push(i);
        }
    }
    let many: Vec<_> = small.iter().map(|&i| items[i]).collect();
    for (&i, o) in small.iter().zip(row_attention_many(&many, scale)?) {
        outs[i] = Some(o);
    }
    Ok(outs.into_iter().flatten().collect())
}

impl CustomOp3 for RowAttention {
    fn name(&self) -> &'static str {
        "row-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let kv = KeysValues::new((ks, kl), (vs, vl))?;
        let mut store = Vec::new();
        let q = turned(View::new(qs, ql, "q")?, &kv, &mut store);
        let pool = shoal_kernels::ThreadPool::global();
        let [heads, t, _] = q.dims;
        let [kv_heads, n, _] = kv.dims().0;
        let parallel = t * n * heads >= PARALLEL_FROM && pool.size() > 1;
        // Too few blocks to keep the threads evenly busy (a decode step): a head a unit.
        let split_heads = parallel && kv_heads * t.div_ceil(BLOCK_ROWS) < 4 * pool.size();
        let p = Problem::new(q, kv, split_heads)?;
        let mut out = vec![0f32; p.t * p.heads * p.hd];
        if parallel && spread::applies(&p) {
            spread::attend(&p, self.scale, &mut out);
            return Ok((CpuStorage::F32(out), Shape::from((p.t, p.heads * p.hd))));
        }
        let out_addr = out.as_mut_ptr() as usize;
        share_out(p.units, parallel, None, &|u, scratch| {
            p.block(u, self.scale, scratch, out_addr as *mut f32)
        });
        Ok((CpuStorage::F32(out), Shape::from((p.t, p.heads * p.hd))))
    }
}

#[cfg(test)]
mod tests;
