//! The Ollama protocol on the serving core, at the paths its clients expect:
//! `POST /api/chat`, `POST /api/generate` (NDJSON streams by default, the last object with
//! `done_reason` and the nanosecond durations; or one object with `"stream": false}`),
//! `GET /api/tags`, `POST /api/show`, `GET /api/ps`, `POST /api/pull`, `GET /api/version`.
//!
//! Requests are typed (wrong types are 400s; the fields Ollama's clients send are
//! accepted, others refused); `options` carries the sampling parameters. What shoal
//! cannot honour yet (`format`, images, thinking) is refused by name. Tools (OpenAI's
//! shape) reach the model's chat template; its calls come back in `message.tool_calls`. Errors are Ollama's
//! `{"error": "…"}`; a failure mid-stream is an `{"error": …}` line, then the body breaks
//! off without a `done` object.

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use shoal_runner::control::{ChatMessage, FinishReason, GenerateRequest, ToolCall};

use super::tools::FunctionTool;
use super::{Answer, Api, Out, RawBody, ask, collect, event_stream, read_json, submit};
use crate::daemon::ApiCall;
use crate::supervisor::{Finish, Piece};

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = OllamaChatRequest)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatRequest {
    model: String,
    messages: Vec<Message>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    options: Option<Options>,
    #[serde(default)]
    tools: Option<Vec<FunctionTool>>,
    #[serde(default)]
    format: Option<Value>,
    /// Accepted and not used: how long Ollama keeps a model loaded (shoal's instances
    /// stay until deleted).
    #[serde(default)]
    #[allow(dead_code)]
    keep_alive: Option<Value>,
    #[serde(default)]
    think: Option<Value>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct GenerateBody {
    model: String,
    #[serde(default)]
    prompt: String,
    #[serde(default)]
    system: Option<String>,
    #[serde(default)]
    raw: bool,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    options: Option<Options>,
    #[serde(default)]
    format: Option<Value>,
    #[serde(default)]
    images: Option<Vec<Value>>,
    #[serde(default)]
    #[allow(dead_code)]
    keep_alive: Option<Value>,
    #[serde(default)]
    think: Option<Value>,
    /// Accepted and not used: Ollama's templating and suffix fields when empty.
    #[serde(default)]
    template: Option<String>,
    #[serde(default)]
    suffix: Option<String>,
    #[serde(default)]
    context: Option<Vec<u32>>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = OllamaMessage)]
struct Message {
    role: String,
    #[serde(default)]
    content: String,
    #[serde(default)]
    images: Option<Vec<Value>>,
    #[serde(default)]
    tool_calls: Option<Vec<MessageCall>>,
    /// Which tool a tool turn's content came from.
    #[serde(default)]
    #[allow(dead_code)]
    tool_name: Option<String>,
}

/// A call in an assistant turn: `{"function": {"name", "arguments": {…}}}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = OllamaMessageCall)]
struct MessageCall {
    function: MessageFunction,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = OllamaMessageFunction)]
struct MessageFunction {
    name: String,
    #[serde(default)]
    arguments: Value,
}

/// Ollama's model options; the ones shoal does not use are accepted and ignored only
/// when they are about loading (context size, threads, GPU layers), which placement
/// decides here.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
struct Options {
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 1)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<usize>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    repeat_penalty: Option<f32>,
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    num_predict: Option<i64>,
    #[serde(default)]
    stop: Option<Vec<String>>,
    #[serde(flatten)]
    #[allow(dead_code)]
    rest: serde_json::Map<String, Value>,
}

/// A request shoal cannot take.
#[derive(Debug, PartialEq)]
pub(crate) struct Unsupported(pub String);

fn apply(options: Option<Options>, r: &mut GenerateRequest) -> Result<(), Unsupported> {
    let o = options.unwrap_or_default();
    // Ollama's defaults: temperature 0.8, top_k 40, top_p 0.9, 128 tokens (-1: the room).
    r.temperature = o.temperature.unwrap_or(0.8).max(0.0);
    r.top_k = o.top_k.unwrap_or(40);
    r.top_p = o.top_p.unwrap_or(0.9);
    if !(r.top_p > 0.0 && r.top_p <= 1.0) {
        return Err(Unsupported("top_p must be within (0, 1]".into()));
    }
    r.min_p = o.min_p.unwrap_or(0.0);
    r.repetition_penalty = o.repeat_penalty.unwrap_or(1.0);
    r.presence_penalty = o.presence_penalty.unwrap_or(0.0);
    r.frequency_penalty = o.frequency_penalty.unwrap_or(0.0);
    r.seed = o.seed.unwrap_or(0);
    r.max_tokens = match o.num_predict {
        None => 128,
        Some(n) if n < 0 => usize::MAX / 2,
        Some(0) => return Err(Unsupported("num_predict must not be 0".into())),
        Some(n) => n as usize,
    };
    r.stop = o.stop.unwrap_or_default();
    Ok(())
}

/// Structured output and thinking, which both endpoints may ask for and shoal does not do.
fn refuse_format_and_think(
    format: Option<&Value>,
    think: Option<&Value>,
) -> Result<(), Unsupported> {
    if format.is_some_and(|f| !f.is_null() && f != "") {
        return Err(Unsupported(
            "format (JSON output) is not supported yet".into(),
        ));
    }
    if think.is_some_and(|t| t != &Value::Bool(false) && !t.is_null()) {
        return Err(Unsupported("think is not supported".into()));
    }
    Ok(())
}

impl ChatRequest {
    pub(crate) fn into_generate(self) -> Result<(GenerateRequest, bool), Unsupported> {
        let tools =
            super::tools::for_runner(self.tools.unwrap_or_default()).map_err(Unsupported)?;
        refuse_format_and_think(self.format.as_ref(), self.think.as_ref())?;
        if self.messages.is_empty() {
            return Err(Unsupported("messages must not be empty".into()));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for m in self.messages {
            if m.images.as_ref().is_some_and(|i| !i.is_empty()) {
                return Err(Unsupported("images are not supported".into()));
            }
            if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool") {
                return Err(Unsupported(format!("unknown role {:?}", m.role)));
            }
            let mut message = ChatMessage::new(m.role, m.content);
            for c in m.tool_calls.into_iter().flatten() {
                let arguments = match c.function.arguments {
                    Value::Null => json!({}),
                    a => a,
                };
                message
                    .tool_calls
                    .push(ToolCall::new(None, c.function.name, arguments));
            }
            messages.push(message);
        }
        let mut r = GenerateRequest::new("");
        r.messages = messages;
        r.tools = tools;
        r.model = Some(self.model);
        apply(self.options, &mut r)?;
        Ok((r, self.stream.unwrap_or(true)))
    }
}

impl GenerateBody {
    pub(crate) fn into_generate(self) -> Result<(GenerateRequest, bool), Unsupported> {
        if self.images.as_ref().is_some_and(|i| !i.is_empty()) {
            return Err(Unsupported("images are not supported".into()));
        }
        refuse_format_and_think(self.format.as_ref(), self.think.as_ref())?;
        if self.template.as_deref().is_some_and(|t| !t.is_empty())
            || self.suffix.as_deref().is_some_and(|s| !s.is_empty())
            || self.context.as_ref().is_some_and(|c| !c.is_empty())
        {
            return Err(Unsupported(
                "template, suffix and context are not supported".into(),
            ));
        }
        if self.prompt.is_empty() {
            return Err(Unsupported("prompt must not be empty".into()));
        }
        let mut r = GenerateRequest::new(self.prompt);
        r.raw = self.raw;
        r.system = self.system;
        r.model = Some(self.model);
        apply(self.options, &mut r)?;
        Ok((r, self.stream.unwrap_or(true)))
    }
}

fn ollama_error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

fn created_at() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // RFC 3339 in UTC from the Unix time (days to a civil date, Howard Hinnant's way).
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Which endpoint an answer is for: chat answers carry a message, generate a response.
#[derive(Clone)]
struct Head {
    chat: bool,
    model: String,
}

impl Head {
    fn piece(&self, text: &str) -> Value {
        let mut v = json!({ "model": self.model, "created_at": created_at(), "done": false });
        if self.chat {
            v["message"] = json!({ "role": "assistant", "content": text });
        } else {
            v["response"] = json!(text);
        }
        v
    }

    /// A piece holding the model's calls (chat only: generate has no tools).
    fn calls(&self, calls: &[ToolCall]) -> Value {
        let mut v = self.piece("");
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| json!({ "function": { "name": c.function.name, "arguments": c.function.arguments } }))
            .collect();
        v["message"]["tool_calls"] = json!(calls);
        v
    }

    fn last(&self, text: &str, f: &Finish) -> Value {
        let mut v = self.piece(text);
        let ns = |ms: f64| (ms * 1e6) as u64;
        let t = &f.timings;
        let obj = v.as_object_mut().expect("an object");
        obj.insert("done".into(), json!(true));
        obj.insert(
            "done_reason".into(),
            json!(match f.finish_reason {
                FinishReason::Length => "length",
                // Ollama ends an answer with calls as any other.
                FinishReason::Stop | FinishReason::Cancelled | FinishReason::ToolCalls => "stop",
                FinishReason::MalformedToolCall => "malformed_tool_call",
            }),
        );
        obj.insert(
            "total_duration".into(),
            json!(ns(t.queued_ms + t.prefill_ms + t.decode_ms)),
        );
        obj.insert("load_duration".into(), json!(0));
        obj.insert("prompt_eval_count".into(), json!(f.usage.prompt_tokens));
        obj.insert("prompt_eval_duration".into(), json!(ns(t.prefill_ms)));
        obj.insert("eval_count".into(), json!(f.usage.completion_tokens));
        obj.insert("eval_duration".into(), json!(ns(t.decode_ms)));
        v
    }
}

fn line(v: &Value) -> Bytes {
    Bytes::from(format!("{v}\n"))
}

fn piece_lines(piece: Piece, head: &Head, out: &mut Vec<Out>) -> bool {
    match piece {
        Piece::Text(t) => {
            out.push(Out::Bytes(line(&head.piece(&t))));
            false
        }
        Piece::ToolCall(c) => {
            out.push(Out::Bytes(line(&head.calls(&[c]))));
            false
        }
        // NDJSON has no comments; an empty piece keeps the stream alive.
        Piece::Keepalive => {
            out.push(Out::Bytes(line(&head.piece(""))));
            false
        }
        // An empty piece with Ollama's `status` (what its pull shows) saying what loads.
        Piece::Progress(p) => {
            let mut v = head.piece("");
            v["status"] = json!(p);
            out.push(Out::Bytes(line(&v)));
            false
        }
        Piece::Done(f) => {
            out.push(Out::Bytes(line(&head.last("", &f))));
            true
        }
        Piece::Error(f) => {
            out.push(Out::Bytes(line(&json!({ "error": f.message }))));
            out.push(Out::Fail);
            true
        }
    }
}

#[utoipa::path(post, path = "/api/chat", tag = "ollama", request_body = ChatRequest,
    responses(super::Answered))]
pub(crate) async fn chat(State(api): State<Api>, body: RawBody) -> Response {
    let parsed: ChatRequest = match read_json(body) {
        Ok(r) => r,
        Err(r) => return ollama_error(r.status, &r.message),
    };
    let head = Head {
        chat: true,
        model: parsed.model.clone(),
    };
    match parsed.into_generate() {
        Ok((r, stream)) => answer(&api, head, r, stream).await,
        Err(Unsupported(why)) => ollama_error(StatusCode::BAD_REQUEST, &why),
    }
}

#[utoipa::path(post, path = "/api/generate", tag = "ollama", request_body = GenerateBody,
    responses(super::Answered))]
pub(crate) async fn generate(State(api): State<Api>, body: RawBody) -> Response {
    let parsed: GenerateBody = match read_json(body) {
        Ok(r) => r,
        Err(r) => return ollama_error(r.status, &r.message),
    };
    let head = Head {
        chat: false,
        model: parsed.model.clone(),
    };
    match parsed.into_generate() {
        Ok((r, stream)) => answer(&api, head, r, stream).await,
        Err(Unsupported(why)) => ollama_error(StatusCode::BAD_REQUEST, &why),
    }
}

async fn answer(api: &Api, head: Head, request: GenerateRequest, stream: bool) -> Response {
    let (first, rx) = match submit(api, request).await {
        Ok(a) => a,
        Err(r) => return ollama_error(r.status, &r.message),
    };
    if stream {
        let mut start = Vec::new();
        let over = piece_lines(first, &head, &mut start);
        return Response::builder()
            .header(header::CONTENT_TYPE, "application/x-ndjson")
            .body(Body::from_stream(event_stream(
                start,
                over,
                rx,
                move |p, out| piece_lines(p, &head, out),
            )))
            .unwrap_or_else(|_| ollama_error(StatusCode::INTERNAL_SERVER_ERROR, "response"));
    }
    match collect(first, rx).await {
        Ok(Answer {
            text,
            calls,
            finish,
        }) => {
            let mut v = head.last(&text, &finish);
            if !calls.is_empty() {
                v["message"]["tool_calls"] = head.calls(&calls)["message"]["tool_calls"].take();
            }
            Json(v).into_response()
        }
        Err(r) => ollama_error(r.status, &r.message),
    }
}

/// `GET /api/tags`: every model placed in the cluster or installed on a node.
#[utoipa::path(get, path = "/api/tags", tag = "ollama",
    responses((status = 200, description = "The models placed or installed in the cluster")))]
pub(crate) async fn tags(State(api): State<Api>) -> Response {
    let status = match ask(&api.calls, ApiCall::Status).await {
        Ok(v) => v,
        Err(r) => return ollama_error(r.status, &r.message),
    };
    let models: Vec<Value> = super::models_of(&status)
        .iter()
        .map(|m| {
            json!({ "name": m, "model": m, "modified_at": "1970-01-01T00:00:00Z", "size": 0,
                "digest": "", "details": { "format": "gguf" } })
        })
        .collect();
    Json(json!({ "models": models })).into_response()
}

/// `POST /api/show`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct ShowRequest {
    /// The model (older clients call it `name`).
    #[serde(default, alias = "name")]
    model: String,
    #[serde(default)]
    #[allow(dead_code)]
    verbose: bool,
}

/// What Ollama's `details` says of a model, from its card when it has one.
fn details(card: Option<&shoal_store::ModelCard>) -> Value {
    json!({
        "parent_model": "",
        "format": "gguf",
        "family": card.map_or("", |c| c.architecture.as_str()),
        "families": card.map(|c| vec![c.architecture.clone()]),
        "parameter_size": card.map_or("", |c| c.parameters.as_str()),
        "quantization_level": "",
    })
}

/// `POST /api/show`: a model the cluster knows, described from its card.
#[utoipa::path(post, path = "/api/show", tag = "ollama", request_body = ShowRequest,
    responses((status = 200, description = "The model's details, shape and capabilities"),
        (status = 400, description = "Malformed JSON or a wrong type"),
        (status = 404, description = "A model the cluster does not know")))]
pub(crate) async fn show(State(api): State<Api>, body: RawBody) -> Response {
    let req: ShowRequest = match read_json(body) {
        Ok(r) => r,
        Err(r) => return ollama_error(r.status, &r.message),
    };
    let status = match ask(&api.calls, ApiCall::Status).await {
        Ok(v) => v,
        Err(r) => return ollama_error(r.status, &r.message),
    };
    if !super::models_of(&status).contains(&req.model) {
        let message = format!("model '{}' not found", req.model);
        return ollama_error(StatusCode::NOT_FOUND, &message);
    }
    let card = shoal_store::find_card(&req.model);
    let mut info = serde_json::Map::new();
    let mut capabilities = vec!["completion"];
    if let Some(c) = &card {
        let arch = &c.architecture;
        info.insert("general.architecture".into(), json!(arch));
        info.insert("general.basename".into(), json!(c.name));
        info.insert(format!("{arch}.context_length"), json!(c.context_length));
        info.insert(format!("{arch}.block_count"), json!(c.layers));
        info.insert(format!("{arch}.embedding_length"), json!(c.hidden));
        info.insert(format!("{arch}.feed_forward_length"), json!(c.ffn));
        info.insert(format!("{arch}.attention.head_count"), json!(c.heads));
        info.insert(format!("{arch}.attention.head_count_kv"), json!(c.kv_heads));
        info.insert(format!("{arch}.vocab_size"), json!(c.vocab));
        if c.tools {
            capabilities.push("tools");
        }
    }
    Json(json!({
        "modelfile": "",
        "parameters": "",
        "template": "",
        "license": card.as_ref().map_or("", |c| c.license.as_str()),
        "details": details(card.as_ref()),
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": "1970-01-01T00:00:00Z",
    }))
    .into_response()
}

/// `GET /api/ps`: the models with a ready instance, and what they hold.
#[utoipa::path(get, path = "/api/ps", tag = "ollama",
    responses((status = 200, description = "The models being served")))]
pub(crate) async fn ps(State(api): State<Api>) -> Response {
    let status = match ask(&api.calls, ApiCall::Status).await {
        Ok(v) => v,
        Err(r) => return ollama_error(r.status, &r.message),
    };
    let ready = status["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["status"]["state"] == "ready");
    let models: Vec<Value> = ready
        .map(|i| {
            let name = i["model"].as_str().unwrap_or_default();
            let card = shoal_store::find_card(name);
            json!({
                "name": name, "model": name,
                "size": card.as_ref().map_or(0, |c| c.size),
                "digest": card.as_ref().map_or("", |c| c.sha256.as_str()),
                "details": details(card.as_ref()),
                // Instances stay until deleted; Ollama's clients want a time.
                "expires_at": "2999-01-01T00:00:00Z",
                "size_vram": 0,
                "context_length": i["context"],
            })
        })
        .collect();
    Json(json!({ "models": models })).into_response()
}

/// `POST /api/pull`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct PullRequest {
    /// The model (older clients call it `name`).
    #[serde(default, alias = "name")]
    model: String,
    #[serde(default)]
    stream: Option<bool>,
    /// Accepted and not used: shoal's packages are checked by their sha256.
    #[serde(default)]
    #[allow(dead_code)]
    insecure: bool,
}

/// How long a pull may take.
const PULL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(1800);

/// Where a pull stands, from the node's status.
fn pull_state(status: &Value, model: &str) -> Result<Option<f64>, String> {
    let have = status["nodes"].as_array().into_iter().flatten().any(|n| {
        n["models"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m == model))
    });
    if have {
        return Ok(None);
    }
    if let Some(why) = status["fetch_failures"][model].as_str() {
        return Err(why.to_string());
    }
    Ok(Some(status["fetches"][model].as_f64().unwrap_or(0.0)))
}

/// `POST /api/pull`: installs a known model on this node unless some node of the cluster
/// has it, with Ollama's progress lines (`status`, `digest`, `total`, `completed`) and
/// `{"status": "success"}` at the end.
#[utoipa::path(post, path = "/api/pull", tag = "ollama", request_body = PullRequest,
    responses((status = 200, description = "NDJSON progress, then success (or one object with `stream: false`)"),
        (status = 400, description = "Malformed JSON or a wrong type"),
        (status = 404, description = "A model shoal has no card for"),
        (status = 502, description = "The pull failed")))]
pub(crate) async fn pull(State(api): State<Api>, body: RawBody) -> Response {
    let req: PullRequest = match read_json(body) {
        Ok(r) => r,
        Err(r) => return ollama_error(r.status, &r.message),
    };
    let Some(card) = shoal_store::find_card(&req.model) else {
        let message = format!("model '{}' not found (see `shoal models`)", req.model);
        return ollama_error(StatusCode::NOT_FOUND, &message);
    };
    let model = req.model.clone();
    match ask(&api.calls, |reply| ApiCall::Pull { model, reply }).await {
        Ok(Ok(())) => {}
        Ok(Err(why)) => return ollama_error(StatusCode::NOT_FOUND, &why),
        Err(r) => return ollama_error(r.status, &r.message),
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Result<Value, String>>();
    let (calls, model) = (api.calls.clone(), req.model.clone());
    tokio::spawn(async move {
        let _ = tx.send(Ok(json!({ "status": "pulling manifest" })));
        let deadline = tokio::time::Instant::now() + PULL_DEADLINE;
        let digest = format!("sha256:{}", card.sha256);
        let mut said = None;
        loop {
            let status = match ask(&calls, ApiCall::Status).await {
                Ok(s) => s,
                Err(r) => return drop(tx.send(Err(r.message))),
            };
            match pull_state(&status, &model) {
                Ok(None) => {
                    let _ = tx.send(Ok(json!({ "status": "verifying sha256 digest" })));
                    return drop(tx.send(Ok(json!({ "status": "success" }))));
                }
                Err(why) => return drop(tx.send(Err(why))),
                Ok(Some(f)) => {
                    let completed = (f * card.size as f64) as u64;
                    if said != Some(completed) {
                        said = Some(completed);
                        let line = json!({ "status": format!("pulling {}", &card.sha256[..12]),
                            "digest": digest, "total": card.size, "completed": completed });
                        if tx.send(Ok(line)).is_err() {
                            return;
                        }
                    }
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return drop(tx.send(Err(format!("the pull of {model} did not end in time"))));
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
    });
    if req.stream == Some(false) {
        let mut last = None;
        while let Some(item) = rx.recv().await {
            match item {
                Ok(v) => last = Some(v),
                Err(why) => return ollama_error(StatusCode::BAD_GATEWAY, &why),
            }
        }
        return Json(last.unwrap_or(json!({ "status": "success" }))).into_response();
    }
    let lines = futures::stream::unfold((rx, false), |(mut rx, over)| async move {
        if over {
            return None;
        }
        match rx.recv().await {
            Some(Ok(v)) => Some((Ok::<Bytes, std::io::Error>(line(&v)), (rx, false))),
            // Ollama's clients read an error object and raise it.
            Some(Err(why)) => Some((Ok(line(&json!({ "error": why }))), (rx, true))),
            None => None,
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(lines))
        .unwrap_or_else(|_| ollama_error(StatusCode::INTERNAL_SERVER_ERROR, "response"))
}

/// `GET /api/version`.
#[utoipa::path(get, path = "/api/version", tag = "ollama",
    responses((status = 200, description = "shoal's version")))]
pub(crate) async fn version() -> Response {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") })).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_request_takes_ollamas_defaults_and_options() {
        let c: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "options": {"temperature": 0, "num_predict": 9, "stop": ["x"], "num_ctx": 4096},
            "keep_alive": "5m", "tools": null, "format": null,
        }))
        .unwrap();
        let (r, stream) = c.into_generate().unwrap();
        assert!(stream, "Ollama streams by default");
        assert_eq!((r.temperature, r.max_tokens, r.top_k), (0.0, 9, 40));
        assert_eq!(r.stop, vec!["x".to_string()]);
        let g: GenerateBody =
            serde_json::from_value(json!({"model": "m", "prompt": "p", "stream": false})).unwrap();
        let (r, stream) = g.into_generate().unwrap();
        assert!(!stream);
        assert_eq!((r.temperature, r.max_tokens), (0.8, 128));
    }

    #[test]
    fn tools_and_calls_reach_the_runner() {
        let c: ChatRequest = serde_json::from_value(json!({
            "model": "m",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
                {"role": "tool", "content": "42", "tool_name": "f"},
            ],
        }))
        .unwrap();
        let (r, _) = c.into_generate().unwrap();
        assert_eq!(r.tools.len(), 1);
        assert_eq!(
            r.messages[1].tool_calls[0].function.arguments,
            json!({"x": 1})
        );
        assert_eq!(r.messages[2].role, "tool");
    }

    #[test]
    fn what_shoal_cannot_take_is_refused() {
        let c: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "format": "json",
        }))
        .unwrap();
        assert!(c.into_generate().is_err());
        assert!(
            serde_json::from_value::<ChatRequest>(json!({"model": "m", "messages": [], "n": 2}))
                .is_err()
        );
        assert!(
            serde_json::from_value::<GenerateBody>(json!({"model": "m", "prompt": 5})).is_err()
        );
    }

    #[test]
    fn created_at_is_rfc3339() {
        let t = created_at();
        assert_eq!(t.len(), 20, "{t}");
        assert!(
            t.starts_with("20") && t.ends_with('Z') && &t[10..11] == "T",
            "{t}"
        );
    }
}
