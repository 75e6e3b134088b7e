//! GGUF files: memory-mapped, validated up front, tensors read one at a time.

use std::collections::HashMap;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;
use candle_core::quantized::gguf_file::{Content, Value};

use crate::{Architecture, ModelConfig, ModelError, Result, RopeStyle, Weight, WeightSource};

/// An open GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    content: Content,
    config: Option<ModelConfig>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .finish()
    }
}

impl GgufFile {
    /// Opens and validates a GGUF file: magic, metadata, and that every tensor lies inside
    /// the file. A model config is derived when the metadata describes a supported
    /// architecture; [`GgufFile::model_config`] reports why not otherwise.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io = |source| ModelError::Io {
            path: path.clone(),
            source,
        };
        let file = std::fs::File::open(&path).map_err(io)?;
        // SAFETY: the file is opened read-only and shoal never writes model files while
        // they are open; a concurrent external writer is outside what we can defend.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let mut magic = [0u8; 4];
        let head = mmap.get(..4).unwrap_or(&[]);
        magic[..head.len()].copy_from_slice(head);
        if &magic != b"GGUF" {
            return Err(ModelError::NotGguf { path, magic });
        }
        let content = Content::read(&mut Cursor::new(&mmap[..])).map_err(|e| {
            let message = crate::candle_message(&e);
            match message.strip_prefix("unknown dtype for tensor ") {
                Some(id) => ModelError::UnsupportedBlockType {
                    path: path.clone(),
                    type_id: id.trim().to_string(),
                },
                None => ModelError::Format {
                    path: path.clone(),
                    message,
                },
            }
        })?;
        let len = mmap.len() as u64;
        for (name, info) in &content.tensor_infos {
            let dtype = info.ggml_dtype;
            let elems = info.shape.elem_count();
            let bytes = (elems / dtype.block_size() * dtype.type_size()) as u64;
            let end = content.tensor_data_offset + info.offset + bytes;
            if end > len {
                return Err(ModelError::Truncated {
                    path,
                    tensor: name.clone(),
                    end,
                    len,
                });
            }
        }
        let mut file = Self {
            path,
            mmap,
            content,
            config: None,
        };
        file.config = file.derive_config().ok();
        Ok(file)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Tensor names with their block type, sorted by name.
    pub fn tensor_types(&self) -> Vec<(String, String)> {
        let mut v: Vec<_> = self
            .content
            .tensor_infos
            .iter()
            .map(|(n, i)| (n.clone(), format!("{:?}", i.ggml_dtype)))
            .collect();
        v.sort();
        v
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        match self.metadata().get(key)? {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn get_usize(&self, key: &str) -> Option<usize> {
        value_to_f64(self.metadata().get(key)?).map(|v| v as usize)
    }

    pub fn get_f32(&self, key: &str) -> Option<f32> {
        value_to_f64(self.metadata().get(key)?).map(|v| v as f32)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        match self.metadata().get(key)? {
            Value::Bool(b) => Some(*b),
            v => value_to_f64(v).map(|x| x != 0.0),
        }
    }

    /// A string array (tokens, merges).
    pub fn get_strings(&self, key: &str) -> Option<Vec<String>> {
        match self.metadata().get(key)? {
            Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
            _ => None,
        }
    }

    /// An integer array (token types).
    pub fn get_ints(&self, key: &str) -> Option<Vec<i64>> {
        match self.metadata().get(key)? {
            Value::Array(items) => items
                .iter()
                .map(|v| value_to_f64(v).map(|x| x as i64))
                .collect(),
            _ => None,
        }
    }

    /// The model's architecture facts, or why they cannot be derived.
    pub fn model_config(&self) -> Result<&ModelConfig> {
        match &self.config {
            Some(c) => Ok(c),
            None => Err(self
                .derive_config()
                .err()
                .unwrap_or_else(|| ModelError::Invalid("no model config".into()))),
        }
    }

    fn derive_config(&self) -> Result<ModelConfig> {
        let arch_name = self
            .get_str("general.architecture")
            .ok_or_else(|| ModelError::MissingMetadata("general.architecture".into()))?;
        let architecture = Architecture::parse(arch_name)
            .ok_or_else(|| ModelError::UnsupportedArchitecture(arch_name.to_string()))?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let need = |k: &str| {
            self.get_usize(&key(k))
                .ok_or_else(|| ModelError::MissingMetadata(key(k)))
        };
        let hidden_size = need("embedding_length")?;
        let num_heads = need("attention.head_count")?;
        let num_kv_heads = self
            .get_usize(&key("attention.head_count_kv"))
            .unwrap_or(num_heads);
        let head_dim = self
            .get_usize(&key("attention.key_length"))
            .unwrap_or(hidden_size / num_heads.max(1));
        let embd = self
            .content
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        let config = ModelConfig {
            architecture,
            hidden_size,
            num_layers: need("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            ffn_size: need("feed_forward_length")?,
            vocab_size: embd.shape.dims()[0],
            rope_theta: self.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_style: match architecture {
                Architecture::Llama => RopeStyle::Interleaved,
                Architecture::Qwen2 | Architecture::Qwen3 => RopeStyle::Halves,
            },
            rms_eps: self
                .get_f32(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-6),
            context_length: self.get_usize(&key("context_length")).unwrap_or(4096),
            tied_embeddings: !self.has_tensor("output.weight"),
        };
        config.validate()?;
        Ok(config)
    }
}

fn value_to_f64(v: &Value) -> Option<f64> {
    Some(match v {
        Value::U8(x) => *x as f64,
        Value::I8(x) => *x as f64,
        Value::U16(x) => *x as f64,
        Value::I16(x) => *x as f64,
        Value::U32(x) => *x as f64,
        Value::I32(x) => *x as f64,
        Value::U64(x) => *x as f64,
        Value::I64(x) => *x as f64,
        Value::F32(x) => *x as f64,
        Value::F64(x) => *x,
        Value::Bool(b) => *b as u8 as f64,
        _ => return None,
    })
}

impl WeightSource for GgufFile {
    fn config(&self) -> Result<&ModelConfig> {
        self.model_config()
    }

    fn load(&self, name: &str) -> Result<Option<Weight>> {
        if !self.has_tensor(name) {
            return Ok(None);
        }
        let q = self
            .content
            .tensor(&mut Cursor::new(&self.mmap[..]), name, &Device::Cpu)?;
        Ok(Some(Weight::Quantized(Arc::new(q))))
    }
}
