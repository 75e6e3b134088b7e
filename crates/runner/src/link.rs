//! The runner's end of its control socket: typed messages out (with heartbeats from a
//! thread of their own), and the node's requests in, read all the time by another thread
//! so that a cancel is seen while a step runs.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shoal_cluster::RunnerStatus;

use crate::control::{FromRunner, ToRunner};

/// A connected control socket.
pub struct Link {
    writer: Arc<Mutex<UnixStream>>,
    inbox: Mutex<Option<Receiver<ToRunner>>>,
}

impl Link {
    /// Connects to the node at `path`; heartbeats start at once. When the node is gone
    /// (a write fails) the process exits: a runner without its node has no one to serve.
    pub fn connect(path: &Path) -> std::io::Result<Link> {
        let stream = UnixStream::connect(path)?;
        let reader = BufReader::new(stream.try_clone()?);
        let writer = Arc::new(Mutex::new(stream));
        let beat = Arc::clone(&writer);
        std::thread::spawn(move || {
            loop {
                if !write(&beat, &FromRunner::Heartbeat) {
                    eprintln!("error: the node closed this runner's control socket");
                    std::process::exit(1);
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        });
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in reader.lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<ToRunner>(&line) {
                    Ok(m) => {
                        if tx.send(m).is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, line, "a control line that is not a request")
                    }
                }
            }
            // The node closed the socket: the inbox ends, and the serving loop with it.
        });
        Ok(Link {
            writer,
            inbox: Mutex::new(Some(rx)),
        })
    }

    pub fn send(&self, m: &FromRunner) -> bool {
        write(&self.writer, m)
    }

    pub fn status(&self, status: RunnerStatus) {
        self.send(&FromRunner::Status { status });
    }

    /// The node's requests (once).
    pub fn inbox(&self) -> Option<Receiver<ToRunner>> {
        self.inbox.lock().ok()?.take()
    }
}

fn write(w: &Mutex<UnixStream>, m: &FromRunner) -> bool {
    let Ok(mut line) = serde_json::to_string(m) else {
        return false;
    };
    line.push('\n');
    w.lock()
        .map(|mut w| w.write_all(line.as_bytes()).is_ok())
        .unwrap_or(false)
}
