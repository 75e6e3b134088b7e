//! End-to-end checks on the real smollm2-135m (installed into the store on first use).

mod common;

use shoal_engine::{EngineError, FinishReason, GenerateParams, Session};
use shoal_model::Tensor;
use shoal_tokenizer::ChatMessage;

#[test]
fn greedy_answers_and_perplexity_match_the_numpy_reference() {
    common::check_against_reference(common::smollm2(), "reference-smollm2-135m.json");
}

#[test]
fn the_demo_question_is_answered_with_paris() {
    let engine = common::smollm2();
    let prompt = engine
        .chat_prompt(&[ChatMessage::new(
            "user",
            "What is the capital of France? Answer in one word.",
        )])
        .expect("prompt");
    let params = GenerateParams {
        max_tokens: 16,
        ..Default::default()
    };
    let out = engine
        .generate(&prompt, &params, &mut |_| true)
        .expect("generate");
    assert!(out.text.contains("Paris"), "answer: {:?}", out.text);
}

#[test]
fn chunked_prefill_gives_the_logits_of_one_pass() {
    let engine = common::smollm2();
    let text = std::fs::read_to_string(common::fixtures().join("prose.txt")).expect("prose");
    let tokens = engine.raw_prompt(&text).expect("tokens");
    let tokens = &tokens[..200];
    let whole = engine
        .prefill_in(&mut engine.session(), tokens, 512)
        .expect("one pass");
    for chunk in [1, 7, 64] {
        let mut session = engine.session();
        let chunked = engine
            .prefill_in(&mut session, tokens, chunk)
            .expect("chunked");
        assert_eq!(session.len(), tokens.len(), "every chunk appended");
        let diff = (&chunked - &whole)
            .and_then(|d| d.abs())
            .and_then(|d| d.max_all())
            .and_then(|d| d.to_scalar::<f32>())
            .expect("diff");
        // Small batches and large ones take different quantized-matmul paths (8-bit
        // activations rounded differently), so the logits agree to rounding, not bits.
        let scale = whole
            .abs()
            .and_then(|d| d.max_all())
            .and_then(|d| d.to_scalar::<f32>())
            .expect("scale");
        assert!(
            diff / scale < 0.05,
            "chunk {chunk}: max logit difference {diff} of {scale}"
        );
        let argmax = |t: &candle_core::Tensor| {
            t.squeeze(0)
                .and_then(|t| t.argmax(0))
                .and_then(|t| t.to_scalar::<u32>())
                .expect("argmax")
        };
        assert_eq!(
            argmax(&chunked),
            argmax(&whole),
            "chunk {chunk}: next token"
        );
    }
}

#[test]
fn max_tokens_and_stop_strings_end_generation() {
    let engine = common::smollm2();
    let prompt = engine
        .chat_prompt(&[ChatMessage::new(
            "user",
            "Count from 1 to 20, separated by commas.",
        )])
        .expect("prompt");
    let limited = GenerateParams {
        max_tokens: 5,
        ..Default::default()
    };
    let out = engine
        .generate(&prompt, &limited, &mut |_| true)
        .expect("generate");
    assert_eq!(out.tokens.len(), 5);
    assert_eq!(out.finish_reason, FinishReason::Length);
    let full = GenerateParams {
        max_tokens: 60,
        ..Default::default()
    };
    let reference = engine
        .generate(&prompt, &full, &mut |_| true)
        .expect("generate");
    assert!(reference.text.contains('5'), "{:?}", reference.text);
    let stop_at = reference.text.find('5').expect("a 5");
    let stopped = GenerateParams {
        max_tokens: 60,
        stop: vec!["5".into()],
        ..Default::default()
    };
    let mut streamed = String::new();
    let out = engine
        .generate(&prompt, &stopped, &mut |piece| {
            streamed.push_str(piece);
            true
        })
        .expect("generate");
    assert_eq!(out.finish_reason, FinishReason::Stop);
    assert_eq!(out.text, reference.text[..stop_at]);
    assert_eq!(streamed, out.text, "what streamed is what was returned");
}

#[test]
fn cancelling_from_the_text_callback_stops_at_once() {
    let engine = common::smollm2();
    let prompt = engine.raw_prompt("Once upon a time").expect("prompt");
    let params = GenerateParams {
        max_tokens: 100,
        ..Default::default()
    };
    let mut pieces = 0;
    let out = engine
        .generate(&prompt, &params, &mut |_| {
            pieces += 1;
            pieces < 3
        })
        .expect("generate");
    assert_eq!(out.finish_reason, FinishReason::Cancelled);
    assert!(out.tokens.len() < 10, "{} tokens", out.tokens.len());
}

#[test]
fn a_prompt_longer_than_the_context_is_refused() {
    let engine = common::smollm2();
    let prompt = vec![100u32; engine.context_length() + 1];
    let err = engine
        .generate(&prompt, &GenerateParams::default(), &mut |_| true)
        .expect_err("must refuse");
    assert!(matches!(err, EngineError::PromptTooLong { .. }), "{err}");
}

#[test]
fn bench_depth_fills_the_context_before_each_generation_run() {
    let engine = shoal_engine::Engine::load(
        &common::model_path("smollm2-135m"),
        &shoal_engine::LoadOptions {
            context_length: Some(64),
            ..Default::default()
        },
    )
    .expect("load");
    let config = |depth, batch| shoal_engine::BenchConfig {
        pp: 0,
        tg: 8,
        repeat: 1,
        prefill_chunk: 32,
        depth,
        batch,
    };
    // 56 positions of context and 8 generated fill the 64 exactly.
    // Alone, and four sequences decoding together, each with a cache of its own.
    for batch in [1, 4] {
        let report = engine
            .bench(&config(56, batch), &mut |_, _| {})
            .expect("56 + 8 fit");
        assert_eq!((report.depth, report.batch), (56, batch));
        assert_eq!(report.generation.samples.len(), 1);
        assert!(report.generation.median > 0.0);
        // One more position of context does not: the depth really is in the cache.
        let err = engine
            .bench(&config(57, batch), &mut |_, _| {})
            .expect_err("57 + 8 exceed the context");
        assert!(
            matches!(
                err,
                EngineError::Model(shoal_model::ModelError::ContextFull { context: 64, .. })
            ),
            "batch {batch}: {err}"
        );
    }
}

/// A session that decodes greedily in runs, as the GPU's chained steps do (here each
/// step through the CPU model), counting the steps it ran.
struct Chained<'m> {
    inner: shoal_engine::LocalSession<'m>,
    steps: usize,
}

impl Session for Chained<'_> {
    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> shoal_engine::Result<Tensor> {
        self.inner.forward(tokens, all_logits)
    }

    fn greedy(
        &mut self,
        token: u32,
        n: usize,
        sink: &mut dyn FnMut(u32) -> bool,
    ) -> shoal_engine::Result<Option<usize>> {
        let mut token = token;
        for k in 0..n {
            let row: Vec<f32> = self
                .inner
                .forward(&[token], false)?
                .flatten_all()?
                .to_vec1()?;
            self.steps += 1;
            // The first index of the largest value, as the decoder's arg-max.
            let next = row
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
                    if v > bv { (i, v) } else { (bi, bv) }
                })
                .0 as u32;
            if !sink(next) {
                return Ok(Some(k + 1));
            }
            token = next;
        }
        Ok(Some(n))
    }

    fn reset(&mut self) -> shoal_engine::Result<()> {
        self.inner.reset()
    }

    fn len(&self) -> usize {
        self.inner.len()
    }
}

/// `generate` on a session with a greedy path hands the decoding to it after the first
/// token, and ends exactly as stepping does: at the budget, at a stop string (no step
/// taken after the sink says stop), at the end of the turn, and when the text callback
/// cancels.
#[test]
fn generation_through_a_greedy_path_ends_as_stepping_does() {
    let engine = common::smollm2();
    let prompt = engine
        .chat_prompt(&[ChatMessage::new(
            "user",
            "Count from 1 to 9, separated by commas.",
        )])
        .expect("prompt");
    let cases = [(5, vec![]), (60, vec!["5".to_string()]), (200, vec![])];
    for (max_tokens, stop) in cases {
        let params = GenerateParams {
            max_tokens,
            stop: stop.clone(),
            ..Default::default()
        };
        let want = engine
            .generate(&prompt, &params, &mut |_| true)
            .expect("stepped");
        let mut chained = Chained {
            inner: engine.session(),
            steps: 0,
        };
        let got = engine
            .generate_in(&mut chained, &prompt, &params, &mut |_| true)
            .expect("chained");
        let what = format!("max_tokens {max_tokens}, stop {stop:?}");
        assert_eq!(got.text, want.text, "{what}");
        assert_eq!(got.tokens, want.tokens, "{what}");
        assert_eq!(got.finish_reason, want.finish_reason, "{what}");
        // The first token comes from the prompt's logits; every later one from a step
        // of the greedy path, and one more where an end-of-turn token (never shown)
        // ended it.
        let eot = usize::from(want.finish_reason == FinishReason::Stop && stop.is_empty());
        assert_eq!(
            chained.steps,
            want.tokens.len() - 1 + eot,
            "{what}: steps run"
        );
    }
    let params = GenerateParams {
        max_tokens: 100,
        ..Default::default()
    };
    let mut chained = Chained {
        inner: engine.session(),
        steps: 0,
    };
    let mut pieces = 0;
    let out = engine
        .generate_in(&mut chained, &prompt, &params, &mut |_| {
            pieces += 1;
            pieces < 3
        })
        .expect("cancelled");
    assert_eq!(out.finish_reason, FinishReason::Cancelled);
    assert!(chained.steps < 10, "{} steps after a cancel", chained.steps);
}
