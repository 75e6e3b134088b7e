//! Runner processes: one `shoal rank` process per rank this node holds, each tied to the
//! node by a local socket carrying the typed JSON lines of `shoal_runner::control`.
//!
//! Runner → node: its status as it connects, loads and gets ready; a heartbeat every
//! second from a thread of its own; for rank 0, the text, end or error of each request
//! by id. Node → runner (rank 0): every request at once, by id (the runner batches them),
//! and a cancel for each whose client went away, whatever state it is in.
//!
//! The watchdog: a runner whose heartbeats stop for the liveness timeout (frozen), or
//! that has requests in hand but sends nothing for the stall timeout, is killed; its
//! requests end at once with an error, and the node reports the rank failed. Every
//! report goes through one channel to the node's loop, in order.
//!
//! A request's answer is a sequence of [`Piece`]s that ends in `Done` or `Error`; a
//! channel that closes before either (the runner was stopped) is an answer cut short,
//! and whoever reads it says so.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use shoal_cluster::RunnerStatus;
use shoal_runner::control::{
    ErrorKind, FinishReason, FromRunner, GenerateRequest, Timings, ToRunner, ToolCall, Usage,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// An instance's rank.
pub type Key = (String, usize);

/// How to start a runner.
#[derive(Debug)]
pub struct RunnerSpec {
    pub instance: String,
    pub rank: usize,
    pub addrs: Vec<String>,
    pub model: PathBuf,
    pub strategy: String,
    pub context: usize,
    pub token: String,
    /// The `shoal` binary.
    pub exe: PathBuf,
    pub threads: Option<usize>,
    pub max_batch: usize,
    /// Rank 0's KV pool in positions, as placement counted it (0: the runner's default).
    pub kv_positions: usize,
    /// Rank 0's bound on a step beside streams, in decode steps (`shoal rank --gap-bound`).
    pub gap_bound: f64,
    pub socket_dir: PathBuf,
    pub stall_timeout: Duration,
    /// `cpu` or `cuda:N`.
    pub device: String,
    /// The rank's port, bound by the node when it reported it; the runner inherits the
    /// socket, so no other process can take the port in between.
    pub listener: Option<std::net::TcpListener>,
}

/// One piece of an answer, as the node's API and a forwarding peer see it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Piece {
    Text(String),
    /// A call of a function the request offered.
    ToolCall(ToolCall),
    /// The answer is complete.
    Done(Finish),
    /// The answer failed; nothing follows.
    Error(Failure),
    /// Nothing new, but the sender is alive (streams between nodes, when idle).
    Keepalive,
    /// The instance the answer waits for is being placed or loaded (what is happening,
    /// for a person to read); only a node's API makes these, before the answer begins.
    Progress(String),
}

/// How an answer ended.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Finish {
    pub finish_reason: FinishReason,
    pub usage: Usage,
    pub timings: Timings,
}

/// Why an answer failed: the kind decides the status code a client sees.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub kind: ErrorKind,
    pub message: String,
}

impl Piece {
    /// A failure of the serving machinery (a runner, a node, a link), not the request's.
    pub fn broken(message: impl Into<String>) -> Piece {
        Piece::Error(Failure {
            kind: ErrorKind::Broken,
            message: message.into(),
        })
    }

    /// The last piece of an answer.
    pub fn ends(&self) -> bool {
        matches!(self, Piece::Done(_) | Piece::Error(_))
    }
}

/// One request for rank 0 and where its answer goes.
pub struct Job {
    pub request: GenerateRequest,
    /// Unbounded: an answer is bounded by its max_tokens, and a slow client must not
    /// lose its end (or be cancelled) because the runner is faster than its connection.
    pub reply: mpsc::UnboundedSender<Piece>,
}

/// What a runner's task reports to the node.
#[derive(Debug)]
pub enum RunnerReport {
    Status(Key, RunnerStatus),
    Exited(Key, String),
}

/// The node's end of a runner.
pub struct RunnerHandle {
    pub jobs: mpsc::Sender<Job>,
    /// Rank 0's sequences, as the runner last said.
    pub load: Arc<Load>,
    /// The runner process (for its memory in use).
    pub pid: Option<u32>,
    task: Option<tokio::task::JoinHandle<()>>,
    stop: Option<oneshot::Sender<String>>,
}

impl RunnerHandle {
    /// Stops the runner, failing the requests it holds or has queued with `why` (the
    /// client hears what happened, not just that the stream ended).
    pub fn stop(mut self, why: String) {
        if let Some(stop) = self.stop.take()
            && stop.send(why).is_ok()
        {
            // The task ends by itself once it has told the clients.
            self.task.take();
        }
    }
}

impl Drop for RunnerHandle {
    fn drop(&mut self) {
        // The task owns the child (killed on drop) and the socket.
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

/// Sequences a rank-0 runner serves (admitted) and holds waiting for room.
#[derive(Debug, Default)]
pub struct Load {
    pub running: AtomicUsize,
    pub prefilling: AtomicUsize,
    pub waiting: AtomicUsize,
}

/// A runner whose heartbeats stop for this long is frozen.
const LIVENESS: Duration = Duration::from_secs(5);
/// How long a runner may take to connect to its control socket.
const CONNECT: Duration = Duration::from_secs(30);

/// Starts a runner and its supervising task.
pub fn start(
    mut spec: RunnerSpec,
    reports: mpsc::Sender<RunnerReport>,
) -> std::io::Result<RunnerHandle> {
    std::fs::create_dir_all(&spec.socket_dir)?;
    let socket = spec
        .socket_dir
        .join(format!("{}-{}.sock", spec.instance, spec.rank));
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket)?;
    let mut cmd = tokio::process::Command::new(&spec.exe);
    cmd.arg("rank")
        .arg("--rank")
        .arg(spec.rank.to_string())
        .arg("--addrs")
        .arg(spec.addrs.join(","))
        .arg("--model")
        .arg(&spec.model)
        .arg("--strategy")
        .arg(&spec.strategy)
        .arg("--ctx")
        .arg(spec.context.to_string())
        .arg("--control")
        .arg(&socket)
        .arg("--device")
        .arg(&spec.device)
        .env(shoal_runner_token_env(), &spec.token)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    if let Some(t) = spec.threads {
        cmd.arg("--threads").arg(t.to_string());
    }
    cmd.arg("--max-batch").arg(spec.max_batch.to_string());
    if spec.kv_positions > 0 {
        cmd.arg("--kv-positions").arg(spec.kv_positions.to_string());
    }
    cmd.arg("--gap-bound").arg(spec.gap_bound.to_string());
    let rank_listener = spec.listener.take();
    if let Some(l) = &rank_listener {
        use std::os::fd::AsRawFd;
        let fd = l.as_raw_fd();
        cmd.arg("--listen-fd").arg(fd.to_string());
        // SAFETY: between fork and exec only fcntl runs, which is async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let child = cmd.spawn()?;
    let pid = child.id();
    // The runner has its own copy of the socket now.
    drop(rank_listener);
    let (jobs, job_rx) = mpsc::channel(64);
    let (stop, stop_rx) = oneshot::channel();
    let load = Arc::new(Load::default());
    let task = tokio::spawn(supervise(
        spec,
        child,
        listener,
        job_rx,
        stop_rx,
        reports,
        Arc::clone(&load),
    ));
    Ok(RunnerHandle {
        jobs,
        load,
        pid,
        task: Some(task),
        stop: Some(stop),
    })
}

/// The environment variable `shoal rank` reads its instance token from.
fn shoal_runner_token_env() -> &'static str {
    "SHOAL_INSTANCE_TOKEN"
}

async fn supervise(
    spec: RunnerSpec,
    mut child: tokio::process::Child,
    listener: UnixListener,
    mut jobs: mpsc::Receiver<Job>,
    mut stop: oneshot::Receiver<String>,
    reports: mpsc::Sender<RunnerReport>,
    load: Arc<Load>,
) {
    let key: Key = (spec.instance.clone(), spec.rank);
    let report = |r: RunnerReport| {
        let reports = reports.clone();
        async move {
            let _ = reports.send(r).await;
        }
    };
    report(RunnerReport::Status(key.clone(), RunnerStatus::Connecting)).await;
    let stream = tokio::select! {
        a = tokio::time::timeout(CONNECT, listener.accept()) => match a {
            Ok(Ok((s, _))) => s,
            Ok(Err(e)) => return exit(&mut child, &reports, key, format!("control socket: {e}")).await,
            Err(_) => return exit(&mut child, &reports, key, "the runner never connected to its node".into()).await,
        },
        status = child.wait() => {
            return exit(&mut child, &reports, key, format!("exited while starting ({})", describe(status))).await;
        }
        why = &mut stop => {
            let why = why.unwrap_or_else(|_| "stopped by its node".into());
            stop_jobs(&mut jobs, &mut HashMap::new(), &why);
            return exit(&mut child, &reports, key, why).await;
        }
    };
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    // Requests sent to the runner and not yet ended, by id.
    let mut inflight: HashMap<u64, Job> = HashMap::new();
    let mut next_id = 0u64;
    let mut last_heartbeat = Instant::now();
    let mut last_progress = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            line = lines.next_line() => {
                let line = match line {
                    Ok(Some(l)) => l,
                    Ok(None) | Err(_) => {
                        fail_all(&mut inflight, "the runner closed its control socket");
                        let why = match tokio::time::timeout(Duration::from_secs(2), child.wait()).await {
                            Ok(s) => format!("exited ({})", describe(s)),
                            Err(_) => "closed its control socket".into(),
                        };
                        return exit(&mut child, &reports, key, why).await;
                    }
                };
                let msg = match serde_json::from_str::<FromRunner>(&line) {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::warn!(?key, line, error = %e, "a runner sent a line that is not a message");
                        continue;
                    }
                };
                let (id, piece) = match msg {
                    FromRunner::Heartbeat => {
                        last_heartbeat = Instant::now();
                        continue;
                    }
                    FromRunner::Load { running, prefilling, waiting } => {
                        load.running.store(running, Ordering::Relaxed);
                        load.prefilling.store(prefilling, Ordering::Relaxed);
                        load.waiting.store(waiting, Ordering::Relaxed);
                        continue;
                    }
                    FromRunner::Status { status } => {
                        last_progress = Instant::now();
                        report(RunnerReport::Status(key.clone(), status)).await;
                        continue;
                    }
                    FromRunner::Text { id, text } => (id, Piece::Text(text)),
                    FromRunner::ToolCall { id, call } => (id, Piece::ToolCall(call)),
                    FromRunner::Done { id, finish_reason, usage, timings } => (id, Piece::Done(Finish { finish_reason, usage, timings })),
                    FromRunner::Error { id, kind, message } => (id, Piece::Error(Failure { kind, message })),
                };
                last_progress = Instant::now();
                let last = piece.ends();
                let delivered = inflight.get(&id).is_some_and(|j| j.reply.send(piece).is_ok());
                if last || !delivered {
                    // Ended, or its client is gone.
                    if inflight.remove(&id).is_some() && !last {
                        let _ = send(&mut write, &ToRunner::Cancel { id }).await;
                    }
                }
            }
            job = jobs.recv() => match job {
                Some(job) => {
                    next_id += 1;
                    let id = next_id;
                    let msg = ToRunner::Generate { id, request: Box::new(job.request.clone()) };
                    if let Err(e) = send(&mut write, &msg).await {
                        let _ = job.reply.send(Piece::broken(format!("runner unreachable: {e}")));
                    } else {
                        if inflight.is_empty() {
                            last_progress = Instant::now();
                        }
                        inflight.insert(id, job);
                    }
                }
                None => return, // the node dropped the handle; the child dies with us
            },
            why = &mut stop => {
                let why = why.unwrap_or_else(|_| "stopped by its node".into());
                stop_jobs(&mut jobs, &mut inflight, &why);
                return exit(&mut child, &reports, key, why).await;
            }
            status = child.wait() => {
                fail_all(&mut inflight, "the runner exited");
                return exit(&mut child, &reports, key, format!("exited ({})", describe(status))).await;
            }
            _ = tick.tick() => {
                // A client that went away (a closed connection drops its receiver): the
                // runner frees its sequence within a step, queued or running.
                let gone: Vec<u64> = inflight.iter().filter(|(_, j)| j.reply.is_closed()).map(|(id, _)| *id).collect();
                for id in gone {
                    inflight.remove(&id);
                    tracing::debug!(?key, id, "client gone: cancelling");
                    let _ = send(&mut write, &ToRunner::Cancel { id }).await;
                }
                if last_heartbeat.elapsed() > LIVENESS {
                    fail_all(&mut inflight, "the runner froze (no heartbeat)");
                    return exit(&mut child, &reports, key, format!("no heartbeat for {LIVENESS:?}; killed")).await;
                }
                if !inflight.is_empty() && last_progress.elapsed() > spec.stall_timeout {
                    fail_all(&mut inflight, "the runner stalled");
                    return exit(&mut child, &reports, key, format!("no progress for {:?} with requests in hand; killed", spec.stall_timeout)).await;
                }
            }
        }
    }
}

async fn send(write: &mut tokio::net::unix::OwnedWriteHalf, msg: &ToRunner) -> std::io::Result<()> {
    let mut line = serde_json::to_string(msg).map_err(std::io::Error::other)?;
    line.push('\n');
    write.write_all(line.as_bytes()).await
}

fn describe(status: std::io::Result<std::process::ExitStatus>) -> String {
    match status {
        Ok(s) => s.to_string(),
        Err(e) => e.to_string(),
    }
}

fn fail_all(inflight: &mut HashMap<u64, Job>, why: &str) {
    for (_, job) in inflight.drain() {
        let _ = job.reply.send(Piece::broken(why));
    }
}

/// Fails every request held or still in the channel: the runner is stopping.
fn stop_jobs(jobs: &mut mpsc::Receiver<Job>, inflight: &mut HashMap<u64, Job>, why: &str) {
    jobs.close();
    while let Ok(job) = jobs.try_recv() {
        let _ = job.reply.send(Piece::broken(why));
    }
    fail_all(inflight, why);
}

async fn exit(
    child: &mut tokio::process::Child,
    reports: &mpsc::Sender<RunnerReport>,
    key: Key,
    why: String,
) {
    let _ = child.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(2), child.wait()).await;
    tracing::warn!(?key, why, "runner ended");
    let _ = reports.send(RunnerReport::Exited(key, why)).await;
}
