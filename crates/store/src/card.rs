//! Built-in model cards: one small TOML file per model, compiled into the binary.

use serde::{Deserialize, Serialize};

/// Where a model comes from and what it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelCard {
    pub name: String,
    pub description: String,
    pub architecture: String,
    pub parameters: String,
    /// Shape facts for placement (per-rank memory) before the file is on a node.
    pub hidden: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub ffn: u32,
    pub vocab: u32,
    pub layers: u32,
    pub context_length: u32,
    pub license: String,
    /// Whether the model's chat template takes tools (and it was trained to call them).
    #[serde(default)]
    pub tools: bool,
    /// The installed file's name.
    pub file: String,
    pub size: u64,
    pub sha256: String,
    /// Packages whose members, concatenated in this order, form the file.
    pub parts: Vec<Part>,
}

/// One package and the member of it that holds a piece of the model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Part {
    pub package: String,
    pub version: String,
    pub member: String,
}

const CARDS: &[(&str, &str)] = &[
    ("smollm2-135m", include_str!("../cards/smollm2-135m.toml")),
    (
        "qwen2.5-coder-0.5b",
        include_str!("../cards/qwen2.5-coder-0.5b.toml"),
    ),
    (
        "qwen2.5-coder-1.5b",
        include_str!("../cards/qwen2.5-coder-1.5b.toml"),
    ),
];

/// The built-in card of `name`, if there is one.
pub fn find_card(name: &str) -> Option<ModelCard> {
    builtin_cards().into_iter().find(|c| c.name == name)
}

/// Every built-in card. The cards are part of the source and checked by a test, so a
/// card that fails to parse is skipped with a warning rather than stopping the program.
pub fn builtin_cards() -> Vec<ModelCard> {
    CARDS
        .iter()
        .filter_map(|(name, text)| match toml::from_str::<ModelCard>(text) {
            Ok(card) => Some(card),
            Err(e) => {
                tracing::warn!(card = name, error = %e, "built-in model card does not parse");
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_card_parses_and_is_consistent() {
        let cards = builtin_cards();
        assert_eq!(cards.len(), CARDS.len());
        for (card, (name, _)) in cards.iter().zip(CARDS) {
            assert_eq!(&card.name, name);
            assert_eq!(card.sha256.len(), 64, "{name}");
            assert!(card.sha256.bytes().all(|b| b.is_ascii_hexdigit()), "{name}");
            assert!(!card.parts.is_empty(), "{name}");
            assert!(card.size > 0, "{name}");
        }
    }
}
