//! `shoal`: the one binary. It runs a model on this machine or split across local
//! processes (`run`, `bench`, `perplexity`, the hidden `rank`), runs a cluster node
//! (`node`, `status`, `place`), and manages the model store (`pull`, `models`, `synth`).

mod args;
mod bench_node;
mod client;
mod commands;
mod load;
mod node_api;
mod sweep;

use std::process::ExitCode;

use clap::Parser;

use args::Cli;

fn main() -> ExitCode {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // SAFETY: the first thing the program does, before any other thread exists.
        // NVLink multicast stays off unless the user asks for it: on shared GPU hosts it
        // can put the GPUs out of service (docs/GPU.md).
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
    let cli = Cli::parse();
    let filter = std::env::var("SHOAL_LOG").unwrap_or_else(|_| cli.log.clone());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|_| "warn".into()),
        )
        .init();
    match commands::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
