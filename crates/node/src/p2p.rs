//! libp2p links between nodes and the messages they carry.
//!
//! Transport: TCP, then the private-network handshake with the cluster key (pnet: a node
//! without the key cannot get past the first bytes), then Noise (authenticated by node
//! keys), then yamux. Behaviours: gossipsub (topics `heartbeat`, `commands`, `events`),
//! request-response (catch-up, placement, model file chunks), mDNS (optional).

use std::time::Duration;

use anyhow::{Context, Result};
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::upgrade::Version;
use libp2p::gossipsub::{self, IdentTopic, MessageAuthenticity};
use libp2p::identity::Keypair;
use libp2p::pnet::{PnetConfig, PreSharedKey};
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::NetworkBehaviour;
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::{Multiaddr, StreamProtocol, Swarm, Transport, mdns, noise, tcp, yamux};
use serde::{Deserialize, Serialize};
use shoal_cluster::{
    ClusterState, Indexed, Instance, NodeId, NodeInfo, PlaceRequest, RunnerStatus,
};

pub const HEARTBEAT_TOPIC: &str = "shoal/heartbeat/1";
pub const COMMANDS_TOPIC: &str = "shoal/commands/1";
pub const EVENTS_TOPIC: &str = "shoal/events/1";

/// Every node, every heartbeat interval.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Heartbeat {
    pub id: NodeId,
    pub term: u64,
    pub leading: bool,
    pub index: u64,
}

/// A node asks the master to record something.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Command {
    Report(NodeInfo),
    RankAddr {
        instance: String,
        rank: usize,
        addr: String,
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
    /// `len` bytes of model `model`'s file from `offset`.
    Chunk {
        model: String,
        offset: u64,
        len: u64,
    },
    /// A link probe: echoed back empty (the payload measures bandwidth).
    Probe {
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Response {
    Snapshot {
        term: u64,
        state: ClusterState,
    },
    Placed(Instance),
    Refused(String),
    Chunk {
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        total: u64,
    },
    Probe,
    Error(String),
}

#[derive(NetworkBehaviour)]
pub struct Behaviour {
    pub gossip: gossipsub::Behaviour,
    pub rpc: request_response::cbor::Behaviour<Request, Response>,
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
                    Some(mdns::tokio::Behaviour::new(
                        mdns::Config::default(),
                        key.public().to_peer_id(),
                    )?)
                } else {
                    None
                };
                Ok(Behaviour {
                    gossip,
                    rpc,
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
