//! Auto-placement: a request for a known model that no instance serves places one (the
//! master's placement, which pulls the model when no node has it) and is answered once
//! it is ready. Until then the answer carries `Progress` pieces saying what the instance
//! is doing (a streamed answer shows them; a whole one just waits), and a load that does
//! not finish within [`LOAD_DEADLINE`] ends the answer with an error saying so.

use std::time::Duration;

use axum::http::StatusCode;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{Api, Refusal, ask, dispatch};
use crate::daemon::{ApiCall, MAX_ATTEMPTS, RouteError};
use crate::supervisor::{Failure, Piece};
use shoal_runner::control::{ErrorKind, GenerateRequest};

/// How long a request waits for the instance it placed (a pull of a large model
/// included).
pub(crate) const LOAD_DEADLINE: Duration = Duration::from_secs(600);
/// How often the instance's state is read while it loads.
const POLL: Duration = Duration::from_millis(500);

/// Places `model` (unless another request already did) and answers `request` from it
/// when it is ready; the pieces start with progress.
pub(crate) async fn place_and_answer(
    api: &Api,
    model: String,
    request: GenerateRequest,
) -> Result<mpsc::UnboundedReceiver<Piece>, Refusal> {
    let placed = ask(&api.calls, |reply| ApiCall::Place {
        model: model.clone(),
        strategy: None,
        nodes: None,
        context: None,
        preview: false,
        if_absent: true,
        reply,
    })
    .await?;
    if let Err(why) = placed {
        return Err(Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{model} has no instance and cannot be placed: {why}"),
        ));
    }
    tracing::info!(model, "placing the model a request asked for");
    let (tx, rx) = mpsc::unbounded_channel();
    let _ = tx.send(Piece::Progress(format!("placing {model}")));
    let api = api.clone();
    tokio::spawn(async move {
        let deadline = Instant::now() + LOAD_DEADLINE;
        let mut said = String::new();
        loop {
            if tx.is_closed() {
                return;
            }
            let route = ask(&api.calls, |reply| ApiCall::Route {
                model: Some(model.clone()),
                local_only: false,
                reply,
            })
            .await;
            match route {
                Ok(Ok(route)) => {
                    relay(dispatch(&api, route, request).await, &tx).await;
                    return;
                }
                Ok(Err(RouteError::NotReady(_) | RouteError::NotPlaced(_))) => {}
                Ok(Err(e)) => return fail(&tx, ErrorKind::Invalid, e.to_string()),
                Err(r) => return fail(&tx, ErrorKind::Busy, r.message),
            }
            if Instant::now() >= deadline {
                let why = format!(
                    "{model} was placed but not ready within {} s; try again later",
                    LOAD_DEADLINE.as_secs()
                );
                return fail(&tx, ErrorKind::Busy, why);
            }
            if let Ok(status) = ask(&api.calls, ApiCall::Status).await {
                match progress(&status, &model) {
                    Progress::Failed(why) => {
                        let why = format!("the instance of {model} failed: {why}");
                        return fail(&tx, ErrorKind::Broken, why);
                    }
                    Progress::Loading(now) if now != said => {
                        let _ = tx.send(Piece::Progress(now.clone()));
                        said = now;
                    }
                    _ => {}
                }
            }
            tokio::time::sleep(POLL).await;
        }
    });
    Ok(rx)
}

/// Passes the answer on until it ends or the client leaves.
async fn relay(
    answer: Result<mpsc::UnboundedReceiver<Piece>, Refusal>,
    tx: &mpsc::UnboundedSender<Piece>,
) {
    let mut answer = match answer {
        Ok(a) => a,
        Err(r) => return fail(tx, ErrorKind::Busy, r.message),
    };
    loop {
        tokio::select! {
            p = answer.recv() => match p {
                Some(p) => {
                    let end = p.ends();
                    if tx.send(p).is_err() || end {
                        return;
                    }
                }
                None => return fail(tx, ErrorKind::Broken, "rank 0's runner stopped before the answer ended".into()),
            },
            _ = tx.closed() => return,
        }
    }
}

fn fail(tx: &mpsc::UnboundedSender<Piece>, kind: ErrorKind, message: String) {
    let _ = tx.send(Piece::Error(Failure { kind, message }));
}

/// What the model's instance is doing, from the node's status.
#[derive(Debug, PartialEq)]
enum Progress {
    /// Not in the state yet (the placement is on its way through the master).
    Unplaced,
    Loading(String),
    /// Failed for good (no attempts left).
    Failed(String),
}

fn progress(status: &Value, model: &str) -> Progress {
    let Some(inst) = status["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|i| i["model"] == model)
    else {
        return Progress::Unplaced;
    };
    // A failed instance is placed again by the master, up to its last attempt.
    let attempts_left = inst["attempt"].as_u64().unwrap_or(0) < u64::from(MAX_ATTEMPTS);
    if inst["status"]["state"] == "failed" && !attempts_left {
        let why = inst["status"]["reason"]
            .as_str()
            .unwrap_or("no reason given");
        return Progress::Failed(why.to_string());
    }
    let ranks: Vec<String> = inst["ranks"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, r)| {
            let state = r["status"]["state"].as_str().unwrap_or("waiting");
            match r["status"]["detail"].as_f64() {
                Some(f) => format!("rank {i} {state} {:.0}%", f * 100.0),
                None => format!("rank {i} {state}"),
            }
        })
        .collect();
    Progress::Loading(format!("loading {model}: {}", ranks.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn progress_says_what_each_rank_does() {
        let status = json!({ "instances": [{
            "model": "m", "attempt": 0, "status": {"state": "starting"},
            "ranks": [
                {"status": {"state": "fetching", "detail": 0.25}},
                {"status": {"state": "connecting"}},
            ],
        }]});
        assert_eq!(
            progress(&status, "m"),
            Progress::Loading("loading m: rank 0 fetching 25%, rank 1 connecting".into())
        );
        assert_eq!(progress(&status, "other"), Progress::Unplaced);
        let failed = json!({ "instances": [{
            "model": "m", "attempt": 3, "status": {"state": "failed", "reason": "out of memory"},
            "ranks": [],
        }]});
        assert_eq!(
            progress(&failed, "m"),
            Progress::Failed("out of memory".into())
        );
    }
}
