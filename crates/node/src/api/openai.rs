//! The OpenAI protocol on the serving core: `POST /v1/chat/completions`,
//! `POST /v1/completions` (streamed as server-sent events ending `data: [DONE]`, or one
//! JSON body) and `GET /v1/models`.
//!
//! Requests are read into typed shapes that refuse unknown fields and wrong types (as
//! OpenAI does), then turned into the runner's [`GenerateRequest`] by pure functions.
//! A parameter shoal cannot honour yet (`n > 1`, `logprobs`, a forced tool
//! choice, a JSON schema) is a 400 naming it, never silently ignored. Tools are rendered
//! by the model's chat template; the calls the runner reads out of the answer come back
//! as `tool_calls` (one delta per call when streamed) with `finish_reason: "tool_calls"`,
//! and a call that does not parse stays in the content with
//! `finish_reason: "malformed_tool_call"`. Errors have OpenAI's shape:
//! `{"error": {"message", "type", "param", "code"}}`. A failure after the stream began is
//! one `data: {"error": …}` event, then the body is broken off (no `[DONE]`), so a
//! client never takes a cut answer for a whole one.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use shoal_runner::control::{ChatMessage, FinishReason, GenerateRequest, ToolCall, Usage};
use tokio::sync::mpsc;

use super::tools::{FunctionTool, arguments_text};
use super::{
    Answer, Api, Out, RawBody, Refusal, ask, collect, event_stream, read_json, response_id, submit,
};
use crate::daemon::ApiCall;
use crate::supervisor::Piece;

/// The default answer length when a request names none (OpenAI's is the model's room).
const DEFAULT_MAX_TOKENS: usize = 1024;

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = OpenAiChatRequest)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatRequest {
    model: String,
    messages: Vec<Message>,
    #[serde(default)]
    #[schema(minimum = 1)]
    max_tokens: Option<usize>,
    #[serde(default)]
    #[schema(minimum = 1)]
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    #[schema(minimum = 0, maximum = 2)]
    temperature: Option<f32>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 1)]
    top_p: Option<f32>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1)]
    n: Option<usize>,
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<usize>,
    #[serde(default)]
    tools: Option<Vec<FunctionTool>>,
    #[serde(default)]
    tool_choice: Option<ToolChoice>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    response_format: Option<Value>,
    /// Accepted and not used: OpenAI's end-user tag.
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompletionRequest {
    model: String,
    prompt: String,
    #[serde(default)]
    #[schema(minimum = 1)]
    max_tokens: Option<usize>,
    #[serde(default)]
    #[schema(minimum = 0, maximum = 2)]
    temperature: Option<f32>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 1)]
    top_p: Option<f32>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1)]
    n: Option<usize>,
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    logprobs: Option<usize>,
    #[serde(default)]
    echo: bool,
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = OpenAiMessage)]
#[serde(deny_unknown_fields)]
struct Message {
    role: Role,
    #[serde(default)]
    content: Option<Content>,
    /// Accepted and not used: a participant's name.
    #[serde(default)]
    #[allow(dead_code)]
    name: Option<String>,
    /// The calls an assistant turn made.
    #[serde(default)]
    tool_calls: Option<Vec<MessageCall>>,
    /// Which call a tool turn answers.
    #[serde(default)]
    tool_call_id: Option<String>,
    /// Accepted and not used: an assistant turn's refusal.
    #[serde(default)]
    #[allow(dead_code)]
    refusal: Option<String>,
}

/// A call in an assistant turn, as the client sends it back.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = OpenAiMessageCall)]
#[serde(deny_unknown_fields)]
struct MessageCall {
    id: String,
    #[serde(rename = "type")]
    #[allow(dead_code)]
    kind: super::tools::FunctionKind,
    function: MessageFunction,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = OpenAiMessageFunction)]
#[serde(deny_unknown_fields)]
struct MessageFunction {
    name: String,
    /// JSON text.
    arguments: String,
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"`, or one named function.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = OpenAiToolChoice)]
#[serde(untagged)]
enum ToolChoice {
    Mode(ToolMode),
    Named(#[allow(dead_code)] Value),
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, utoipa::ToSchema)]
#[schema(as = OpenAiToolMode)]
#[serde(rename_all = "snake_case")]
enum ToolMode {
    None,
    Auto,
    Required,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, utoipa::ToSchema)]
#[schema(as = OpenAiRole)]
#[serde(rename_all = "snake_case")]
enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

/// A message's content: a string, or parts of which shoal reads the text ones.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = OpenAiContent)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Part {
    Text { text: String },
    ImageUrl {},
    InputAudio {},
    File {},
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// A request shoal cannot take, with the parameter at fault.
#[derive(Debug, PartialEq)]
pub(crate) struct Unsupported {
    pub param: &'static str,
    pub message: String,
}

fn unsupported(param: &'static str, message: impl Into<String>) -> Unsupported {
    Unsupported {
        param,
        message: message.into(),
    }
}

/// Refuses `n` > 1 (one answer per request); takes the presence and frequency
/// penalties within OpenAI's range.
fn penalties(
    r: &mut GenerateRequest,
    n: Option<usize>,
    presence: Option<f32>,
    frequency: Option<f32>,
) -> Result<(), Unsupported> {
    if n.is_some_and(|n| n != 1) {
        return Err(unsupported("n", "only n = 1 is supported"));
    }
    let within = |v: f32| (-2.0..=2.0).contains(&v);
    r.presence_penalty = presence.unwrap_or(0.0);
    if !within(r.presence_penalty) {
        let why = "presence_penalty must be within -2 and 2";
        return Err(unsupported("presence_penalty", why));
    }
    r.frequency_penalty = frequency.unwrap_or(0.0);
    if !within(r.frequency_penalty) {
        let why = "frequency_penalty must be within -2 and 2";
        return Err(unsupported("frequency_penalty", why));
    }
    Ok(())
}

/// What both endpoints take alike: the answer's length, sampling, seed and stop strings.
fn generation(
    r: &mut GenerateRequest,
    max_tokens: usize,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stop>,
) -> Result<(), Unsupported> {
    if max_tokens == 0 {
        return Err(unsupported("max_tokens", "max_tokens must be at least 1"));
    }
    r.max_tokens = max_tokens;
    r.seed = seed.unwrap_or(0);
    r.stop = stop.map(Stop::into_vec).unwrap_or_default();
    // OpenAI's default temperature is 1; its range is 0..=2.
    let t = temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&t) {
        return Err(unsupported(
            "temperature",
            "temperature must be within 0 and 2",
        ));
    }
    let p = top_p.unwrap_or(1.0);
    if !(p > 0.0 && p <= 1.0) {
        return Err(unsupported("top_p", "top_p must be within (0, 1]"));
    }
    r.temperature = t;
    r.top_p = p;
    Ok(())
}

fn text_of(content: Option<Content>) -> Result<String, Unsupported> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t),
        Some(Content::Parts(parts)) => {
            let mut out = String::new();
            for p in parts {
                match p {
                    Part::Text { text } => out.push_str(&text),
                    _ => {
                        return Err(unsupported(
                            "messages",
                            "only text content is supported (no images, audio or files)",
                        ));
                    }
                }
            }
            Ok(out)
        }
    }
}

impl ChatRequest {
    /// The runner's request, and whether to stream with usage at the end.
    pub(crate) fn into_generate(self) -> Result<(GenerateRequest, bool, bool), Unsupported> {
        if self.logprobs == Some(true) || self.top_logprobs.is_some() {
            return Err(unsupported("logprobs", "logprobs are not supported yet"));
        }
        let tools = match (self.tools.unwrap_or_default(), self.tool_choice) {
            (_, Some(ToolChoice::Mode(ToolMode::None))) => Vec::new(),
            (t, None | Some(ToolChoice::Mode(ToolMode::Auto))) => t,
            (_, Some(_)) => {
                return Err(unsupported(
                    "tool_choice",
                    "only \"auto\" and \"none\" are supported (shoal cannot force a call)",
                ));
            }
        };
        if self.parallel_tool_calls == Some(false) {
            return Err(unsupported(
                "parallel_tool_calls",
                "parallel_tool_calls: false is not supported (the model may make several calls)",
            ));
        }
        let tools = super::tools::for_runner(tools).map_err(|m| unsupported("tools", m))?;
        if let Some(f) = &self.response_format
            && f.get("type").and_then(Value::as_str) != Some("text")
        {
            return Err(unsupported(
                "response_format",
                "only the text response format is supported",
            ));
        }
        if self.messages.is_empty() {
            return Err(unsupported("messages", "messages must not be empty"));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for m in self.messages {
            let role = match m.role {
                Role::System | Role::Developer => "system",
                Role::User => "user",
                Role::Assistant => "assistant",
                Role::Tool => "tool",
            };
            let mut message = ChatMessage::new(role, text_of(m.content)?);
            message.tool_call_id = m.tool_call_id;
            for c in m.tool_calls.into_iter().flatten() {
                let arguments = super::tools::arguments_value(&c.function.arguments);
                let call = ToolCall::new(Some(c.id), c.function.name, arguments);
                message.tool_calls.push(call);
            }
            messages.push(message);
        }
        let mut r = GenerateRequest::new("");
        penalties(
            &mut r,
            self.n,
            self.presence_penalty,
            self.frequency_penalty,
        )?;
        r.messages = messages;
        r.tools = tools;
        r.model = Some(self.model);
        let asked = self.max_completion_tokens.or(self.max_tokens);
        r.must_fit = asked.is_some();
        let max_tokens = asked.unwrap_or(DEFAULT_MAX_TOKENS);
        generation(
            &mut r,
            max_tokens,
            self.temperature,
            self.top_p,
            self.seed,
            self.stop,
        )?;
        let usage = self.stream_options.is_some_and(|o| o.include_usage);
        Ok((r, self.stream, usage))
    }
}

impl CompletionRequest {
    pub(crate) fn into_generate(self) -> Result<(GenerateRequest, bool, bool), Unsupported> {
        if self.logprobs.is_some() {
            return Err(unsupported("logprobs", "logprobs are not supported yet"));
        }
        if self.echo {
            return Err(unsupported("echo", "echo is not supported"));
        }
        let mut r = GenerateRequest::new(self.prompt);
        penalties(
            &mut r,
            self.n,
            self.presence_penalty,
            self.frequency_penalty,
        )?;
        r.raw = true;
        r.model = Some(self.model);
        // OpenAI's legacy default is 16 tokens.
        r.must_fit = self.max_tokens.is_some();
        let max_tokens = self.max_tokens.unwrap_or(16);
        generation(
            &mut r,
            max_tokens,
            self.temperature,
            self.top_p,
            self.seed,
            self.stop,
        )?;
        let usage = self.stream_options.is_some_and(|o| o.include_usage);
        Ok((r, self.stream, usage))
    }
}

/// An error body in OpenAI's shape.
/// OpenAI's error type for a status code.
fn error_type(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => "invalid_request_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        _ => "api_error",
    }
}

fn openai_error(status: StatusCode, message: &str, param: Option<&str>) -> Response {
    let kind = error_type(status);
    let code = match status {
        StatusCode::NOT_FOUND => Some("model_not_found"),
        _ => None,
    };
    let body = json!({ "error": {
        "message": message, "type": kind, "param": param, "code": code,
    }});
    (status, Json(body)).into_response()
}

fn refused(r: Refusal) -> Response {
    openai_error(r.status, &r.message, None)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop | FinishReason::Cancelled => "stop",
        FinishReason::Length => "length",
        FinishReason::ToolCalls => "tool_calls",
        // Not one of OpenAI's: the call the model wrote is in the content, as text.
        FinishReason::MalformedToolCall => "malformed_tool_call",
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

/// Which protocol object an answer is written as.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// What every chunk and body of one answer share.
#[derive(Clone)]
struct Head {
    kind: Kind,
    id: String,
    model: String,
    created: u64,
    /// Tool calls streamed so far (each delta carries its index).
    calls: usize,
}

impl Head {
    fn new(kind: Kind, model: &str) -> Self {
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        };
        Self {
            kind,
            id: response_id(prefix),
            model: model.to_string(),
            created: now(),
            calls: 0,
        }
    }

    /// The chunk that streams one tool call whole: its id, name and arguments.
    fn call_chunk(&mut self, call: &ToolCall) -> Value {
        let index = self.calls;
        self.calls += 1;
        let delta = json!({ "tool_calls": [{
            "index": index, "id": response_id("call"), "type": "function",
            "function": { "name": call.function.name, "arguments": arguments_text(call) },
        }]});
        json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.model,
            "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": null }],
        })
    }

    /// One streamed chunk: a piece of text, and the finish reason on the last.
    fn chunk(&self, text: Option<&str>, first: bool, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish })
            }
            Kind::Completion => json!({
                "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.model, "choices": [choice],
        })
    }

    fn usage_chunk(&self, usage: &Usage) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.model, "choices": [], "usage": usage_json(usage),
        })
    }

    fn whole(&self, a: &Answer) -> Value {
        let (text, finish) = (&a.text, &a.finish);
        let choice = match self.kind {
            Kind::Chat => {
                let mut message = json!({ "role": "assistant", "content": text, "refusal": null });
                if !a.calls.is_empty() {
                    let calls: Vec<Value> = a
                        .calls
                        .iter()
                        .map(|c| json!({ "id": response_id("call"), "type": "function",
                            "function": { "name": c.function.name, "arguments": arguments_text(c) } }))
                        .collect();
                    message["tool_calls"] = json!(calls);
                    if text.is_empty() {
                        message["content"] = Value::Null;
                    }
                }
                json!({
                    "index": 0, "message": message, "logprobs": null,
                    "finish_reason": finish_reason(finish.finish_reason),
                })
            }
            Kind::Completion => json!({
                "index": 0, "text": text, "logprobs": null,
                "finish_reason": finish_reason(finish.finish_reason),
            }),
        };
        json!({
            "id": self.id, "object": self.object(false), "created": self.created,
            "model": self.model, "choices": [choice], "usage": usage_json(&finish.usage),
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Completion, _) => "text_completion",
        }
    }
}

#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai", request_body = ChatRequest,
    responses(super::Answered))]
pub(crate) async fn chat_completions(State(api): State<Api>, body: RawBody) -> Response {
    let request: ChatRequest = match read_json(body) {
        Ok(r) => r,
        Err(r) => return refused(r),
    };
    let model = request.model.clone();
    match request.into_generate() {
        Ok((r, stream, usage)) => {
            answer(&api, Head::new(Kind::Chat, &model), r, stream, usage).await
        }
        Err(u) => openai_error(StatusCode::BAD_REQUEST, &u.message, Some(u.param)),
    }
}

#[utoipa::path(post, path = "/v1/completions", tag = "openai", request_body = CompletionRequest,
    responses(super::Answered))]
pub(crate) async fn completions(State(api): State<Api>, body: RawBody) -> Response {
    let request: CompletionRequest = match read_json(body) {
        Ok(r) => r,
        Err(r) => return refused(r),
    };
    let model = request.model.clone();
    match request.into_generate() {
        Ok((r, stream, usage)) => {
            answer(&api, Head::new(Kind::Completion, &model), r, stream, usage).await
        }
        Err(u) => openai_error(StatusCode::BAD_REQUEST, &u.message, Some(u.param)),
    }
}

async fn answer(
    api: &Api,
    head: Head,
    request: GenerateRequest,
    stream: bool,
    usage: bool,
) -> Response {
    let (first, rx) = match submit(api, request).await {
        Ok(a) => a,
        Err(r) => return refused(r),
    };
    if stream {
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(events(head, first, rx, usage)))
            .unwrap_or_else(|_| openai_error(StatusCode::INTERNAL_SERVER_ERROR, "response", None));
    }
    match collect(first, rx).await {
        Ok(a) => Json(head.whole(&a)).into_response(),
        Err(r) => refused(r),
    }
}

fn event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The events one piece of the answer makes; true when the answer is over.
fn piece_events(piece: Piece, head: &mut Head, usage: bool, out: &mut Vec<Out>) -> bool {
    match piece {
        Piece::Text(t) => {
            out.push(Out::Bytes(event(&head.chunk(Some(&t), false, None))));
            false
        }
        Piece::ToolCall(c) => {
            out.push(Out::Bytes(event(&head.call_chunk(&c))));
            false
        }
        Piece::Keepalive => {
            out.push(Out::Bytes(Bytes::from_static(b": keepalive\n\n")));
            false
        }
        Piece::Progress(p) => {
            out.push(Out::Bytes(super::comment(&p)));
            false
        }
        Piece::Done(f) => {
            let reason = finish_reason(f.finish_reason);
            out.push(Out::Bytes(event(&head.chunk(None, false, Some(reason)))));
            if usage {
                out.push(Out::Bytes(event(&head.usage_chunk(&f.usage))));
            }
            out.push(Out::Bytes(Bytes::from_static(b"data: [DONE]\n\n")));
            true
        }
        Piece::Error(f) => {
            let kind = error_type(Refusal::of(f.clone()).status);
            let body = json!({ "error": {
                "message": f.message, "type": kind, "param": null, "code": null,
            }});
            out.push(Out::Bytes(event(&body)));
            out.push(Out::Fail);
            true
        }
    }
}

/// The answer as server-sent events: a first chunk with the role, a chunk per piece of
/// text, a last one with the finish reason, the usage when asked, then `[DONE]`.
/// Comment lines keep a quiet stream alive.
fn events(
    mut head: Head,
    first: Piece,
    rx: mpsc::UnboundedReceiver<Piece>,
    usage: bool,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    let mut start = vec![Out::Bytes(event(&head.chunk(None, true, None)))];
    let over = piece_events(first, &mut head, usage, &mut start);
    event_stream(start, over, rx, move |p, out| {
        piece_events(p, &mut head, usage, out)
    })
}

/// `GET /v1/models`: every model placed in the cluster or installed on a node.
#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, description = "The models placed or installed in the cluster")))]
pub(crate) async fn models(State(api): State<Api>) -> Response {
    let status = match ask(&api.calls, ApiCall::Status).await {
        Ok(v) => v,
        Err(r) => return refused(r),
    };
    let names = super::models_of(&status);
    let data: Vec<Value> = names
        .iter()
        .map(|m| json!({ "id": m, "object": "model", "created": 0, "owned_by": "shoal" }))
        .collect();
    Json(json!({ "object": "list", "data": data })).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::Finish;

    fn chat(body: Value) -> Result<(GenerateRequest, bool, bool), Unsupported> {
        serde_json::from_value::<ChatRequest>(body)
            .expect("parses")
            .into_generate()
    }

    #[test]
    fn a_chat_request_becomes_the_runners_request() {
        let (r, stream, usage) = chat(json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"},
            ],
            "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "top_p": 0.5,
            "stop": "x", "seed": 3, "stream": true, "stream_options": {"include_usage": true},
            "n": 1, "user": "u", "response_format": {"type": "text"},
        }))
        .expect("accepted");
        assert!(stream && usage);
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.max_tokens, 7, "max_completion_tokens wins");
        assert_eq!((r.temperature, r.top_p, r.seed), (0.0, 0.5, 3));
        assert_eq!(r.stop, vec!["x".to_string()]);
        let roles: Vec<&str> = r.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(r.messages[1].content, "Hi!");
        let (r, stream, _) =
            chat(json!({"model": "m", "messages": [{"role": "user", "content": "a"}]})).unwrap();
        assert!(!stream);
        assert_eq!((r.temperature, r.max_tokens), (1.0, DEFAULT_MAX_TOKENS));
    }

    #[test]
    fn tools_and_a_tool_round_trip_reach_the_runner() {
        let tool = json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}});
        let (r, _, _) = chat(json!({
            "model": "m", "tools": [tool.clone()], "tool_choice": "auto", "parallel_tool_calls": true,
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
        }))
        .expect("accepted");
        assert_eq!(r.tools, std::slice::from_ref(&tool));
        let call = &r.messages[1].tool_calls[0];
        assert_eq!(
            (call.id.as_deref(), call.function.name.as_str()),
            (Some("call_1"), "get_weather")
        );
        assert_eq!(call.function.arguments, json!({"city": "Paris"}));
        assert_eq!(r.messages[2].tool_call_id.as_deref(), Some("call_1"));
        let (r, _, _) = chat(
            json!({"model": "m", "tools": [tool.clone()], "tool_choice": "none",
            "messages": [{"role": "user", "content": "a"}]}),
        )
        .expect("accepted");
        assert!(
            r.tools.is_empty(),
            "tool_choice none: the model is not shown them"
        );
    }

    #[test]
    fn an_answer_with_calls_has_tool_calls_and_no_content() {
        let head = Head::new(Kind::Chat, "m");
        let a = Answer {
            text: String::new(),
            calls: vec![ToolCall::new(None, "f", json!({"x": 1}))],
            finish: Finish {
                finish_reason: FinishReason::ToolCalls,
                usage: Usage::default(),
                timings: Default::default(),
            },
        };
        let v = head.whole(&a);
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls");
        assert_eq!(c["message"]["content"], Value::Null);
        assert_eq!(
            c["message"]["tool_calls"][0]["function"]["arguments"],
            r#"{"x":1}"#
        );
        assert!(
            c["message"]["tool_calls"][0]["id"]
                .as_str()
                .unwrap()
                .starts_with("call-")
        );
    }

    #[test]
    fn what_shoal_cannot_honour_is_refused_by_name() {
        let base = || json!({"model": "m", "messages": [{"role": "user", "content": "a"}]});
        for (field, value, param) in [
            ("n", json!(2), "n"),
            ("presence_penalty", json!(2.5), "presence_penalty"),
            ("frequency_penalty", json!(-3), "frequency_penalty"),
            ("logprobs", json!(true), "logprobs"),
            ("tool_choice", json!("required"), "tool_choice"),
            (
                "tool_choice",
                json!({"type": "function", "function": {"name": "f"}}),
                "tool_choice",
            ),
            ("parallel_tool_calls", json!(false), "parallel_tool_calls"),
            (
                "response_format",
                json!({"type": "json_schema"}),
                "response_format",
            ),
            ("temperature", json!(3), "temperature"),
            ("max_tokens", json!(0), "max_tokens"),
        ] {
            let mut b = base();
            b[field] = value;
            assert_eq!(chat(b).unwrap_err().param, param);
        }
        let mut b = base();
        b["messages"] = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]);
        assert_eq!(chat(b).unwrap_err().param, "messages");
    }

    #[test]
    fn wrong_types_and_unknown_fields_do_not_parse() {
        for body in [
            json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "max_tokens": "x"}),
            json!({"model": "m", "messages": [{"role": "user", "content": "a"}], "best_of": 2}),
            json!({"model": "m", "messages": [{"role": "wizard", "content": "a"}]}),
            json!({"messages": [{"role": "user", "content": "a"}]}),
        ] {
            assert!(serde_json::from_value::<ChatRequest>(body).is_err());
        }
    }

    #[test]
    fn the_stream_ends_with_done_and_usage_when_asked_or_breaks_off_on_failure() {
        let mut head = Head::new(Kind::Chat, "m");
        let mut out = Vec::new();
        assert!(!piece_events(
            Piece::Text("a".into()),
            &mut head,
            true,
            &mut out
        ));
        let finish = Finish {
            finish_reason: FinishReason::Length,
            usage: Usage {
                prompt_tokens: 3,
                cached_tokens: 0,
                completion_tokens: 2,
            },
            timings: Default::default(),
        };
        assert!(piece_events(Piece::Done(finish), &mut head, true, &mut out));
        let text: Vec<String> = out
            .iter()
            .map(|o| match o {
                Out::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
                Out::Fail => "FAIL".into(),
            })
            .collect();
        assert!(text[0].contains(r#""content":"a""#));
        assert!(text[1].contains(r#""finish_reason":"length""#));
        assert!(text[2].contains(r#""total_tokens":5"#) && text[2].contains(r#""choices":[]"#));
        assert_eq!(text[3], "data: [DONE]\n\n");
        let mut out = Vec::new();
        assert!(piece_events(
            Piece::broken("gone"),
            &mut head,
            false,
            &mut out
        ));
        assert!(
            matches!(out.last(), Some(Out::Fail)),
            "no [DONE] after a failure"
        );
    }
}
