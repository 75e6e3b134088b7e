//! The node's event loop: the single owner of everything the node knows.
//!
//! Inputs arrive as messages (swarm events, API calls, runner reports, model-file
//! progress, a 250 ms tick); the loop updates its state and sends messages out; it never
//! blocks on a peer, a runner or a disk: model copies, pulls and forwarded requests run
//! in tasks of their own that report back. Each tick: a heartbeat; the liveness view;
//! the election decision; as master, node-loss detection and re-placement of failed
//! instances; a resource report; the worker's plan carried out.
//!
//! - [`replication`]: election, the master's log, catch-up.
//! - [`placement`]: the master creates, removes and re-places instances.
//! - [`worker`]: the resource report, rank ports and runners.
//! - [`fetch`]: model files copied from peers or pulled from their packages.
//! - [`rpc`]: swarm events, gossip, direct requests, link probes.
//! - [`api`]: the loop's answers to the HTTP API.

mod api;
mod fetch;
mod placement;
mod replication;
mod rpc;
mod worker;

use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use libp2p::gossipsub;
use libp2p::request_response::{self, OutboundRequestId, ResponseChannel};
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId, Swarm};
use shoal_cluster::election::{Decision, Standing, decide, heaviest};
use shoal_cluster::placement::{ModelFacts, PlaceRequest, Plan, place};
use shoal_cluster::worker::{Action, Local, plan};
use shoal_cluster::{
    Backend, ClusterState, Event, Indexed, Instance, InstanceStatus, LinkStats, NodeId, NodeInfo,
    RankSlot, Resources, RunnerStatus, apply,
};
use shoal_store::{Store, builtin_cards, find_card};
use tokio::sync::{mpsc, oneshot};

use crate::gpu::{Gpu, query_gpu};
use crate::keys::{KeySource, cluster_key, load_or_create_identity};
use crate::p2p::{
    self, Behaviour, BehaviourEvent, COMMANDS_TOPIC, Command, EVENTS_TOPIC, HEARTBEAT_TOPIC,
    Heartbeat, Published, Request, Response,
};
use crate::supervisor::{self, Job, RunnerHandle, RunnerReport, RunnerSpec};
use fetch::FetchReport;

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
    /// Requests a rank-0 runner serves at once.
    pub max_batch: usize,
    /// Rank 0's bound on a step beside streams, in decode steps.
    pub gap_bound: f64,
    /// The key every HTTP request but `/health` must carry; `None`: open (loopback only,
    /// unless the user said `--insecure`).
    pub api_key: Option<String>,
    /// Serve the API beyond loopback without a key.
    pub insecure: bool,
    /// A request for a known model that no instance serves places one.
    pub auto_place: bool,
    /// The most memory this node offers to models (its runners' memory counts against
    /// it); `None`: what the machine has free.
    pub memory_limit: Option<u64>,
}

const TICK: Duration = Duration::from_millis(250);
/// Positions per prefill chunk, as placement counts an instance's working memory.
const PREFILL_CHUNK: usize = 256;
/// A node silent for this long is dead.
const NODE_TIMEOUT: Duration = Duration::from_millis(2500);
/// How long a starting node listens before taking part in the election.
const GRACE: Duration = Duration::from_millis(1500);
/// A peer counts towards this node's side once it has been up this long without a
/// break: while a partition heals, each side still counts what it had apart.
const SETTLE: Duration = Duration::from_secs(5);

/// A live peer: its last heartbeat, and since when it has been up without a break.
struct Seen {
    last: Instant,
    since: Instant,
    hb: Heartbeat,
}
/// Placements of a model after its instance failed, at most.
pub(crate) const MAX_ATTEMPTS: u32 = 3;

/// Calls from the HTTP API into the loop.
pub enum ApiCall {
    Status(oneshot::Sender<serde_json::Value>),
    Place {
        model: String,
        strategy: Option<shoal_cluster::Strategy>,
        nodes: Option<usize>,
        context: Option<usize>,
        preview: bool,
        /// An instance of the model already placed is the answer.
        if_absent: bool,
        reply: oneshot::Sender<Result<serde_json::Value, String>>,
    },
    /// Install a known model on this node unless some node has it (Ollama's pull).
    Pull {
        model: String,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Remove an instance (through the master).
    Delete {
        instance: String,
        reply: oneshot::Sender<Result<serde_json::Value, String>>,
    },
    /// Where to send a request for `model`: a local rank 0 or the node that holds it.
    Route {
        model: Option<String>,
        /// Only a local rank 0 will do (a request another node forwarded here).
        local_only: bool,
        reply: oneshot::Sender<Result<Route, RouteError>>,
    },
}

/// Why a request has nowhere to go.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No model of that name is known to shoal or placed in the cluster.
    #[error("unknown model {0} (see `shoal models`)")]
    UnknownModel(String),
    /// The model is known (a built-in card) but not placed anywhere.
    #[error("no instance of {0} is placed (place one with `shoal place {0}`)")]
    NotPlaced(String),
    /// The model is placed but no instance of it is ready (yet).
    #[error("{0}")]
    NotReady(String),
}

pub enum Route {
    /// Rank 0 runs here.
    Local(mpsc::Sender<Job>),
    /// Rank 0 runs on this peer: the request is forwarded over the cluster's link.
    Remote(PeerId),
}

enum Pending {
    Place(oneshot::Sender<Result<serde_json::Value, String>>),
    CatchUp,
    /// A link probe to a peer: sent when, and with how many bytes.
    Probe(PeerId, Instant, usize),
}

struct Daemon {
    config: NodeConfig,
    me: NodeId,
    swarm: Swarm<Behaviour>,
    /// Opens streams to peers (model files) from tasks of their own.
    streams: libp2p_stream::Control,
    store: Store,
    http: String,
    /// This machine's host name, as the cluster shows it.
    hostname: String,
    state: ClusterState,
    highest_term: u64,
    leading: bool,
    master: Option<NodeId>,
    started: Instant,
    /// Last heartbeat per live node (not this one).
    alive: HashMap<NodeId, Seen>,
    /// Catching up from a peer whose state outweighs this node's, to lead with it: the
    /// standing that peer announced.
    adopting: Option<Standing>,
    /// The standing last taken that way (not taken twice). Set only once the state has
    /// come: a catch-up that fails (a connection the heal replaced) is tried again.
    adopted: Option<Standing>,
    /// Following a master that will take this node's (heavier) state, since when: its
    /// events are not applied here until its snapshot comes.
    awaiting: Option<(NodeId, Instant)>,
    /// The address each connected peer is reached at, from this node's connections to it:
    /// a rank on that peer is dialled there.
    peer_ips: HashMap<PeerId, IpAddr>,
    statics: Vec<Multiaddr>,
    /// Peers mDNS found, with the addresses they announced.
    discovered: HashMap<PeerId, Vec<Multiaddr>>,
    last_dial: Instant,
    local: Local,
    runners: HashMap<(String, usize), RunnerHandle>,
    /// Why instances were removed (recent ones), for the clients of their runners.
    removed: HashMap<String, String>,
    /// Ports opened for this node's ranks, held until the runner takes the socket.
    rank_listeners: HashMap<(String, usize), std::net::TcpListener>,
    reports_tx: mpsc::Sender<RunnerReport>,
    /// Model files arriving (copies and pulls), each a task of its own.
    fetches: HashMap<String, tokio::task::JoinHandle<()>>,
    fetch_tx: mpsc::Sender<FetchReport>,
    /// Every change of the state, as JSON, for `/events` (an event as applied, or a
    /// `snapshot` notice when a whole state was taken).
    events: tokio::sync::broadcast::Sender<String>,
    /// How far each arriving model file is (0..1), for `/v1/status` and `/api/pull`.
    fetch_progress: HashMap<String, f32>,
    /// The last failure of a model file that did not arrive, by model.
    fetch_failures: HashMap<String, String>,
    /// Models whose copy failed lately, and until when not to try again.
    fetch_backoff: HashMap<String, Instant>,
    pending: HashMap<OutboundRequestId, Pending>,
    catching_up: bool,
    last_report: Option<(NodeInfo, Instant)>,
    /// Failed instances the master will place again, by instance id.
    retry: HashMap<String, placement::Retry>,
    log: Option<std::fs::File>,
    /// Measured links to peers, and when each was last probed.
    links: HashMap<NodeId, LinkStats>,
    last_probe: HashMap<PeerId, Instant>,
    /// This machine's GPUs, refreshed by a task of its own.
    gpu: Option<Gpu>,
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
    let store = Store::new(config.data_dir.clone()).with_pip_args(shoal_store::pip_args_from_env());
    let state = load_snapshot(&config.data_dir).unwrap_or_default();
    let (api_tx, mut api_rx) = mpsc::channel::<ApiCall>(64);
    let (events, _) = tokio::sync::broadcast::channel::<String>(256);
    if config.api_key.is_none() && !config.http.ip().is_loopback() && !config.insecure {
        anyhow::bail!(
            "refusing to serve the API on {} without a key: give --api-key-file (or \
             SHOAL_API_KEY), or --insecure to serve it open",
            config.http
        );
    }
    let http_listener = tokio::net::TcpListener::bind(config.http)
        .await
        .with_context(|| format!("cannot listen on {}", config.http))?;
    let http = http_listener.local_addr()?.to_string();
    let mut streams = swarm.behaviour().streams.new_control();
    let generate = streams.accept(p2p::GENERATE).context("generate protocol")?;
    let files = streams
        .accept(p2p::MODEL_FILE)
        .context("model file protocol")?;
    tokio::spawn(crate::forward::serve(generate, api_tx.clone()));
    tokio::spawn(fetch::serve(files, store.clone()));
    let key = config.api_key.clone().map(crate::api::ApiKey::new);
    tokio::spawn(crate::api::serve(
        http_listener,
        api_tx,
        streams.clone(),
        key,
        config.auto_place,
        events.clone(),
    ));
    let (reports_tx, mut reports_rx) = mpsc::channel(256);
    let (fetch_tx, mut fetch_rx) = mpsc::channel(64);
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
        streams,
        store,
        http: http.clone(),
        hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default(),
        highest_term: state.term,
        state,
        leading: false,
        master: None,
        started: Instant::now(),
        alive: HashMap::new(),
        peer_ips: HashMap::new(),
        statics,
        discovered: HashMap::new(),
        last_dial: Instant::now() - Duration::from_secs(60),
        local: Local::default(),
        runners: HashMap::new(),
        removed: HashMap::new(),
        rank_listeners: HashMap::new(),
        reports_tx,
        fetches: HashMap::new(),
        fetch_tx,
        events,
        fetch_progress: HashMap::new(),
        fetch_failures: HashMap::new(),
        fetch_backoff: HashMap::new(),
        pending: HashMap::new(),
        catching_up: false,
        adopting: None,
        adopted: None,
        awaiting: None,
        last_report: None,
        retry: HashMap::new(),
        log,
        links: HashMap::new(),
        last_probe: HashMap::new(),
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
            Some(f) = fetch_rx.recv() => d.on_fetch(f),
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
            standing: self.standing(),
        };
        self.publish(HEARTBEAT_TOPIC, &hb);
        let silent: Vec<NodeId> = self
            .alive
            .iter()
            .filter(|(_, seen)| seen.last.elapsed() >= NODE_TIMEOUT)
            .map(|(id, _)| id.clone())
            .collect();
        self.alive
            .retain(|_, seen| seen.last.elapsed() < NODE_TIMEOUT);
        for id in silent {
            // Its connections are closed, so that it is dialled afresh when it can be
            // reached again: after a cut cable the old connection still looks open, and
            // gossip sent down it is lost until it times out, long after the cable heals.
            if let Ok(peer) = id.parse::<PeerId>() {
                tracing::info!(peer = %id, "silent; closing its connections");
                let _ = self.swarm.disconnect_peer_id(peer);
            }
        }
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

    fn dial_statics(&mut self) {
        if self.last_dial.elapsed() < Duration::from_secs(2) {
            return;
        }
        self.last_dial = Instant::now();
        self.dial_discovered();
        if self.swarm.connected_peers().count() >= self.statics.len() && !self.statics.is_empty() {
            return;
        }
        for addr in self.statics.clone() {
            if let Err(e) = self.swarm.dial(addr.clone()) {
                tracing::debug!(%addr, error = %e, "dial");
            }
        }
    }
}

impl Daemon {
    /// This node's state, as its heartbeat tells the others.
    fn standing(&self) -> Standing {
        let settled = self
            .alive
            .values()
            .filter(|s| s.since.elapsed() >= SETTLE)
            .count();
        Standing {
            side: 1 + settled,
            term: self.state.term,
            index: self.state.index,
        }
    }
}
