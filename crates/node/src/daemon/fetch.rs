//! Model files between nodes, and from their packages when no node has them.
//!
//! Both run in tasks of their own and report to the loop through one channel: a copy
//! opens a `/shoal/model-file/1` stream to a peer that has the file, resumes after what
//! an earlier copy left in `FILE.partial` (re-hashing it first, off the loop), checks
//! size and sha256 against the card and installs it with the store's marker; a pull runs
//! the store's `pip download` on a blocking thread. The serving side streams the file
//! from the asked offset. Every read from a peer has a deadline.

use std::path::PathBuf;

use futures::{AsyncReadExt, AsyncWriteExt};
use libp2p_stream::IncomingStreams;
use sha2::{Digest, Sha256};
use shoal_store::{ModelCard, hex};

use super::*;
use crate::p2p::{FileHeader, FileRequest, read_line, write_line};

/// What a copy or a pull tells the loop.
#[derive(Debug)]
pub enum FetchReport {
    Progress {
        model: String,
        fraction: f32,
    },
    Installed {
        model: String,
    },
    Failed {
        model: String,
        why: String,
        pull: bool,
    },
}

/// A peer that sends nothing for this long has failed the copy.
const READ_DEADLINE: Duration = Duration::from_secs(10);
const BLOCK: usize = 1 << 20;

/// Serves model files to peers that copy them.
pub async fn serve(mut incoming: IncomingStreams, store: Store) {
    while let Some((peer, stream)) = incoming.next().await {
        let store = store.clone();
        tokio::spawn(async move {
            if let Err(e) = send_file(stream, &store).await {
                tracing::debug!(%peer, error = %e, "model file stream ended");
            }
        });
    }
}

async fn send_file(stream: libp2p::Stream, store: &Store) -> std::io::Result<()> {
    let mut stream = futures::io::BufReader::new(stream);
    let req: FileRequest = read_line(&mut stream, READ_DEADLINE).await?;
    let stream = stream.get_mut();
    let card = find_card(&req.model).filter(|c| store.is_installed(c));
    let Some(card) = card else {
        let why = format!("{} is not installed here", req.model);
        return write_line(stream, &FileHeader::Refused(why)).await;
    };
    write_line(stream, &FileHeader::Sending { total: card.size }).await?;
    use tokio::io::{AsyncReadExt as _, AsyncSeekExt};
    let mut file = tokio::fs::File::open(store.model_path(&card)).await?;
    file.seek(std::io::SeekFrom::Start(req.offset.min(card.size)))
        .await?;
    let mut buf = vec![0u8; BLOCK];
    loop {
        let n = file.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        stream.write_all(&buf[..n]).await?;
    }
    stream.close().await
}

/// Copies `card`'s file from `peer` into the store.
async fn copy(
    mut streams: libp2p_stream::Control,
    peer: PeerId,
    card: ModelCard,
    store: Store,
    reports: mpsc::Sender<FetchReport>,
) -> Result<(), String> {
    let dir = store.model_dir(&card);
    let partial: PathBuf = dir.join(format!("{}.partial", card.file));
    // Resume: hash what an earlier copy left, on a blocking thread.
    let (hasher, offset) = {
        let (dir, partial) = (dir.clone(), partial.clone());
        let shown = partial.display().to_string();
        tokio::task::spawn_blocking(move || -> std::io::Result<(Sha256, u64)> {
            std::fs::create_dir_all(&dir)?;
            let mut hasher = Sha256::new();
            let mut offset = 0u64;
            if let Ok(mut f) = std::fs::File::open(&partial) {
                let mut buf = vec![0u8; BLOCK];
                loop {
                    let n = std::io::Read::read(&mut f, &mut buf)?;
                    if n == 0 {
                        break;
                    }
                    hasher.update(&buf[..n]);
                    offset += n as u64;
                }
            }
            Ok((hasher, offset))
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("cannot read {shown}: {e}"))?
    };
    let mut hasher = hasher;
    let mut offset = offset.min(card.size);
    tracing::info!(model = %card.name, from = %peer, offset, "copying model file");
    let stream = tokio::time::timeout(READ_DEADLINE, streams.open_stream(peer, p2p::MODEL_FILE))
        .await
        .map_err(|_| "the peer did not open a stream in time".to_string())?
        .map_err(|e| format!("cannot open a stream: {e}"))?;
    let req = FileRequest {
        model: card.name.clone(),
        offset,
    };
    let mut stream = futures::io::BufReader::new(stream);
    write_line(stream.get_mut(), &req)
        .await
        .map_err(|e| e.to_string())?;
    match read_line::<FileHeader, _>(&mut stream, READ_DEADLINE)
        .await
        .map_err(|e| e.to_string())?
    {
        FileHeader::Refused(why) => return Err(why),
        FileHeader::Sending { total } if total != card.size => {
            return Err(format!(
                "the peer's file has {total} bytes, not {}",
                card.size
            ));
        }
        FileHeader::Sending { .. } => {}
    }
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&partial)
        .await
        .map_err(|e| format!("cannot write {}: {e}", partial.display()))?;
    let mut buf = vec![0u8; BLOCK];
    let mut reported = u64::MAX;
    while offset < card.size {
        let n = tokio::time::timeout(READ_DEADLINE, stream.read(&mut buf))
            .await
            .map_err(|_| format!("no data from the peer for {READ_DEADLINE:?}"))?
            .map_err(|e| format!("the copy broke: {e}"))?;
        if n == 0 {
            return Err(format!(
                "the peer stopped at {offset} of {} bytes",
                card.size
            ));
        }
        let n = n.min((card.size - offset) as usize);
        use tokio::io::AsyncWriteExt as _;
        file.write_all(&buf[..n])
            .await
            .map_err(|e| format!("cannot write {}: {e}", partial.display()))?;
        hasher.update(&buf[..n]);
        offset += n as u64;
        let tenths = offset * 10 / card.size.max(1);
        if tenths != reported {
            reported = tenths;
            let fraction = offset as f32 / card.size.max(1) as f32;
            let _ = reports
                .send(FetchReport::Progress {
                    model: card.name.clone(),
                    fraction,
                })
                .await;
        }
    }
    use tokio::io::AsyncWriteExt as _;
    file.flush().await.map_err(|e| e.to_string())?;
    drop(file);
    let digest = hex(&hasher.finalize());
    if digest != card.sha256 {
        let _ = tokio::fs::remove_file(&partial).await;
        return Err(format!(
            "the copy's sha256 {digest} is not the card's; discarded"
        ));
    }
    tokio::fs::rename(&partial, store.model_path(&card))
        .await
        .map_err(|e| e.to_string())?;
    tokio::fs::write(dir.join(".sha256"), &card.sha256)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

impl Daemon {
    /// Starts copying `model` from `from`.
    pub(super) fn start_fetch(&mut self, model: &str, from: &NodeId) {
        let (Some(card), Ok(peer)) = (find_card(model), from.parse::<PeerId>()) else {
            return;
        };
        let (streams, store, reports) = (
            self.streams.clone(),
            self.store.clone(),
            self.fetch_tx.clone(),
        );
        let name = model.to_string();
        let task = tokio::spawn(async move {
            let report = match copy(streams, peer, card, store, reports.clone()).await {
                Ok(()) => FetchReport::Installed { model: name },
                Err(why) => FetchReport::Failed {
                    model: name,
                    why,
                    pull: false,
                },
            };
            let _ = reports.send(report).await;
        });
        self.fetches.insert(model.to_string(), task);
    }

    /// Installs `model` from its package(s) through the store (no node has it).
    pub(super) fn start_pull(&mut self, model: &str) {
        let Some(card) = find_card(model) else {
            return;
        };
        tracing::info!(model, "no node has the model: pulling it");
        self.fetch_failures.remove(model);
        let (store, reports) = (self.store.clone(), self.fetch_tx.clone());
        let name = model.to_string();
        let task = tokio::spawn(async move {
            let progress = reports.clone();
            let progress_name = name.clone();
            let pulled = tokio::task::spawn_blocking(move || {
                let last = std::sync::atomic::AtomicU64::new(u64::MAX);
                store.pull_with_progress(&card, &|done, total| {
                    let tenths = done * 10 / total.max(1);
                    if last.swap(tenths, std::sync::atomic::Ordering::Relaxed) != tenths {
                        let _ = progress.blocking_send(FetchReport::Progress {
                            model: progress_name.clone(),
                            fraction: done as f32 / total.max(1) as f32,
                        });
                    }
                })
            })
            .await;
            let report = match pulled {
                Ok(Ok(_)) => FetchReport::Installed { model: name },
                Ok(Err(e)) => FetchReport::Failed {
                    model: name,
                    why: format!("cannot pull it: {e}"),
                    pull: true,
                },
                Err(e) => FetchReport::Failed {
                    model: name,
                    why: format!("the pull panicked: {e}"),
                    pull: true,
                },
            };
            let _ = reports.send(report).await;
        });
        self.fetches.insert(model.to_string(), task);
    }

    /// This node's ranks of instances of `model`.
    pub(super) fn ranks_of(&self, model: &str) -> Vec<(String, usize)> {
        self.state
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
            .collect()
    }

    pub(super) fn on_fetch(&mut self, report: FetchReport) {
        match report {
            FetchReport::Progress { model, fraction } => {
                self.fetch_progress.insert(model.clone(), fraction);
                for (instance, rank) in self.ranks_of(&model) {
                    self.command(Command::RankStatus {
                        instance,
                        rank,
                        status: RunnerStatus::Fetching(fraction),
                    });
                }
            }
            FetchReport::Installed { model } => {
                self.fetches.remove(&model);
                self.fetch_progress.remove(&model);
                tracing::info!(model, "model file installed and verified");
            }
            FetchReport::Failed { model, why, pull } => {
                self.fetches.remove(&model);
                self.fetch_progress.remove(&model);
                self.fetch_failures.insert(model.clone(), why.clone());
                tracing::warn!(model, why, "model file not installed");
                // A copy is tried again after a pause (from the same or another peer);
                // a pull that failed fails its ranks, so that the error shows in the
                // state instead of a loop of pulls.
                if !pull {
                    self.fetch_backoff
                        .insert(model.clone(), Instant::now() + Duration::from_secs(2));
                }
                if pull {
                    for (instance, rank) in self.ranks_of(&model) {
                        self.command(Command::RankStatus {
                            instance,
                            rank,
                            status: RunnerStatus::Failed(format!("{model}: {why}")),
                        });
                    }
                }
            }
        }
    }
}
