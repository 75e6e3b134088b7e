//! With the `cuda` feature: compiles the GPU kernels (src/transformer/decode.cu for one
//! token's step, src/transformer/prefill.cu for many rows) to PTX with the CUDA
//! toolchain's `nvcc` (scripts/build-cuda.sh puts it on PATH and sets CUDA_COMPUTE_CAP).
//! Without it, nothing: a CPU build needs no CUDA toolchain.

use std::path::PathBuf;
use std::process::Command;

const SOURCES: [&str; 2] = ["decode", "prefill"];

fn main() {
    for name in SOURCES {
        println!("cargo:rerun-if-changed=src/transformer/{name}.cu");
    }
    // decode.cu includes its parts from decode/ (cargo scans the folder).
    println!("cargo:rerun-if-changed=src/transformer/decode");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    for name in SOURCES {
        let out =
            PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join(format!("{name}.ptx"));
        let src = format!("src/transformer/{name}.cu");
        let status = Command::new("nvcc")
            .args(["--ptx", "-O3", "-std=c++17", "-lineinfo"])
            .arg(format!("-arch=compute_{cap}"))
            .arg(&src)
            .arg("-o")
            .arg(&out)
            .status()
            .expect("nvcc (the CUDA toolchain: scripts/build-cuda.sh) could not be run");
        assert!(status.success(), "nvcc failed on {src}");
    }
}
