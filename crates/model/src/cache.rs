//! The KV cache of one sequence, kept outside the layers so the engine owns its lifetime.

use candle_core::{DType, Device, Tensor};

use crate::Result;
use crate::kv8::{self, Part};

/// Zeroed storage for keys or values. f16 on a CPU comes from zeroed pages as f32 does
/// (candle fills an f16 tensor element by element: ~100 MB of a long prompt's cache
/// written in one step stalled every stream beside it by ~80 ms).
fn zeros(shape: (usize, usize, usize), dtype: DType, device: &Device) -> Result<Tensor> {
    use half::vec::HalfBitsVecExt;
    if device.is_cpu() && dtype == DType::F16 {
        let bits = vec![0u16; shape.0 * shape.1 * shape.2];
        return Ok(Tensor::from_vec(
            bits.reinterpret_into::<half::f16>(),
            shape,
            device,
        )?);
    }
    Ok(Tensor::zeros(shape, dtype, device)?)
}

/// The type a model computing in `dtype` on `device` keeps its keys and values in: f16
/// where the CPU computes in f32 (half the memory a sequence holds and half the bytes a
/// decode step's attention reads, which at a few hundred positions are more than the
/// weights of a small model; the row attention widens them exactly as it loads them),
/// unless `SHOAL_KV=f32` or the kernels are the dense reference (`SHOAL_KERNELS=dense`,
/// which rounds no activation); `SHOAL_KV=q8` keeps them in 8 bits (`U8`: the rows of
/// [`crate::kv8`]); elsewhere the compute type itself.
pub fn kv_dtype(device: &Device, dtype: DType) -> DType {
    let asked = std::env::var("SHOAL_KV").ok();
    let dense = crate::KernelChoice::from_env() == crate::KernelChoice::Dense;
    if !device.is_cpu() || dtype != DType::F32 || dense {
        return dtype;
    }
    match asked.as_deref() {
        Some("f32") => DType::F32,
        Some("q8") => DType::U8,
        None | Some("f16") => DType::F16,
        Some(other) => {
            tracing::warn!(asked = other, "SHOAL_KV is f16, f32 or q8; keeping f16");
            DType::F16
        }
    }
}

/// Keys and values of one layer: `(num_kv_heads, capacity, head_dim)`, grown by doubling.
#[derive(Debug, Clone)]
struct LayerCache {
    k: Tensor,
    v: Tensor,
}

/// Per-sequence KV cache for a range of layers (a shard holds only its own).
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<Option<LayerCache>>,
    first_layer: usize,
    len: usize,
    max_len: usize,
    /// Positions the sequence is expected to reach: storage grows to them at once, so a
    /// long prompt is not copied again each time it doubles (a step that copies a cache of
    /// thousands of positions in every layer stalls every stream in the batch).
    reserve: usize,
    device: Device,
    dtype: DType,
}

impl KvCache {
    /// A cache for layers `first_layer..first_layer + num_layers` of a model, holding at most
    /// `max_len` positions.
    pub fn new(first_layer: usize, num_layers: usize, max_len: usize) -> Self {
        Self::new_on(first_layer, num_layers, max_len, &Device::Cpu, DType::F32)
    }

    /// [`KvCache::new`] with the keys and values on `device`, kept in `dtype` (whatever
    /// type [`KvCache::append`] is given, they are stored in this one).
    pub fn new_on(
        first_layer: usize,
        num_layers: usize,
        max_len: usize,
        device: &Device,
        dtype: DType,
    ) -> Self {
        Self {
            layers: vec![None; num_layers],
            first_layer,
            len: 0,
            max_len,
            reserve: 0,
            device: device.clone(),
            dtype,
        }
    }

    /// The type keys and values are kept in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Expects the sequence to reach `positions` (its prompt and answer): the next growth
    /// of the storage goes straight there.
    pub fn reserve(&mut self, positions: usize) {
        self.reserve = self.reserve.max(positions.min(self.max_len));
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Forgets everything (the buffers are kept for the next sequence).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Drops positions from `len` on (a prefix cache keeps what matches).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// The keys and values `(num_kv_heads, len, head_dim)` stored for `layer`, if any.
    pub(crate) fn stored(&self, layer: usize) -> Result<Option<(Tensor, Tensor)>> {
        if self.len == 0 {
            return Ok(None);
        }
        let slot = layer
            .checked_sub(self.first_layer)
            .and_then(|i| self.layers.get(i))
            .and_then(|s| s.as_ref());
        match slot {
            Some(l) => Ok(Some((
                l.k.narrow(1, 0, self.len)?,
                l.v.narrow(1, 0, self.len)?,
            ))),
            None => Ok(None),
        }
    }

    /// Bytes the cache holds now.
    pub fn size_in_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|l| 2 * l.k.elem_count() * l.k.dtype().size_in_bytes())
            .sum()
    }

    /// Stores `k`, `v` (`(num_kv_heads, t, head_dim)`) of `layer` at the current end and
    /// returns the full keys and values `(num_kv_heads, len + t, head_dim)`, as kept
    /// (in the cache's type). The sequence
    /// length advances only through [`KvCache::advance`], once every layer has appended.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (n_kv, t, hd) = k.dims3()?;
        let needed = self.len + t;
        if needed > self.max_len {
            return Err(crate::ModelError::ContextFull {
                positions: needed,
                context: self.max_len,
            });
        }
        self.grow(layer, n_kv, hd, needed)?;
        let slot = &self.layers[layer - self.first_layer];
        let cache = slot
            .as_ref()
            .ok_or_else(|| crate::ModelError::Invalid("KV cache slot was not allocated".into()))?;
        cache
            .k
            .slice_set(&self.as_kept(k, Part::Keys)?, 1, self.len)?;
        cache
            .v
            .slice_set(&self.as_kept(v, Part::Values)?, 1, self.len)?;
        Ok((cache.k.narrow(1, 0, needed)?, cache.v.narrow(1, 0, needed)?))
    }

    /// Keys or values `(num_kv_heads, t, head_dim)` as the storage keeps them.
    fn as_kept(&self, x: &Tensor, part: Part) -> Result<Tensor> {
        if self.dtype == DType::U8 {
            return kv8::quantize(x, part);
        }
        Ok(x.to_dtype(self.dtype)?.contiguous()?)
    }

    /// What keys or values `x` read back from this cache would be, in `x`'s own type (ring
    /// attention attends to a chunk's keys and values as its cache will keep them).
    pub(crate) fn round_trip(&self, x: &Tensor, part: Part) -> Result<Tensor> {
        if self.dtype == DType::U8 {
            return Ok(kv8::dequantize(&kv8::quantize(x, part)?, part)?.to_dtype(x.dtype())?);
        }
        Ok(x.to_dtype(self.dtype)?.to_dtype(x.dtype())?)
    }

    /// Stored keys or values (as [`KvCache::stored`] gives them) as values of `dtype`.
    pub(crate) fn widened(&self, x: &Tensor, part: Part, dtype: DType) -> Result<Tensor> {
        if self.dtype == DType::U8 {
            return Ok(kv8::dequantize(x, part)?.to_dtype(dtype)?);
        }
        Ok(x.to_dtype(dtype)?)
    }

    /// Elements of storage a row of `hd` values takes (8-bit rows carry their scale).
    fn row_width(&self, hd: usize) -> usize {
        if self.dtype == DType::U8 {
            kv8::row_bytes(hd)
        } else {
            hd
        }
    }

    /// Makes `layer`'s storage hold at least `needed` positions, keeping what is stored:
    /// the next power of two (or the expected length at once), within the context.
    fn grow(&mut self, layer: usize, n_kv: usize, hd: usize, needed: usize) -> Result<()> {
        let (len, reserve, max_len) = (self.len, self.reserve, self.max_len);
        let (dtype, device) = (self.dtype, self.device.clone());
        let width = self.row_width(hd);
        let slot = layer
            .checked_sub(self.first_layer)
            .and_then(|i| self.layers.get_mut(i))
            .ok_or_else(|| {
                crate::ModelError::Invalid(format!("layer {layer} is not in this cache"))
            })?;
        let capacity = slot.as_ref().map_or(0, |l| l.k.dim(1).unwrap_or(0));
        if needed <= capacity {
            return Ok(());
        }
        let new_cap = needed
            .next_power_of_two()
            .max(reserve)
            .clamp(64, max_len.max(needed));
        let fresh = LayerCache {
            k: zeros((n_kv, new_cap, width), dtype, &device)?,
            v: zeros((n_kv, new_cap, width), dtype, &device)?,
        };
        if let Some(old) = slot.as_ref().filter(|_| len > 0) {
            fresh
                .k
                .slice_set(&old.k.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
            fresh
                .v
                .slice_set(&old.v.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
        }
        *slot = Some(fresh);
        Ok(())
    }

    /// Every layer's whole storage `(num_kv_heads, capacity, head_dim)`, grown to hold at
    /// least `needed` positions (what is stored is kept): the GPU decode path writes the
    /// next position in place. All layers share one capacity.
    #[cfg(any(test, feature = "cuda"))]
    pub(crate) fn decode_layers(
        &mut self,
        n_kv: usize,
        hd: usize,
        needed: usize,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        if needed > self.max_len {
            return Err(crate::ModelError::ContextFull {
                positions: needed,
                context: self.max_len,
            });
        }
        let first = self.first_layer;
        (first..first + self.layers.len())
            .map(|layer| {
                self.grow(layer, n_kv, hd, needed)?;
                let l = self.layers[layer - first].as_ref().ok_or_else(|| {
                    crate::ModelError::Invalid("KV cache slot was not allocated".into())
                })?;
                Ok((l.k.clone(), l.v.clone()))
            })
            .collect()
    }

    /// A copy of the first `len` positions, in storage of its own (a prefix cache hands
    /// a new sequence the keys and values of a prompt it shares).
    pub fn fork(&self, len: usize) -> Result<KvCache> {
        let len = len.min(self.len);
        let mut layers = Vec::with_capacity(self.layers.len());
        for slot in &self.layers {
            layers.push(match slot.as_ref().filter(|_| len > 0) {
                None => None,
                Some(l) => {
                    let (n_kv, _, hd) = l.k.dims3()?;
                    let cap = len.next_power_of_two().clamp(64, self.max_len.max(len));
                    let fresh = LayerCache {
                        k: zeros((n_kv, cap, hd), self.dtype, &self.device)?,
                        v: zeros((n_kv, cap, hd), self.dtype, &self.device)?,
                    };
                    fresh
                        .k
                        .slice_set(&l.k.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                    fresh
                        .v
                        .slice_set(&l.v.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                    Some(fresh)
                }
            });
        }
        Ok(KvCache {
            layers,
            first_layer: self.first_layer,
            len,
            max_len: self.max_len,
            reserve: 0,
            device: self.device.clone(),
            dtype: self.dtype,
        })
    }

    /// Marks `t` more positions as stored, after all layers appended them.
    pub fn advance(&mut self, t: usize) {
        self.len += t;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(t: &Tensor, len: usize) -> Vec<f32> {
        t.narrow(1, 0, len)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("values")
    }

    #[test]
    fn an_f16_cache_keeps_what_it_is_given_rounded_and_in_half_the_bytes() {
        let (n_kv, hd) = (2, 8);
        let mut cache = KvCache::new_on(0, 1, 500, &Device::Cpu, DType::F16);
        let k = Tensor::randn(0f32, 3.0, (n_kv, 70, hd), &Device::Cpu).expect("k");
        // Two appends, the second past the first 64 positions' storage.
        cache
            .append(
                0,
                &k.narrow(1, 0, 10).expect("10"),
                &k.narrow(1, 0, 10).expect("10"),
            )
            .expect("append");
        cache.advance(10);
        let (kk, vv) = cache
            .append(
                0,
                &k.narrow(1, 10, 60).expect("60"),
                &k.narrow(1, 10, 60).expect("60"),
            )
            .expect("append");
        cache.advance(60);
        assert_eq!((kk.dtype(), vv.dtype()), (DType::F16, DType::F16));
        let want = k
            .to_dtype(DType::F16)
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("rounded");
        let (sk, _) = cache.stored(0).expect("stored").expect("some");
        let got = sk.to_dtype(DType::F32).expect("f32");
        assert_eq!(values(&got, 70), want);
        assert_eq!(cache.size_in_bytes(), 2 * n_kv * 128 * hd * 2);
    }

    #[test]
    fn an_8_bit_cache_keeps_rows_with_their_scales_and_gives_back_what_it_rounds_to() {
        let (n_kv, hd) = (2, 16);
        let mut cache = KvCache::new_on(0, 1, 500, &Device::Cpu, DType::U8);
        let k = Tensor::randn(0f32, 3.0, (n_kv, 70, hd), &Device::Cpu).expect("k");
        for (start, len) in [(0, 10), (10, 60)] {
            let part = k.narrow(1, start, len).expect("part");
            cache.append(0, &part, &part).expect("append");
            cache.advance(len);
        }
        let (sk, sv) = cache.stored(0).expect("stored").expect("some");
        assert_eq!(sk.dims3().expect("dims"), (n_kv, 70, hd + 4));
        assert_eq!(sv.dtype(), DType::U8);
        // 68 of 128 bytes a row in f16's place: 20 against 32 at this head size.
        assert_eq!(cache.size_in_bytes(), 2 * n_kv * 128 * (hd + 4));
        // What the cache gives back is what a round trip through it gives (the keys
        // rotated and turned back).
        let back = cache.widened(&sk, Part::Keys, DType::F32).expect("widen");
        let rounded = cache.round_trip(&k, Part::Keys).expect("round trip");
        assert_eq!(values(&back, 70), values(&rounded, 70));
        // Values come back within half a step of the largest.
        let back = cache.widened(&sv, Part::Values, DType::F32).expect("widen");
        let err = (&back - &k)
            .and_then(|d| d.abs())
            .and_then(|d| d.max_all())
            .and_then(|d| d.to_scalar::<f32>())
            .expect("err");
        let amax = k
            .abs()
            .and_then(|a| a.max_all())
            .and_then(|a| a.to_scalar::<f32>())
            .expect("amax");
        assert!(
            err <= amax / 254.0 * 1.001,
            "{err} against a step of {}",
            amax / 127.0
        );
        // A fork keeps the rows as they are.
        let fork = cache.fork(40).expect("fork");
        let (fk, _) = fork.stored(0).expect("stored").expect("some");
        let bytes = |t: &Tensor| {
            t.narrow(1, 0, 40)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<u8>())
                .expect("bytes")
        };
        assert_eq!(bytes(&fk), bytes(&sk));
    }

    #[test]
    fn decode_layers_grow_every_layer_by_doubling_and_keep_what_is_stored() {
        let (n_kv, hd) = (2, 4);
        let mut cache = KvCache::new(3, 2, 1000);
        let k = Tensor::arange(0f32, (n_kv * 5 * hd) as f32, &Device::Cpu)
            .and_then(|t| t.reshape((n_kv, 5, hd)))
            .expect("k");
        for layer in 3..5 {
            cache.append(layer, &k, &k).expect("append");
        }
        cache.advance(5);
        // 64 positions at first; the 65th doubles every layer, contents kept.
        let small = cache.decode_layers(n_kv, hd, 6).expect("6 fit");
        assert!(
            small
                .iter()
                .all(|(k, v)| k.dim(1).ok() == Some(64) && v.dim(1).ok() == Some(64))
        );
        let grown = cache.decode_layers(n_kv, hd, 65).expect("65 fit");
        assert_eq!(grown.len(), 2);
        for (gk, gv) in &grown {
            assert_eq!(gk.dim(1).expect("dim"), 128);
            assert_eq!(values(gk, 5), values(&k, 5));
            assert_eq!(values(gv, 5), values(&k, 5));
        }
        // Past the context is the typed error, and nothing is allocated for it.
        let err = cache
            .decode_layers(n_kv, hd, 1001)
            .expect_err("past the context");
        assert!(matches!(
            err,
            crate::ModelError::ContextFull {
                positions: 1001,
                context: 1000
            }
        ));
        assert_eq!(cache.size_in_bytes(), 2 * 2 * n_kv * 128 * hd * 4);
    }
}
