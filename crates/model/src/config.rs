//! Architecture facts of a model, read from GGUF metadata or a Hugging Face `config.json`.

use serde::{Deserialize, Serialize};

/// The decoder architectures shoal implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama 2/3, SmolLM2: no biases, no q/k norms.
    Llama,
    /// Qwen2 / Qwen2.5: biases on q, k and v.
    Qwen2,
    /// Qwen3: RMS norms on q and k per head, no biases.
    Qwen3,
}

impl Architecture {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "llama" | "LlamaForCausalLM" | "MistralForCausalLM" => Some(Self::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Some(Self::Qwen2),
            "qwen3" | "Qwen3ForCausalLM" => Some(Self::Qwen3),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }

    pub fn has_qkv_bias(self) -> bool {
        self == Self::Qwen2
    }

    pub fn has_qk_norm(self) -> bool {
        self == Self::Qwen3
    }
}

/// Which pairs of a head's dimensions rope rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    /// Adjacent pairs (x[2i], x[2i+1]): llama weights as GGUF stores them (rows permuted).
    Interleaved,
    /// Two halves (x[i], x[i+d/2]): Hugging Face llama, and qwen in every format.
    Halves,
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_size: usize,
    pub vocab_size: usize,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
    pub context_length: usize,
    pub tied_embeddings: bool,
}

impl ModelConfig {
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Checks the relations between the numbers that the forward pass relies on.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |m: String| Err(crate::ModelError::Invalid(m));
        if self.num_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return bad(format!("model has an empty dimension: {self:?}"));
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} attention heads cannot be grouped over {} KV heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head dimension {} must be even", self.head_dim));
        }
        Ok(())
    }
}
