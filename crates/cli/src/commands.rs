//! What each subcommand does (its arguments are in `args`).

use std::io::{BufRead, Write};
use std::time::Duration;

use anyhow::{Context, Result, bail};
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
use shoal_runner::{Rank, SplitModel, plan};
use shoal_store::{Resolved, Store, builtin_cards};
use shoal_tokenizer::ChatMessage;

use crate::args::{
    BenchArgs, Cli, Command, ModelArgs, NodeArgs, PerplexityArgs, RankArgs, RunArgs,
};
use crate::client::{delete, place, run_remote, status};

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
    if let Err(e) = rank.warm_up() {
        // Only a head start: the steps themselves load what they need.
        tracing::warn!(error = %e, "warming the kernels up failed; the first request will");
    }
    // On a GPU a step that reads a prompt slice beside the streams costs about the same
    // whatever the slice (its fixed part, the mixed batch's launches, is most of it), so
    // the gap bound would read prompts a token or a few a step: on an H100, 8 clients of
    // a qwen2.5-1.5b Q4_K instance waited 4.5 s (median) for their first token, through
    // 1,568 steps of 1-4 prompt tokens at 28.6 ms each. There, slices are sized by the
    // step-time bound alone.
    let gap_bound = if rank.model().compute().device.is_cuda() {
        0.0
    } else {
        args.gap_bound.max(0.0)
    };
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
    let lone_rows_alike = rank.model().lone_rows_alike();
    let model = SplitModel::new(rank);
    let inbox = control.inbox().context("the control inbox was taken")?;
    let mut config = ServeConfig {
        gap_bound,
        ..ServeConfig::new(engine.context_length(), args.max_batch)
    };
    // One rank's kernels are known here; a split's other ranks may be other machines.
    config.limits.lone_prompt_rows = world == 1 && lone_rows_alike;
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
