//! The node's event loop: the single owner of everything the node knows.
//!
//! Inputs arrive as messages (swarm events, API calls, runner reports, a 250 ms tick);
//! the loop updates its state and sends messages out; it never blocks on a peer or a
//! runner. Each tick: a heartbeat; the liveness view; the election decision; as master,
//! node-loss detection and re-placement of failed instances; a resource report; the
//! worker's plan carried out.
//!
//! Replication: the master numbers every event, applies it, persists it (an event log
//! and a snapshot in the data directory) and publishes it. A replica applies events in
//! order; on a gap, or when it follows a new master, it asks the master for a snapshot.
//! A node about to lead first catches up from any live node that has seen more.

use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use libp2p::gossipsub;
use libp2p::request_response::{self, OutboundRequestId, ResponseChannel};
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId, Swarm};
use sha2::{Digest, Sha256};
use shoal_cluster::election::{Decision, decide};
use shoal_cluster::placement::{ModelFacts, PlaceRequest, Plan, place};
use shoal_cluster::worker::{Action, Local, plan};
use shoal_cluster::{
    Backend, ClusterState, Event, Indexed, Instance, InstanceStatus, LinkStats, NodeId, NodeInfo,
    RankSlot, Resources, RunnerStatus, apply,
};
use shoal_store::{ModelCard, Store, builtin_cards, find_card};
use tokio::sync::{mpsc, oneshot};

use crate::keys::{KeySource, cluster_key, load_or_create_identity};
use crate::p2p::{
    self, Behaviour, BehaviourEvent, COMMANDS_TOPIC, Command, EVENTS_TOPIC, HEARTBEAT_TOPIC,
    Heartbeat, Published, Request, Response,
};
use crate::supervisor::{self, Job, RunnerHandle, RunnerReport, RunnerSpec};

/// How a node is started.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub data_dir: PathBuf,
    /// The control HTTP API.
    pub http: SocketAddr,
    /// libp2p.
    pub p2p: SocketAddr,
    /// Peers to dial (other networks, tests).
    pub peers: Vec<SocketAddr>,
    pub cluster_key_file: Option<PathBuf>,
    pub mdns: bool,
    /// A runner with a request in hand and no progress for this long is killed.
    pub stall_timeout: Duration,
    /// The `shoal` binary, started for runners.
    pub exe: PathBuf,
    /// Compute threads per runner (default: the runner's own default).
    pub runner_threads: Option<usize>,
}

const TICK: Duration = Duration::from_millis(250);
/// A node silent for this long is dead.
const NODE_TIMEOUT: Duration = Duration::from_millis(2500);
/// How long a starting node listens before taking part in the election.
const GRACE: Duration = Duration::from_millis(1500);
const CHUNK: u64 = 4 << 20;
/// Placements of a model after its instance failed, at most.
const MAX_ATTEMPTS: u32 = 3;

/// Calls from the HTTP API into the loop.
pub enum ApiCall {
    Status(oneshot::Sender<serde_json::Value>),
    Place {
        model: String,
        strategy: Option<shoal_cluster::Strategy>,
        nodes: Option<usize>,
        context: Option<usize>,
        preview: bool,
        reply: oneshot::Sender<Result<serde_json::Value, String>>,
    },
    /// Where to send a request for `model`: a local rank 0 or another node's API.
    Route {
        model: Option<String>,
        reply: oneshot::Sender<Result<Route, String>>,
    },
}

pub enum Route {
    Local(mpsc::Sender<Job>),
    Remote(String),
}

struct Fetch {
    card: ModelCard,
    from: PeerId,
    file: std::fs::File,
    partial: PathBuf,
    offset: u64,
    hasher: Sha256,
    pending: Option<OutboundRequestId>,
}

enum Pending {
    Place(oneshot::Sender<Result<serde_json::Value, String>>),
    CatchUp,
    Chunk(String),
    /// A link probe to a peer: sent when, and with how many bytes.
    Probe(PeerId, Instant, usize),
}

/// Bytes of the bulk link probe.
const PROBE_BYTES: usize = 512 << 10; // under the codec's 1 MiB request limit
/// How often each link is probed.
const PROBE_EVERY: Duration = Duration::from_secs(10);

struct Daemon {
    config: NodeConfig,
    me: NodeId,
    swarm: Swarm<Behaviour>,
    store: Store,
    http: String,
    state: ClusterState,
    highest_term: u64,
    leading: bool,
    master: Option<NodeId>,
    started: Instant,
    /// Last heartbeat per live node (not this one).
    alive: HashMap<NodeId, (Instant, Heartbeat)>,
    statics: Vec<Multiaddr>,
    last_dial: Instant,
    local: Local,
    runners: HashMap<(String, usize), RunnerHandle>,
    reports_tx: mpsc::Sender<RunnerReport>,
    fetches: HashMap<String, Fetch>,
    pending: HashMap<OutboundRequestId, Pending>,
    catching_up: bool,
    last_report: Option<(NodeInfo, Instant)>,
    /// When the master may next place a failed model again, and how often it has.
    retry: HashMap<String, (Instant, u32)>,
    /// The failed instance's shape, tried first when placing it again.
    retry_strategy: HashMap<String, (shoal_cluster::Strategy, usize, usize)>,
    log: Option<std::fs::File>,
    /// Measured links to peers, and when each was last probed.
    links: HashMap<NodeId, LinkStats>,
    last_probe: HashMap<PeerId, Instant>,
    /// The last fetch progress reported per model (tenths).
    fetch_reported: HashMap<String, u64>,
    /// This machine's GPUs, refreshed by a task of its own.
    gpu: Option<Gpu>,
}

/// The GPUs of this machine as `nvidia-smi` reports them: the first one's name and
/// total memory, the least free memory of any, and how many there are.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpu {
    pub name: String,
    pub total: u64,
    pub free: u64,
    pub count: u32,
}

/// The GPUs, or `None` (no tool, no GPU, or no answer within 5 s).
async fn query_gpu() -> Option<Gpu> {
    let run = tokio::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=name,memory.total,memory.free",
            "--format=csv,noheader,nounits",
        ])
        .output();
    let out = tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .ok()?
        .ok()?;
    if !out.status.success() {
        return None;
    }
    parse_gpus(&String::from_utf8_lossy(&out.stdout))
}

/// `nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv,noheader,nounits`.
fn parse_gpus(text: &str) -> Option<Gpu> {
    let mib = |v: Option<&str>| v.and_then(|x| x.parse::<u64>().ok()).map(|m| m << 20);
    let mut gpu: Option<Gpu> = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split(',').map(str::trim);
        let name = f.next()?.to_string();
        let total = mib(f.next())?;
        // Rounded, so that small changes do not make events.
        let free = mib(f.next())? / (256 << 20) * (256 << 20);
        gpu = Some(match gpu {
            None => Gpu {
                name,
                total,
                free,
                count: 1,
            },
            Some(g) => Gpu {
                free: g.free.min(free),
                count: g.count + 1,
                ..g
            },
        });
    }
    gpu
}

/// Runs a node until interrupted.
pub async fn run(config: NodeConfig) -> Result<()> {
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("cannot create {}", config.data_dir.display()))?;
    let key = load_or_create_identity(&config.data_dir)?;
    let (psk, source) = cluster_key(config.cluster_key_file.as_deref(), &config.data_dir)?;
    if let KeySource::Made(path) = &source {
        eprintln!(
            "no cluster key given: made one in {} (give it to the other nodes with --cluster-key-file or SHOAL_CLUSTER_KEY)",
            path.display()
        );
    }
    let me = key.public().to_peer_id().to_string();
    let mut swarm = p2p::build(key, psk, config.mdns)?;
    for t in p2p::topics() {
        swarm
            .behaviour_mut()
            .gossip
            .subscribe(&t)
            .context("subscribe")?;
    }
    swarm
        .listen_on(p2p::multiaddr(config.p2p))
        .with_context(|| format!("cannot listen on {}", config.p2p))?;
    let store = Store::new(config.data_dir.clone());
    let state = load_snapshot(&config.data_dir).unwrap_or_default();
    let (api_tx, mut api_rx) = mpsc::channel::<ApiCall>(64);
    let http_listener = tokio::net::TcpListener::bind(config.http)
        .await
        .with_context(|| format!("cannot listen on {}", config.http))?;
    let http = http_listener.local_addr()?.to_string();
    tokio::spawn(crate::api::serve(http_listener, api_tx));
    let (reports_tx, mut reports_rx) = mpsc::channel(256);
    let (gpu_tx, mut gpu_rx) = mpsc::channel::<Option<Gpu>>(4);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(30)).await;
            if gpu_tx.send(query_gpu().await).await.is_err() {
                return;
            }
        }
    });
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(config.data_dir.join("events.jsonl"))
        .ok();
    let statics = config.peers.iter().map(|a| p2p::multiaddr(*a)).collect();
    let mut d = Daemon {
        me: me.clone(),
        swarm,
        store,
        http: http.clone(),
        highest_term: state.term,
        state,
        leading: false,
        master: None,
        started: Instant::now(),
        alive: HashMap::new(),
        statics,
        last_dial: Instant::now() - Duration::from_secs(60),
        local: Local::default(),
        runners: HashMap::new(),
        reports_tx,
        fetches: HashMap::new(),
        pending: HashMap::new(),
        catching_up: false,
        last_report: None,
        retry: HashMap::new(),
        retry_strategy: HashMap::new(),
        log,
        links: HashMap::new(),
        last_probe: HashMap::new(),
        fetch_reported: HashMap::new(),
        gpu: query_gpu().await,
        config,
    };
    tracing::info!(node = %me, http = %http, "node started");
    println!("node {me} listening: http {http}, p2p {}", d.config.p2p);
    let mut tick = tokio::time::interval(TICK);
    loop {
        tokio::select! {
            ev = d.swarm.select_next_some() => d.on_swarm(ev),
            Some(call) = api_rx.recv() => d.on_api(call),
            Some(r) = reports_rx.recv() => d.on_runner(r),
            Some(g) = gpu_rx.recv() => d.gpu = g,
            _ = tick.tick() => d.on_tick(),
            _ = tokio::signal::ctrl_c() => {
                tracing::info!("interrupted; stopping runners");
                d.runners.clear();
                return Ok(());
            }
        }
    }
}

fn load_snapshot(dir: &Path) -> Option<ClusterState> {
    let text = std::fs::read_to_string(dir.join("state.json")).ok()?;
    serde_json::from_str(&text).ok()
}

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

impl Daemon {
    fn publish<T: serde::Serialize>(&mut self, topic: &str, msg: &T) {
        let Ok(data) = serde_json::to_vec(msg) else {
            return;
        };
        let topic = gossipsub::IdentTopic::new(topic);
        if let Err(e) = self.swarm.behaviour_mut().gossip.publish(topic, data) {
            // No peers yet is normal for a lone node.
            tracing::trace!(error = %e, "publish");
        }
    }

    fn master_peer(&self) -> Option<PeerId> {
        self.master.as_ref().and_then(|m| m.parse().ok())
    }

    // ---- the tick ----

    fn on_tick(&mut self) {
        let hb = Heartbeat {
            id: self.me.clone(),
            term: self.highest_term,
            leading: self.leading,
            index: self.state.index,
        };
        self.publish(HEARTBEAT_TOPIC, &hb);
        self.alive
            .retain(|_, (seen, _)| seen.elapsed() < NODE_TIMEOUT);
        self.dial_statics();
        if self.started.elapsed() >= GRACE {
            self.elect();
        }
        if self.leading {
            self.master_duties();
        }
        self.probe();
        // Which model files are here: read once a tick, for the report and the worker.
        self.local.models = builtin_cards()
            .into_iter()
            .filter(|c| self.store.is_installed(c))
            .map(|c| c.name)
            .collect();
        self.report();
        self.work();
    }

    /// Measures each link now and then: a small round trip (latency), then 512 KiB
    /// (bandwidth).
    fn probe(&mut self) {
        let peers: Vec<PeerId> = self.swarm.connected_peers().copied().collect();
        for peer in peers {
            if self
                .last_probe
                .get(&peer)
                .is_some_and(|t| t.elapsed() < PROBE_EVERY)
            {
                continue;
            }
            self.last_probe.insert(peer, Instant::now());
            let id = self.swarm.behaviour_mut().rpc.send_request(
                &peer,
                Request::Probe {
                    payload: Vec::new(),
                },
            );
            self.pending
                .insert(id, Pending::Probe(peer, Instant::now(), 0));
        }
    }

    fn on_probe(&mut self, peer: PeerId, sent: Instant, bytes: usize) {
        let took = sent.elapsed();
        let id = peer.to_string();
        if bytes == 0 {
            let rtt_us = took.as_micros() as u64;
            let entry = self.links.entry(id).or_insert(LinkStats {
                rtt_us,
                bandwidth: 0,
            });
            entry.rtt_us = rtt_us;
            let id = self.swarm.behaviour_mut().rpc.send_request(
                &peer,
                Request::Probe {
                    payload: vec![0u8; PROBE_BYTES],
                },
            );
            self.pending
                .insert(id, Pending::Probe(peer, Instant::now(), PROBE_BYTES));
        } else if let Some(l) = self.links.get_mut(&id) {
            let secs = took
                .saturating_sub(Duration::from_micros(l.rtt_us))
                .as_secs_f64();
            l.bandwidth = (bytes as f64 / secs.max(1e-6)) as u64;
        }
    }

    fn dial_statics(&mut self) {
        if self.last_dial.elapsed() < Duration::from_secs(2) {
            return;
        }
        self.last_dial = Instant::now();
        if self.swarm.connected_peers().count() >= self.statics.len() && !self.statics.is_empty() {
            return;
        }
        for addr in self.statics.clone() {
            if let Err(e) = self.swarm.dial(addr.clone()) {
                tracing::debug!(%addr, error = %e, "dial");
            }
        }
    }

    fn elect(&mut self) {
        let mut alive: BTreeSet<NodeId> = self.alive.keys().cloned().collect();
        alive.insert(self.me.clone());
        match decide(&self.me, self.leading, self.highest_term, &alive) {
            Decision::KeepLeading => {}
            Decision::Lead { term } => {
                // Take over only with the newest state any live node has seen.
                let ahead = self
                    .alive
                    .iter()
                    .filter(|(_, (_, hb))| {
                        hb.index > self.state.index && hb.term >= self.state.term
                    })
                    .max_by_key(|(_, (_, hb))| (hb.term, hb.index))
                    .map(|(id, _)| id.clone());
                if let Some(peer) = ahead {
                    self.catch_up_from(&peer);
                    return;
                }
                tracing::info!(term, "elected master");
                self.leading = true;
                self.highest_term = term;
                self.master = Some(self.me.clone());
                self.state.term = term;
                let snap = Published::Snapshot {
                    term,
                    state: self.state.clone(),
                };
                self.publish(EVENTS_TOPIC, &snap);
                self.persist(None);
            }
            Decision::Follow(m) => {
                if self.leading {
                    tracing::info!(master = %m, "stepping down");
                }
                self.leading = false;
                if self.master.as_ref() != Some(&m) {
                    tracing::info!(master = %m, "following");
                    self.master = Some(m.clone());
                    self.catch_up_from(&m);
                }
            }
        }
    }

    fn catch_up_from(&mut self, peer: &NodeId) {
        if self.catching_up {
            return;
        }
        let Ok(p) = peer.parse::<PeerId>() else {
            return;
        };
        let id = self
            .swarm
            .behaviour_mut()
            .rpc
            .send_request(&p, Request::CatchUp);
        self.pending.insert(id, Pending::CatchUp);
        self.catching_up = true;
    }

    /// The master's periodic work: drop dead nodes, place failed instances again.
    fn master_duties(&mut self) {
        let dead: Vec<NodeId> = self
            .state
            .nodes
            .keys()
            .filter(|id| **id != self.me && !self.alive.contains_key(*id))
            .cloned()
            .collect();
        for id in dead {
            tracing::warn!(node = %id, "node lost");
            self.emit(Event::NodeDown { id });
        }
        let failed: Vec<Instance> = self
            .state
            .instances
            .values()
            .filter(|i| matches!(i.status, InstanceStatus::Failed(_)))
            .cloned()
            .collect();
        for inst in failed {
            let reason = match &inst.status {
                InstanceStatus::Failed(r) => r.clone(),
                _ => String::new(),
            };
            self.emit(Event::InstanceRemoved {
                instance: inst.id.clone(),
                reason: reason.clone(),
            });
            let attempt = inst.attempt + 1;
            if attempt > MAX_ATTEMPTS {
                tracing::error!(model = %inst.model, reason, "instance failed too often; not placing it again");
                continue;
            }
            // Back off: 1 s, 2 s, 4 s.
            let wait = Duration::from_secs(1 << (attempt - 1));
            self.retry
                .insert(inst.model.clone(), (Instant::now() + wait, attempt));
            self.retry_strategy.insert(
                inst.model.clone(),
                (inst.strategy, inst.ranks.len(), inst.context),
            );
            tracing::warn!(model = %inst.model, reason, attempt, "instance failed; placing it again");
        }
        let due: Vec<String> = self
            .retry
            .iter()
            .filter(|(_, (at, _))| Instant::now() >= *at)
            .map(|(m, _)| m.clone())
            .collect();
        for model in due {
            let Some((_, attempt)) = self.retry.remove(&model) else {
                continue;
            };
            let (strategy, n, context) = self
                .retry_strategy
                .remove(&model)
                .map_or((None, None, None), |(s, n, c)| (Some(s), Some(n), Some(c)));
            // The same shape if it still fits, else whatever fits.
            let result = self
                .place_now(&model, strategy, n, context, attempt)
                .or_else(|_| self.place_now(&model, None, None, context, attempt));
            if let Err(e) = result {
                tracing::error!(model, error = %e, "cannot place again");
            }
        }
    }

    // ---- the master's log ----

    fn emit(&mut self, event: Event) {
        let e = Indexed {
            term: self.highest_term,
            index: self.state.index + 1,
            event,
        };
        self.state = apply(&self.state, &e);
        self.persist(Some(&e));
        self.publish(EVENTS_TOPIC, &Published::Event(e));
    }

    fn persist(&mut self, e: Option<&Indexed>) {
        if let (Some(log), Some(e)) = (self.log.as_mut(), e)
            && let Ok(line) = serde_json::to_string(e)
        {
            let _ = writeln!(log, "{line}");
        }
        let dir = &self.config.data_dir;
        if let Ok(text) = serde_json::to_string(&self.state) {
            let tmp = dir.join("state.json.tmp");
            if std::fs::write(&tmp, text).is_ok() {
                let _ = std::fs::rename(&tmp, dir.join("state.json"));
            }
        }
    }

    fn command(&mut self, cmd: Command) {
        if self.leading {
            self.on_command(cmd);
        } else if self.master.is_some() {
            self.publish(COMMANDS_TOPIC, &cmd);
        }
    }

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Report(info) => {
                if self.state.nodes.get(&info.id) != Some(&info) {
                    self.emit(Event::NodeUp { info });
                }
            }
            Command::RankAddr {
                instance,
                rank,
                addr,
            } => {
                let known = self
                    .state
                    .instances
                    .get(&instance)
                    .and_then(|i| i.ranks.get(rank))
                    .is_some_and(|s| s.addr.as_ref() != Some(&addr));
                if known {
                    self.emit(Event::RankAddr {
                        instance,
                        rank,
                        addr,
                    });
                }
            }
            Command::RankStatus {
                instance,
                rank,
                status,
            } => {
                let changed = self
                    .state
                    .instances
                    .get(&instance)
                    .and_then(|i| i.ranks.get(rank))
                    .is_some_and(|s| s.status != status);
                if changed {
                    self.emit(Event::RankStatus {
                        instance,
                        rank,
                        status,
                    });
                }
            }
        }
    }

    // ---- placement ----

    fn facts(model: &str) -> Result<(ModelFacts, ModelCard), String> {
        let card = find_card(model).ok_or_else(|| format!("unknown model {model:?}"))?;
        Ok((
            ModelFacts {
                name: card.name.clone(),
                size: card.size,
                layers: card.layers as usize,
                hidden: card.hidden as usize,
                heads: card.heads as usize,
                kv_heads: card.kv_heads as usize,
                ffn: card.ffn as usize,
                vocab: card.vocab as usize,
            },
            card,
        ))
    }

    fn request(
        model: &str,
        strategy: Option<shoal_cluster::Strategy>,
        nodes: Option<usize>,
        context: Option<usize>,
    ) -> Result<PlaceRequest, String> {
        let (facts, card) = Self::facts(model)?;
        Ok(PlaceRequest {
            model: facts,
            strategy,
            nodes,
            context: context.unwrap_or((card.context_length as usize).min(2048)),
            chunk: 256,
        })
    }

    /// The master creates an instance from the first plan.
    fn place_now(
        &mut self,
        model: &str,
        strategy: Option<shoal_cluster::Strategy>,
        nodes: Option<usize>,
        context: Option<usize>,
        attempt: u32,
    ) -> Result<Instance, String> {
        let req = Self::request(model, strategy, nodes, context)?;
        if !self
            .state
            .nodes
            .values()
            .any(|n| n.models.contains(&req.model.name))
        {
            return Err(format!(
                "no node has {model}: install it on one (`shoal pull {model}` with the node's SHOAL_HOME) and the others copy it"
            ));
        }
        let plans = place(&self.state, &req).map_err(|r| r.0)?;
        let Plan {
            strategy,
            nodes,
            gpus,
            ..
        } = plans.into_iter().next().ok_or("no plan")?;
        let id = format!("{model}-{}", self.state.index + 1);
        let instance = Instance {
            id,
            model: model.to_string(),
            strategy,
            context: req.context,
            ranks: nodes
                .into_iter()
                .zip(gpus.into_iter().chain(std::iter::repeat(None)))
                .map(|(node, gpu)| RankSlot {
                    node,
                    gpu,
                    addr: None,
                    status: RunnerStatus::Idle,
                })
                .collect(),
            token: crate::keys::new_cluster_key().map_err(|e| e.to_string())?,
            status: InstanceStatus::Starting,
            attempt,
        };
        tracing::info!(instance = %instance.id, %strategy, nodes = instance.ranks.len(), "placing");
        self.emit(Event::InstancePlaced {
            instance: instance.clone(),
        });
        Ok(instance)
    }

    // ---- reports and the worker ----

    fn info(&self) -> NodeInfo {
        let (total, free) = meminfo();
        let models = self.local.models.iter().cloned().collect();
        NodeInfo {
            id: self.me.clone(),
            http: self.http.clone(),
            resources: Resources {
                memory_total: total,
                // Rounded, so that small changes do not make events.
                memory_free: free / (256 << 20) * (256 << 20),
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
        }
    }

    fn report(&mut self) {
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

    fn work(&mut self) {
        self.local.runners = self.runners.keys().cloned().collect();
        self.local.fetching = self.fetches.keys().cloned().collect();
        for action in plan(&self.state, &self.me, &self.local) {
            match action {
                Action::Fetch { model, from } => self.start_fetch(&model, &from),
                Action::OpenPort { instance, rank } => {
                    let ip = if self.config.p2p.ip().is_unspecified() {
                        "127.0.0.1".to_string()
                    } else {
                        self.config.p2p.ip().to_string()
                    };
                    match std::net::TcpListener::bind((ip.as_str(), 0)).and_then(|l| l.local_addr())
                    {
                        Ok(a) => {
                            self.local.ports.insert((instance.clone(), rank));
                            self.command(Command::RankAddr {
                                instance,
                                rank,
                                addr: a.to_string(),
                            });
                        }
                        Err(e) => tracing::error!(error = %e, "cannot open a rank port"),
                    }
                }
                Action::Start { instance, rank } => self.start_runner(&instance, rank),
                Action::Stop { instance, rank } => {
                    tracing::info!(instance, rank, "stopping runner");
                    self.runners.remove(&(instance.clone(), rank));
                    self.local.ports.remove(&(instance, rank));
                }
            }
        }
    }

    fn start_runner(&mut self, instance: &str, rank: usize) {
        let Some(inst) = self.state.instances.get(instance).cloned() else {
            return;
        };
        let Some(card) = find_card(&inst.model) else {
            return;
        };
        let addrs: Vec<String> = inst.ranks.iter().filter_map(|r| r.addr.clone()).collect();
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
            socket_dir: self.config.data_dir.join("runners"),
            stall_timeout: self.config.stall_timeout,
            // The rank's GPU as placed (a CPU build of shoal refuses, and the rank is
            // reported failed with the reason). Tensor ranks on GPUs of this one node
            // join over NCCL by themselves.
            device: match slot_gpu {
                Some(g) => format!("cuda:{g}"),
                None => "cpu".into(),
            },
        };
        tracing::info!(instance, rank, "starting runner");
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

    fn on_runner(&mut self, r: RunnerReport) {
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
                self.local.ports.remove(&(instance.clone(), rank));
                self.command(Command::RankStatus {
                    instance,
                    rank,
                    status: RunnerStatus::Failed(why),
                });
            }
        }
    }

    // ---- model files ----

    fn start_fetch(&mut self, model: &str, from: &NodeId) {
        let Some(card) = find_card(model) else {
            return;
        };
        let Ok(peer) = from.parse::<PeerId>() else {
            return;
        };
        let dir = self.store.model_dir(&card);
        let partial = dir.join(format!("{}.partial", card.file));
        let opened = std::fs::create_dir_all(&dir).and_then(|_| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .read(true)
                .open(&partial)
        });
        let file = match opened {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(error = %e, "cannot write {}", partial.display());
                return;
            }
        };
        // Resume: hash what is already there.
        let mut hasher = Sha256::new();
        let mut offset = 0;
        if let Ok(mut f) = std::fs::File::open(&partial) {
            let mut buf = vec![0u8; 1 << 20];
            while let Ok(n) = std::io::Read::read(&mut f, &mut buf) {
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
                offset += n as u64;
            }
        }
        tracing::info!(model, from = %from, offset, "fetching model file");
        let mut fetch = Fetch {
            card,
            from: peer,
            file,
            partial,
            offset,
            hasher,
            pending: None,
        };
        let id = self.swarm.behaviour_mut().rpc.send_request(
            &peer,
            Request::Chunk {
                model: model.to_string(),
                offset,
                len: CHUNK,
            },
        );
        fetch.pending = Some(id);
        self.pending.insert(id, Pending::Chunk(model.to_string()));
        self.fetches.insert(model.to_string(), fetch);
    }

    fn on_chunk(&mut self, model: &str, data: Vec<u8>, total: u64) {
        let Some(mut f) = self.fetches.remove(model) else {
            return;
        };
        if total != f.card.size {
            tracing::error!(model, total, "peer's file has the wrong size");
            let _ = std::fs::remove_file(&f.partial);
            return;
        }
        if f.file.write_all(&data).is_err() {
            tracing::error!(model, "cannot write the model file");
            return;
        }
        f.hasher.update(&data);
        f.offset += data.len() as u64;
        let tenths = f.offset * 10 / total.max(1);
        if self.fetch_reported.get(model) != Some(&tenths) {
            self.fetch_reported.insert(model.to_string(), tenths);
            let fraction = f.offset as f32 / total.max(1) as f32;
            let mine: Vec<(String, usize)> = self
                .state
                .instances
                .values()
                .filter(|i| i.model == model)
                .flat_map(|i| {
                    i.ranks
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| r.node == self.me)
                        .map(|(r, _)| (i.id.clone(), r))
                        .collect::<Vec<_>>()
                })
                .collect();
            for (instance, rank) in mine {
                self.command(Command::RankStatus {
                    instance,
                    rank,
                    status: RunnerStatus::Fetching(fraction),
                });
            }
        }
        if f.offset < total && !data.is_empty() {
            let id = self.swarm.behaviour_mut().rpc.send_request(
                &f.from,
                Request::Chunk {
                    model: model.to_string(),
                    offset: f.offset,
                    len: CHUNK,
                },
            );
            f.pending = Some(id);
            self.pending.insert(id, Pending::Chunk(model.to_string()));
            self.fetches.insert(model.to_string(), f);
            return;
        }
        let digest: String = f
            .hasher
            .clone()
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if digest != f.card.sha256 || f.offset != total {
            tracing::error!(
                model,
                digest,
                "copied file does not match the card; discarded"
            );
            let _ = std::fs::remove_file(&f.partial);
            return;
        }
        let _ = f.file.flush();
        let path = self.store.model_path(&f.card);
        if std::fs::rename(&f.partial, &path).is_ok() {
            let _ = std::fs::write(
                self.store.model_dir(&f.card).join(".sha256"),
                &f.card.sha256,
            );
            tracing::info!(model, "model file copied and verified");
        }
    }

    fn serve_chunk(&self, model: &str, offset: u64, len: u64) -> Response {
        let Some(card) = find_card(model) else {
            return Response::Error(format!("unknown model {model}"));
        };
        if !self.store.is_installed(&card) {
            return Response::Error(format!("{model} is not installed here"));
        }
        let path = self.store.model_path(&card);
        let read = || -> std::io::Result<Vec<u8>> {
            use std::io::{Read, Seek, SeekFrom};
            let mut f = std::fs::File::open(&path)?;
            f.seek(SeekFrom::Start(offset))?;
            let mut buf = Vec::with_capacity(len.min(CHUNK) as usize);
            f.take(len.min(CHUNK)).read_to_end(&mut buf)?;
            Ok(buf)
        };
        match read() {
            Ok(data) => Response::Chunk {
                data,
                total: card.size,
            },
            Err(e) => Response::Error(e.to_string()),
        }
    }

    // ---- the network ----

    fn on_swarm(&mut self, ev: SwarmEvent<BehaviourEvent>) {
        match ev {
            SwarmEvent::Behaviour(BehaviourEvent::Gossip(gossipsub::Event::Message {
                message,
                ..
            })) => {
                let Some(source) = message.source.map(|p| p.to_string()) else {
                    return;
                };
                match message.topic.as_str() {
                    HEARTBEAT_TOPIC => {
                        if let Ok(hb) = serde_json::from_slice::<Heartbeat>(&message.data)
                            && hb.id == source
                        {
                            self.highest_term = self.highest_term.max(hb.term);
                            self.alive.insert(source, (Instant::now(), hb));
                        }
                    }
                    COMMANDS_TOPIC if self.leading => {
                        if let Ok(cmd) = serde_json::from_slice::<Command>(&message.data) {
                            self.on_command(cmd);
                        }
                    }
                    EVENTS_TOPIC => {
                        if let Ok(p) = serde_json::from_slice::<Published>(&message.data) {
                            self.on_published(&source, p);
                        }
                    }
                    _ => {}
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Rpc(e)) => self.on_rpc(e),
            SwarmEvent::Behaviour(BehaviourEvent::Mdns(libp2p::mdns::Event::Discovered(list))) => {
                for (peer, addr) in list {
                    if !self.swarm.is_connected(&peer) {
                        let _ = self.swarm.dial(addr);
                    }
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                num_established: 0,
                ..
            } => {
                // A peer whose every connection closed is gone now (kill -9, cable).
                self.alive.remove(&peer_id.to_string());
            }
            SwarmEvent::IncomingConnectionError {
                error,
                send_back_addr,
                ..
            } => {
                tracing::debug!(%send_back_addr, %error, "refused a connection (wrong cluster key?)");
            }
            _ => {}
        }
    }

    fn on_published(&mut self, source: &NodeId, p: Published) {
        match p {
            Published::Snapshot { term, state } => {
                if term >= self.highest_term && source != &self.me {
                    if self.leading && term == self.highest_term && source < &self.me {
                        return; // a lower id with the same term: ours stands
                    }
                    self.highest_term = term;
                    self.leading = false;
                    self.master = Some(source.clone());
                    self.state = state;
                    self.state.term = term;
                    self.persist(None);
                }
            }
            Published::Event(e) => {
                if e.term < self.highest_term || Some(source) != self.master.as_ref() {
                    return;
                }
                if e.index == self.state.index + 1 {
                    self.state = apply(&self.state, &e);
                    self.persist(Some(&e));
                } else if e.index > self.state.index + 1 {
                    let m = source.clone();
                    self.catch_up_from(&m);
                }
            }
        }
    }

    fn on_rpc(&mut self, e: request_response::Event<Request, Response>) {
        match e {
            request_response::Event::Message { peer, message, .. } => match message {
                request_response::Message::Request {
                    request, channel, ..
                } => self.on_request(peer, request, channel),
                request_response::Message::Response {
                    request_id,
                    response,
                } => self.on_response(request_id, response),
            },
            request_response::Event::OutboundFailure {
                request_id, error, ..
            } => {
                let why = format!("request failed: {error}");
                match self.pending.remove(&request_id) {
                    Some(Pending::Place(reply)) => {
                        let _ = reply.send(Err(why));
                    }
                    Some(Pending::CatchUp) => self.catching_up = false,
                    Some(Pending::Probe(..)) => {}
                    Some(Pending::Chunk(model)) => {
                        tracing::warn!(model, why, "fetch interrupted; will resume");
                        self.fetches.remove(&model);
                    }
                    None => {}
                }
            }
            _ => {}
        }
    }

    fn on_request(&mut self, peer: PeerId, request: Request, channel: ResponseChannel<Response>) {
        let response = match request {
            Request::CatchUp => Response::Snapshot {
                term: self.highest_term,
                state: self.state.clone(),
            },
            Request::Place(req) => {
                if !self.leading {
                    Response::Refused("this node is not the master".into())
                } else {
                    match self.place_now(
                        &req.model.name,
                        req.strategy,
                        req.nodes,
                        Some(req.context),
                        0,
                    ) {
                        Ok(i) => Response::Placed(i),
                        Err(e) => Response::Refused(e),
                    }
                }
            }
            Request::Chunk { model, offset, len } => self.serve_chunk(&model, offset, len),
            Request::Probe { .. } => Response::Probe,
        };
        if self
            .swarm
            .behaviour_mut()
            .rpc
            .send_response(channel, response)
            .is_err()
        {
            tracing::debug!(%peer, "response dropped: the peer went away");
        }
    }

    fn on_response(&mut self, id: OutboundRequestId, response: Response) {
        match (self.pending.remove(&id), response) {
            (Some(Pending::CatchUp), Response::Snapshot { term, state }) => {
                self.catching_up = false;
                if term >= self.state.term && state.index >= self.state.index
                    || term > self.state.term
                {
                    tracing::info!(index = state.index, term, "caught up from a snapshot");
                    self.highest_term = self.highest_term.max(term);
                    self.state = state;
                    self.persist(None);
                }
            }
            (Some(Pending::Place(reply)), Response::Placed(i)) => {
                let _ = reply.send(serde_json::to_value(&i).map_err(|e| e.to_string()));
            }
            (Some(Pending::Place(reply)), Response::Refused(why) | Response::Error(why)) => {
                let _ = reply.send(Err(why));
            }
            (Some(Pending::Chunk(model)), Response::Chunk { data, total }) => {
                self.on_chunk(&model, data, total)
            }
            (Some(Pending::Chunk(model)), Response::Error(why)) => {
                tracing::warn!(model, why, "peer cannot send the model file");
                self.fetches.remove(&model);
            }
            (Some(Pending::Probe(peer, sent, bytes)), Response::Probe) => {
                self.on_probe(peer, sent, bytes)
            }
            (Some(Pending::CatchUp), _) => self.catching_up = false,
            _ => {}
        }
    }

    // ---- the API ----

    fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "node_id": self.me,
            "master_id": self.master,
            "term": self.highest_term,
            "index": self.state.index,
            "leading": self.leading,
            "peers": self.swarm.connected_peers().map(|p| p.to_string()).collect::<Vec<_>>(),
            "nodes": self.state.nodes.values().collect::<Vec<_>>(),
            "instances": self.state.instances.values().map(|i| {
                // The token stays inside the cluster's state, out of status output.
                let mut v = serde_json::to_value(i).unwrap_or_default();
                if let Some(o) = v.as_object_mut() { o.remove("token"); }
                v
            }).collect::<Vec<_>>(),
        })
    }

    fn on_api(&mut self, call: ApiCall) {
        match call {
            ApiCall::Status(reply) => {
                let _ = reply.send(self.status());
            }
            ApiCall::Place {
                model,
                strategy,
                nodes,
                context,
                preview,
                reply,
            } => {
                let req = match Self::request(&model, strategy, nodes, context) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                };
                if preview {
                    let r = place(&self.state, &req)
                        .map_err(|r| r.0)
                        .and_then(|p| serde_json::to_value(p).map_err(|e| e.to_string()));
                    let _ = reply.send(r);
                } else if self.leading {
                    let r = self
                        .place_now(&model, strategy, nodes, context, 0)
                        .and_then(|i| serde_json::to_value(i).map_err(|e| e.to_string()));
                    let _ = reply.send(r);
                } else if let Some(m) = self.master_peer() {
                    let id = self
                        .swarm
                        .behaviour_mut()
                        .rpc
                        .send_request(&m, Request::Place(req));
                    self.pending.insert(id, Pending::Place(reply));
                } else {
                    let _ = reply.send(Err("no master yet; try again in a moment".into()));
                }
            }
            ApiCall::Route { model, reply } => {
                let _ = reply.send(self.route(model.as_deref()));
            }
        }
    }

    fn route(&self, model: Option<&str>) -> Result<Route, String> {
        let inst = self
            .state
            .instances
            .values()
            .filter(|i| i.status == InstanceStatus::Ready)
            .find(|i| model.is_none_or(|m| i.model == m))
            .ok_or_else(|| match model {
                Some(m) => format!("no ready instance of {m} (see `shoal status`)"),
                None => "no ready instance (place one with `shoal place MODEL`)".into(),
            })?;
        let head = inst.ranks.first().ok_or("an instance without ranks")?;
        if head.node == self.me {
            let h = self
                .runners
                .get(&(inst.id.clone(), 0))
                .ok_or("rank 0 is not running here yet")?;
            return Ok(Route::Local(h.jobs.clone()));
        }
        let node = self
            .state
            .nodes
            .get(&head.node)
            .ok_or("rank 0's node is not in the cluster")?;
        Ok(Route::Remote(node.http.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::parse_gpus;

    #[test]
    fn nvidia_smi_lines_become_a_gpu_count_with_the_least_free_memory() {
        let two = "NVIDIA H200, 143771, 143000\nNVIDIA H200, 143771, 100000\n";
        let g = parse_gpus(two).expect("two GPUs");
        assert_eq!(g.count, 2);
        assert_eq!(g.name, "NVIDIA H200");
        assert_eq!(g.total, 143771 << 20);
        assert_eq!(g.free, (100000u64 << 20) / (256 << 20) * (256 << 20));
        assert_eq!(parse_gpus(""), None);
        assert_eq!(parse_gpus("No devices were found"), None);
    }
}
