//! The node's control HTTP API: `GET /v1/status`, `POST /v1/place`, `POST /v1/run`.
//!
//! Handlers never touch the node's state: they send a call to the node's loop and wait
//! (with a deadline) for its answer. `/v1/run` streams the answer as plain text; a
//! failure after the first byte ends the stream with a NUL byte and `error: …`, which
//! `shoal run --node` shows as an error. A request for a model whose rank 0 lives on
//! another node is redirected there (307 keeps the method and body).

use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use crate::daemon::{ApiCall, Route};
use crate::supervisor::Job;

const LOOP_DEADLINE: Duration = Duration::from_secs(30);

pub async fn serve(listener: tokio::net::TcpListener, calls: mpsc::Sender<ApiCall>) {
    let app = Router::new()
        .route("/v1/status", get(status))
        .route("/v1/place", post(place))
        .route("/v1/run", post(run))
        .with_state(calls);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "http server stopped");
    }
}

fn error(code: StatusCode, msg: impl Into<String>) -> Response {
    (code, Json(json!({ "error": msg.into() }))).into_response()
}

async fn ask<T>(
    calls: &mpsc::Sender<ApiCall>,
    make: impl FnOnce(oneshot::Sender<T>) -> ApiCall,
) -> Result<T, Response> {
    let (tx, rx) = oneshot::channel();
    calls
        .send(make(tx))
        .await
        .map_err(|_| error(StatusCode::SERVICE_UNAVAILABLE, "the node is stopping"))?;
    match tokio::time::timeout(LOOP_DEADLINE, rx).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(_)) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the node dropped the call",
        )),
        Err(_) => Err(error(
            StatusCode::GATEWAY_TIMEOUT,
            "the node did not answer in time",
        )),
    }
}

async fn status(State(calls): State<mpsc::Sender<ApiCall>>) -> Response {
    match ask(&calls, ApiCall::Status).await {
        Ok(v) => Json(v).into_response(),
        Err(r) => r,
    }
}

#[derive(Deserialize)]
struct PlaceBody {
    model: String,
    strategy: Option<String>,
    nodes: Option<usize>,
    ctx: Option<usize>,
    #[serde(default)]
    preview: bool,
}

async fn place(
    State(calls): State<mpsc::Sender<ApiCall>>,
    body: Result<Json<PlaceBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(b) = match body {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let strategy = match b.strategy.as_deref().map(str::parse).transpose() {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let r = ask(&calls, |reply| ApiCall::Place {
        model: b.model,
        strategy,
        nodes: b.nodes,
        context: b.ctx,
        preview: b.preview,
        reply,
    })
    .await;
    match r {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(why)) => error(StatusCode::UNPROCESSABLE_ENTITY, why),
        Err(r) => r,
    }
}

async fn run(
    State(calls): State<mpsc::Sender<ApiCall>>,
    body: Result<Json<Value>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(body) = match body {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    if body.get("prompt").and_then(Value::as_str).is_none() {
        return error(
            StatusCode::BAD_REQUEST,
            "the body needs a \"prompt\" string",
        );
    }
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string);
    let route = match ask(&calls, |reply| ApiCall::Route { model, reply }).await {
        Ok(Ok(r)) => r,
        Ok(Err(why)) => return error(StatusCode::SERVICE_UNAVAILABLE, why),
        Err(r) => return r,
    };
    let jobs = match route {
        Route::Remote(http) => {
            return (
                StatusCode::TEMPORARY_REDIRECT,
                [(header::LOCATION, format!("http://{http}/v1/run"))],
            )
                .into_response();
        }
        Route::Local(jobs) => jobs,
    };
    let (tx, mut rx) = mpsc::channel(256);
    if jobs.send(Job { body, reply: tx }).await.is_err() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "rank 0's runner is gone");
    }
    // The first piece decides the status code.
    let first = match rx.recv().await {
        Some(Ok(piece)) => Some(piece),
        Some(Err(why)) => return error(StatusCode::BAD_GATEWAY, why),
        None => None,
    };
    let stream = futures::stream::unfold((first, rx, false), |(first, mut rx, ended)| async move {
        if ended {
            return None;
        }
        if let Some(p) = first {
            return Some((Ok::<_, std::io::Error>(Bytes::from(p)), (None, rx, false)));
        }
        match rx.recv().await {
            Some(Ok(p)) => Some((Ok(Bytes::from(p)), (None, rx, false))),
            Some(Err(why)) => Some((Ok(Bytes::from(format!("\0error: {why}"))), (None, rx, true))),
            None => None,
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response"))
}
