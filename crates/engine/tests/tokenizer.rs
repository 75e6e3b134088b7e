//! Tokenizers rebuilt from GGUF metadata against llama.cpp's `llama-tokenize` ids, on
//! the vocabularies of smollm2-135m and qwen2.5-coder (vocabulary-only GGUF fixtures).

mod common;

use shoal_engine::gguf_vocab;
use shoal_model::GgufFile;
use shoal_tokenizer::Tokenizer;

fn check(vocab_file: &str, reference: &str) {
    let file = GgufFile::open(common::fixtures().join(vocab_file)).expect("open vocab");
    let tokenizer = Tokenizer::from_gguf(gguf_vocab(&file)).expect("tokenizer");
    let reference = common::read_json(&common::fixtures().join(reference));
    let cases = reference.as_array().expect("cases");
    assert!(cases.len() > 40);
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let want = common::ids(&case["ids"]);
        let got = tokenizer.encode(text, false).expect("encode");
        assert_eq!(got, want, "ids of {text:?}");
        assert_eq!(
            tokenizer.decode(&got).expect("decode"),
            text,
            "round trip of {text:?}"
        );
    }
}

#[test]
fn smollm2_vocabulary_matches_llama_cpp() {
    check("vocab-smollm2-135m.gguf", "tokenizer-smollm2-135m.json");
}

#[test]
fn qwen2_5_vocabulary_matches_llama_cpp() {
    check("vocab-qwen2.5-coder.gguf", "tokenizer-qwen2.5-coder.json");
}

#[test]
fn special_tokens_map_to_their_ids_and_end_generation() {
    let file = GgufFile::open(common::fixtures().join("vocab-qwen2.5-coder.gguf")).expect("open");
    let tokenizer = Tokenizer::from_gguf(gguf_vocab(&file)).expect("tokenizer");
    let im_start = tokenizer.token_to_id("<|im_start|>").expect("im_start");
    let im_end = tokenizer.token_to_id("<|im_end|>").expect("im_end");
    let ids = tokenizer
        .encode("<|im_start|>user<|im_end|>", false)
        .expect("encode");
    assert_eq!(ids.first(), Some(&im_start));
    assert_eq!(ids.last(), Some(&im_end));
    assert!(tokenizer.stop_ids().contains(&im_end));
    assert!(!tokenizer.add_bos(), "qwen adds no BOS");
}
