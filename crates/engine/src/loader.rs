//! Opening a model path (a GGUF file or a Hugging Face directory) as an [`Engine`].

use std::path::Path;

use shoal_model::{Compute, GgufFile, LoadSpec, Model, ModelConfig, SafetensorsDir, WeightSource};
use shoal_tokenizer::{GgufVocab, Tokenizer};

use crate::{Engine, Result};

/// How to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Context length to serve; the model's own (capped at 8192 by default) when `None`.
    pub context_length: Option<usize>,
    /// Where to compute (the CPU in f32 by default).
    pub compute: Option<Compute>,
}

/// The largest context shoal allocates unless asked for more: long contexts cost rope
/// tables and cache growth that a prompt of a few hundred tokens does not need.
const DEFAULT_CONTEXT_CAP: usize = 8192;

/// The tokenizer fields of a GGUF file's metadata.
pub fn gguf_vocab(file: &GgufFile) -> GgufVocab {
    GgufVocab {
        model: file
            .get_str("tokenizer.ggml.model")
            .unwrap_or("")
            .to_string(),
        pre: file.get_str("tokenizer.ggml.pre").map(str::to_string),
        tokens: file
            .get_strings("tokenizer.ggml.tokens")
            .unwrap_or_default(),
        token_types: file
            .get_ints("tokenizer.ggml.token_type")
            .unwrap_or_default(),
        merges: file
            .get_strings("tokenizer.ggml.merges")
            .unwrap_or_default(),
        bos_id: file
            .get_usize("tokenizer.ggml.bos_token_id")
            .map(|v| v as u32),
        eos_id: file
            .get_usize("tokenizer.ggml.eos_token_id")
            .map(|v| v as u32),
        add_bos: file.get_bool("tokenizer.ggml.add_bos_token"),
        chat_template: file.get_str("tokenizer.chat_template").map(str::to_string),
    }
}

/// The architecture facts of the model at `path`, without loading its weights.
pub fn model_config(path: &Path) -> Result<ModelConfig> {
    if path.is_dir() {
        Ok(SafetensorsDir::open(path)?.config()?.clone())
    } else {
        Ok(GgufFile::open(path)?.model_config()?.clone())
    }
}

impl Engine {
    /// Loads the whole model at `path` with its tokenizer.
    pub fn load(path: &Path, options: &LoadOptions) -> Result<Self> {
        Self::load_part(path, options, &|c: &ModelConfig| {
            LoadSpec::full(c.num_layers)
        })
    }

    /// Loads the part of the model at `path` that `spec` picks (a shard), with the whole
    /// tokenizer.
    pub fn load_part(
        path: &Path,
        options: &LoadOptions,
        spec: &dyn Fn(&ModelConfig) -> LoadSpec,
    ) -> Result<Self> {
        let (source, tokenizer): (Box<dyn WeightSource>, Tokenizer) = if path.is_dir() {
            let dir = SafetensorsDir::open(path)?;
            let tok = Tokenizer::from_hf_dir(path)?;
            (Box::new(dir), tok)
        } else {
            let file = GgufFile::open(path)?;
            // The model must be one shoal runs before its tokenizer matters.
            file.model_config()?;
            let tok = Tokenizer::from_gguf(gguf_vocab(&file))?;
            (Box::new(file), tok)
        };
        let config = source.config()?.clone();
        let context = options
            .context_length
            .unwrap_or(config.context_length.min(DEFAULT_CONTEXT_CAP));
        tracing::info!(
            path = %path.display(),
            architecture = config.architecture.name(),
            layers = config.num_layers,
            context,
            "loading model"
        );
        let compute = options.compute.clone().unwrap_or_else(Compute::cpu);
        let model = Model::load_on(source.as_ref(), spec(&config), context, &compute)?;
        Ok(Self::new(model, tokenizer))
    }
}
