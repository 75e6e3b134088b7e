//! Ranks in separate processes or machines, one TCP connection per pair of ranks.
//!
//! Setup: every rank listens on its address; rank `i` dials every rank below it and
//! accepts every rank above it. Both sides of a connection present the instance token in
//! a hello frame; a connection without it is dropped and the rank keeps waiting for the
//! real peer until the setup deadline.
//!
//! After setup each link has one reader thread (the only reader of its socket) that
//! forwards data frames into a channel, so a large send never waits on a peer that is
//! itself blocked sending, and a writer shared with a heartbeat thread. A link whose peer
//! sends nothing, not even a heartbeat, for the liveness timeout fails with
//! `PeerSilent`: a frozen or cut-off peer is noticed in seconds, while a peer that is
//! merely busy computing keeps its heartbeats going.

use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::wire::{Frame, Kind, ReadError, read_frame, write_frame};
use crate::{CollectiveError, Health, Result, Transport};

/// How ranks find and trust each other.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    pub rank: usize,
    /// Every rank's listening address, by rank.
    pub addrs: Vec<SocketAddr>,
    /// The instance token every rank must present.
    pub token: String,
    /// How long setup may take in all.
    pub setup_timeout: Duration,
    /// Interval between heartbeats on an idle or busy link.
    pub heartbeat: Duration,
    /// A link with no frame for this long has failed.
    pub liveness: Duration,
}

impl TcpConfig {
    pub fn new(rank: usize, addrs: Vec<SocketAddr>, token: impl Into<String>) -> Self {
        Self {
            rank,
            addrs,
            token: token.into(),
            setup_timeout: Duration::from_secs(30),
            heartbeat: Duration::from_millis(250),
            liveness: Duration::from_secs(3),
        }
    }
}

type Inbox = Receiver<Result<(u64, Vec<u8>)>>;

struct Link {
    writer: Arc<Mutex<TcpStream>>,
    inbox: Inbox,
}

/// One rank's connections to all the others.
pub struct TcpTransport {
    rank: usize,
    links: Vec<Option<Link>>,
    liveness: Duration,
    stop: Arc<AtomicBool>,
    /// The first failure of each link, repeated to later calls.
    failed: Vec<Option<String>>,
    /// The first failure any reader thread saw, for watchdogs on other threads.
    health: Health,
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CollectiveError {
    let what = what.into();
    move |source| CollectiveError::Io { what, source }
}

fn hello_payload(token: &str, rank: usize, world: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(token.len() + 8);
    p.extend_from_slice(&(rank as u32).to_le_bytes());
    p.extend_from_slice(&(world as u32).to_le_bytes());
    p.extend_from_slice(token.as_bytes());
    p
}

/// Reads a hello frame and returns the sender's rank if it holds the token.
fn read_hello(stream: &mut TcpStream, token: &str, world: usize) -> Result<usize> {
    let frame = read_frame(stream).map_err(|e| match e {
        ReadError::Io(e) => CollectiveError::Refused(format!("no hello: {e}")),
        ReadError::Closed => CollectiveError::Refused("closed before its hello".into()),
        ReadError::Garbage(r) => CollectiveError::Refused(format!("malformed hello: {r}")),
    })?;
    if frame.kind != Kind::Hello || frame.payload.len() < 8 {
        return Err(CollectiveError::Refused(
            "the first frame was not a hello".into(),
        ));
    }
    let p = &frame.payload;
    let rank = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize;
    let their_world = u32::from_le_bytes([p[4], p[5], p[6], p[7]]) as usize;
    if !constant_time_eq(&p[8..], token.as_bytes()) {
        return Err(CollectiveError::Refused("wrong instance token".into()));
    }
    if their_world != world || rank >= world {
        return Err(CollectiveError::Refused(format!(
            "rank {rank} of {their_world} does not belong to this world of {world}"
        )));
    }
    Ok(rank)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl TcpTransport {
    /// Connects this rank to every other. `listener` must be bound to
    /// `config.addrs[config.rank]`.
    pub fn connect(config: &TcpConfig, listener: TcpListener) -> Result<Self> {
        let world = config.addrs.len();
        let rank = config.rank;
        if rank >= world {
            return Err(CollectiveError::Invalid(format!("rank {rank} of {world}")));
        }
        let until = Instant::now() + config.setup_timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let hello = hello_payload(&config.token, rank, world);
        // Dial the lower ranks.
        for (peer, &addr) in config.addrs.iter().enumerate().take(rank) {
            let stream = dial(addr, until, |s| {
                s.set_read_timeout(Some(config.liveness.max(Duration::from_secs(1))))
                    .map_err(io_err("set timeout"))?;
                write_frame(s, Kind::Hello, 0, &hello).map_err(io_err("send hello"))?;
                let got = read_hello(s, &config.token, world)?;
                if got != peer {
                    return Err(CollectiveError::Refused(format!(
                        "{addr} answered as rank {got}, expected {peer}"
                    )));
                }
                Ok(())
            })?;
            streams[peer] = Some(stream);
        }
        // Accept the higher ranks.
        listener
            .set_nonblocking(true)
            .map_err(io_err("listener nonblocking"))?;
        while streams[rank + 1..].iter().any(Option::is_none) {
            if Instant::now() >= until {
                let missing: Vec<usize> = (rank + 1..world)
                    .filter(|&p| streams[p].is_none())
                    .collect();
                return Err(CollectiveError::Setup(format!(
                    "rank {rank}: ranks {missing:?} did not connect within {:?}",
                    config.setup_timeout
                )));
            }
            match listener.accept() {
                Ok((mut s, from)) => {
                    let accepted = (|| -> Result<usize> {
                        s.set_nonblocking(false)
                            .map_err(io_err("stream blocking"))?;
                        s.set_read_timeout(Some(Duration::from_secs(2)))
                            .map_err(io_err("set timeout"))?;
                        let peer = read_hello(&mut s, &config.token, world)?;
                        if peer <= rank || streams[peer].is_some() {
                            return Err(CollectiveError::Refused(format!(
                                "unexpected rank {peer}"
                            )));
                        }
                        write_frame(&mut s, Kind::Hello, 0, &hello)
                            .map_err(io_err("send hello"))?;
                        Ok(peer)
                    })();
                    match accepted {
                        Ok(peer) => streams[peer] = Some(s),
                        Err(e) => {
                            tracing::warn!(%from, error = %e, "refused a connection");
                            let _ = s.shutdown(Shutdown::Both);
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(io_err("accept")(e)),
            }
        }
        Self::start(rank, streams, config)
    }

    fn start(rank: usize, streams: Vec<Option<TcpStream>>, config: &TcpConfig) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let health = Health::default();
        let mut links = Vec::with_capacity(streams.len());
        let mut writers = Vec::new();
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                links.push(None);
                continue;
            };
            s.set_nodelay(true).map_err(io_err("nodelay"))?;
            s.set_read_timeout(Some(config.liveness))
                .map_err(io_err("read timeout"))?;
            s.set_write_timeout(Some(config.liveness))
                .map_err(io_err("write timeout"))?;
            let reader = s.try_clone().map_err(io_err("clone stream"))?;
            let (tx, inbox) = channel();
            let liveness = config.liveness;
            let health = health.clone();
            std::thread::Builder::new()
                .name(format!("shoal-link-{rank}-{peer}"))
                .spawn(move || read_loop(reader, peer, liveness, tx, health))
                .map_err(io_err("spawn link reader"))?;
            let writer = Arc::new(Mutex::new(s));
            writers.push(Arc::clone(&writer));
            links.push(Some(Link { writer, inbox }));
        }
        let beat_stop = Arc::clone(&stop);
        let interval = config.heartbeat;
        std::thread::Builder::new()
            .name(format!("shoal-heartbeat-{rank}"))
            .spawn(move || {
                while !beat_stop.load(Ordering::Relaxed) {
                    for w in &writers {
                        if let Ok(mut s) = w.lock() {
                            // A failed heartbeat shows up as the link's read error.
                            let _ = write_frame(&mut *s, Kind::Heartbeat, 0, &[]);
                        }
                    }
                    std::thread::sleep(interval);
                }
            })
            .map_err(io_err("spawn heartbeat"))?;
        let world = links.len();
        Ok(Self {
            rank,
            links,
            liveness: config.liveness,
            stop,
            failed: vec![None; world],
            health,
        })
    }

    fn link(&self, peer: usize) -> Result<&Link> {
        self.links
            .get(peer)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| CollectiveError::Invalid(format!("no link to rank {peer}")))
    }

    fn remember(&mut self, peer: usize, e: CollectiveError) -> CollectiveError {
        if self.failed[peer].is_none() {
            self.failed[peer] = Some(e.to_string());
        }
        e
    }
}

/// Dials `addr` until it answers or `until` passes, then runs `handshake` on the stream.
fn dial(
    addr: SocketAddr,
    until: Instant,
    handshake: impl Fn(&mut TcpStream) -> Result<()>,
) -> Result<TcpStream> {
    let mut last = String::from("no attempt");
    while Instant::now() < until {
        let left = until
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(10));
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(2))) {
            Ok(mut s) => match handshake(&mut s) {
                Ok(()) => return Ok(s),
                Err(e @ CollectiveError::Refused(_)) => return Err(e),
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(CollectiveError::Setup(format!(
        "could not reach {addr}: {last}"
    )))
}

fn read_loop(
    mut s: TcpStream,
    peer: usize,
    liveness: Duration,
    tx: Sender<Result<(u64, Vec<u8>)>>,
    health: Health,
) {
    loop {
        let err = match read_frame(&mut s) {
            Ok(Frame {
                kind: Kind::Heartbeat,
                ..
            }) => continue,
            Ok(Frame {
                kind: Kind::Data,
                op,
                payload,
            }) => {
                if tx.send(Ok((op, payload))).is_err() {
                    return; // the transport is gone
                }
                continue;
            }
            Ok(Frame {
                kind: Kind::Close, ..
            })
            | Err(ReadError::Closed) => CollectiveError::PeerClosed { peer },
            Ok(Frame {
                kind: Kind::Hello, ..
            }) => CollectiveError::Garbage {
                peer,
                reason: "a hello after setup".into(),
            },
            Err(ReadError::Garbage(reason)) => CollectiveError::Garbage { peer, reason },
            Err(ReadError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                CollectiveError::PeerSilent {
                    peer,
                    silent: liveness,
                }
            }
            Err(ReadError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                CollectiveError::PeerClosed { peer }
            }
            Err(ReadError::Io(source)) => CollectiveError::Io {
                what: format!("reading from rank {peer}"),
                source,
            },
        };
        health.fail(err.to_string());
        let _ = tx.send(Err(err));
        let _ = s.shutdown(Shutdown::Both);
        return;
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.links.len()
    }

    fn send(&mut self, to: usize, op: u64, data: &[u8]) -> Result<()> {
        if let Some(cause) = self.failed.get(to).and_then(|f| f.clone()) {
            return Err(CollectiveError::LinkDown { peer: to, cause });
        }
        let liveness = self.liveness;
        let link = self.link(to)?;
        let result = match link.writer.lock() {
            Ok(mut s) => write_frame(&mut *s, Kind::Data, op, data),
            Err(_) => return Err(CollectiveError::Invalid("link writer poisoned".into())),
        };
        result.map_err(|e| {
            let err = match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    CollectiveError::PeerSilent {
                        peer: to,
                        silent: liveness,
                    }
                }
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
                    CollectiveError::PeerClosed { peer: to }
                }
                _ => CollectiveError::Io {
                    what: format!("sending to rank {to}"),
                    source: e,
                },
            };
            self.remember(to, err)
        })
    }

    fn health(&self) -> Health {
        self.health.clone()
    }

    fn recv(&mut self, from: usize, op: u64, deadline: Duration) -> Result<Vec<u8>> {
        if let Some(cause) = self.failed.get(from).and_then(|f| f.clone()) {
            return Err(CollectiveError::LinkDown { peer: from, cause });
        }
        let got = self.link(from)?.inbox.recv_timeout(deadline);
        let result = match got {
            Ok(Ok((got, data))) if got == op => return Ok(data),
            Ok(Ok((got, _))) => CollectiveError::OutOfStep {
                peer: from,
                expected: op,
                got,
            },
            Ok(Err(e)) => e,
            Err(RecvTimeoutError::Timeout) => CollectiveError::Timeout {
                peer: from,
                op,
                waited: deadline,
            },
            Err(RecvTimeoutError::Disconnected) => CollectiveError::PeerClosed { peer: from },
        };
        Err(self.remember(from, result))
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for link in self.links.iter().flatten() {
            if let Ok(mut s) = link.writer.lock() {
                let _ = write_frame(&mut *s, Kind::Close, 0, &[]);
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

/// Binds `n` listeners on loopback ports chosen by the system: addresses for a local
/// group (tests, `--ranks N` on one machine).
pub fn loopback_listeners(n: usize) -> Result<Vec<(TcpListener, SocketAddr)>> {
    (0..n)
        .map(|_| {
            let l = TcpListener::bind("127.0.0.1:0").map_err(io_err("bind loopback"))?;
            let a = l.local_addr().map_err(io_err("local address"))?;
            Ok((l, a))
        })
        .collect()
}
