//! Hugging Face model directories: `config.json` plus `*.safetensors` (bf16, f16, f32).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use serde::Deserialize;

use crate::{Architecture, ModelConfig, ModelError, Result, RopeStyle, Weight, WeightSource};

/// An open Hugging Face model directory.
pub struct SafetensorsDir {
    dir: PathBuf,
    tensors: MmapedSafetensors,
    names: HashSet<String>,
    config: ModelConfig,
}

#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: Option<String>,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: usize,
    vocab_size: usize,
    rope_theta: Option<f32>,
    rms_norm_eps: Option<f32>,
    max_position_embeddings: Option<usize>,
    #[serde(default)]
    tie_word_embeddings: bool,
}

impl SafetensorsDir {
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|source| ModelError::Io {
            path: config_path.clone(),
            source,
        })?;
        let hf: HfConfig = serde_json::from_str(&text).map_err(|e| ModelError::Format {
            path: config_path.clone(),
            message: e.to_string(),
        })?;
        let arch_name = hf
            .architectures
            .first()
            .cloned()
            .or(hf.model_type.clone())
            .unwrap_or_default();
        let architecture = Architecture::parse(&arch_name)
            .or_else(|| hf.model_type.as_deref().and_then(Architecture::parse))
            .ok_or(ModelError::UnsupportedArchitecture(arch_name))?;
        let config = ModelConfig {
            architecture,
            hidden_size: hf.hidden_size,
            num_layers: hf.num_hidden_layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            ffn_size: hf.intermediate_size,
            vocab_size: hf.vocab_size,
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            rope_style: RopeStyle::Halves,
            rms_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            context_length: hf.max_position_embeddings.unwrap_or(4096),
            tied_embeddings: hf.tie_word_embeddings,
        };
        config.validate()?;
        let io = |source| ModelError::Io {
            path: dir.clone(),
            source,
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ModelError::Invalid(format!(
                "{} has no *.safetensors files",
                dir.display()
            )));
        }
        // SAFETY: model files are opened read-only and not modified while mapped.
        let tensors =
            unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| ModelError::Format {
                path: dir.clone(),
                message: crate::candle_message(&e),
            })?;
        let names = tensors.tensors().into_iter().map(|(n, _)| n).collect();
        let mut this = Self {
            dir,
            tensors,
            names,
            config,
        };
        // Tied embeddings are also implied when the checkpoint simply has no lm_head.
        if !this.names.contains("lm_head.weight") {
            this.config.tied_embeddings = true;
        }
        Ok(this)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Maps a GGUF tensor name to its Hugging Face name.
fn hf_name(gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let (module, kind) = tail.rsplit_once('.')?;
    let hf_module = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf_module}.{kind}"))
}

impl WeightSource for SafetensorsDir {
    fn config(&self) -> Result<&ModelConfig> {
        Ok(&self.config)
    }

    fn load(&self, name: &str) -> Result<Option<Weight>> {
        let Some(hf) = hf_name(name) else {
            return Ok(None);
        };
        if !self.names.contains(&hf) {
            return Ok(None);
        }
        let t = self.tensors.load(&hf, &Device::Cpu)?.to_dtype(DType::F32)?;
        Ok(Some(Weight::Dense(t)))
    }
}

#[cfg(test)]
mod tests {
    use super::hf_name;

    #[test]
    fn maps_gguf_names_to_hf() {
        assert_eq!(
            hf_name("blk.12.attn_q.bias").as_deref(),
            Some("model.layers.12.self_attn.q_proj.bias")
        );
        assert_eq!(
            hf_name("blk.0.ffn_down.weight").as_deref(),
            Some("model.layers.0.mlp.down_proj.weight")
        );
        assert_eq!(hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(hf_name("blk.0.unknown.weight"), None);
    }
}
