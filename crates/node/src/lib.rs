//! `shoal node`: the daemon every machine runs.
//!
//! - [`keys`]: the node's persistent identity and the cluster's pre-shared key.
//! - [`p2p`]: libp2p links (TCP + pnet + Noise + yamux), gossip topics for heartbeats,
//!   commands and events, request-response for catch-up, placement and model files.
//! - [`daemon`]: the node's one event loop, the single owner of its state: election,
//!   the master's event log (persisted, snapshotted, served for catch-up), the
//!   replica's apply, the worker's plan carried out.
//! - [`supervisor`]: runner processes, their control sockets, heartbeats and watchdog.
//! - [`api`]: the control HTTP API (`shoal status`, `shoal place`, `shoal run --node`).
//! - [`forward`]: a request taken by a node without rank 0, answered by the node that
//!   has it over the cluster's link.
//! - [`gpu`]: this machine's GPUs.
//!
//! The loop never waits on a runner, a peer or a socket: every such wait happens in a
//! task of its own that reports back through a channel, with a deadline.

pub mod api;
pub mod daemon;
pub mod forward;
pub mod gpu;
pub mod keys;
pub mod p2p;
pub mod supervisor;

pub use daemon::{NodeConfig, run};

/// Runs a node on a runtime of its own until interrupted (for the CLI, which has none).
pub fn run_blocking(config: NodeConfig) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(config))
}
