//! libp2p links between nodes and the messages they carry.
//!
//! Transport: TCP, then the private-network handshake with the cluster key (pnet: a node
//! without the key cannot get past the first bytes), then Noise (authenticated by node
//! keys), then yamux. Behaviours: gossipsub (topics `heartbeat`, `commands`, `events`),
//! request-response (catch-up, placement, link probes), streams (a forwarded request
//! and its answer, a model file), mDNS (optional).
//!
//! A stream starts with one JSON line (the request) and goes on in JSON lines (a
//! forwarded answer's [`Piece`]s) or raw bytes (a model file after its [`FileHeader`]).

use std::time::Duration;

use anyhow::{Context, Result};
use futures::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::upgrade::Version;
use libp2p::gossipsub::{self, IdentTopic, MessageAuthenticity};
use libp2p::identity::Keypair;
use libp2p::pnet::{PnetConfig, PreSharedKey};
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::NetworkBehaviour;
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::{Multiaddr, StreamProtocol, Swarm, Transport, mdns, noise, tcp, yamux};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use shoal_cluster::{
    ClusterState, Indexed, Instance, NodeId, NodeInfo, PlaceRequest, RunnerStatus,
};

pub const HEARTBEAT_TOPIC: &str = "shoal/heartbeat/1";
pub const COMMANDS_TOPIC: &str = "shoal/commands/1";
pub const EVENTS_TOPIC: &str = "shoal/events/1";
/// A request forwarded to the node that holds rank 0, and its answer.
pub const GENERATE: StreamProtocol = StreamProtocol::new("/shoal/generate/1");
/// A model file copied from a node that has it.
pub const MODEL_FILE: StreamProtocol = StreamProtocol::new("/shoal/model-file/1");
/// The longest line a stream may carry.
const MAX_LINE: u64 = 16 << 20;

/// Every node, every heartbeat interval.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Heartbeat {
    pub id: NodeId,
    /// The highest term this node has seen.
    pub term: u64,
    pub leading: bool,
    /// The state it holds.
    pub standing: shoal_cluster::election::Standing,
}

/// A node asks the master to record something.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Command {
    Report(NodeInfo),
    RankPort {
        instance: String,
        rank: usize,
        port: u16,
    },
    RankStatus {
        instance: String,
        rank: usize,
        status: RunnerStatus,
    },
}

/// What the master publishes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Published {
    Event(Indexed),
    /// A new master's whole state, with its term.
    Snapshot {
        term: u64,
        state: ClusterState,
    },
}

/// Direct requests between nodes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Request {
    /// The master's state (a replica that missed events, or just restarted).
    CatchUp,
    /// Create an instance (sent to the master).
    Place(PlaceRequest),
    /// Create an instance unless the model has one already, which is the answer then
    /// (auto-placement: many requests for a model, one instance).
    PlaceIfAbsent(PlaceRequest),
    /// Remove an instance (sent to the master): its runners stop everywhere.
    Delete(String),
    /// A link probe: echoed back empty (the payload measures bandwidth).
    Probe {
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Response {
    Snapshot { term: u64, state: ClusterState },
    Placed(Instance),
    Deleted(String),
    Refused(String),
    Probe,
    Error(String),
}

/// The first line of a model-file stream.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FileRequest {
    pub model: String,
    /// Bytes the asking node already has.
    pub offset: u64,
}

/// The serving node's answer; the file's bytes from the offset follow `Sending`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum FileHeader {
    Sending { total: u64 },
    Refused(String),
}

/// The first line of a generate stream: the request as the node's API took it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Forward {
    pub request: shoal_runner::control::GenerateRequest,
}

/// Writes `msg` as one JSON line.
pub async fn write_line<T: Serialize, W: futures::AsyncWrite + Unpin>(
    stream: &mut W,
    msg: &T,
) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line).await?;
    stream.flush().await
}

/// Reads one JSON line, waiting at most `deadline`. The reader is buffered for the
/// stream's whole life: what follows the line stays in its buffer.
pub async fn read_line<T: DeserializeOwned, R: futures::AsyncBufRead + Unpin>(
    reader: &mut R,
    deadline: Duration,
) -> std::io::Result<T> {
    let mut line = Vec::new();
    let read = async {
        let mut limited = reader.take(MAX_LINE);
        limited.read_until(b'\n', &mut line).await
    };
    let n = tokio::time::timeout(deadline, read)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no line in time"))??;
    if n == 0 || line.last() != Some(&b'\n') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the stream ended inside a line",
        ));
    }
    serde_json::from_slice(&line)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[derive(NetworkBehaviour)]
pub struct Behaviour {
    pub gossip: gossipsub::Behaviour,
    pub rpc: request_response::cbor::Behaviour<Request, Response>,
    pub streams: libp2p_stream::Behaviour,
    pub mdns: Toggle<mdns::tokio::Behaviour>,
}

/// Builds the swarm for `key` in the private network of `cluster_key`.
pub fn build(key: Keypair, cluster_key: [u8; 32], mdns_on: bool) -> Result<Swarm<Behaviour>> {
    let psk = PreSharedKey::new(cluster_key);
    let swarm = libp2p::SwarmBuilder::with_existing_identity(key)
        .with_tokio()
        .with_other_transport(
            |key| -> Result<_, Box<dyn std::error::Error + Send + Sync>> {
                let noise = noise::Config::new(key)?;
                Ok(
                    tcp::tokio::Transport::new(tcp::Config::default().nodelay(true))
                        .and_then(move |socket, _| PnetConfig::new(psk).handshake(socket))
                        .upgrade(Version::V1Lazy)
                        .authenticate(noise)
                        .multiplex(yamux::Config::default())
                        .timeout(Duration::from_secs(10))
                        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer))),
                )
            },
        )
        .context("transport")?
        .with_behaviour(
            |key| -> Result<_, Box<dyn std::error::Error + Send + Sync>> {
                let config = gossipsub::ConfigBuilder::default()
                    .heartbeat_interval(Duration::from_millis(250))
                    .validation_mode(gossipsub::ValidationMode::Strict)
                    .flood_publish(true)
                    .max_transmit_size(8 << 20)
                    .build()?;
                let gossip =
                    gossipsub::Behaviour::new(MessageAuthenticity::Signed(key.clone()), config)?;
                let rpc = request_response::cbor::Behaviour::new(
                    [(StreamProtocol::new("/shoal/rpc/1"), ProtocolSupport::Full)],
                    request_response::Config::default()
                        .with_request_timeout(Duration::from_secs(30)),
                );
                let mdns = if mdns_on {
                    // Asked again every few seconds, not every 5 minutes (the default):
                    // libp2p's mDNS stops probing at the first answer, so machines that
                    // start together may hear only some of each other at first.
                    let config = mdns::Config {
                        query_interval: Duration::from_secs(5),
                        ttl: Duration::from_secs(60),
                        ..mdns::Config::default()
                    };
                    Some(mdns::tokio::Behaviour::new(
                        config,
                        key.public().to_peer_id(),
                    )?)
                } else {
                    None
                };
                Ok(Behaviour {
                    gossip,
                    rpc,
                    streams: libp2p_stream::Behaviour::new(),
                    mdns: Toggle::from(mdns),
                })
            },
        )
        .context("behaviour")?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(3600)))
        .build();
    Ok(swarm)
}

/// `/ip4/A/tcp/P` for a socket address.
pub fn multiaddr(addr: std::net::SocketAddr) -> Multiaddr {
    let mut m = Multiaddr::empty();
    match addr.ip() {
        std::net::IpAddr::V4(ip) => m.push(libp2p::multiaddr::Protocol::Ip4(ip)),
        std::net::IpAddr::V6(ip) => m.push(libp2p::multiaddr::Protocol::Ip6(ip)),
    }
    m.push(libp2p::multiaddr::Protocol::Tcp(addr.port()));
    m
}

pub fn topics() -> [IdentTopic; 3] {
    [
        IdentTopic::new(HEARTBEAT_TOPIC),
        IdentTopic::new(COMMANDS_TOPIC),
        IdentTopic::new(EVENTS_TOPIC),
    ]
}
