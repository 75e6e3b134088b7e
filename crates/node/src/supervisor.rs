//! Runner processes: one `shoal rank` process per rank this node holds, each tied to the
//! node by a local socket carrying JSON lines.
//!
//! Runner → node: `{"status": …}` as it connects, loads and gets ready; `{"heartbeat":
//! n}` every second from a thread of its own; for rank 0, `{"text": …}`, `{"done": …}`
//! or `{"error": …}` answering a request. Node → runner (rank 0): `{"generate": {…}}`.
//!
//! The watchdog: a runner whose heartbeats stop for the liveness timeout (frozen), or
//! that has a request in hand but sends nothing for the stall timeout, is killed; its
//! request ends at once with an error, and the node reports the rank failed. Every
//! report goes through one channel to the node's loop, in order.
//!
//! A request's answer is a sequence of [`Piece`]s that ends in `Done` or `Error`; a
//! channel that closes before either (the runner was stopped) is an answer cut short,
//! and whoever reads it says so.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use shoal_cluster::RunnerStatus;
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
    /// The answer is complete.
    Done,
    /// The answer failed; nothing follows.
    Error(String),
    /// Nothing new, but the sender is alive (streams between nodes, when idle).
    Keepalive,
}

/// One request for rank 0 and where its answer goes.
pub struct Job {
    pub body: Value,
    pub reply: mpsc::Sender<Piece>,
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
    // The runner has its own copy of the socket now.
    drop(rank_listener);
    let (jobs, job_rx) = mpsc::channel(64);
    let (stop, stop_rx) = oneshot::channel();
    let task = tokio::spawn(supervise(spec, child, listener, job_rx, stop_rx, reports));
    Ok(RunnerHandle {
        jobs,
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
            stop_jobs(&mut jobs, None, &mut VecDeque::new(), &why).await;
            return exit(&mut child, &reports, key, why).await;
        }
    };
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    let mut queue: VecDeque<Job> = VecDeque::new();
    let mut current: Option<Job> = None;
    let mut last_heartbeat = Instant::now();
    let mut last_progress = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        if current.is_none()
            && let Some(job) = queue.pop_front()
        {
            let line = serde_json::json!({ "generate": job.body }).to_string() + "\n";
            if let Err(e) = write.write_all(line.as_bytes()).await {
                let _ = job
                    .reply
                    .send(Piece::Error(format!("runner unreachable: {e}")))
                    .await;
            } else {
                last_progress = Instant::now();
                current = Some(job);
            }
        }
        tokio::select! {
            line = lines.next_line() => {
                let line = match line {
                    Ok(Some(l)) => l,
                    Ok(None) | Err(_) => {
                        fail_jobs(current.take(), &mut queue, "the runner closed its control socket").await;
                        let why = match tokio::time::timeout(Duration::from_secs(2), child.wait()).await {
                            Ok(s) => format!("exited ({})", describe(s)),
                            Err(_) => "closed its control socket".into(),
                        };
                        return exit(&mut child, &reports, key, why).await;
                    }
                };
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    tracing::warn!(?key, line, "a runner sent a line that is not JSON");
                    continue;
                };
                if v.get("heartbeat").is_some() {
                    last_heartbeat = Instant::now();
                } else if let Some(s) = v.get("status") {
                    last_progress = Instant::now();
                    if let Ok(status) = serde_json::from_value::<RunnerStatus>(s.clone()) {
                        report(RunnerReport::Status(key.clone(), status)).await;
                    }
                } else if let Some(t) = v.get("text").and_then(Value::as_str) {
                    last_progress = Instant::now();
                    if let Some(job) = &current {
                        let _ = job.reply.send(Piece::Text(t.to_string())).await;
                    }
                } else if v.get("done").is_some() {
                    if let Some(job) = current.take() {
                        let _ = job.reply.send(Piece::Done).await;
                    }
                } else if let Some(e) = v.get("error")
                    && let Some(job) = current.take()
                {
                    let _ = job.reply.send(Piece::Error(e.as_str().unwrap_or("error").to_string())).await;
                }
            }
            job = jobs.recv() => match job {
                Some(job) => queue.push_back(job),
                None => return, // the node dropped the handle; the child dies with us
            },
            why = &mut stop => {
                let why = why.unwrap_or_else(|_| "stopped by its node".into());
                stop_jobs(&mut jobs, current.take(), &mut queue, &why).await;
                return exit(&mut child, &reports, key, why).await;
            }
            status = child.wait() => {
                fail_jobs(current.take(), &mut queue, "the runner exited").await;
                return exit(&mut child, &reports, key, format!("exited ({})", describe(status))).await;
            }
            _ = tick.tick() => {
                if last_heartbeat.elapsed() > LIVENESS {
                    fail_jobs(current.take(), &mut queue, "the runner froze (no heartbeat)").await;
                    return exit(&mut child, &reports, key, format!("no heartbeat for {LIVENESS:?}; killed")).await;
                }
                if current.is_some() && last_progress.elapsed() > spec.stall_timeout {
                    fail_jobs(current.take(), &mut queue, "the runner stalled").await;
                    return exit(&mut child, &reports, key, format!("no progress for {:?} with a request in hand; killed", spec.stall_timeout)).await;
                }
            }
        }
    }
}

fn describe(status: std::io::Result<std::process::ExitStatus>) -> String {
    match status {
        Ok(s) => s.to_string(),
        Err(e) => e.to_string(),
    }
}

async fn fail_jobs(current: Option<Job>, queue: &mut VecDeque<Job>, why: &str) {
    for job in current.into_iter().chain(queue.drain(..)) {
        let _ = job.reply.send(Piece::Error(why.to_string())).await;
    }
}

/// Fails every request held, queued, or still in the channel: the runner is stopping.
async fn stop_jobs(
    jobs: &mut mpsc::Receiver<Job>,
    current: Option<Job>,
    queue: &mut VecDeque<Job>,
    why: &str,
) {
    jobs.close();
    while let Ok(job) = jobs.try_recv() {
        queue.push_back(job);
    }
    fail_jobs(current, queue, why).await;
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
