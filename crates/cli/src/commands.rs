//! The subcommands and their arguments.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use shoal_cluster::RunnerStatus;
use shoal_collectives::Group;
use shoal_collectives::tcp::{TcpConfig, TcpTransport};
use shoal_engine::{
    BenchConfig, Engine, GenerateParams, LoadOptions, SamplingParams, Session, model_config,
};
use shoal_model::Compute;
use shoal_runner::control::FromRunner;
use shoal_runner::launch::{Launch, LocalRanks, TOKEN_ENV, launch as launch_ranks, rank_devices};
use shoal_runner::link::Link;
use shoal_runner::serve::{ServeConfig, serve};
use shoal_runner::{Rank, SplitModel, Strategy, plan};
use shoal_store::{Resolved, Store, builtin_cards};
use shoal_tokenizer::ChatMessage;

#[derive(Parser, Debug)]
#[command(
    name = "shoal",
    version,
    about = "Serve large language models across the machines you own"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log filter (tracing syntax, e.g. `info` or `shoal_engine=debug`); SHOAL_LOG overrides.
    #[arg(long, global = true, default_value = "warn")]
    pub log: String,
}

#[derive(Subcommand, Debug)]
enum Command {
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
struct ModelArgs {
    /// A known model name (see `shoal models`), a GGUF file or a Hugging Face directory.
    #[arg(long, short = 'm', default_value = "smollm2-135m")]
    model: String,
    /// Context length to serve (default: the model's, at most 8192).
    #[arg(long)]
    ctx: Option<usize>,
    /// Where to compute: `cpu` or `cuda:N` (a CUDA build, bf16). With --ranks: `cuda`
    /// puts rank i on GPU i (tensor parallelism joins them with NCCL), or name one
    /// device per rank, comma-separated.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compute threads (default: every core; with --ranks, the cores shared out).
    #[arg(long, short = 't')]
    threads: Option<usize>,
    /// Split the model across this many local processes.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// How to split it: pipeline (layer ranges), tensor (slices of every layer) or
    /// sequence (ring attention over the prompt).
    #[arg(long, default_value = "tensor")]
    strategy: Strategy,
    /// Seconds one collective operation between ranks may wait.
    #[arg(long, default_value_t = 120.0)]
    rank_timeout: f64,
}

#[derive(Args, Debug)]
struct RankArgs {
    /// This process's rank (1 and up; rank 0 is the process that started it).
    #[arg(long)]
    rank: usize,
    /// Every rank's address, by rank, comma-separated.
    #[arg(long, value_delimiter = ',')]
    addrs: Vec<std::net::SocketAddr>,
    /// The model file or directory.
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    strategy: Strategy,
    #[arg(long)]
    ctx: Option<usize>,
    #[arg(long, short = 't')]
    threads: Option<usize>,
    #[arg(long, default_value_t = 120.0)]
    rank_timeout: f64,
    /// The node's control socket (cluster runners): status, heartbeats, and for rank 0
    /// the requests to answer.
    #[arg(long)]
    control: Option<PathBuf>,
    /// Where this rank computes: `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// A listening socket inherited from the node (its port is this rank's address):
    /// the node bound it, so no other process can take the port in between.
    #[arg(long)]
    listen_fd: Option<i32>,
    /// Rank 0: sequences served at once (continuous batching).
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// Rank 0: KV positions over all sequences and kept prefixes (the pool placement
    /// counted); default the context times --max-batch.
    #[arg(long)]
    kv_positions: Option<usize>,
    /// Rank 0: while a prompt is read beside streaming answers, each step is kept within this
    /// many times a decode-only step (the streams' gap between tokens); 0: 256-token
    /// prompt slices whatever they cost.
    #[arg(long, default_value_t = 2.0)]
    gap_bound: f64,
}

#[derive(Args, Debug)]
struct NodeArgs {
    /// Where the node keeps its identity, cluster key, state and models.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The control HTTP API.
    #[arg(long, default_value = "127.0.0.1:52415")]
    listen: std::net::SocketAddr,
    /// The libp2p address other nodes reach this one at.
    #[arg(long, default_value = "0.0.0.0:52416")]
    p2p_listen: std::net::SocketAddr,
    /// A peer's libp2p address (repeatable): nodes on other networks, tests.
    #[arg(long)]
    peer: Vec<std::net::SocketAddr>,
    /// The cluster key file (64 hex digits; `shoal keygen` makes one). SHOAL_CLUSTER_KEY
    /// works too; without either the node makes a key in its data directory.
    #[arg(long)]
    cluster_key_file: Option<PathBuf>,
    /// Do not look for nodes on the local network.
    #[arg(long)]
    no_mdns: bool,
    /// Seconds a runner may hold a request without progress before it is killed.
    #[arg(long, default_value_t = 60.0)]
    stall_timeout: f64,
    /// Compute threads per runner.
    #[arg(long)]
    runner_threads: Option<usize>,
    /// Requests an instance serves at once (continuous batching); more wait in a queue.
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// While a prompt is read beside streaming answers, each step is kept within this
    /// many times a decode-only step (the streams' gap between tokens); 0: 256-token
    /// prompt slices whatever they cost.
    #[arg(long, default_value_t = 2.0)]
    gap_bound: f64,
    /// The key every API request but /health must carry (Bearer or x-api-key). Seen by
    /// other users in the process list: prefer --api-key-file or SHOAL_API_KEY.
    #[arg(long)]
    api_key: Option<String>,
    /// A file holding the API key.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Serve the API beyond loopback without a key.
    #[arg(long)]
    insecure: bool,
    /// Answer a request for a known model that has no instance with an error, instead of
    /// placing one (pulling the model if no node has it) and answering once it is ready.
    #[arg(long)]
    no_auto_place: bool,
    /// The most memory this node offers to models, e.g. 12G or 800M (its runners count
    /// against it); default: whatever the machine has free.
    #[arg(long, value_parser = parse_size)]
    memory: Option<u64>,
}

/// A size in bytes: a number with an optional K, M, G or T (powers of 1024; `KiB`,
/// `MB` and the like mean the same).
fn parse_size(text: &str) -> Result<u64, String> {
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
struct NodeAddr {
    /// The node to ask (its --listen address).
    #[arg(long, default_value = "127.0.0.1:52415")]
    node: String,
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Interactive chat: read a message per line from stdin.
    #[arg(short = 'i', long)]
    interactive: bool,
    /// The prompt (a user message, rendered with the model's chat template).
    prompt: Option<String>,
    /// A system message before the prompt.
    #[arg(long)]
    system: Option<String>,
    /// Send the prompt as raw text, without the chat template.
    #[arg(long)]
    raw: bool,
    #[arg(long, short = 'n', default_value_t = 256)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// 0 keeps all.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Prompt tokens per forward pass.
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    /// Print timing to stderr at the end.
    #[arg(long)]
    stats: bool,
    /// Send the prompt to a cluster through this node (HOST:PORT) instead of running
    /// the model here.
    #[arg(long)]
    node: Option<String>,
}

#[derive(Args, Debug)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Benchmark this machine alone.
    #[arg(long)]
    local: bool,
    /// Benchmark a live instance through this node (HOST:PORT) under concurrent clients.
    #[arg(long, conflicts_with = "local")]
    node: Option<String>,
    /// With --node: client counts to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    concurrency: Vec<usize>,
    /// With --node: a warm-up request first.
    #[arg(long)]
    warmup: bool,
    /// Prompt tokens (default 512). With --node, exactly that many (random ordinary
    /// tokens, different for every request), or 0 (the default there): a short chat
    /// question. With --sweep, a comma-separated list.
    #[arg(long, value_delimiter = ',')]
    pp: Vec<usize>,
    /// Tokens to generate; with --sweep, a comma-separated list.
    #[arg(long, value_delimiter = ',', default_value = "128")]
    tg: Vec<usize>,
    /// With --node: place an instance of the model for each of --strategies and
    /// --rank-counts (deleting it after), and bench each over every --pp, --tg and
    /// --concurrency.
    #[arg(long, requires = "node")]
    sweep: bool,
    /// With --sweep: the strategies, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "pipeline")]
    strategies: Vec<String>,
    /// With --sweep: the rank counts, comma-separated (1 is measured once, whatever the
    /// strategies: one rank holds the whole model).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    rank_counts: Vec<usize>,
    /// With --sweep: an SVG plot of total tok/s against clients.
    #[arg(long)]
    plot: Option<PathBuf>,
    #[arg(long, short = 'r', default_value_t = 3)]
    repeat: usize,
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// With --local: tokens prefilled (untimed) before each generation run, to measure
    /// generation deep into a context (llama-bench's `-d`).
    #[arg(long, default_value_t = 0)]
    depth: usize,
    /// With --local: sequences generating together (one batched forward pass a step, as
    /// a runner serving that many streams); generation is then their total tok/s.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// One JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Quantized-matmul kernels: `shoal` (its own), `candle` (the previous ones) or
    /// `dense` (weights dequantized to f32: exact and slow).
    #[arg(long, default_value = "shoal", value_parser = ["shoal", "candle", "dense"])]
    kernels: String,
}

#[derive(Args, Debug)]
struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArgs,
    file: PathBuf,
    /// Tokens per scoring window (each starts from an empty cache).
    #[arg(long, default_value_t = 512)]
    window: usize,
    /// Positions per forward pass.
    #[arg(long, default_value_t = 128)]
    chunk: usize,
    #[arg(long)]
    json: bool,
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Run(args) => run_prompt(args),
        Command::Pull { name } => pull(&name),
        Command::Models { json } => models(json),
        Command::Bench(args) => bench(args),
        Command::Load(args) => crate::load::command(args),
        Command::Perplexity(args) => perplexity(args),
        Command::Rank(args) => serve_rank(args),
        Command::Node(args) => node(args),
        Command::Synth {
            shape,
            dtype,
            layers,
            seed,
            out,
        } => synth(&shape, &dtype, layers, seed, &out),
        Command::Keygen => {
            println!("{}", shoal_node::keys::new_cluster_key()?);
            Ok(())
        }
        Command::Status { node, json } => status(&node.node, json),
        Command::Place {
            model,
            node,
            preview,
            strategy,
            nodes,
            ctx,
            json,
        } => place(&node.node, &model, preview, strategy, nodes, ctx, json),
        Command::Delete { instance, node } => delete(&node.node, &instance),
        Command::Tokenize { model, text } => {
            let engine = load(&model)?;
            let ids = engine.tokenizer().encode(&text, false)?;
            println!("{}", serde_json::to_string(&ids)?);
            Ok(())
        }
    }
}

fn set_threads(threads: Option<usize>) {
    let n = threads
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1)
        .max(1);
    let candle = std::env::var("SHOAL_CANDLE_THREADS").unwrap_or_else(|_| n.to_string());
    // SAFETY: called once at start-up, before any thread that reads the environment.
    unsafe {
        std::env::set_var("CANDLE_NUM_THREADS", &candle);
        std::env::set_var("RAYON_NUM_THREADS", &candle);
        std::env::set_var("SHOAL_NUM_THREADS", n.to_string());
        // candle's element-wise workers spin 25,000 pauses after each large operation
        // (a prompt's), competing with the kernels' own threads for the same cores: on
        // 2 cores, 15% of a 64-token prompt's CPU time went to that spin; at 1,000, 3%.
        if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
            std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "1000");
        }
    }
}

fn load(args: &ModelArgs) -> Result<Engine> {
    set_threads(args.threads);
    let store = Store::from_env();
    let path = store.resolve_or_pull(&args.model)?;
    let options = LoadOptions {
        context_length: args.ctx,
        compute: Some(Compute::parse(&args.device)?),
    };
    Engine::load(&path, &options).with_context(|| format!("cannot load {}", path.display()))
}

/// A model ready to compute: in this process, or split across local rank processes
/// that this process leads as rank 0.
struct Loaded {
    engine: Engine,
    split: Option<(SplitModel<TcpTransport>, LocalRanks)>,
}

impl Loaded {
    fn open(args: &ModelArgs) -> Result<Self> {
        if args.ranks <= 1 {
            return Ok(Self {
                engine: load(args)?,
                split: None,
            });
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = args.threads.unwrap_or((cores / args.ranks).max(1));
        set_threads(Some(threads));
        let store = Store::from_env();
        let path = store.resolve_or_pull(&args.model)?;
        let config =
            model_config(&path).with_context(|| format!("cannot load {}", path.display()))?;
        let specs = plan(&config, args.strategy, args.ranks)?;
        let deadline = Duration::from_secs_f64(args.rank_timeout.max(0.1));
        let devices = rank_devices(&args.device, args.ranks)?;
        let launch = Launch {
            exe: std::env::current_exe().context("cannot find the shoal executable")?,
            model: path.clone(),
            strategy: args.strategy,
            world: args.ranks,
            context: args.ctx,
            threads,
            deadline,
            devices: devices.clone(),
        };
        let (transport, ranks) = launch_ranks(&launch)?;
        let spec = specs[0].clone();
        let options = LoadOptions {
            context_length: args.ctx,
            compute: Some(Compute::parse(&devices[0])?),
        };
        let load = spec.load.clone();
        let engine = Engine::load_part(&path, &options, &move |_| load.clone())
            .with_context(|| format!("cannot load {}", path.display()))?;
        let mut rank = Rank::new(spec, engine.shared_model(), Group::new(transport, deadline))?;
        let nccl = rank.connect_devices()?;
        tracing::info!(ranks = args.ranks, strategy = %args.strategy, nccl, "model split across local processes");
        Ok(Self {
            engine,
            split: Some((SplitModel::new(rank), ranks)),
        })
    }

    fn with_session<R>(&mut self, f: impl FnOnce(&Engine, &mut dyn Session) -> R) -> R {
        match &mut self.split {
            Some((model, _)) => f(&self.engine, &mut model.session()),
            None => f(&self.engine, &mut self.engine.session()),
        }
    }

    /// Tells the other ranks to leave and waits for them.
    fn close(self) -> Result<()> {
        if let Some((model, ranks)) = self.split {
            let result = model.shutdown();
            drop(ranks);
            result?;
        }
        Ok(())
    }
}

fn serve_rank(args: RankArgs) -> Result<()> {
    set_threads(args.threads);
    let control = args
        .control
        .as_deref()
        .map(|p| {
            Link::connect(p).with_context(|| format!("cannot reach the node at {}", p.display()))
        })
        .transpose()?;
    if let Some(c) = &control {
        c.status(RunnerStatus::Connecting);
    }
    let result = serve_rank_inner(&args, control.as_ref());
    if let (Some(c), Err(e)) = (&control, &result) {
        c.status(RunnerStatus::Failed(format!("{e:#}")));
    }
    result
}

fn serve_rank_inner(args: &RankArgs, control: Option<&Link>) -> Result<()> {
    let token = std::env::var(TOKEN_ENV).with_context(|| format!("{TOKEN_ENV} is not set"))?;
    let world = args.addrs.len();
    let addr = *args
        .addrs
        .get(args.rank)
        .with_context(|| format!("rank {} of {world} addresses", args.rank))?;
    let listener = match args.listen_fd {
        // SAFETY: the node passed this descriptor for this process to own; nothing else
        // in the process uses it.
        Some(fd) => unsafe { <std::net::TcpListener as std::os::fd::FromRawFd>::from_raw_fd(fd) },
        None => {
            std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?
        }
    };
    let transport = TcpTransport::connect(
        &TcpConfig::new(args.rank, args.addrs.clone(), token),
        listener,
    )?;
    if let Some(c) = control {
        c.status(RunnerStatus::Loading(0.0));
    }
    let config = model_config(&args.model)?;
    let spec = plan(&config, args.strategy, world)?
        .into_iter()
        .nth(args.rank)
        .context("no shard for this rank")?;
    let options = LoadOptions {
        context_length: args.ctx,
        compute: Some(Compute::parse(&args.device)?),
    };
    let load = spec.load.clone();
    let engine = Engine::load_part(&args.model, &options, &move |_| load.clone())?;
    let deadline = Duration::from_secs_f64(args.rank_timeout.max(0.1));
    let mut rank = Rank::new(spec, engine.shared_model(), Group::new(transport, deadline))?;
    rank.connect_devices()?;
    if let Some(c) = control {
        c.status(RunnerStatus::Ready);
    }
    if args.rank > 0 {
        rank.follow()
            .with_context(|| format!("rank {}", args.rank))?;
        return Ok(());
    }
    let Some(control) = control else {
        bail!("rank 0 without --control has nothing to answer");
    };
    let model = SplitModel::new(rank);
    let inbox = control.inbox().context("the control inbox was taken")?;
    let mut config = ServeConfig {
        gap_bound: args.gap_bound.max(0.0),
        ..ServeConfig::new(engine.context_length(), args.max_batch)
    };
    if let Some(pool) = args.kv_positions {
        config = config.with_kv_positions(pool, engine.context_length());
    }
    let send = |m: FromRunner| control.send(&m);
    let served = serve(&engine, &model, &inbox, &send, config);
    let _ = model.shutdown();
    Ok(served?)
}

fn synth(
    shape: &str,
    dtype: &str,
    layers: Option<usize>,
    seed: u64,
    out: &std::path::Path,
) -> Result<()> {
    use candle_core::quantized::GgmlDType;
    let mut s = shoal_model::synthetic::SyntheticShape::preset(shape)
        .with_context(|| format!("unknown shape {shape:?} (qwen2.5-1.5b, llama-8b, llama-70b)"))?;
    if let Some(l) = layers {
        s.layers = l.max(1);
    }
    let dt = match dtype {
        "f32" => GgmlDType::F32,
        "f16" => GgmlDType::F16,
        "bf16" => GgmlDType::BF16,
        "q8_0" => GgmlDType::Q8_0,
        "q4_0" => GgmlDType::Q4_0,
        "q4k" => GgmlDType::Q4K,
        "q6k" => GgmlDType::Q6K,
        _ => bail!("unknown dtype {dtype:?} (f32, f16, bf16, q8_0, q4_0, q4k, q6k)"),
    };
    let started = std::time::Instant::now();
    shoal_model::synthetic::write_synthetic_gguf_fast(&s, dt, seed, out)?;
    let size = std::fs::metadata(out).map_or(0, |m| m.len());
    println!(
        "wrote {} ({shape}, {} layers, {dtype}, {:.2} GB) in {:.1}s",
        out.display(),
        s.layers,
        size as f64 / 1e9,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn node(args: NodeArgs) -> Result<()> {
    let api_key = api_key(&args)?;
    let data_dir = args
        .data_dir
        .unwrap_or_else(|| Store::from_env().home().join("node"));
    shoal_node::run_blocking(shoal_node::NodeConfig {
        data_dir,
        http: args.listen,
        p2p: args.p2p_listen,
        peers: args.peer,
        cluster_key_file: args.cluster_key_file,
        mdns: !args.no_mdns,
        stall_timeout: Duration::from_secs_f64(args.stall_timeout.max(1.0)),
        exe: std::env::current_exe().context("cannot find the shoal executable")?,
        runner_threads: args.runner_threads,
        max_batch: args.max_batch.max(1),
        gap_bound: args.gap_bound.max(0.0),
        api_key,
        insecure: args.insecure,
        auto_place: !args.no_auto_place,
        memory_limit: args.memory,
    })
}

/// The node's API key: `--api-key`, else `--api-key-file`, else `SHOAL_API_KEY`.
fn api_key(args: &NodeArgs) -> Result<Option<String>> {
    let key = match (&args.api_key, &args.api_key_file) {
        (Some(k), _) => Some(k.clone()),
        (None, Some(f)) => Some(
            std::fs::read_to_string(f)
                .with_context(|| format!("cannot read the API key file {}", f.display()))?,
        ),
        (None, None) => std::env::var("SHOAL_API_KEY").ok(),
    };
    let key = key.map(|k| k.trim().to_string());
    if key.as_deref() == Some("") {
        bail!("the API key is empty");
    }
    Ok(key)
}

/// A request to a node, with the API key of `SHOAL_API_KEY` when there is one.
pub(crate) fn keyed<B>(req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
    match std::env::var("SHOAL_API_KEY") {
        Ok(k) if !k.trim().is_empty() => {
            req.header("authorization", format!("Bearer {}", k.trim()))
        }
        _ => req,
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .max_redirects(0)
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(5)))
        .build()
        .into()
}

/// The error a node answered with, from its JSON body.
fn node_error(status: u16, body: &str) -> anyhow::Error {
    let msg = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            let e = v.get("error")?;
            e.as_str()
                .or(e.get("message")?.as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| body.trim().to_string());
    anyhow::anyhow!("the node answered {status}: {msg}")
}

fn get_json(node: &str, path: &str) -> Result<serde_json::Value> {
    let url = format!("http://{node}{path}");
    let sent = keyed(agent().get(&url))
        .config()
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .call();
    read_answer(node, sent)
}

/// A node's answer: its JSON body, or the error it answered with.
fn read_answer(
    node: &str,
    sent: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> Result<serde_json::Value> {
    let resp = sent.with_context(|| format!("cannot reach the node at {node}"))?;
    let status = resp.status().as_u16();
    let body = resp.into_body().read_to_string()?;
    if status != 200 {
        return Err(node_error(status, &body));
    }
    Ok(serde_json::from_str(&body)?)
}

fn post_json(node: &str, path: &str, body: &serde_json::Value) -> Result<serde_json::Value> {
    let url = format!("http://{node}{path}");
    let sent = keyed(agent().post(&url))
        .config()
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .send_json(body);
    read_answer(node, sent)
}

fn delete(node: &str, instance: &str) -> Result<()> {
    let url = format!("http://{node}/v1/instances/{instance}");
    let sent = keyed(agent().delete(&url))
        .config()
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .call();
    read_answer(node, sent)?;
    println!("deleted {instance}");
    Ok(())
}

fn status(node: &str, json: bool) -> Result<()> {
    let v = get_json(node, "/v1/status")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let s = |v: &serde_json::Value| v.as_str().unwrap_or("-").to_string();
    println!("node   {}", s(&v["node_id"]));
    println!(
        "master {} (term {}, index {})",
        s(&v["master_id"]),
        v["term"],
        v["index"]
    );
    println!("nodes:");
    for n in v["nodes"].as_array().into_iter().flatten() {
        let r = &n["resources"];
        let b = &r["backend"];
        let gpus = match b["kind"].as_str() {
            Some("cuda") => format!(
                "  {} x {} ({}/{} MiB free each)",
                b["count"].as_u64().unwrap_or(1),
                s(&b["name"]),
                b["memory_free"].as_u64().unwrap_or(0) >> 20,
                b["memory_total"].as_u64().unwrap_or(0) >> 20,
            ),
            _ => String::new(),
        };
        println!(
            "  {}  http {}  memory {}/{} MiB free  cores {}{gpus}  models {}",
            s(&n["id"]),
            s(&n["http"]),
            r["memory_free"].as_u64().unwrap_or(0) >> 20,
            r["memory_total"].as_u64().unwrap_or(0) >> 20,
            r["cores"],
            n["models"]
        );
    }
    println!("instances:");
    for i in v["instances"].as_array().into_iter().flatten() {
        println!(
            "  {}  {}  {}  {}",
            s(&i["id"]),
            s(&i["model"]),
            s(&i["strategy"]),
            i["status"]
        );
        for (r, slot) in i["ranks"].as_array().into_iter().flatten().enumerate() {
            let on = slot["gpu"]
                .as_u64()
                .map_or(String::new(), |g| format!(" GPU {g}"));
            println!(
                "    rank {r}: {}{on}  port {}  {}",
                s(&slot["node"]),
                slot["port"].as_u64().map_or("-".into(), |p| p.to_string()),
                slot["status"]
            );
        }
    }
    Ok(())
}

fn place(
    node: &str,
    model: &str,
    preview: bool,
    strategy: Option<String>,
    nodes: Option<usize>,
    ctx: Option<usize>,
    json: bool,
) -> Result<()> {
    let body = serde_json::json!({
        "model": model, "strategy": strategy, "nodes": nodes, "ctx": ctx, "preview": preview,
    });
    let v = post_json(node, "/v1/place", &body)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if preview {
        for p in v.as_array().into_iter().flatten() {
            let mem: Vec<String> = p["memory"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|m| format!("{} MiB", m.as_u64().unwrap_or(0) >> 20))
                .collect();
            let gpus: Vec<String> = p["gpus"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|g| g.as_u64().map_or(String::new(), |g| format!(" GPU {g}")))
                .chain(std::iter::repeat(String::new()))
                .take(mem.len())
                .collect();
            println!(
                "{:<9} over {} rank(s): {}",
                p["strategy"].as_str().unwrap_or(""),
                p["nodes"].as_array().map_or(0, Vec::len),
                p["nodes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .zip(&mem)
                    .zip(&gpus)
                    .map(|((n, m), g)| format!("{}{g} {m}", n.as_str().unwrap_or("")))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    } else {
        println!(
            "placed {} ({} over {} node(s))",
            v["id"].as_str().unwrap_or(""),
            v["strategy"].as_str().unwrap_or(""),
            v["ranks"].as_array().map_or(0, Vec::len)
        );
    }
    Ok(())
}

/// A node that sends nothing for this long (not even its one-second keepalive) has
/// lost the connection or froze.
const NODE_SILENCE: Duration = Duration::from_secs(8);

fn run_remote(node: &str, args: &RunArgs) -> Result<()> {
    let model = &args.model.model;
    let body = serde_json::json!({
        "model": model,
        "prompt": args.prompt.clone().unwrap_or_default(),
        "raw": args.raw,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
    });
    let url = format!("http://{node}/v1/run");
    let resp = keyed(agent().post(&url))
        .send_json(&body)
        .with_context(|| format!("cannot reach the node at {node}"))?;
    let status = resp.status().as_u16();
    if status != 200 {
        let text = resp.into_body().read_to_string().unwrap_or_default();
        return Err(node_error(status, &text));
    }
    // Lines are read on a thread of their own so that a silent connection (a cut cable
    // sends nothing, not even an end) is noticed here with a deadline.
    let reader = std::io::BufReader::new(resp.into_body().into_reader());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(reader) {
            let failed = line.is_err();
            if tx.send(line).is_err() || failed {
                return;
            }
        }
    });
    let mut out = std::io::stdout().lock();
    loop {
        let line = match rx.recv_timeout(NODE_SILENCE) {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                writeln!(out)?;
                bail!("the answer's stream from {node} broke: {e}");
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                writeln!(out)?;
                bail!(
                    "no word from the node at {node} for {NODE_SILENCE:?}: the connection is cut or the node froze"
                );
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                writeln!(out)?;
                bail!("the node at {node} ended the stream before the answer was complete");
            }
        };
        if line.trim().is_empty() {
            continue; // keepalive
        }
        let v: serde_json::Value = serde_json::from_str(&line)
            .with_context(|| format!("the node sent a line that is not JSON: {line:?}"))?;
        if let Some(t) = v.get("text").and_then(|t| t.as_str()) {
            out.write_all(t.as_bytes())?;
            out.flush()?;
        } else if v.get("done").is_some() {
            writeln!(out)?;
            return Ok(());
        } else if let Some(e) = v.get("error") {
            writeln!(out)?;
            bail!("{}", e.as_str().unwrap_or("the answer failed"));
        }
    }
}

fn run_prompt(args: RunArgs) -> Result<()> {
    if !args.interactive && args.prompt.is_none() {
        bail!("give a prompt, or -i for an interactive chat");
    }
    if let Some(node) = &args.node {
        return run_remote(node, &args);
    }
    let mut loaded = Loaded::open(&args.model)?;
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repeat_penalty,
            repeat_last_n: args.repeat_last_n,
            seed: args.seed,
            ..SamplingParams::default()
        },
        prefill_chunk: args.prefill_chunk,
        shown_tokens: Vec::new(),
    };
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(ChatMessage::new("system", system.clone()));
    }
    if !args.interactive {
        let prompt = args.prompt.unwrap_or_default();
        let ids = if args.raw {
            loaded.engine.raw_prompt(&prompt)?
        } else {
            messages.push(ChatMessage::new("user", prompt));
            loaded.engine.chat_prompt(&messages)?
        };
        let result = loaded
            .with_session(|engine, session| answer(engine, session, &ids, &params, args.stats));
        let closed = loaded.close();
        result?;
        return closed;
    }
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.is_empty() {
            continue;
        }
        messages.push(ChatMessage::new("user", line));
        let ids = loaded.engine.chat_prompt(&messages)?;
        let result = loaded
            .with_session(|engine, session| answer(engine, session, &ids, &params, args.stats));
        match result {
            Ok(text) => messages.push(ChatMessage::new("assistant", text)),
            Err(e) => {
                // The conversation goes on; the failed turn is dropped.
                eprintln!("error: {e:#}");
                messages.pop();
            }
        }
    }
    loaded.close()
}

/// Streams one answer to stdout; returns its text.
fn answer(
    engine: &Engine,
    session: &mut dyn Session,
    ids: &[u32],
    params: &GenerateParams,
    stats: bool,
) -> Result<String> {
    let mut out = std::io::stdout().lock();
    let generation = engine.generate_in(session, ids, params, &mut |piece| {
        out.write_all(piece.as_bytes())
            .and_then(|_| out.flush())
            .is_ok()
    })?;
    let _ = writeln!(out);
    if stats {
        let n = generation.tokens.len();
        eprintln!(
            "prompt {} tokens in {:.2}s ({:.1} tok/s); answer {} tokens in {:.2}s ({:.1} tok/s); {:?}",
            generation.prompt_tokens,
            generation.prefill_secs,
            generation.prompt_tokens as f64 / generation.prefill_secs.max(1e-9),
            n,
            generation.decode_secs,
            n as f64 / generation.decode_secs.max(1e-9),
            generation.finish_reason,
        );
    }
    Ok(generation.text)
}

fn pull(name: &str) -> Result<()> {
    let store = Store::from_env();
    match store.resolve(name)? {
        Resolved::Path(p) => bail!("{} is a path, not a model name", p.display()),
        Resolved::Installed(_, path) => println!("{name} is installed at {}", path.display()),
        Resolved::Missing(card) => {
            let path = store.pull(&card)?;
            println!("{name} installed at {}", path.display());
        }
    }
    Ok(())
}

fn models(json: bool) -> Result<()> {
    let store = Store::from_env();
    let rows: Vec<serde_json::Value> = builtin_cards()
        .into_iter()
        .map(|card| {
            let installed = store.is_installed(&card);
            serde_json::json!({
                "name": card.name,
                "architecture": card.architecture,
                "parameters": card.parameters,
                "size": card.size,
                "installed": installed,
                "path": installed.then(|| store.model_path(&card)),
                "description": card.description,
            })
        })
        .collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{:<22} {:<7} {:>6} {:>9}  {:<10} description",
        "name", "arch", "params", "size", "installed"
    );
    for r in &rows {
        println!(
            "{:<22} {:<7} {:>6} {:>6} MB  {:<10} {}",
            r["name"].as_str().unwrap_or(""),
            r["architecture"].as_str().unwrap_or(""),
            r["parameters"].as_str().unwrap_or(""),
            r["size"].as_u64().unwrap_or(0) / 1_000_000,
            if r["installed"].as_bool().unwrap_or(false) {
                "yes"
            } else {
                "no"
            },
            r["description"].as_str().unwrap_or(""),
        );
    }
    println!("store: {}", store.home().display());
    Ok(())
}

fn bar(len: u64, msg: &str) -> ProgressBar {
    let bar = ProgressBar::new(len).with_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(msg.to_string());
    bar
}

fn bench(args: BenchArgs) -> Result<()> {
    let first = |list: &[usize], or: usize| list.first().copied().unwrap_or(or);
    if let (true, Some(node)) = (args.sweep, &args.node) {
        let options = crate::sweep::Options {
            node: node.clone(),
            model: args.model.model.clone(),
            strategies: args.strategies.clone(),
            ranks: args.rank_counts.clone(),
            pp: if args.pp.is_empty() {
                vec![0]
            } else {
                args.pp.clone()
            },
            tg: args.tg.clone(),
            concurrency: args.concurrency.clone(),
            repeat: args.repeat.max(1),
            ctx: args.model.ctx.unwrap_or(2048),
        };
        let runs = crate::sweep::run(&options)?;
        if let Some(path) = &args.plot {
            crate::sweep::plot(&args.model.model, &runs, path)?;
            eprintln!("plot: {}", path.display());
        }
        if args.json {
            println!("{}", serde_json::to_string_pretty(&runs)?);
        } else {
            crate::sweep::print(&args.model.model, &runs);
        }
        if let Some(why) = crate::sweep::first_failure(&runs) {
            bail!("{why}");
        }
        return Ok(());
    }
    if let Some(node) = &args.node {
        let options = crate::bench_node::Options {
            node: node.clone(),
            model: Some(args.model.model.clone()),
            concurrency: args.concurrency.clone(),
            pp: first(&args.pp, 0),
            tg: first(&args.tg, 128),
            repeat: args.repeat.max(1),
            warmup: args.warmup,
        };
        let rows = crate::bench_node::run(&options)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&rows)?);
        } else {
            crate::bench_node::print(&args.model.model, &rows);
        }
        if let Some(why) = crate::bench_node::first_failure(&rows) {
            bail!("{why}");
        }
        return Ok(());
    }
    if !args.local {
        bail!(
            "say where: `shoal bench --local` (this machine) or `--node HOST:PORT` (an instance)"
        );
    }
    // SAFETY: start-up, before any thread reads the environment.
    unsafe { std::env::set_var("SHOAL_KERNELS", &args.kernels) };
    if args.batch > 1 && args.model.ranks > 1 {
        bail!("--batch measures one process's whole model: leave out --ranks");
    }
    let mut loaded = Loaded::open(&args.model)?;
    let config = BenchConfig {
        pp: first(&args.pp, 512),
        tg: first(&args.tg, 128),
        repeat: args.repeat.max(1),
        prefill_chunk: args.prefill_chunk,
        depth: args.depth,
        batch: args.batch.max(1),
    };
    let progress = bar(0, "bench");
    let report = loaded.with_session(|engine, session| {
        engine.bench_in(session, &config, &mut |done, total| {
            progress.set_length(total as u64);
            progress.set_position(done as u64);
        })
    });
    progress.finish_and_clear();
    let closed = loaded.close();
    let report = report?;
    closed?;
    let threads = std::env::var("CANDLE_NUM_THREADS").unwrap_or_default();
    if args.json {
        let v = serde_json::json!({
            "model": args.model.model,
            "threads": threads.parse::<usize>().ok(),
            "kernels": args.kernels,
            "ranks": args.model.ranks,
            "strategy": (args.model.ranks > 1).then(|| args.model.strategy.name()),
            "pp": report.pp,
            "tg": report.tg,
            "repeat": report.repeat,
            "depth": report.depth,
            "batch": report.batch,
            "prompt_tps": report.prompt.median,
            "generation_tps": report.generation.median,
            "prompt": report.prompt,
            "generation": report.generation,
            "peak_rss_bytes": report.peak_rss_bytes,
        });
        println!("{v}");
        return Ok(());
    }
    println!(
        "model {} threads {threads} kernels {}{}",
        args.model.model,
        args.kernels,
        if args.model.ranks > 1 {
            format!(
                " ranks {} strategy {}",
                args.model.ranks, args.model.strategy
            )
        } else {
            String::new()
        }
    );
    println!(
        "{:<12} {:>10} {:>10} {:>10}",
        "test", "median", "min", "max"
    );
    let row = |name: String, s: &shoal_engine::Stats| {
        println!(
            "{name:<12} {:>10.1} {:>10.1} {:>10.1}",
            s.median, s.min, s.max
        );
    };
    if report.pp > 0 {
        row(format!("pp{}", report.pp), &report.prompt);
    }
    let mut tg = match report.depth {
        0 => format!("tg{}", report.tg),
        d => format!("tg{} @ d{d}", report.tg),
    };
    if report.batch > 1 {
        tg = format!("{tg} x{}", report.batch);
    }
    row(tg, &report.generation);
    println!(
        "tokens/s over {} runs; peak RSS {:.1} MiB",
        report.repeat,
        report.peak_rss_bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}

fn perplexity(args: PerplexityArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("cannot read {}", args.file.display()))?;
    let mut loaded = Loaded::open(&args.model)?;
    let progress = bar(0, "scoring");
    let result = loaded.with_session(|engine, session| {
        engine.perplexity_in(
            session,
            &text,
            args.window,
            args.chunk,
            &mut |done, total| {
                progress.set_length(total as u64);
                progress.set_position(done as u64);
            },
        )
    });
    progress.finish_and_clear();
    let closed = loaded.close();
    let result = result?;
    closed?;
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        println!(
            "tokens {} perplexity {:.4}",
            result.tokens.len(),
            result.ppl
        );
    }
    Ok(())
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
