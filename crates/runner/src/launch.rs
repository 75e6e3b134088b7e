//! Starting the ranks of an instance as local processes (`--ranks N` on one machine).
//!
//! The calling process is rank 0. It picks a loopback port per rank, makes a fresh
//! instance token, and starts `shoal rank …` for ranks 1..N with the token in their
//! environment (not on the command line, where other users could read it). The returned
//! guard owns the children: dropped, it gives them a moment to leave after the shutdown
//! step and kills any that did not. A child whose rank 0 dies notices within the
//! heartbeat liveness timeout and exits on its own. Children inherit the rest of the
//! environment, `NCCL_NVLS_ENABLE=0` included (the `shoal` binary sets it at start-up).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shoal_collectives::tcp::{TcpConfig, TcpTransport, loopback_listeners};

use crate::RankError;
use crate::shard::Strategy;

/// The environment variable that carries the instance token to a rank.
pub const TOKEN_ENV: &str = "SHOAL_INSTANCE_TOKEN";

/// What to start.
#[derive(Clone, Debug)]
pub struct Launch {
    /// The `shoal` binary (the current executable).
    pub exe: PathBuf,
    pub model: PathBuf,
    pub strategy: Strategy,
    pub world: usize,
    /// Context length, when the user chose one (every rank must use the same).
    pub context: Option<usize>,
    /// Compute threads of each rank.
    pub threads: usize,
    /// The longest one collective operation may wait.
    pub deadline: Duration,
    /// Where each rank computes (`cpu`, `cuda:N`), by rank; rank 0 is this process.
    pub devices: Vec<String>,
}

/// Where each of `world` ranks computes, from `--device`: `cpu`; `cuda` (rank i on GPU
/// i, one process per GPU); one device for all; or a comma-separated list, one per rank.
pub fn rank_devices(spec: &str, world: usize) -> Result<Vec<String>, RankError> {
    if spec == "cuda" {
        return Ok((0..world).map(|i| format!("cuda:{i}")).collect());
    }
    let list: Vec<String> = spec.split(',').map(|d| d.trim().to_string()).collect();
    match list.len() {
        1 => Ok(vec![list[0].clone(); world]),
        n if n == world => Ok(list),
        n => Err(RankError::Invalid(format!(
            "--device names {n} devices for {world} ranks"
        ))),
    }
}

/// The child processes of ranks 1..N.
pub struct LocalRanks {
    children: Vec<(usize, Child)>,
}

impl LocalRanks {
    /// Process ids by rank, for tests and diagnostics.
    pub fn pids(&self) -> Vec<(usize, u32)> {
        self.children.iter().map(|(r, c)| (*r, c.id())).collect()
    }
}

impl Drop for LocalRanks {
    fn drop(&mut self) {
        let until = Instant::now() + Duration::from_secs(3);
        for (rank, child) in &mut self.children {
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => {
                        tracing::debug!(rank = *rank, %status, "rank exited");
                        break;
                    }
                    Ok(None) if Instant::now() < until => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    _ => {
                        tracing::warn!(rank = *rank, "rank did not exit; killing it");
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
    }
}

/// A fresh random token: 128 bits from the OS, hex.
pub fn new_token() -> Result<String, RankError> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| RankError::Plan(format!("no randomness for the instance token: {e}")))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Starts ranks 1..N and connects this process as rank 0.
pub fn launch(l: &Launch) -> Result<(TcpTransport, LocalRanks), RankError> {
    if l.world < 2 {
        return Err(RankError::Plan("launching ranks needs at least 2".into()));
    }
    if l.devices.len() != l.world {
        return Err(RankError::Plan(format!(
            "{} devices for {} ranks",
            l.devices.len(),
            l.world
        )));
    }
    let mut listeners = loopback_listeners(l.world)?;
    let addrs: Vec<_> = listeners.iter().map(|(_, a)| *a).collect();
    // Free the children's ports for them to bind (rank 0 keeps its listener).
    let (own, _) = listeners.remove(0);
    drop(listeners);
    let token = new_token()?;
    let joined = addrs
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut ranks = LocalRanks {
        children: Vec::new(),
    };
    for rank in 1..l.world {
        let mut cmd = Command::new(&l.exe);
        cmd.arg("rank")
            .arg("--rank")
            .arg(rank.to_string())
            .arg("--addrs")
            .arg(&joined)
            .arg("--model")
            .arg(&l.model)
            .arg("--strategy")
            .arg(l.strategy.name())
            .arg("--threads")
            .arg(l.threads.to_string())
            .arg("--rank-timeout")
            .arg(l.deadline.as_secs_f64().to_string())
            .arg("--device")
            .arg(&l.devices[rank])
            .env(TOKEN_ENV, &token)
            .stdin(Stdio::null());
        if let Some(c) = l.context {
            cmd.arg("--ctx").arg(c.to_string());
        }
        let child = cmd.spawn().map_err(|e| {
            RankError::Plan(format!(
                "cannot start rank {rank} ({}): {e}",
                l.exe.display()
            ))
        })?;
        ranks.children.push((rank, child));
    }
    let config = TcpConfig::new(0, addrs, token);
    let transport = TcpTransport::connect(&config, own)?;
    Ok((transport, ranks))
}
