//! Collective operations between the ranks of one model instance.
//!
//! Every rank runs the same program: the same collective calls in the same order. Each
//! call carries an operation number, and a frame from another operation is an error, so
//! a rank that fell out of step is caught at once instead of mixing tensors.
//!
//! Two transports move the bytes: [`tcp`] between processes (and machines), and
//! [`local`] between threads of one process for tests. The algorithms ([`Group`]) are
//! written once over the [`Transport`] trait.
//!
//! Nothing waits forever. A receive waits at most the operation deadline; over TCP every
//! link also carries heartbeats, so a peer that dies, freezes (SIGSTOP) or whose cable is
//! cut is noticed within the liveness timeout even while the operation deadline is long.

pub mod local;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod tcp;
mod wire;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use wire::{MAX_FRAME_BYTES, f32s_from_bytes, f32s_to_bytes};

/// What went wrong between ranks. Every rank that observes a failure returns one of
/// these; none hangs.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("rank {peer} sent nothing for {waited:?} during operation {op} (deadline)")]
    Timeout {
        peer: usize,
        op: u64,
        waited: Duration,
    },
    #[error("rank {peer} went silent: no frame or heartbeat for {0:?}", .silent)]
    PeerSilent { peer: usize, silent: Duration },
    #[error("rank {peer} closed the connection")]
    PeerClosed { peer: usize },
    #[error("rank {peer} sent a malformed frame: {reason}")]
    Garbage { peer: usize, reason: String },
    #[error("rank {peer} is out of step: it sent operation {got}, this rank is at {expected}")]
    OutOfStep {
        peer: usize,
        expected: u64,
        got: u64,
    },
    #[error("the link to rank {peer} failed earlier: {cause}")]
    LinkDown { peer: usize, cause: String },
    #[error("connection refused: {0}")]
    Refused(String),
    #[error("could not connect the ranks: {0}")]
    Setup(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid collective call: {0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, CollectiveError>;

/// Point-to-point messages between ranks, in order per pair of ranks.
pub trait Transport: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Sends `data` as operation `op` to rank `to`.
    fn send(&mut self, to: usize, op: u64, data: &[u8]) -> Result<()>;
    /// Receives operation `op`'s message from rank `from`, waiting at most `deadline`.
    fn recv(&mut self, from: usize, op: u64, deadline: Duration) -> Result<Vec<u8>>;
    /// The links' health as another thread can watch it while this transport is busy
    /// (or idle): a watchdog over work that does not go through the transport, such as
    /// NCCL collectives on the GPUs, learns from it that a peer died or froze.
    fn health(&self) -> Health {
        Health::default()
    }
}

/// The first failure of any link of a transport, readable from any thread.
#[derive(Clone, Debug, Default)]
pub struct Health(Arc<OnceLock<String>>);

impl Health {
    /// The first failure seen, if any.
    pub fn failure(&self) -> Option<&str> {
        self.0.get().map(String::as_str)
    }

    /// Records a failure; later ones are dropped (the first is the cause).
    pub fn fail(&self, why: impl Into<String>) {
        let _ = self.0.set(why.into());
    }
}

/// Payloads at or below this many bytes are all-reduced directly (every rank sends its
/// whole vector to every other); larger ones take the ring.
pub const DIRECT_ALL_REDUCE_BYTES: usize = 64 * 1024;

/// The collective operations of one rank, over any transport.
///
/// Messages are numbered per ordered pair of ranks: the n-th message this rank sends to
/// rank r carries n, and r expects exactly n next. Ranks that disagree about the program
/// (one sent a message the other does not wait for) fail with `OutOfStep`.
pub struct Group<T: Transport> {
    transport: T,
    sent: Vec<u64>,
    received: Vec<u64>,
    deadline: Duration,
}

impl<T: Transport> Group<T> {
    /// `deadline` bounds every wait of every operation.
    pub fn new(transport: T, deadline: Duration) -> Self {
        let world = transport.world();
        Self {
            transport,
            sent: vec![0; world],
            received: vec![0; world],
            deadline,
        }
    }

    /// The transport's health, for a watchdog thread.
    pub fn health(&self) -> Health {
        self.transport.health()
    }

    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    pub fn world(&self) -> usize {
        self.transport.world()
    }

    /// How long one wait may last.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    pub fn set_deadline(&mut self, deadline: Duration) {
        self.deadline = deadline;
    }

    fn put(&mut self, to: usize, data: &[u8]) -> Result<()> {
        self.sent[to] += 1;
        self.transport.send(to, self.sent[to], data)
    }

    fn take(&mut self, from: usize, deadline: Duration) -> Result<Vec<u8>> {
        self.received[from] += 1;
        self.transport.recv(from, self.received[from], deadline)
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.world() || peer == self.rank() {
            return Err(CollectiveError::Invalid(format!(
                "rank {} cannot talk to rank {peer} in a world of {}",
                self.rank(),
                self.world()
            )));
        }
        Ok(())
    }

    /// Sends `data` to `to`; the matching call on `to` is [`Group::recv`].
    pub fn send(&mut self, to: usize, data: &[u8]) -> Result<()> {
        self.check_peer(to)?;
        self.put(to, data)
    }

    /// Receives what `from` sent with [`Group::send`].
    pub fn recv(&mut self, from: usize) -> Result<Vec<u8>> {
        self.check_peer(from)?;
        self.take(from, self.deadline)
    }

    /// [`Group::recv`] with its own deadline (a rank idle between requests may wait
    /// longer than an operation may take; heartbeats still catch a dead peer).
    pub fn recv_within(&mut self, from: usize, deadline: Duration) -> Result<Vec<u8>> {
        self.check_peer(from)?;
        self.take(from, deadline)
    }

    /// Every rank ends with `root`'s bytes in `data`.
    pub fn broadcast(&mut self, root: usize, data: &mut Vec<u8>) -> Result<()> {
        let deadline = self.deadline;
        self.broadcast_within(root, data, deadline)
    }

    /// [`Group::broadcast`] with its own deadline for the non-root ranks' wait.
    pub fn broadcast_within(
        &mut self,
        root: usize,
        data: &mut Vec<u8>,
        deadline: Duration,
    ) -> Result<()> {
        if root >= self.world() {
            return Err(CollectiveError::Invalid(format!("no root rank {root}")));
        }
        if self.rank() == root {
            for peer in (0..self.world()).filter(|&p| p != root) {
                self.put(peer, data)?;
            }
        } else {
            *data = self.take(root, deadline)?;
        }
        Ok(())
    }

    /// Every rank's `local` (lengths may differ), indexed by rank.
    pub fn all_gather(&mut self, local: &[f32]) -> Result<Vec<Vec<f32>>> {
        let bytes = f32s_to_bytes(local);
        let (rank, world) = (self.rank(), self.world());
        for peer in (0..world).filter(|&p| p != rank) {
            self.put(peer, &bytes)?;
        }
        let mut out = Vec::with_capacity(world);
        for peer in 0..world {
            if peer == rank {
                out.push(local.to_vec());
            } else {
                let b = self.take(peer, self.deadline)?;
                out.push(
                    f32s_from_bytes(&b)
                        .map_err(|reason| CollectiveError::Garbage { peer, reason })?,
                );
            }
        }
        Ok(out)
    }

    /// Element-wise sum over the ranks, in place. Every rank ends with bitwise the same
    /// values (sums are taken in one order that does not depend on the rank).
    pub fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<()> {
        if self.world() == 1 {
            return Ok(());
        }
        if data.len() * 4 <= DIRECT_ALL_REDUCE_BYTES || data.len() < self.world() {
            self.all_reduce_direct(data)
        } else {
            self.all_reduce_ring(data)
        }
    }

    fn all_reduce_direct(&mut self, data: &mut [f32]) -> Result<()> {
        let parts = self.all_gather(data)?;
        for (peer, p) in parts.iter().enumerate() {
            if p.len() != data.len() {
                return Err(CollectiveError::Garbage {
                    peer,
                    reason: format!("{} values for an all-reduce of {}", p.len(), data.len()),
                });
            }
        }
        for (i, v) in data.iter_mut().enumerate() {
            let mut s = 0f32;
            for p in &parts {
                s += p[i];
            }
            *v = s;
        }
        Ok(())
    }

    /// Reduce-scatter then all-gather around the ring: each rank sends and receives
    /// `2·(n-1)/n` of the vector whatever the number of ranks.
    fn all_reduce_ring(&mut self, data: &mut [f32]) -> Result<()> {
        let (rank, n) = (self.rank(), self.world());
        let len = data.len();
        let bounds = |c: usize| (c * len / n, (c + 1) * len / n);
        // Reduce-scatter: after step s, chunk (rank - s - 1) holds s + 2 ranks' sums.
        for s in 0..n - 1 {
            let (a, b) = bounds((rank + n - s) % n);
            let (c, d) = bounds((rank + n - s - 1) % n);
            let got = self.ring_step(&data[a..b], d - c)?;
            for (v, g) in data[c..d].iter_mut().zip(got) {
                *v += g;
            }
        }
        // All-gather: chunk (rank + 1) is complete here; pass complete chunks on.
        for s in 0..n - 1 {
            let (a, b) = bounds((rank + 1 + n - s) % n);
            let (c, d) = bounds((rank + n - s) % n);
            let got = self.ring_step(&data[a..b], d - c)?;
            data[c..d].copy_from_slice(&got);
        }
        Ok(())
    }

    /// Sends `chunk` to the next rank and takes the previous rank's chunk, which must
    /// hold `expect` values.
    fn ring_step(&mut self, chunk: &[f32], expect: usize) -> Result<Vec<f32>> {
        let n = self.world();
        let (next, prev) = ((self.rank() + 1) % n, (self.rank() + n - 1) % n);
        self.put(next, &f32s_to_bytes(chunk))?;
        let got = self.take(prev, self.deadline)?;
        let got = f32s_from_bytes(&got)
            .map_err(|reason| CollectiveError::Garbage { peer: prev, reason })?;
        if got.len() != expect {
            return Err(CollectiveError::Garbage {
                peer: prev,
                reason: format!("ring chunk of {} values, expected {expect}", got.len()),
            });
        }
        Ok(got)
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<()> {
        self.all_gather(&[]).map(|_| ())
    }
}
