//! This node's part: its resource report and the worker's plan carried out (ports,
//! runners, model copies).

use super::*;

fn meminfo() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

/// A process's resident memory, bytes (0 once it is gone).
fn resident(pid: u32) -> u64 {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    pages * page
}

/// The machine's memory as offered to models: under `--memory`, the limit less what this
/// node's runners hold, never more than the machine has free.
fn offered((total, free): (u64, u64), limit: Option<u64>, runners_hold: u64) -> (u64, u64) {
    match limit {
        Some(limit) => (
            total.min(limit),
            free.min(limit.saturating_sub(runners_hold)),
        ),
        None => (total, free),
    }
}

impl Daemon {
    pub(super) fn info(&self) -> NodeInfo {
        let held = match self.config.memory_limit {
            Some(_) => self
                .runners
                .values()
                .filter_map(|r| r.pid)
                .map(resident)
                .sum(),
            None => 0,
        };
        let (total, free) = offered(meminfo(), self.config.memory_limit, held);
        let models = self.local.models.iter().cloned().collect();
        NodeInfo {
            id: self.me.clone(),
            http: self.http.clone(),
            hostname: self.hostname.clone(),
            resources: Resources {
                memory_total: total,
                // Rounded, so that small changes do not make events (to 64 MiB: a
                // small node's offer is a few hundred).
                memory_free: free / (64 << 20) * (64 << 20),
                cores: std::thread::available_parallelism().map_or(1, |n| n.get()) as u32,
                backend: match &self.gpu {
                    Some(g) => Backend::Cuda {
                        name: g.name.clone(),
                        memory_total: g.total,
                        memory_free: g.free,
                        count: g.count,
                    },
                    None => Backend::Cpu,
                },
            },
            models,
            // Rounded (1 ms, 10 MB/s), so that jitter does not make events.
            links: self
                .links
                .iter()
                .filter(|(id, _)| self.alive.contains_key(*id))
                .map(|(id, l)| {
                    (
                        id.clone(),
                        LinkStats {
                            rtt_us: l.rtt_us.div_ceil(1000) * 1000,
                            bandwidth: l.bandwidth / 10_000_000 * 10_000_000,
                        },
                    )
                })
                .collect(),
            fetching: self
                .fetch_progress
                .iter()
                .map(|(m, f)| (m.clone(), ((f * 100.0) as u8).min(100) / 5 * 5))
                .collect(),
        }
    }

    pub(super) fn report(&mut self) {
        if self.master.is_none() {
            return;
        }
        let info = self.info();
        let due = match &self.last_report {
            Some((last, at)) => last != &info || at.elapsed() > Duration::from_secs(3),
            None => true,
        };
        let missing = self.state.nodes.get(&self.me) != Some(&info);
        if due && missing {
            self.last_report = Some((info.clone(), Instant::now()));
            self.command(Command::Report(info));
        }
    }

    pub(super) fn work(&mut self) {
        self.local.runners = self.runners.keys().cloned().collect();
        self.fetch_backoff
            .retain(|_, until| Instant::now() < *until);
        self.local.fetching = self
            .fetches
            .keys()
            .chain(self.fetch_backoff.keys())
            .cloned()
            .collect();
        self.local.reachable = self
            .peer_ips
            .keys()
            .map(|p| p.to_string())
            .filter(|id| self.alive.contains_key(id))
            .collect();
        self.keep_rank_ports();
        // A port is open while its socket is held here (until the runner takes it).
        self.local.ports = self.rank_listeners.keys().cloned().collect();
        for action in plan(&self.state, &self.me, &self.local) {
            match action {
                Action::Fetch { model, from } => self.start_fetch(&model, &from),
                Action::Pull { model } => self.start_pull(&model),
                Action::OpenPort { instance, rank } => self.open_port(instance, rank),
                Action::Start { instance, rank } => self.start_runner(&instance, rank),
                Action::Stop { instance, rank } => {
                    let why = self.stop_reason(&instance);
                    tracing::info!(instance, rank, why, "stopping runner");
                    if let Some(r) = self.runners.remove(&(instance, rank)) {
                        r.stop(why);
                    }
                }
            }
        }
    }

    /// Why a runner of `instance` is stopped, in words for its clients.
    fn stop_reason(&self, instance: &str) -> String {
        let why = match self.state.instances.get(instance).map(|i| &i.status) {
            Some(InstanceStatus::Failed(r)) => Some(r.clone()),
            _ => self.removed.get(instance).cloned(),
        };
        match why {
            Some(r) if !r.is_empty() => format!("instance {instance} stopped: {r}"),
            _ => format!("instance {instance} was removed"),
        }
    }

    /// Binds the rank's port and reports it. The socket is held here until the runner
    /// starts and inherits it. It listens on every interface (or on the `--p2p-listen`
    /// address when one was given): peers on any network this node is on can reach it,
    /// and the instance token keeps strangers out.
    pub(super) fn open_port(&mut self, instance: String, rank: usize) {
        let ip = self.config.p2p.ip();
        match std::net::TcpListener::bind((ip, 0)).and_then(|l| Ok((l.local_addr()?, l))) {
            Ok((addr, listener)) => {
                self.rank_listeners
                    .insert((instance.clone(), rank), listener);
                self.command(Command::RankPort {
                    instance,
                    rank,
                    port: addr.port(),
                });
            }
            Err(e) => tracing::error!(error = %e, "cannot open a rank port"),
        }
    }

    /// Drops the ports of instances that are gone or failed, and reports again the ones
    /// the state does not show yet (a report lost while the master changed).
    pub(super) fn keep_rank_ports(&mut self) {
        let state = &self.state;
        let live = |(id, rank): &(String, usize)| {
            state
                .instances
                .get(id)
                .filter(|i| !matches!(i.status, InstanceStatus::Failed(_)))
                .and_then(|i| i.ranks.get(*rank))
        };
        self.rank_listeners.retain(|k, _| live(k).is_some());
        let unreported: Vec<Command> = self
            .rank_listeners
            .iter()
            .filter(|(k, _)| live(k).is_some_and(|s| s.port.is_none()))
            .filter_map(|((instance, rank), l)| {
                Some(Command::RankPort {
                    instance: instance.clone(),
                    rank: *rank,
                    port: l.local_addr().ok()?.port(),
                })
            })
            .collect();
        for c in unreported {
            self.command(c);
        }
    }

    /// Every rank's address as this node reaches it: its own ranks on loopback, a peer's
    /// at the address of this node's connection to that peer.
    pub(super) fn rank_addrs(&self, inst: &Instance) -> Option<Vec<String>> {
        inst.ranks
            .iter()
            .map(|r| {
                let port = r.port?;
                let ip = if r.node == self.me {
                    IpAddr::from([127, 0, 0, 1])
                } else {
                    *self.peer_ips.get(&r.node.parse::<PeerId>().ok()?)?
                };
                Some(SocketAddr::new(ip, port).to_string())
            })
            .collect()
    }

    pub(super) fn start_runner(&mut self, instance: &str, rank: usize) {
        let Some(inst) = self.state.instances.get(instance).cloned() else {
            return;
        };
        let Some(card) = find_card(&inst.model) else {
            return;
        };
        let Some(addrs) = self.rank_addrs(&inst) else {
            return; // a peer's address is not known yet: the next tick tries again
        };
        let Some(listener) = self.rank_listeners.remove(&(instance.to_string(), rank)) else {
            // The port was opened by an earlier run of this node: it cannot be had back.
            self.command(Command::RankStatus {
                instance: instance.to_string(),
                rank,
                status: RunnerStatus::Failed("this rank's port was lost (node restarted)".into()),
            });
            return;
        };
        let slot_gpu = inst.ranks.get(rank).and_then(|r| r.gpu);
        let spec = RunnerSpec {
            instance: inst.id.clone(),
            rank,
            addrs,
            model: self.store.model_path(&card),
            strategy: inst.strategy.name().to_string(),
            context: inst.context,
            token: inst.token.clone(),
            exe: self.config.exe.clone(),
            threads: self.config.runner_threads,
            max_batch: self.config.max_batch,
            kv_positions: inst.kv_positions,
            gap_bound: self.config.gap_bound,
            socket_dir: self.config.data_dir.join("runners"),
            stall_timeout: self.config.stall_timeout,
            // The rank's GPU as placed (a CPU build of shoal refuses, and the rank is
            // reported failed with the reason). Tensor ranks on GPUs of this one node
            // join over NCCL by themselves.
            device: match slot_gpu {
                Some(g) => format!("cuda:{g}"),
                None => "cpu".into(),
            },
            listener: Some(listener),
        };
        tracing::info!(instance, rank, addrs = ?spec.addrs, "starting runner");
        match supervisor::start(spec, self.reports_tx.clone()) {
            Ok(h) => {
                self.runners.insert((instance.to_string(), rank), h);
            }
            Err(e) => self.command(Command::RankStatus {
                instance: instance.to_string(),
                rank,
                status: RunnerStatus::Failed(format!("cannot start: {e}")),
            }),
        }
    }

    pub(super) fn on_runner(&mut self, r: RunnerReport) {
        match r {
            RunnerReport::Status((instance, rank), status) => {
                self.command(Command::RankStatus {
                    instance,
                    rank,
                    status,
                });
            }
            RunnerReport::Exited((instance, rank), why) => {
                self.runners.remove(&(instance.clone(), rank));
                self.command(Command::RankStatus {
                    instance,
                    rank,
                    status: RunnerStatus::Failed(why),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::offered;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_memory_limit_offers_the_limit_less_what_the_runners_hold() {
        // No limit: the machine as it is.
        assert_eq!(
            offered((16 * GIB, 9 * GIB), None, 3 * GIB),
            (16 * GIB, 9 * GIB)
        );
        // A limit under what is free: the limit, less the runners' share.
        assert_eq!(
            offered((16 * GIB, 9 * GIB), Some(4 * GIB), GIB),
            (4 * GIB, 3 * GIB)
        );
        // Runners past the limit: nothing more to offer.
        assert_eq!(
            offered((16 * GIB, 9 * GIB), Some(2 * GIB), 3 * GIB),
            (2 * GIB, 0)
        );
        // A limit over what is free: never more than the machine has.
        assert_eq!(
            offered((16 * GIB, 2 * GIB), Some(8 * GIB), 0),
            (8 * GIB, 2 * GIB)
        );
    }
}
