//! The command line: `shoal`'s subcommands and their arguments (clap), as
//! `commands::run` dispatches them.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use shoal_runner::Strategy;

#[derive(Parser, Debug)]
#[command(
    name = "shoal",
    version,
    about = "Serve large language models across the machines you own"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Log filter (tracing syntax, e.g. `info` or `shoal_engine=debug`); SHOAL_LOG overrides.
    #[arg(long, global = true, default_value = "warn")]
    pub(crate) log: String,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Answer a prompt (or chat with -i) on this machine.
    Run(RunArgs),
    /// Install a known model into the store.
    Pull { name: String },
    /// List known and installed models.
    Models {
        #[arg(long)]
        json: bool,
    },
    /// Measure prompt and generation speed.
    Bench(BenchArgs),
    /// Streaming clients against a node for a while (every API, varied prompts, some
    /// that cancel); what became of every request. Fails on any request lost or failed.
    Load(crate::load::LoadArgs),
    /// Score a text file: perplexity and the arg-max prediction at every position.
    Perplexity(PerplexityArgs),
    /// Run this machine's node: join the cluster, take part in it, run its runners.
    Node(NodeArgs),
    /// Print a new cluster key.
    Keygen,
    /// Write a model with generated weights in the shape of a real one (benchmarks where
    /// the real file cannot go, sharding tests).
    Synth {
        /// `qwen2.5-1.5b`, `llama-8b` or `llama-70b`.
        #[arg(long)]
        shape: String,
        /// Matrix type: f32, f16, bf16, q8_0, q4_0, q4k, q6k.
        #[arg(long, default_value = "q4k")]
        dtype: String,
        /// Fewer layers than the real model (a quicker file of the same width).
        #[arg(long)]
        layers: Option<usize>,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long)]
        out: PathBuf,
    },
    /// Nodes, instances and runners of the cluster.
    Status {
        #[command(flatten)]
        node: NodeAddr,
        #[arg(long)]
        json: bool,
    },
    /// Place a model instance on the cluster (or list the ways it fits).
    Place {
        model: String,
        #[command(flatten)]
        node: NodeAddr,
        /// List every valid plan with per-node memory instead of placing.
        #[arg(long)]
        preview: bool,
        #[arg(long)]
        strategy: Option<String>,
        /// Exactly this many ranks: a CPU node is one, a GPU node one per GPU.
        #[arg(long, alias = "ranks")]
        nodes: Option<usize>,
        /// Context length of the instance.
        #[arg(long)]
        ctx: Option<usize>,
        #[arg(long)]
        json: bool,
    },
    /// Remove an instance (its runners stop on every node).
    Delete {
        /// The instance's id, as `shoal status` lists it.
        instance: String,
        #[command(flatten)]
        node: NodeAddr,
    },
    /// One rank of a split model (started by `--ranks N`; the instance token comes in
    /// SHOAL_INSTANCE_TOKEN).
    #[command(hide = true)]
    Rank(RankArgs),
    /// Print the token ids of a text.
    Tokenize {
        #[command(flatten)]
        model: ModelArgs,
        text: String,
    },
}

#[derive(Args, Debug)]
pub(crate) struct ModelArgs {
    /// A known model name (see `shoal models`), a GGUF file or a Hugging Face directory.
    #[arg(long, short = 'm', default_value = "smollm2-135m")]
    pub(crate) model: String,
    /// Context length to serve (default: the model's, at most 8192).
    #[arg(long)]
    pub(crate) ctx: Option<usize>,
    /// Where to compute: `cpu` or `cuda:N` (a CUDA build, bf16). With --ranks: `cuda`
    /// puts rank i on GPU i (tensor parallelism joins them with NCCL), or name one
    /// device per rank, comma-separated.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Compute threads (default: every core; with --ranks, the cores shared out).
    #[arg(long, short = 't')]
    pub(crate) threads: Option<usize>,
    /// Split the model across this many local processes.
    #[arg(long, default_value_t = 1)]
    pub(crate) ranks: usize,
    /// How to split it: pipeline (layer ranges), tensor (slices of every layer) or
    /// sequence (ring attention over the prompt).
    #[arg(long, default_value = "tensor")]
    pub(crate) strategy: Strategy,
    /// Seconds one collective operation between ranks may wait.
    #[arg(long, default_value_t = 120.0)]
    pub(crate) rank_timeout: f64,
}

#[derive(Args, Debug)]
pub(crate) struct RankArgs {
    /// This process's rank (1 and up; rank 0 is the process that started it).
    #[arg(long)]
    pub(crate) rank: usize,
    /// Every rank's address, by rank, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub(crate) addrs: Vec<std::net::SocketAddr>,
    /// The model file or directory.
    #[arg(long)]
    pub(crate) model: PathBuf,
    #[arg(long)]
    pub(crate) strategy: Strategy,
    #[arg(long)]
    pub(crate) ctx: Option<usize>,
    #[arg(long, short = 't')]
    pub(crate) threads: Option<usize>,
    #[arg(long, default_value_t = 120.0)]
    pub(crate) rank_timeout: f64,
    /// The node's control socket (cluster runners): status, heartbeats, and for rank 0
    /// the requests to answer.
    #[arg(long)]
    pub(crate) control: Option<PathBuf>,
    /// Where this rank computes: `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// A listening socket inherited from the node (its port is this rank's address):
    /// the node bound it, so no other process can take the port in between.
    #[arg(long)]
    pub(crate) listen_fd: Option<i32>,
    /// Rank 0: sequences served at once (continuous batching).
    #[arg(long, default_value_t = 16)]
    pub(crate) max_batch: usize,
    /// Rank 0: KV positions over all sequences and kept prefixes (the pool placement
    /// counted); default the context times --max-batch.
    #[arg(long)]
    pub(crate) kv_positions: Option<usize>,
    /// Rank 0: while a prompt is read beside streaming answers, each step is kept within this
    /// many times a decode-only step (the streams' gap between tokens); 0: 256-token
    /// prompt slices whatever they cost. CPU ranks only: GPU ranks always take the latter.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) gap_bound: f64,
}

#[derive(Args, Debug)]
pub(crate) struct NodeArgs {
    /// Where the node keeps its identity, cluster key, state and models.
    #[arg(long)]
    pub(crate) data_dir: Option<PathBuf>,
    /// The control HTTP API.
    #[arg(long, default_value = "127.0.0.1:52415")]
    pub(crate) listen: std::net::SocketAddr,
    /// The libp2p address other nodes reach this one at.
    #[arg(long, default_value = "0.0.0.0:52416")]
    pub(crate) p2p_listen: std::net::SocketAddr,
    /// A peer's libp2p address (repeatable): nodes on other networks, tests.
    #[arg(long)]
    pub(crate) peer: Vec<std::net::SocketAddr>,
    /// The cluster key file (64 hex digits; `shoal keygen` makes one). SHOAL_CLUSTER_KEY
    /// works too; without either the node makes a key in its data directory.
    #[arg(long)]
    pub(crate) cluster_key_file: Option<PathBuf>,
    /// Do not look for nodes on the local network.
    #[arg(long)]
    pub(crate) no_mdns: bool,
    /// Seconds a runner may hold a request without progress before it is killed.
    #[arg(long, default_value_t = 60.0)]
    pub(crate) stall_timeout: f64,
    /// Compute threads per runner.
    #[arg(long)]
    pub(crate) runner_threads: Option<usize>,
    /// Requests an instance serves at once (continuous batching); more wait in a queue.
    #[arg(long, default_value_t = 16)]
    pub(crate) max_batch: usize,
    /// While a prompt is read beside streaming answers, each step is kept within this
    /// many times a decode-only step (the streams' gap between tokens); 0: 256-token
    /// prompt slices whatever they cost. CPU ranks only: GPU ranks always take the latter.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) gap_bound: f64,
    /// The key every API request but /health must carry (Bearer or x-api-key). Seen by
    /// other users in the process list: prefer --api-key-file or SHOAL_API_KEY.
    #[arg(long)]
    pub(crate) api_key: Option<String>,
    /// A file holding the API key.
    #[arg(long)]
    pub(crate) api_key_file: Option<PathBuf>,
    /// Serve the API beyond loopback without a key.
    #[arg(long)]
    pub(crate) insecure: bool,
    /// Answer a request for a known model that has no instance with an error, instead of
    /// placing one (pulling the model if no node has it) and answering once it is ready.
    #[arg(long)]
    pub(crate) no_auto_place: bool,
    /// The most memory this node offers to models, e.g. 12G or 800M (its runners count
    /// against it); default: whatever the machine has free.
    #[arg(long, value_parser = parse_size)]
    pub(crate) memory: Option<u64>,
}

/// A size in bytes: a number with an optional K, M, G or T (powers of 1024; `KiB`,
/// `MB` and the like mean the same).
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(digits);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 800M, 12G)"))?;
    let shift = match unit
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(format!("{text:?}: the unit is K, M, G or T")),
    };
    Ok((number * (1u64 << shift) as f64) as u64)
}

#[derive(Args, Debug)]
pub(crate) struct NodeAddr {
    /// The node to ask (its --listen address).
    #[arg(long, default_value = "127.0.0.1:52415")]
    pub(crate) node: String,
}

#[derive(Args, Debug)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Interactive chat: read a message per line from stdin.
    #[arg(short = 'i', long)]
    pub(crate) interactive: bool,
    /// The prompt (a user message, rendered with the model's chat template).
    pub(crate) prompt: Option<String>,
    /// A system message before the prompt.
    #[arg(long)]
    pub(crate) system: Option<String>,
    /// Send the prompt as raw text, without the chat template.
    #[arg(long)]
    pub(crate) raw: bool,
    #[arg(long, short = 'n', default_value_t = 256)]
    pub(crate) max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) temperature: f32,
    /// 0 keeps all.
    #[arg(long, default_value_t = 0)]
    pub(crate) top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub(crate) top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub(crate) min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub(crate) repeat_penalty: f32,
    #[arg(long, default_value_t = 64)]
    pub(crate) repeat_last_n: usize,
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    pub(crate) stop: Vec<String>,
    /// Prompt tokens per forward pass.
    #[arg(long, default_value_t = 256)]
    pub(crate) prefill_chunk: usize,
    /// Print timing to stderr at the end.
    #[arg(long)]
    pub(crate) stats: bool,
    /// Send the prompt to a cluster through this node (HOST:PORT) instead of running
    /// the model here.
    #[arg(long)]
    pub(crate) node: Option<String>,
}

#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Benchmark this machine alone.
    #[arg(long)]
    pub(crate) local: bool,
    /// Benchmark a live instance through this node (HOST:PORT) under concurrent clients.
    #[arg(long, conflicts_with = "local")]
    pub(crate) node: Option<String>,
    /// With --node: client counts to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub(crate) concurrency: Vec<usize>,
    /// With --node: a warm-up request first.
    #[arg(long)]
    pub(crate) warmup: bool,
    /// Prompt tokens (default 512). With --node, exactly that many (random ordinary
    /// tokens, different for every request), or 0 (the default there): a short chat
    /// question. With --sweep, a comma-separated list.
    #[arg(long, value_delimiter = ',')]
    pub(crate) pp: Vec<usize>,
    /// Tokens to generate; with --sweep, a comma-separated list.
    #[arg(long, value_delimiter = ',', default_value = "128")]
    pub(crate) tg: Vec<usize>,
    /// With --node: place an instance of the model for each of --strategies and
    /// --rank-counts (deleting it after), and bench each over every --pp, --tg and
    /// --concurrency.
    #[arg(long, requires = "node")]
    pub(crate) sweep: bool,
    /// With --sweep: the strategies, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "pipeline")]
    pub(crate) strategies: Vec<String>,
    /// With --sweep: the rank counts, comma-separated (1 is measured once, whatever the
    /// strategies: one rank holds the whole model).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub(crate) rank_counts: Vec<usize>,
    /// With --sweep: an SVG plot of total tok/s against clients.
    #[arg(long)]
    pub(crate) plot: Option<PathBuf>,
    #[arg(long, short = 'r', default_value_t = 3)]
    pub(crate) repeat: usize,
    #[arg(long, default_value_t = 512)]
    pub(crate) prefill_chunk: usize,
    /// With --local: tokens prefilled (untimed) before each generation run, to measure
    /// generation deep into a context (llama-bench's `-d`).
    #[arg(long, default_value_t = 0)]
    pub(crate) depth: usize,
    /// With --local: sequences generating together (one batched forward pass a step, as
    /// a runner serving that many streams); generation is then their total tok/s.
    #[arg(long, default_value_t = 1)]
    pub(crate) batch: usize,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Quantized-matmul kernels: `shoal` (its own), `candle` (the previous ones) or
    /// `dense` (weights dequantized to f32: exact and slow).
    #[arg(long, default_value = "shoal", value_parser = ["shoal", "candle", "dense"])]
    pub(crate) kernels: String,
}

#[derive(Args, Debug)]
pub(crate) struct PerplexityArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    pub(crate) file: PathBuf,
    /// Tokens per scoring window (each starts from an empty cache).
    #[arg(long, default_value_t = 512)]
    pub(crate) window: usize,
    /// Positions per forward pass.
    #[arg(long, default_value_t = 128)]
    pub(crate) chunk: usize,
    #[arg(long)]
    pub(crate) json: bool,
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_are_read_in_powers_of_1024() {
        assert_eq!(parse_size("800M"), Ok(800 << 20));
        assert_eq!(parse_size("12G"), Ok(12 << 30));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2 kb"), Ok(2048));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3X").is_err());
    }
}
