//! Helpers shared by the engine's integration tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use shoal_engine::{Engine, LoadOptions};

/// The repository's `tests/fixtures` directory.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Path of a known model, installed into the store on first use.
pub fn model_path(name: &str) -> PathBuf {
    shoal_store::Store::from_env()
        .resolve_or_pull(name)
        .unwrap_or_else(|e| panic!("cannot install {name}: {e}"))
}

/// smollm2-135m, loaded once per test binary.
pub fn smollm2() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        Engine::load(
            &model_path("smollm2-135m"),
            &LoadOptions {
                context_length: Some(2048),
                ..Default::default()
            },
        )
        .expect("load smollm2-135m")
    })
}

pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("fixture JSON")
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("array of numbers")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

/// Checks shoal against a reference fixture made by `tools/reference/reference.py`:
/// greedy chat answers up to the reference's first near-tie, and teacher-forced top-1
/// agreement and perplexity over the prose text.
pub fn check_against_reference(engine: &Engine, fixture: &str) {
    let reference = read_json(&fixtures().join(fixture));
    let mut compared = 0;
    for case in reference["chat"].as_array().expect("chat cases") {
        let prompt = case["prompt"].as_str().expect("prompt");
        let want_prompt = ids(&case["prompt_ids"]);
        let messages = [shoal_tokenizer::ChatMessage::new("user", prompt)];
        let got_prompt = engine.chat_prompt(&messages).expect("chat prompt");
        assert_eq!(got_prompt, want_prompt, "prompt ids for {prompt:?}");
        let want = ids(&case["greedy"]);
        let gaps = floats(&case["gaps"]);
        let params = shoal_engine::GenerateParams {
            max_tokens: want.len(),
            ..Default::default()
        };
        let got = engine
            .generate(&got_prompt, &params, &mut |_| true)
            .expect("generate");
        // Compare up to and including the first step whose top two logits lie within 0.5:
        // the token there is still expected to match only when it is not a near-tie.
        let firm = gaps.iter().position(|&g| g < 0.5).unwrap_or(want.len());
        // The reference runs on past an end-of-turn token; shoal stops there.
        let end = want
            .iter()
            .position(|t| engine.tokenizer().stop_ids().contains(t))
            .unwrap_or(want.len());
        let firm = firm.min(end);
        assert!(
            got.tokens.len() >= firm.min(want.len()),
            "{prompt:?}: shoal stopped after {} tokens, reference is firm for {firm}",
            got.tokens.len()
        );
        assert_eq!(
            &got.tokens[..firm],
            &want[..firm],
            "greedy ids for {prompt:?}"
        );
        compared += firm;
    }
    assert!(compared > 0, "no firm positions compared");
    let ppl = &reference["perplexity"];
    let text = std::fs::read_to_string(fixtures().join("prose.txt")).expect("prose");
    let got = engine
        .perplexity(&text, 4096, 128, &mut |_, _| {})
        .expect("perplexity");
    assert_eq!(got.tokens, ids(&ppl["tokens"]), "prose token ids");
    let want_top1 = ids(&ppl["top1"]);
    let gaps = floats(&ppl["gaps"]);
    let firm: Vec<usize> = (0..gaps.len()).filter(|&i| gaps[i] >= 0.2).collect();
    let agree = firm
        .iter()
        .filter(|&&i| got.top1[i] == want_top1[i])
        .count();
    let share = agree as f64 / firm.len() as f64;
    assert!(
        share >= 0.99,
        "top-1 agreement {share:.4} over {} firm positions",
        firm.len()
    );
    let want_ppl = ppl["ppl"].as_f64().expect("ppl");
    let rel = (got.ppl - want_ppl).abs() / want_ppl;
    eprintln!(
        "{fixture}: {compared} free-running greedy ids equal; top-1 {agree}/{} firm positions; perplexity {:.4} vs {want_ppl:.4} ({:.3}%)",
        firm.len(),
        got.ppl,
        rel * 100.0
    );
    assert!(
        rel < 0.02,
        "perplexity {} vs reference {want_ppl} ({rel:.4})",
        got.ppl
    );
}
