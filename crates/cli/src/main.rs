//! `shoal`: the one binary. Today it runs a model on this machine (`run`, `bench`,
//! `perplexity`) and manages the model store (`pull`, `models`).

mod commands;

use std::process::ExitCode;

use clap::Parser;

use commands::Cli;

fn main() -> ExitCode {
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
