//! Any node answers any request: a request that reached a node without rank 0 of the
//! model goes to the node that has it over the cluster's own authenticated link (a
//! `/shoal/generate/1` stream), and the answer comes back piece by piece.
//!
//! The serving side sends a keepalive whenever it has been quiet for a second, so the
//! asking side can tell a slow answer from a cut link or a frozen node: nothing for
//! [`SILENCE`] ends the answer with an error naming the peer. A stream that closes
//! before its `Done` is an error too: an answer is never cut silently.
//!
//! The serving side acknowledges a request with a keepalive as soon as it has read it.
//! A stream that ends before that was never taken: libp2p-stream drops an incoming stream
//! when the previous one has not been accepted yet (its queue holds one), which a burst
//! of clients does; so does a stream on one of two connections dialled at once, when one
//! of them closes. Such a request is sent again on a new stream, a few times.

use std::time::Duration;

use futures::StreamExt;
use libp2p::PeerId;
use libp2p_stream::IncomingStreams;
use tokio::sync::{mpsc, oneshot};

use crate::daemon::{ApiCall, Route};
use crate::p2p::{self, Forward, read_line, write_line};
use crate::supervisor::{Job, Piece};
use shoal_runner::control::GenerateRequest;

/// The serving side writes a keepalive after this much quiet.
const KEEPALIVE: Duration = Duration::from_secs(1);
/// The asking side gives up after this much silence from the peer.
pub const SILENCE: Duration = Duration::from_secs(5);
/// How long opening a stream and sending the request may take.
const OPEN: Duration = Duration::from_secs(10);
/// Streams a request is sent on before the peer is said not to take it.
const ATTEMPTS: u32 = 6;

/// Takes forwarded requests from peers and answers them from a local rank 0.
pub async fn serve(mut incoming: IncomingStreams, calls: mpsc::Sender<ApiCall>) {
    while let Some((peer, stream)) = incoming.next().await {
        let calls = calls.clone();
        tokio::spawn(async move {
            if let Err(e) = answer(stream, calls).await {
                tracing::debug!(%peer, error = %e, "forwarded request ended");
            }
        });
    }
}

async fn answer(stream: libp2p::Stream, calls: mpsc::Sender<ApiCall>) -> std::io::Result<()> {
    let mut stream = futures::io::BufReader::new(stream);
    let req: Forward = read_line(&mut stream, OPEN).await?;
    let stream = stream.get_mut();
    write_line(stream, &Piece::Keepalive).await?;
    let model = req.request.model.clone();
    let (reply, route) = oneshot::channel();
    let asked = calls
        .send(ApiCall::Route {
            model,
            local_only: true,
            reply,
        })
        .await;
    let route = match asked {
        Ok(()) => tokio::time::timeout(OPEN, route)
            .await
            .ok()
            .and_then(Result::ok),
        Err(_) => None,
    };
    let jobs = match route {
        Some(Ok(Route::Local(jobs))) => jobs,
        Some(Ok(Route::Remote(_))) => {
            let why = "rank 0 is not on this node any more".to_string();
            return write_line(stream, &Piece::broken(why)).await;
        }
        Some(Err(why)) => return write_line(stream, &Piece::broken(why.to_string())).await,
        None => {
            let why = "the node holding rank 0 did not route the request".to_string();
            return write_line(stream, &Piece::broken(why)).await;
        }
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    if jobs
        .send(Job {
            request: req.request,
            reply: tx,
        })
        .await
        .is_err()
    {
        let why = "rank 0's runner is gone".to_string();
        return write_line(stream, &Piece::broken(why)).await;
    }
    loop {
        let piece = match tokio::time::timeout(KEEPALIVE, rx.recv()).await {
            Ok(Some(p)) => p,
            Ok(None) => Piece::broken("rank 0's runner stopped before the answer ended"),
            Err(_) => Piece::Keepalive,
        };
        let last = piece.ends();
        write_line(stream, &piece).await?;
        if last {
            return futures::AsyncWriteExt::close(stream).await;
        }
    }
}

/// Sends `request` to `peer`, which holds rank 0, and returns the answer's pieces. The
/// channel always ends with `Done` or `Error`. When the receiver is dropped (the client
/// went away) the stream is closed, and the serving node cancels the request.
pub fn forward(
    mut streams: libp2p_stream::Control,
    peer: PeerId,
    request: GenerateRequest,
) -> mpsc::UnboundedReceiver<Piece> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let forward = Forward { request };
        let mut attempt = 0;
        let mut stream = loop {
            attempt += 1;
            match send_request(&mut streams, peer, &forward).await {
                Ok(s) => break s,
                Err(Sent::Untaken(why)) if attempt < ATTEMPTS => {
                    tracing::debug!(%peer, attempt, %why, "the request did not get through; again");
                    tokio::time::sleep(Duration::from_millis(20 << attempt)).await;
                }
                Err(Sent::Untaken(why)) => {
                    let why = format!("{why} ({ATTEMPTS} attempts)");
                    let _ = tx.send(Piece::broken(why));
                    return;
                }
                Err(Sent::Failed(why)) => {
                    let _ = tx.send(Piece::broken(why));
                    return;
                }
            }
        };
        loop {
            let read = tokio::select! {
                r = read_line::<Piece, _>(&mut stream, SILENCE) => r,
                _ = tx.closed() => return, // the client went away: close the stream
            };
            let piece = match read {
                Ok(Piece::Keepalive) => continue,
                Ok(p) => p,
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Piece::broken(format!(
                    "no word from node {peer} (rank 0) for {SILENCE:?}: the link is cut or the node froze"
                )),
                Err(e) => Piece::broken(format!(
                    "the link to node {peer} (rank 0) broke before the answer ended: {e}"
                )),
            };
            let last = piece.ends();
            if tx.send(piece).is_err() || last {
                return; // the client went away, or the answer is complete
            }
        }
    });
    rx
}

/// Why a request did not get through.
enum Sent {
    /// The peer never took the request (the stream was dropped, or its connection closed,
    /// before the acknowledgement: one of two connections dialled at once closes): safe
    /// to send again. Why, for the client if it keeps happening.
    Untaken(String),
    /// The peer did not answer in time, or answered out of protocol: said for the client.
    Failed(String),
}

/// Opens a stream to `peer`, sends the request and waits for its acknowledgement; the
/// stream, ready for the answer's pieces.
async fn send_request(
    streams: &mut libp2p_stream::Control,
    peer: PeerId,
    forward: &Forward,
) -> Result<futures::io::BufReader<libp2p::Stream>, Sent> {
    let opened = tokio::time::timeout(OPEN, streams.open_stream(peer, p2p::GENERATE)).await;
    let stream = match opened {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Err(Sent::Untaken(format!(
                "cannot reach node {peer}, which holds rank 0: {e}"
            )));
        }
        Err(_) => {
            return Err(Sent::Failed(format!(
                "node {peer}, which holds rank 0, did not answer in {OPEN:?}"
            )));
        }
    };
    let mut stream = futures::io::BufReader::new(stream);
    if let Err(e) = write_line(stream.get_mut(), forward).await {
        return Err(Sent::Untaken(format!(
            "cannot send the request to node {peer}: {e}"
        )));
    }
    match read_line::<Piece, _>(&mut stream, OPEN).await {
        Ok(Piece::Keepalive) => Ok(stream),
        Ok(other) => Err(Sent::Failed(format!(
            "node {peer} answered a forwarded request with {other:?} before taking it"
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(Sent::Untaken(format!(
            "node {peer}, which holds rank 0, dropped the request's stream"
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Err(Sent::Failed(format!(
            "node {peer}, which holds rank 0, did not take the request in {OPEN:?}"
        ))),
        Err(e) => Err(Sent::Untaken(format!(
            "the link to node {peer} (rank 0) broke before it took the request: {e}"
        ))),
    }
}
