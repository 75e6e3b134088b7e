//! The same reference checks on qwen2.5-coder-0.5b: a 476 MB download, so run on demand
//! (`cargo test --release -p shoal-engine --test qwen -- --ignored`).

mod common;

use shoal_engine::{Engine, LoadOptions};

#[test]
#[ignore = "downloads qwen2.5-coder-0.5b (476 MB)"]
fn qwen2_5_coder_0_5b_matches_the_numpy_reference() {
    let engine = Engine::load(
        &common::model_path("qwen2.5-coder-0.5b"),
        &LoadOptions {
            context_length: Some(2048),
            ..Default::default()
        },
    )
    .expect("load");
    common::check_against_reference(&engine, "reference-qwen2.5-coder-0.5b.json");
}
