//! Ranks as threads of one process, joined by channels: for tests, and for a model split
//! inside one process.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;

use crate::{CollectiveError, Group, Result, Transport};

/// A numbered message.
type Message = (u64, Vec<u8>);

/// One rank's ends of the channels to every other rank.
pub struct LocalTransport {
    rank: usize,
    to: Vec<Option<Sender<Message>>>,
    from: Vec<Option<Receiver<Message>>>,
}

/// `world` connected ranks; give each to its own thread.
pub fn local_group(world: usize, deadline: Duration) -> Vec<Group<LocalTransport>> {
    let mut to: Vec<Vec<Option<Sender<Message>>>> = (0..world)
        .map(|_| (0..world).map(|_| None).collect())
        .collect();
    let mut from: Vec<Vec<Option<Receiver<Message>>>> = (0..world)
        .map(|_| (0..world).map(|_| None).collect())
        .collect();
    for a in 0..world {
        for b in 0..world {
            if a != b {
                let (tx, rx) = channel();
                to[a][b] = Some(tx);
                from[b][a] = Some(rx);
            }
        }
    }
    to.into_iter()
        .zip(from)
        .enumerate()
        .map(|(rank, (to, from))| Group::new(LocalTransport { rank, to, from }, deadline))
        .collect()
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.to.len()
    }

    fn send(&mut self, to: usize, op: u64, data: &[u8]) -> Result<()> {
        let tx = self
            .to
            .get(to)
            .and_then(|t| t.as_ref())
            .ok_or_else(|| CollectiveError::Invalid(format!("no rank {to}")))?;
        tx.send((op, data.to_vec()))
            .map_err(|_| CollectiveError::PeerClosed { peer: to })
    }

    fn recv(&mut self, from: usize, op: u64, deadline: Duration) -> Result<Vec<u8>> {
        let rx = self
            .from
            .get(from)
            .and_then(|r| r.as_ref())
            .ok_or_else(|| CollectiveError::Invalid(format!("no rank {from}")))?;
        match rx.recv_timeout(deadline) {
            Ok((got, data)) if got == op => Ok(data),
            Ok((got, _)) => Err(CollectiveError::OutOfStep {
                peer: from,
                expected: op,
                got,
            }),
            Err(RecvTimeoutError::Timeout) => Err(CollectiveError::Timeout {
                peer: from,
                op,
                waited: deadline,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(CollectiveError::PeerClosed { peer: from }),
        }
    }
}
