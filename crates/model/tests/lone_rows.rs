//! Where `Model::lone_rows_alike` says so, a prompt read one row a step beside another
//! sequence's decode rows gives the logits it gives read whole: the scheduler then slices
//! prompts into single rows beside streams (`Limits::lone_prompt_rows`), the smallest
//! step a long prompt can add to a stream's gap.

use candle_core::quantized::GgmlDType;
use shoal_model::synthetic::{SyntheticShape, write_synthetic_gguf};
use shoal_model::{Architecture, BatchPart, GgufFile, LoadSpec, Model};

fn rows(t: &candle_core::Tensor) -> Vec<Vec<f32>> {
    t.to_vec2::<f32>().expect("logits")
}

#[test]
fn a_prompt_read_a_row_a_step_beside_a_stream_equals_it_read_whole() {
    let dir = std::env::temp_dir().join(format!("shoal-lone-rows-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    for (arch, wt) in [
        (Architecture::Qwen2, GgmlDType::Q8_0),
        (Architecture::Llama, GgmlDType::Q4_1),
    ] {
        let path = dir.join(format!("{}-{wt:?}.gguf", arch.name()));
        let shape = SyntheticShape {
            hidden: 256,
            ffn: 512,
            vocab: 300,
            ..SyntheticShape::tiny(arch)
        };
        write_synthetic_gguf(&shape, wt, 3, &path).expect("write");
        let file = GgufFile::open(&path).expect("open");
        let spec = LoadSpec::full(file.model_config().expect("config").num_layers);
        let model = Model::load(&file, spec, 256).expect("load");
        if !model.lone_rows_alike() {
            eprintln!("skipped: this machine's kernels compute a lone row otherwise");
            return;
        }
        let prompt: Vec<u32> = (0..13).map(|i| (i * 37 + 5) % 300).collect();
        let whole = rows(
            &model
                .forward(&prompt, &mut model.new_cache(), false)
                .expect("whole"),
        )
        .remove(0);

        // The stream: a sequence of its own, one decode row a step.
        let mut stream = model.new_cache();
        model
            .forward(&[7, 8, 9, 10, 11], &mut stream, false)
            .expect("stream's prompt");
        let mut sliced = model.new_cache();
        let mut last = Vec::new();
        for (k, &token) in prompt.iter().enumerate() {
            let h = model
                .embed(&[(k as u32 * 13 + 1) % 300, token])
                .expect("embed");
            let mut parts = [
                BatchPart {
                    cache: &mut stream,
                    rows: 1,
                },
                BatchPart {
                    cache: &mut sliced,
                    rows: 1,
                },
            ];
            let h = model
                .forward_layers_batch(h, &mut parts, None)
                .expect("step");
            last = rows(&model.head_each(&h).expect("head")).remove(1);
        }
        let scale = whole.iter().fold(1f32, |m, v| m.max(v.abs()));
        let err = whole
            .iter()
            .zip(&last)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!(
            "{} {wt:?}: a row a step vs whole: {err:.2e} (scale {scale:.2})",
            arch.name()
        );
        // Bit for bit: the kernels compute a lone row as they compute it among others,
        // so nothing may move (a last-place change could flip a greedy token).
        assert_eq!(
            whole,
            last,
            "{} {wt:?}: sliced into lone rows the prompt's logits moved by {err}",
            arch.name()
        );
    }
}
