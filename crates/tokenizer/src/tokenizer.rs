//! Byte-level BPE tokenizers, rebuilt from GGUF metadata or read from `tokenizer.json`.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::{ChatTemplate, Result, TokenizerError};

/// Qwen2's pre-tokenizer split (as in its `tokenizer.json` and llama.cpp's `qwen2`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split: like Qwen2's but digits in runs of up to three.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (`tokenizer.ggml.token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The tokenizer part of a GGUF file's metadata.
#[derive(Clone, Debug, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`; shoal reads `gpt2` (byte-level BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`: names the pre-tokenizer split.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub token_types: Vec<i64>,
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub add_bos: Option<bool>,
    pub chat_template: Option<String>,
}

/// A tokenizer with the facts generation needs: BOS rule, end-of-generation ids, template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_id: Option<u32>,
    add_bos: bool,
    stop_ids: Vec<u32>,
    template: ChatTemplate,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("add_bos", &self.add_bos)
            .field("stop_ids", &self.stop_ids)
            .finish()
    }
}

/// Names of tokens that end a turn in the chat formats shoal knows.
const END_OF_TURN: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
];

impl Tokenizer {
    /// Rebuilds the tokenizer from GGUF metadata.
    pub fn from_gguf(vocab: GgufVocab) -> Result<Self> {
        if vocab.model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(vocab.model));
        }
        if vocab.tokens.is_empty() {
            return Err(TokenizerError::Invalid("the vocabulary is empty".into()));
        }
        let ids: Vocab = vocab
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges = vocab
            .merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| TokenizerError::Invalid(format!("merge {m:?} has no space")))
            })
            .collect::<Result<Vec<_>>>()?;
        let pre = vocab.pre.as_deref().unwrap_or("default");
        let llama3 = matches!(pre, "llama3" | "llama-bpe" | "llama-v3");
        let bpe = BPE::builder()
            .vocab_and_merges(ids, merges)
            .ignore_merges(llama3)
            .build()?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
            Ok(Split::new(
                SplitPattern::Regex(pattern.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )?
            .into())
        };
        let byte_level =
            |use_regex| PreTokenizerWrapper::from(ByteLevel::new(false, false, use_regex));
        let pre_tokenizer = match pre {
            "qwen2" | "deepseek-r1-qwen" => {
                inner.with_normalizer(Some(NFC))?;
                Sequence::new(vec![split(QWEN2_SPLIT)?, byte_level(false)])
            }
            _ if llama3 => Sequence::new(vec![split(LLAMA3_SPLIT)?, byte_level(false)]),
            "smollm" | "starcoder" | "refact" | "codeshell" => {
                Sequence::new(vec![Digits::new(true).into(), byte_level(true)])
            }
            _ => Sequence::new(vec![byte_level(true)]),
        };
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let mut special = Vec::new();
        let mut user = Vec::new();
        for (i, kind) in vocab.token_types.iter().enumerate() {
            let Some(text) = vocab.tokens.get(i) else {
                break;
            };
            match *kind {
                TOKEN_TYPE_CONTROL => special.push(AddedToken::from(text.clone(), true)),
                TOKEN_TYPE_USER_DEFINED => user.push(AddedToken::from(text.clone(), false)),
                _ => {}
            }
        }
        inner.add_special_tokens(special)?;
        inner.add_tokens(user)?;
        let token_text = |id: Option<u32>| id.and_then(|i| vocab.tokens.get(i as usize).cloned());
        let template = ChatTemplate::new(
            vocab.chat_template.clone(),
            token_text(vocab.bos_id).unwrap_or_default(),
            token_text(vocab.eos_id).unwrap_or_default(),
        );
        let mut this = Self {
            inner,
            bos_id: vocab.bos_id,
            add_bos: vocab.add_bos.unwrap_or(llama3),
            stop_ids: Vec::new(),
            template,
        };
        this.stop_ids = this.end_of_turn_ids(vocab.eos_id);
        Ok(this)
    }

    /// Reads `tokenizer.json` and, when present, `tokenizer_config.json` (chat template,
    /// BOS and EOS tokens) from a Hugging Face model directory.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| TokenizerError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| TokenizerError::Io {
                path: cfg_path.display().to_string(),
                message: e.to_string(),
            })?,
            Err(_) => serde_json::Value::Null,
        };
        // A token field is either a string or {"content": "..."}.
        let token_field = |key: &str| -> Option<String> {
            let v = cfg.get(key)?;
            v.as_str()
                .map(str::to_string)
                .or_else(|| v.get("content")?.as_str().map(str::to_string))
        };
        let bos = token_field("bos_token");
        let eos = token_field("eos_token");
        let bos_id = bos.as_deref().and_then(|t| inner.token_to_id(t));
        let eos_id = eos.as_deref().and_then(|t| inner.token_to_id(t));
        let template = ChatTemplate::new(
            cfg.get("chat_template")
                .and_then(|v| v.as_str())
                .map(str::to_string),
            bos.unwrap_or_default(),
            eos.unwrap_or_default(),
        );
        let add_bos = cfg
            .get("add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let mut this = Self {
            inner,
            bos_id,
            add_bos,
            stop_ids: Vec::new(),
            template,
        };
        this.stop_ids = this.end_of_turn_ids(eos_id);
        Ok(this)
    }

    fn end_of_turn_ids(&self, eos_id: Option<u32>) -> Vec<u32> {
        let mut ids: Vec<u32> = eos_id.into_iter().collect();
        for name in END_OF_TURN {
            if let Some(id) = self.inner.token_to_id(name).filter(|id| !ids.contains(id)) {
                ids.push(id);
            }
        }
        ids
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Whether the model expects a BOS token at the start of a sequence.
    pub fn add_bos(&self) -> bool {
        self.add_bos && self.bos_id.is_some()
    }

    /// Token ids that end generation (EOS and the end-of-turn tokens of the vocabulary).
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    pub fn chat_template(&self) -> &ChatTemplate {
        &self.template
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Encodes text; special tokens written in the text (`<|im_start|>`) become their ids.
    /// `with_bos` prepends BOS when the model's rule asks for it.
    pub fn encode(&self, text: &str, with_bos: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if with_bos && self.add_bos() {
            ids.extend(self.bos_id);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(self.inner.decode(ids, false)?)
    }

    /// An incremental decoder that yields text as soon as it forms whole characters.
    /// Special tokens are left out.
    pub fn stream(&self) -> TextStream<'_> {
        self.stream_showing(&[])
    }

    /// The same, but the special tokens among `shown` are written as their text (the
    /// tags a tool-call reader looks for, which Qwen's vocabulary makes special).
    pub fn stream_showing(&self, shown: &[u32]) -> TextStream<'_> {
        TextStream {
            tokenizer: self,
            ids: Vec::new(),
            emitted: 0,
            shown: shown.to_vec(),
        }
    }
}

/// Turns generated ids into text piece by piece, never splitting a UTF-8 character.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    emitted: usize,
    shown: Vec<u32>,
}

impl TextStream<'_> {
    /// The text of every id so far: runs between shown special tokens decoded apart,
    /// the shown tokens as their own text.
    fn text(&self) -> Result<String> {
        if self.shown.is_empty() {
            return Ok(self.tokenizer.inner.decode(&self.ids, true)?);
        }
        let mut out = String::new();
        for run in self.ids.split_inclusive(|id| self.shown.contains(id)) {
            let (body, tag) = match run.split_last() {
                Some((last, body)) if self.shown.contains(last) => (body, Some(*last)),
                _ => (run, None),
            };
            out.push_str(&self.tokenizer.inner.decode(body, true)?);
            if let Some(tag) = tag {
                out.push_str(&self.tokenizer.inner.id_to_token(tag).unwrap_or_default());
            }
        }
        Ok(out)
    }

    /// Adds one id; returns the new text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = self.text()?;
        // An incomplete UTF-8 sequence decodes to U+FFFD; wait for the rest of it.
        if text.ends_with('\u{FFFD}') || text.len() < self.emitted {
            return Ok(String::new());
        }
        let new = text[self.emitted..].to_string();
        self.emitted = text.len();
        Ok(new)
    }
}
