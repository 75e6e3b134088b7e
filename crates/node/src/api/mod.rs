//! The node's HTTP API: its own `GET /v1/status`, `POST /v1/place`, `POST /v1/run`, and
//! the OpenAI protocol ([`openai`]) on the same serving core.
//!
//! Handlers never touch the node's state: they send a call to the node's loop and wait
//! (with a deadline) for its answer. A request for a model whose rank 0 lives on another
//! node is forwarded there over the cluster's link ([`crate::forward`]); the client
//! never needs to reach any node but this one.
//!
//! `/v1/run` streams the answer as JSON lines: `{"text": …}` per piece, then
//! `{"done": true}`. An empty line is a keepalive, sent after a second of quiet, so a
//! client can give up on a silent connection. A failure after the first piece writes
//! `{"error": …}` and then breaks the HTTP body off (no closing chunk), so even a
//! client that reads no JSON sees a failed transfer, never a finished answer.

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

use crate::daemon::{ApiCall, Route, RouteError};
use crate::supervisor::{Failure, Job, Piece};
use shoal_runner::control::{ErrorKind, GenerateRequest, ToolCall};

mod anthropic;
mod autoplace;
mod dashboard;
mod metrics;
mod ollama;
mod openai;
mod openapi;
mod tools;

const LOOP_DEADLINE: Duration = Duration::from_secs(30);
/// The largest request body taken (a whole context of text is far less).
const BODY_LIMIT: usize = 8 << 20;

/// A request's body, or why axum would not read it (too large, cut off).
pub(crate) type RawBody = Result<Bytes, axum::extract::rejection::BytesRejection>;

/// Reads a protocol's JSON body into `T`: a body over the limit is a 413, one that is not
/// JSON or does not fit the type a 400, each saying so.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(body: RawBody) -> Result<T, Refusal> {
    let body = body.map_err(|e| {
        let message = if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            format!("the body is larger than {} MiB", BODY_LIMIT >> 20)
        } else {
            e.body_text()
        };
        Refusal::new(e.status(), message)
    })?;
    serde_json::from_slice(&body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "the body is not valid JSON"
        } else {
            "the request does not fit the API"
        };
        Refusal::new(StatusCode::BAD_REQUEST, format!("{what}: {e}"))
    })
}
/// A keepalive line after this much quiet on an answer's stream.
const KEEPALIVE: Duration = Duration::from_secs(1);

#[derive(Clone)]
pub(crate) struct Api {
    metrics: std::sync::Arc<metrics::Metrics>,
    calls: mpsc::Sender<ApiCall>,
    streams: libp2p_stream::Control,
    /// Place a known model that has no instance when a request asks for it.
    auto_place: bool,
    /// The state's changes, for `/events`.
    events: tokio::sync::broadcast::Sender<String>,
}

/// The API key, kept as its digest: requests are compared in constant time.
#[derive(Clone)]
pub struct ApiKey([u8; 32]);

impl ApiKey {
    pub fn new(key: String) -> Self {
        Self(digest(key.trim().as_bytes()))
    }

    /// Whether `given` is the key, in time independent of where they differ.
    fn admits(&self, given: &str) -> bool {
        let d = digest(given.trim().as_bytes());
        self.0.iter().zip(d).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// The key a request carries: `Authorization: Bearer …` (OpenAI clients) or
/// `x-api-key: …` (Anthropic clients).
fn carried(headers: &axum::http::HeaderMap) -> Option<&str> {
    if let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        return v.strip_prefix("Bearer ").or(v.strip_prefix("bearer "));
    }
    headers.get("x-api-key").and_then(|v| v.to_str().ok())
}

async fn authorize(
    State(key): State<Option<ApiKey>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = request.uri().path();
    let open = path == "/health" || dashboard::is_open(path);
    match &key {
        Some(k) if !open => match carried(request.headers()) {
            Some(given) if k.admits(given) => next.run(request).await,
            given => {
                let message = if given.is_some() {
                    "the API key is wrong"
                } else {
                    "this node needs an API key (Authorization: Bearer KEY, or x-api-key: KEY)"
                };
                let body = json!({ "error": {
                    "message": message, "type": "authentication_error", "param": null, "code": null,
                }});
                (StatusCode::UNAUTHORIZED, Json(body)).into_response()
            }
        },
        _ => next.run(request).await,
    }
}

pub async fn serve(
    listener: tokio::net::TcpListener,
    calls: mpsc::Sender<ApiCall>,
    streams: libp2p_stream::Control,
    key: Option<ApiKey>,
    auto_place: bool,
    events: tokio::sync::broadcast::Sender<String>,
) {
    let app = Router::new()
        .route("/", get(dashboard::page))
        .route("/ui/{file}", get(dashboard::asset))
        .route("/favicon.ico", get(dashboard::favicon))
        .route("/v1/catalog", get(dashboard::catalog))
        .route("/health", get(health))
        .route("/openapi.json", get(openapi::document))
        .route("/v1/status", get(status))
        .route("/state", get(state))
        .route("/events", get(state_events))
        .route("/v1/place", post(place))
        .route("/v1/instances", get(instances))
        .route("/v1/instances/{id}", axum::routing::delete(delete_instance))
        .route("/v1/run", post(run))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/ps", get(ollama::ps))
        .route("/api/pull", post(ollama::pull))
        .route("/api/version", get(ollama::version))
        .route("/metrics", get(metrics::metrics))
        .with_state(Api {
            calls,
            streams,
            metrics: Default::default(),
            auto_place,
            events,
        })
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::map_response(close_after_unread_body))
        .layer(axum::middleware::map_response(retry_after_when_unavailable))
        .layer(axum::middleware::from_fn_with_state(key, authorize));
    // Each streamed token is a small write: with Nagle's algorithm one waits for the
    // client's (delayed) acknowledgement of the one before.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY not set on a connection");
        }
    });
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "http server stopped");
    }
}

#[utoipa::path(get, path = "/health", tag = "shoal",
    responses((status = 200, description = "The node is up (needs no key)")))]
async fn health() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

fn error(code: StatusCode, msg: impl Into<String>) -> Response {
    (code, Json(json!({ "error": msg.into() }))).into_response()
}

/// A client told "unavailable" (no ready instance yet, the model being placed, the node
/// stopping) is told when to ask again, so that clients which honour it back off for a
/// second instead of giving up or asking again at once.
async fn retry_after_when_unavailable(mut r: Response) -> Response {
    if r.status() == StatusCode::SERVICE_UNAVAILABLE
        && !r.headers().contains_key(header::RETRY_AFTER)
    {
        r.headers_mut().insert(
            header::RETRY_AFTER,
            axum::http::HeaderValue::from_static("1"),
        );
    }
    r
}

/// A body refused for its size is left unread, so the connection cannot carry another
/// request: saying so keeps a client from sending its next one down it.
async fn close_after_unread_body(mut r: Response) -> Response {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        r.headers_mut().insert(
            header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    r
}

/// What a generating endpoint answers, for `/openapi.json`.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(crate) enum Answered {
    #[response(
        status = 200,
        description = "The answer: one JSON body, or a stream when `stream` is set"
    )]
    Answer,
    #[response(
        status = 400,
        description = "Malformed JSON, a wrong type, an unknown field, a parameter shoal cannot honour, a prompt or max_tokens past the context"
    )]
    Invalid,
    #[response(status = 401, description = "A wrong or missing API key")]
    Unauthorized,
    #[response(status = 404, description = "A model shoal does not know")]
    UnknownModel,
    #[response(status = 413, description = "A body over 8 MiB")]
    TooLarge,
    #[response(status = 502, description = "The instance failed while answering")]
    Broken,
    #[response(
        status = 503,
        description = "The model has no ready instance, or its queue is full"
    )]
    Busy,
}

/// A request the node cannot take, with the status code it earns; each protocol writes
/// it in its own error shape.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub status: StatusCode,
    pub message: String,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    /// An answer's failure before its first piece, by kind.
    fn of(f: Failure) -> Self {
        let status = match f.kind {
            ErrorKind::Invalid => StatusCode::BAD_REQUEST,
            ErrorKind::Busy => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Broken => StatusCode::BAD_GATEWAY,
        };
        Self::new(status, f.message)
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        error(self.status, self.message)
    }
}

async fn ask<T>(
    calls: &mpsc::Sender<ApiCall>,
    make: impl FnOnce(oneshot::Sender<T>) -> ApiCall,
) -> Result<T, Refusal> {
    let (tx, rx) = oneshot::channel();
    calls
        .send(make(tx))
        .await
        .map_err(|_| Refusal::new(StatusCode::SERVICE_UNAVAILABLE, "the node is stopping"))?;
    match tokio::time::timeout(LOOP_DEADLINE, rx).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(_)) => Err(Refusal::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the node dropped the call",
        )),
        Err(_) => Err(Refusal::new(
            StatusCode::GATEWAY_TIMEOUT,
            "the node did not answer in time",
        )),
    }
}

/// Hands `request` to rank 0 where `route` says it runs; its answer's pieces.
async fn dispatch(
    api: &Api,
    route: Route,
    request: GenerateRequest,
) -> Result<mpsc::UnboundedReceiver<Piece>, Refusal> {
    match route {
        Route::Local(jobs) => {
            let (tx, rx) = mpsc::unbounded_channel();
            if jobs.send(Job { request, reply: tx }).await.is_err() {
                return Err(Refusal::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "rank 0's runner is gone",
                ));
            }
            Ok(rx)
        }
        Route::Remote(peer) => Ok(crate::forward::forward(api.streams.clone(), peer, request)),
    }
}

/// Sends `request` to its instance's rank 0, here or on the peer that holds it, and
/// waits for the first piece of the answer (which decides the status code): the first
/// piece and the rest. Every answer ends with `Done` or `Error`. A known model placed
/// nowhere is placed first (unless the node was told `--no-auto-place`): the answer then
/// opens with `Progress` pieces while the instance loads.
pub(crate) async fn submit(
    api: &Api,
    request: GenerateRequest,
) -> Result<(Piece, mpsc::UnboundedReceiver<Piece>), Refusal> {
    let model = request.model.clone();
    let mut watch = metrics::Watch::new(api.metrics.clone(), model.as_deref());
    let route = ask(&api.calls, |reply| ApiCall::Route {
        model,
        local_only: false,
        reply,
    })
    .await
    .inspect_err(|_| watch.refused("not_routed", false))?;
    let mut answer = match route {
        Ok(route) => dispatch(api, route, request).await?,
        Err(RouteError::NotPlaced(m)) if api.auto_place => {
            autoplace::place_and_answer(api, m, request)
                .await
                .inspect_err(|_| watch.refused("not_placed", true))?
        }
        Err(e @ RouteError::UnknownModel(_)) => {
            watch.refused("unknown_model", false);
            return Err(Refusal::new(StatusCode::NOT_FOUND, e.to_string()));
        }
        Err(e @ (RouteError::NotReady(_) | RouteError::NotPlaced(_))) => {
            watch.refused("not_ready", true);
            return Err(Refusal::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()));
        }
    };
    // Every piece passes the metrics on its way; a client that goes away closes this end,
    // and the answer's own channel with it (so its runner cancels).
    let (tx, mut rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                p = answer.recv() => match p {
                    Some(p) => {
                        watch.saw(&p);
                        let end = p.ends();
                        if tx.send(p).is_err() || end {
                            return;
                        }
                    }
                    None => return,
                },
                _ = tx.closed() => return,
            }
        }
    });
    match rx.recv().await {
        Some(Piece::Error(f)) => Err(Refusal::of(f)),
        None => Err(Refusal::new(
            StatusCode::BAD_GATEWAY,
            "rank 0's runner stopped before answering",
        )),
        Some(p) => Ok((p, rx)),
    }
}

#[utoipa::path(get, path = "/v1/status", tag = "shoal",
    responses((status = 200, description = "Nodes, instances, runners and the serving load")))]
async fn status(State(api): State<Api>) -> Response {
    match ask(&api.calls, ApiCall::Status).await {
        Ok(v) => Json(v).into_response(),
        Err(r) => r.into_response(),
    }
}

#[utoipa::path(get, path = "/state", tag = "shoal",
    responses((status = 200, description = "The state every node agrees on: term, index, nodes (resources, models, links) and instances")))]
async fn state(State(api): State<Api>) -> Response {
    match ask(&api.calls, ApiCall::Status).await {
        Ok(v) => Json(json!({
            "term": v["term"], "index": v["index"], "master_id": v["master_id"],
            "nodes": v["nodes"], "instances": v["instances"],
        }))
        .into_response(),
        Err(r) => r.into_response(),
    }
}

#[utoipa::path(get, path = "/events", tag = "shoal",
    responses((status = 200, description = "Server-sent events: `state` with every change the node applies (the master's events, in order, with their term and index; `snapshot` when a whole state was taken), `lagged` when this client fell behind (read `/state` again)", content_type = "text/event-stream")))]
async fn state_events(State(api): State<Api>) -> Response {
    use tokio::sync::broadcast::error::RecvError;
    let rx = api.events.subscribe();
    let body = futures::stream::unfold(rx, |mut rx| async move {
        let out = match tokio::time::timeout(Duration::from_secs(15), rx.recv()).await {
            Ok(Ok(e)) => format!("event: state\ndata: {e}\n\n"),
            Ok(Err(RecvError::Lagged(n))) => {
                format!("event: lagged\ndata: {{\"missed\": {n}}}\n\n")
            }
            Ok(Err(RecvError::Closed)) => return None,
            Err(_) => ": keepalive\n\n".to_string(),
        };
        Some((Ok::<Bytes, std::io::Error>(Bytes::from(out)), rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response"))
}

#[utoipa::path(get, path = "/v1/instances", tag = "shoal",
    responses((status = 200, description = "Every instance: model, strategy, context, ranks (node, GPU, state), status")))]
async fn instances(State(api): State<Api>) -> Response {
    match ask(&api.calls, ApiCall::Status).await {
        Ok(v) => Json(json!({ "instances": v["instances"] })).into_response(),
        Err(r) => r.into_response(),
    }
}

#[utoipa::path(delete, path = "/v1/instances/{id}", tag = "shoal",
    params(("id" = String, Path, description = "The instance's id, as `/v1/instances` lists it")),
    responses((status = 200, description = "`{\"deleted\": id}`: removed; its runners stop on every node"),
        (status = 404, description = "No instance has that id"),
        (status = 503, description = "No master to remove it yet")))]
async fn delete_instance(
    State(api): State<Api>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let status = match ask(&api.calls, ApiCall::Status).await {
        Ok(v) => v,
        Err(r) => return r.into_response(),
    };
    let known = status["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|i| i["id"] == id.as_str());
    if !known {
        return error(StatusCode::NOT_FOUND, format!("no instance {id}"));
    }
    match ask(&api.calls, |reply| ApiCall::Delete {
        instance: id,
        reply,
    })
    .await
    {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(why)) => error(StatusCode::SERVICE_UNAVAILABLE, why),
        Err(r) => r.into_response(),
    }
}

#[derive(Deserialize, utoipa::ToSchema)]
struct PlaceBody {
    model: String,
    strategy: Option<String>,
    nodes: Option<usize>,
    ctx: Option<usize>,
    #[serde(default)]
    preview: bool,
}

#[utoipa::path(post, path = "/v1/place", tag = "shoal", request_body = PlaceBody,
    responses((status = 200, description = "The instance placed, or with `preview` the plans that fit"),
        (status = 400, description = "Malformed JSON or a wrong type"),
        (status = 422, description = "No plan fits")))]
async fn place(
    State(api): State<Api>,
    body: Result<Json<PlaceBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(b) = match body {
        Ok(b) => b,
        Err(e) => return error(e.status(), e.body_text()),
    };
    let strategy = match b.strategy.as_deref().map(str::parse).transpose() {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let r = ask(&api.calls, |reply| ApiCall::Place {
        model: b.model,
        strategy,
        nodes: b.nodes,
        context: b.ctx,
        preview: b.preview,
        if_absent: false,
        reply,
    })
    .await;
    match r {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(why)) => error(StatusCode::UNPROCESSABLE_ENTITY, why),
        Err(r) => r.into_response(),
    }
}

#[utoipa::path(post, path = "/v1/run", tag = "shoal", request_body(content = Object, description = "The runner's request: `prompt` or `messages`, `model`, sampling"),
    responses(Answered))]
async fn run(
    State(api): State<Api>,
    body: Result<Json<Value>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(body) = match body {
        Ok(b) => b,
        Err(e) => return error(e.status(), e.body_text()),
    };
    // Typed, so a wrong type or an unknown field is refused, never replaced by a default.
    let request: GenerateRequest = match serde_json::from_value(body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("bad request: {e}")),
    };
    let (first, rx) = match submit(&api, request).await {
        Ok(answer) => answer,
        Err(r) => return r.into_response(),
    };
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(answer_lines(first, rx)))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response"))
}

/// What the body does after a piece.
enum Next {
    Line(Bytes),
    /// The error line, then the body is broken off.
    Fail(Bytes),
    /// The last line: how the answer ended, its usage and timings.
    End(Bytes),
}

fn line(v: Value) -> Bytes {
    Bytes::from(format!("{v}\n"))
}

fn next(piece: Option<Piece>) -> Next {
    match piece {
        Some(Piece::Text(t)) => Next::Line(line(json!({ "text": t }))),
        Some(Piece::ToolCall(c)) => Next::Line(line(json!({ "tool_call": c }))),
        Some(Piece::Progress(p)) => Next::Line(line(json!({ "progress": p }))),
        Some(Piece::Keepalive) => Next::Line(Bytes::from_static(b"\n")),
        Some(Piece::Done(f)) => Next::End(line(json!({
            "done": true,
            "finish_reason": f.finish_reason,
            "usage": f.usage,
            "timings": f.timings,
        }))),
        Some(Piece::Error(f)) => Next::Fail(line(json!({ "error": f.message }))),
        None => Next::Fail(line(json!({
            "error": "rank 0's runner stopped before the answer ended"
        }))),
    }
}

/// The answer as JSON lines, with keepalives; see the module's comment for how it ends.
fn answer_lines(
    first: Piece,
    rx: mpsc::UnboundedReceiver<Piece>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    enum At {
        First(Piece),
        Streaming,
        Failed,
        Over,
    }
    futures::stream::unfold((At::First(first), rx), |(at, mut rx)| async move {
        let piece = match at {
            At::Over => return None,
            At::Failed => {
                // A pause first, so the error line leaves hyper's buffer before the body
                // is broken off (an error drops the connection with what is unsent).
                tokio::time::sleep(Duration::from_millis(100)).await;
                return Some((
                    Err(std::io::Error::other("the answer failed")),
                    (At::Over, rx),
                ));
            }
            At::First(p) => Some(p),
            At::Streaming => match tokio::time::timeout(KEEPALIVE, rx.recv()).await {
                Ok(p) => p,
                Err(_) => Some(Piece::Keepalive),
            },
        };
        match next(piece) {
            Next::Line(b) => Some((Ok(b), (At::Streaming, rx))),
            Next::Fail(b) => Some((Ok(b), (At::Failed, rx))),
            Next::End(b) => Some((Ok(b), (At::Over, rx))),
        }
    })
}

/// A server-sent events comment line (clients skip it; a person watching sees it).
pub(crate) fn comment(text: &str) -> Bytes {
    Bytes::from(format!(": {}\n\n", text.replace(['\n', '\r'], " ")))
}

/// What a server-sent event stream writes next.
pub(crate) enum Out {
    Bytes(Bytes),
    /// Break the body off (after a pause, so the error event leaves hyper's buffer): the
    /// client sees a failed transfer, never a finished answer.
    Fail,
}

/// An answer as server-sent events: `start` first (over when it ended the answer), then
/// what `on_piece` makes of each piece until it says the answer is over; a keepalive
/// piece after a second of quiet, a failure when the runner's end closes early.
pub(crate) fn event_stream(
    mut start: Vec<Out>,
    over: bool,
    rx: mpsc::UnboundedReceiver<Piece>,
    on_piece: impl FnMut(Piece, &mut Vec<Out>) -> bool + Send + 'static,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    start.reverse();
    futures::stream::unfold(
        (start, over, rx, on_piece),
        |(mut queue, mut over, mut rx, mut on_piece)| async move {
            loop {
                match queue.pop() {
                    Some(Out::Bytes(b)) => return Some((Ok(b), (queue, over, rx, on_piece))),
                    Some(Out::Fail) => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        let e = std::io::Error::other("the answer failed");
                        return Some((Err(e), (Vec::new(), true, rx, on_piece)));
                    }
                    None if over => return None,
                    None => {}
                }
                let piece = match tokio::time::timeout(KEEPALIVE, rx.recv()).await {
                    Ok(Some(p)) => p,
                    Ok(None) => Piece::broken("rank 0's runner stopped before the answer ended"),
                    Err(_) => Piece::Keepalive,
                };
                let mut fresh = Vec::new();
                over = on_piece(piece, &mut fresh);
                fresh.reverse();
                queue = fresh;
            }
        },
    )
}

/// Every model placed in the cluster or installed on a node, from the node's status.
pub(crate) fn models_of(status: &Value) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    let instances = status["instances"].as_array().into_iter().flatten();
    names.extend(
        instances
            .filter_map(|i| i["model"].as_str())
            .map(str::to_string),
    );
    for n in status["nodes"].as_array().into_iter().flatten() {
        let models = n["models"].as_array().into_iter().flatten();
        names.extend(models.filter_map(Value::as_str).map(str::to_string));
    }
    names.sort();
    names.dedup();
    names
}

/// A whole answer, for the protocols' non-streamed bodies.
pub(crate) struct Answer {
    pub text: String,
    pub calls: Vec<ToolCall>,
    pub finish: crate::supervisor::Finish,
}

pub(crate) async fn collect(
    first: Piece,
    mut rx: mpsc::UnboundedReceiver<Piece>,
) -> Result<Answer, Refusal> {
    let mut text = String::new();
    let mut calls = Vec::new();
    let mut piece = Some(first);
    loop {
        match piece {
            Some(Piece::Text(t)) => text.push_str(&t),
            Some(Piece::ToolCall(c)) => calls.push(c),
            Some(Piece::Keepalive | Piece::Progress(_)) => {}
            Some(Piece::Done(finish)) => {
                return Ok(Answer {
                    text,
                    calls,
                    finish,
                });
            }
            Some(Piece::Error(f)) => return Err(Refusal::of(f)),
            None => {
                return Err(Refusal::new(
                    StatusCode::BAD_GATEWAY,
                    "rank 0's runner stopped before the answer ended",
                ));
            }
        }
        piece = rx.recv().await;
    }
}

/// An id unique enough for a response (not a secret): `prefix` and 16 hex digits.
pub(crate) fn response_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("{prefix}-{:016x}", h.finish())
}
