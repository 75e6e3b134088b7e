//! The network: swarm events, gossip, direct requests and link probes.

use libp2p::core::ConnectedPoint;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::dial_opts::DialOpts;

use super::*;

/// Bytes of the bulk link probe.
const PROBE_BYTES: usize = 512 << 10; // under the codec's 1 MiB request limit
/// How often each link is probed.
const PROBE_EVERY: Duration = Duration::from_secs(10);

/// The IP address in a multiaddr, if it has one.
fn ip_of(addr: &Multiaddr) -> Option<IpAddr> {
    addr.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
        _ => None,
    })
}

impl Daemon {
    /// Dials every peer mDNS found that is not connected, with every address it
    /// announced, as that peer: one that leads elsewhere (its loopback, seen from here)
    /// fails the peer id check.
    pub(super) fn dial_discovered(&mut self) {
        let todo: Vec<(PeerId, Vec<Multiaddr>)> = self
            .discovered
            .iter()
            .filter(|(p, _)| !self.swarm.is_connected(p))
            .map(|(p, a)| (*p, a.clone()))
            .collect();
        for (peer, addrs) in todo {
            let opts = DialOpts::peer_id(peer).addresses(addrs).build();
            if let Err(e) = self.swarm.dial(opts) {
                tracing::debug!(%peer, error = %e, "dial");
            }
        }
    }

    pub(super) fn probe(&mut self) {
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

    pub(super) fn on_probe(&mut self, peer: PeerId, sent: Instant, bytes: usize) {
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

    pub(super) fn on_swarm(&mut self, ev: SwarmEvent<BehaviourEvent>) {
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
                            let now = Instant::now();
                            let since = self.alive.get(&source).map_or(now, |s| s.since);
                            self.alive.insert(
                                source,
                                Seen {
                                    last: now,
                                    since,
                                    hb,
                                },
                            );
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
                // Kept, and dialled until connected (here and on every dial round): a
                // peer may not listen yet when it is first seen, or come back later.
                for (peer, addr) in list {
                    let addrs = self.discovered.entry(peer).or_default();
                    if !addrs.contains(&addr) {
                        addrs.push(addr);
                    }
                }
                self.dial_discovered();
            }
            SwarmEvent::Behaviour(BehaviourEvent::Mdns(libp2p::mdns::Event::Expired(list))) => {
                for (peer, addr) in list {
                    if let Some(addrs) = self.discovered.get_mut(&peer) {
                        addrs.retain(|a| a != &addr);
                    }
                }
                self.discovered.retain(|_, addrs| !addrs.is_empty());
            }
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                tracing::debug!(peer = ?peer_id, %error, "dial failed");
            }
            SwarmEvent::ConnectionEstablished {
                peer_id, endpoint, ..
            } => {
                // Where this node reaches the peer: the address it dialled, or the one
                // the peer's connection came from. Its ranks are dialled there.
                let addr = match &endpoint {
                    ConnectedPoint::Dialer { address, .. } => address,
                    ConnectedPoint::Listener { send_back_addr, .. } => send_back_addr,
                };
                if let Some(ip) = ip_of(addr) {
                    tracing::debug!(peer = %peer_id, %ip, "connected");
                    self.peer_ips.insert(peer_id, ip);
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                num_established: 0,
                ..
            } => {
                // A peer whose every connection closed is gone now (kill -9, cable).
                self.alive.remove(&peer_id.to_string());
                self.peer_ips.remove(&peer_id);
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

    pub(super) fn on_rpc(&mut self, e: request_response::Event<Request, Response>) {
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
                    Some(Pending::CatchUp) => {
                        self.catching_up = false;
                        self.adopting = None;
                    }
                    Some(Pending::Probe(..)) => {}
                    None => {}
                }
            }
            _ => {}
        }
    }

    pub(super) fn on_request(
        &mut self,
        peer: PeerId,
        request: Request,
        channel: ResponseChannel<Response>,
    ) {
        let if_absent = matches!(request, Request::PlaceIfAbsent(_));
        let response = match request {
            Request::CatchUp => Response::Snapshot {
                term: self.highest_term,
                state: self.state.clone(),
            },
            Request::Place(_) | Request::PlaceIfAbsent(_) | Request::Delete(_) if !self.leading => {
                Response::Refused("this node is not the master".into())
            }
            Request::Delete(id) => match self.delete_now(&id) {
                Ok(()) => Response::Deleted(id),
                Err(e) => Response::Refused(e),
            },
            Request::Place(req) | Request::PlaceIfAbsent(req) => {
                let (model, context) = (&req.model.name, Some(req.context));
                let placed = if if_absent {
                    self.place_if_absent(model, req.strategy, req.nodes, context)
                } else {
                    self.place_now(model, req.strategy, req.nodes, context, 0)
                };
                match placed {
                    Ok(i) => Response::Placed(i),
                    Err(e) => Response::Refused(e),
                }
            }
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

    pub(super) fn on_response(&mut self, id: OutboundRequestId, response: Response) {
        match (self.pending.remove(&id), response) {
            (Some(Pending::CatchUp), Response::Snapshot { term, state })
                if self.adopting.is_some() =>
            {
                // The heavier state, whatever its term: lead with it above every term.
                self.catching_up = false;
                self.adopted = self.adopting.take();
                tracing::info!(index = state.index, term, "took a heavier state");
                self.highest_term = self.highest_term.max(term);
                self.state = state;
                self.take_office(self.highest_term + 1);
            }
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
            (Some(Pending::Place(reply)), Response::Deleted(id)) => {
                let _ = reply.send(Ok(serde_json::json!({ "deleted": id })));
            }
            (Some(Pending::Place(reply)), Response::Placed(i)) => {
                let _ = reply.send(serde_json::to_value(&i).map_err(|e| e.to_string()));
            }
            (Some(Pending::Place(reply)), Response::Refused(why) | Response::Error(why)) => {
                let _ = reply.send(Err(why));
            }
            (Some(Pending::Probe(peer, sent, bytes)), Response::Probe) => {
                self.on_probe(peer, sent, bytes)
            }
            (Some(Pending::CatchUp), _) => {
                self.catching_up = false;
                self.adopting = None;
            }
            _ => {}
        }
    }
}
