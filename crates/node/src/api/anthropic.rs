//! The Anthropic protocol on the serving core: `POST /v1/messages`, one JSON message or a
//! stream of server-sent events (`message_start`, `content_block_start`, `ping`,
//! `content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`).
//!
//! Requests are typed and strict (unknown fields and wrong types are 400s, as Anthropic's
//! own API answers); what shoal cannot honour yet (images, extended thinking, a forced
//! tool choice) is refused by name. Tools are offered to the model through its chat
//! template (`tool_use` and `tool_result` blocks become its assistant calls and tool
//! turns); its calls come back as `tool_use` blocks (streamed as `input_json_delta`) with
//! `stop_reason: "tool_use"`. Errors have Anthropic's shape: `{"type": "error", "error": {"type",
//! "message"}}`. A failure after the stream began is an `error` event, then the body is
//! broken off without `message_stop`.

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use shoal_runner::control::{ChatMessage, FinishReason, GenerateRequest, ToolCall, Usage};

use super::tools::FunctionTool;
use super::{
    Answer, Api, Out, RawBody, Refusal, collect, event_stream, read_json, response_id, submit,
};
use crate::supervisor::Piece;

/// `POST /v1/messages`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct MessagesRequest {
    model: String,
    #[schema(minimum = 1)]
    max_tokens: usize,
    messages: Vec<Message>,
    #[serde(default)]
    system: Option<Content>,
    #[serde(default)]
    #[schema(minimum = 0, maximum = 1)]
    temperature: Option<f32>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 1)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<usize>,
    #[serde(default)]
    stop_sequences: Vec<String>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    tools: Option<Vec<Tool>>,
    #[serde(default)]
    tool_choice: Option<ToolChoice>,
    #[serde(default)]
    thinking: Option<Value>,
    /// Accepted and not used: the caller's tags.
    #[serde(default)]
    #[allow(dead_code)]
    metadata: Option<Value>,
}

/// A client tool: `{"name", "description", "input_schema"}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct Tool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    input_schema: Value,
    /// `"custom"` or none; Anthropic's server tools (web search and such) are not here.
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    cache_control: Option<Value>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = AnthropicToolChoice)]
#[serde(deny_unknown_fields)]
struct ToolChoice {
    #[serde(rename = "type")]
    kind: ToolMode,
    #[serde(default)]
    #[allow(dead_code)]
    name: Option<String>,
    #[serde(default)]
    disable_parallel_tool_use: Option<bool>,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, utoipa::ToSchema)]
#[schema(as = AnthropicToolMode)]
#[serde(rename_all = "snake_case")]
enum ToolMode {
    Auto,
    None,
    Any,
    Tool,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = AnthropicMessage)]
#[serde(deny_unknown_fields)]
struct Message {
    role: Role,
    content: Content,
}

#[derive(Debug, Deserialize, Clone, Copy, utoipa::ToSchema)]
#[schema(as = AnthropicRole)]
#[serde(rename_all = "snake_case")]
enum Role {
    User,
    Assistant,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = AnthropicContent)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text {
        text: String,
        /// Accepted and not used: prompt caching hints (shoal's prefix cache is automatic).
        #[serde(default)]
        #[allow(dead_code)]
        cache_control: Option<Value>,
    },
    Image {},
    Document {},
    ToolUse {
        id: String,
        name: String,
        input: Value,
        #[serde(default)]
        #[allow(dead_code)]
        cache_control: Option<Value>,
    },
    ToolResult {
        tool_use_id: String,
        #[serde(default)]
        #[schema(no_recursion)]
        content: Option<Content>,
        #[serde(default)]
        is_error: bool,
        #[serde(default)]
        #[allow(dead_code)]
        cache_control: Option<Value>,
    },
}

/// What shoal cannot take, and the field at fault.
#[derive(Debug, PartialEq)]
pub(crate) struct Unsupported {
    pub field: &'static str,
    pub message: String,
}

fn unsupported(field: &'static str, message: impl Into<String>) -> Unsupported {
    Unsupported {
        field,
        message: message.into(),
    }
}

/// The text of content that may hold only text (a system prompt, a tool's result).
fn text_of(c: Content, field: &'static str) -> Result<String, Unsupported> {
    let turns = turns("user", c, field)?;
    match turns.as_slice() {
        [] => Ok(String::new()),
        [one] if one.tool_calls.is_empty() && one.tool_call_id.is_none() => Ok(one.content.clone()),
        _ => Err(unsupported(field, "only text is taken here")),
    }
}

/// One message as the template's turns: its text (with an assistant's calls), and a
/// tool turn for each `tool_result` block.
fn turns(role: &str, c: Content, field: &'static str) -> Result<Vec<ChatMessage>, Unsupported> {
    let blocks = match c {
        Content::Text(t) => return Ok(vec![ChatMessage::new(role, t)]),
        Content::Blocks(blocks) => blocks,
    };
    let mut results = Vec::new();
    let mut own = ChatMessage::new(role, "");
    for b in blocks {
        match b {
            Block::Text { text, .. } => own.content.push_str(&text),
            Block::ToolUse {
                id, name, input, ..
            } if role == "assistant" => own.tool_calls.push(ToolCall::new(Some(id), name, input)),
            Block::ToolResult {
                tool_use_id,
                content,
                is_error,
                ..
            } if role == "user" => {
                let text = match content {
                    Some(c) => text_of(c, field)?,
                    None => String::new(),
                };
                let mut turn = ChatMessage::new(
                    "tool",
                    if is_error {
                        format!("Error: {text}")
                    } else {
                        text
                    },
                );
                turn.tool_call_id = Some(tool_use_id);
                results.push(turn);
            }
            Block::ToolUse { .. } => {
                return Err(unsupported(
                    field,
                    "tool_use blocks belong to assistant turns",
                ));
            }
            Block::ToolResult { .. } => {
                return Err(unsupported(
                    field,
                    "tool_result blocks belong to user turns",
                ));
            }
            Block::Image {} | Block::Document {} => {
                return Err(unsupported(field, "only text content is supported"));
            }
        }
    }
    if !own.content.is_empty() || !own.tool_calls.is_empty() || results.is_empty() {
        results.push(own);
    }
    Ok(results)
}

/// The tools the model is shown, by `tool_choice`.
fn offered(tools: Vec<Tool>, choice: Option<ToolChoice>) -> Result<Vec<Value>, Unsupported> {
    if let Some(c) = &choice {
        if matches!(c.kind, ToolMode::Any | ToolMode::Tool) {
            return Err(unsupported(
                "tool_choice",
                "only auto and none are supported (shoal cannot force a call)",
            ));
        }
        if c.disable_parallel_tool_use == Some(true) {
            return Err(unsupported(
                "tool_choice",
                "disable_parallel_tool_use is not supported (the model may make several calls)",
            ));
        }
        if c.kind == ToolMode::None {
            return Ok(Vec::new());
        }
    }
    let mut functions = Vec::with_capacity(tools.len());
    for t in tools {
        if t.kind.as_deref().is_some_and(|k| k != "custom") {
            return Err(unsupported(
                "tools",
                "only client tools (custom) are supported",
            ));
        }
        functions.push(FunctionTool::new(
            t.name,
            t.description,
            Some(t.input_schema),
        ));
    }
    super::tools::for_runner(functions).map_err(|m| unsupported("tools", m))
}

impl MessagesRequest {
    /// The runner's request, and whether to stream.
    pub(crate) fn into_generate(self) -> Result<(GenerateRequest, bool), Unsupported> {
        if self.max_tokens == 0 {
            return Err(unsupported("max_tokens", "max_tokens must be at least 1"));
        }
        let t = self.temperature.unwrap_or(1.0);
        if !(0.0..=1.0).contains(&t) {
            return Err(unsupported(
                "temperature",
                "temperature must be within 0 and 1",
            ));
        }
        let p = self.top_p.unwrap_or(1.0);
        if !(p > 0.0 && p <= 1.0) {
            return Err(unsupported("top_p", "top_p must be within (0, 1]"));
        }
        let conversation = Conversation {
            model: self.model,
            messages: self.messages,
            system: self.system,
            tools: self.tools,
            tool_choice: self.tool_choice,
            thinking: self.thinking,
        };
        let mut r = conversation.into_request()?;
        r.max_tokens = self.max_tokens;
        r.must_fit = true;
        r.temperature = t;
        r.top_p = p;
        r.top_k = self.top_k.unwrap_or(0);
        r.stop = self.stop_sequences;
        Ok((r, self.stream))
    }
}

/// `POST /v1/messages/count_tokens`: what a message request would put in the prompt.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Conversation {
    model: String,
    messages: Vec<Message>,
    #[serde(default)]
    system: Option<Content>,
    #[serde(default)]
    tools: Option<Vec<Tool>>,
    #[serde(default)]
    tool_choice: Option<ToolChoice>,
    #[serde(default)]
    thinking: Option<Value>,
}

impl Conversation {
    /// The runner's request for this conversation (with the defaults for the rest).
    fn into_request(self) -> Result<GenerateRequest, Unsupported> {
        let tools = offered(self.tools.unwrap_or_default(), self.tool_choice)?;
        if self.thinking.is_some() {
            return Err(unsupported(
                "thinking",
                "extended thinking is not supported",
            ));
        }
        if self.messages.is_empty() {
            return Err(unsupported("messages", "messages must not be empty"));
        }
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = self.system {
            messages.push(ChatMessage::new("system", text_of(system, "system")?));
        }
        for m in self.messages {
            let role = match m.role {
                Role::User => "user",
                Role::Assistant => "assistant",
            };
            messages.extend(turns(role, m.content, "messages")?);
        }
        let mut r = GenerateRequest::new("");
        r.messages = messages;
        r.tools = tools;
        r.model = Some(self.model);
        Ok(r)
    }
}

/// Anthropic's error type for a status code.
fn error_type(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST => "invalid_request_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        _ => "api_error",
    }
}

fn anthropic_error(status: StatusCode, message: &str) -> Response {
    let body =
        json!({ "type": "error", "error": { "type": error_type(status), "message": message } });
    (status, Json(body)).into_response()
}

fn stop_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop | FinishReason::Cancelled => "end_turn",
        FinishReason::Length => "max_tokens",
        FinishReason::ToolCalls => "tool_use",
        // Not one of Anthropic's: the call the model wrote is in the text.
        FinishReason::MalformedToolCall => "malformed_tool_call",
    }
}

fn usage_json(u: &Usage) -> Value {
    // Anthropic counts cache reads apart from the input tokens.
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
    })
}

#[utoipa::path(post, path = "/v1/messages", tag = "anthropic", request_body = MessagesRequest,
    responses(super::Answered))]
pub(crate) async fn messages(State(api): State<Api>, body: RawBody) -> Response {
    let request: MessagesRequest = match read_json(body) {
        Ok(r) => r,
        Err(r) => return anthropic_error(r.status, &r.message),
    };
    let model = request.model.clone();
    let (request, stream) = match request.into_generate() {
        Ok(r) => r,
        Err(u) => {
            return anthropic_error(
                StatusCode::BAD_REQUEST,
                &format!("{}: {}", u.field, u.message),
            );
        }
    };
    let (first, rx) = match submit(&api, request).await {
        Ok(a) => a,
        Err(r) => return anthropic_error(r.status, &r.message),
    };
    let id = response_id("msg");
    if stream {
        let start = json!({ "type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": { "input_tokens": 0, "output_tokens": 0 },
        }});
        let mut out = vec![Out::Bytes(sse("message_start", &start))];
        let mut blocks = Blocks::default();
        out.push(Out::Bytes(sse("ping", &json!({ "type": "ping" }))));
        let over = piece_events(first, &mut blocks, &mut out);
        let body = event_stream(out, over, rx, move |p, out| {
            piece_events(p, &mut blocks, out)
        });
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(body))
            .unwrap_or_else(|_| anthropic_error(StatusCode::INTERNAL_SERVER_ERROR, "response"));
    }
    match collect(first, rx).await {
        Ok(a) => Json(whole(&id, &model, &a)).into_response(),
        Err(r) => anthropic_error(r.status, &r.message),
    }
}

#[utoipa::path(post, path = "/v1/messages/count_tokens", tag = "anthropic", request_body = Conversation,
    responses((status = 200, description = "`{\"input_tokens\": N}`: the prompt's tokens as the model's template renders it"),
        (status = 400, description = "Malformed JSON, a wrong type, an unknown field, what shoal cannot take"),
        (status = 404, description = "A model shoal does not know"),
        (status = 503, description = "The model has no ready instance")))]
pub(crate) async fn count_tokens(State(api): State<Api>, body: RawBody) -> Response {
    let conversation: Conversation = match read_json(body) {
        Ok(r) => r,
        Err(r) => return anthropic_error(r.status, &r.message),
    };
    let mut request = match conversation.into_request() {
        Ok(r) => r,
        Err(u) => {
            let message = format!("{}: {}", u.field, u.message);
            return anthropic_error(StatusCode::BAD_REQUEST, &message);
        }
    };
    request.count_only = true;
    let answer = match submit(&api, request).await {
        Ok((first, rx)) => collect(first, rx).await,
        Err(r) => Err(r),
    };
    match answer {
        Ok(a) => Json(json!({ "input_tokens": a.finish.usage.prompt_tokens })).into_response(),
        Err(r) => anthropic_error(r.status, &r.message),
    }
}

fn whole(id: &str, model: &str, a: &Answer) -> Value {
    let mut content = Vec::new();
    if !a.text.is_empty() || a.calls.is_empty() {
        content.push(json!({ "type": "text", "text": a.text }));
    }
    content.extend(a.calls.iter().map(tool_use));
    json!({
        "id": id, "type": "message", "role": "assistant", "model": model,
        "content": content,
        "stop_reason": stop_reason(a.finish.finish_reason), "stop_sequence": null,
        "usage": usage_json(&a.finish.usage),
    })
}

fn tool_use(c: &ToolCall) -> Value {
    json!({ "type": "tool_use", "id": response_id("toolu"), "name": c.function.name,
        "input": c.function.arguments })
}

/// The content blocks a stream has opened: a text block when text comes, and a tool_use
/// block per call (opened, given its input in one delta, and closed at once). An answer
/// with nothing in it still has one (empty) text block.
#[derive(Default)]
struct Blocks {
    /// The index of the open block, or of the next one.
    index: usize,
    text_open: bool,
}

impl Blocks {
    fn open_text(&mut self, out: &mut Vec<Out>) {
        out.push(Out::Bytes(sse(
            "content_block_start",
            &json!({ "type": "content_block_start", "index": self.index,
                "content_block": { "type": "text", "text": "" } }),
        )));
        self.text_open = true;
    }

    fn close(&mut self, out: &mut Vec<Out>) {
        if self.text_open {
            out.push(Out::Bytes(sse(
                "content_block_stop",
                &json!({ "type": "content_block_stop", "index": self.index }),
            )));
            self.text_open = false;
            self.index += 1;
        }
    }

    fn text(&mut self, t: &str, out: &mut Vec<Out>) {
        if !self.text_open {
            self.open_text(out);
        }
        out.push(Out::Bytes(sse(
            "content_block_delta",
            &json!({ "type": "content_block_delta", "index": self.index,
                "delta": { "type": "text_delta", "text": t } }),
        )));
    }

    fn call(&mut self, c: &ToolCall, out: &mut Vec<Out>) {
        self.close(out);
        let mut block = tool_use(c);
        block["input"] = json!({});
        let i = self.index;
        out.push(Out::Bytes(sse(
            "content_block_start",
            &json!({ "type": "content_block_start", "index": i, "content_block": block }),
        )));
        out.push(Out::Bytes(sse(
            "content_block_delta",
            &json!({ "type": "content_block_delta", "index": i,
                "delta": { "type": "input_json_delta",
                    "partial_json": c.function.arguments.to_string() } }),
        )));
        out.push(Out::Bytes(sse(
            "content_block_stop",
            &json!({ "type": "content_block_stop", "index": i }),
        )));
        self.index += 1;
    }
}

fn sse(event: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

/// The events one piece makes; true when the answer is over.
fn piece_events(piece: Piece, blocks: &mut Blocks, out: &mut Vec<Out>) -> bool {
    match piece {
        Piece::Text(t) => {
            blocks.text(&t, out);
            false
        }
        Piece::ToolCall(c) => {
            blocks.call(&c, out);
            false
        }
        Piece::Keepalive => {
            out.push(Out::Bytes(sse("ping", &json!({ "type": "ping" }))));
            false
        }
        Piece::Progress(p) => {
            out.push(Out::Bytes(super::comment(&p)));
            false
        }
        Piece::Done(f) => {
            if blocks.index == 0 && !blocks.text_open {
                blocks.open_text(out);
            }
            blocks.close(out);
            out.push(Out::Bytes(sse(
                "message_delta",
                &json!({ "type": "message_delta",
                    "delta": { "stop_reason": stop_reason(f.finish_reason), "stop_sequence": null },
                    "usage": usage_json(&f.usage) }),
            )));
            out.push(Out::Bytes(sse(
                "message_stop",
                &json!({ "type": "message_stop" }),
            )));
            true
        }
        Piece::Error(f) => {
            let kind = error_type(Refusal::of(f.clone()).status);
            out.push(Out::Bytes(sse(
                "error",
                &json!({ "type": "error", "error": { "type": kind, "message": f.message } }),
            )));
            out.push(Out::Fail);
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::Finish;

    fn request(body: Value) -> Result<(GenerateRequest, bool), Unsupported> {
        serde_json::from_value::<MessagesRequest>(body)
            .expect("parses")
            .into_generate()
    }

    #[test]
    fn a_messages_request_becomes_the_runners_request() {
        let (r, stream) = request(json!({
            "model": "m", "max_tokens": 9, "stream": true,
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
                {"role": "user", "content": "Bye"},
            ],
            "temperature": 0, "top_k": 5, "stop_sequences": ["x"], "metadata": {"user_id": "u"},
        }))
        .expect("accepted");
        assert!(stream);
        let roles: Vec<&str> = r.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!((r.max_tokens, r.temperature, r.top_k), (9, 0.0, 5));
        assert_eq!(r.stop, vec!["x".to_string()]);
    }

    #[test]
    fn what_shoal_cannot_take_is_refused() {
        let base = || json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "a"}]});
        for (field, value) in [
            ("tool_choice", json!({"type": "any"})),
            (
                "tools",
                json!([{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]),
            ),
            ("thinking", json!({"type": "enabled", "budget_tokens": 100})),
            ("max_tokens", json!(0)),
            ("temperature", json!(1.5)),
        ] {
            let mut b = base();
            b[field] = value;
            assert_eq!(request(b).unwrap_err().field, field);
        }
        for bad in [
            json!({"model": "m", "messages": [{"role": "user", "content": "a"}]}),
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "a"}]}),
            json!({"model": "m", "max_tokens": 5, "messages": [], "top_n": 1}),
        ] {
            assert!(serde_json::from_value::<MessagesRequest>(bad).is_err());
        }
    }

    #[test]
    fn tool_use_and_tool_result_blocks_become_calls_and_tool_turns() {
        let (r, _) = request(json!({
            "model": "m", "max_tokens": 50,
            "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto"},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "Thanks"},
                ]},
            ],
        }))
        .expect("accepted");
        assert_eq!(
            r.tools,
            [
                json!({"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {"type": "object"}}})
            ]
        );
        let roles: Vec<&str> = r.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "tool", "user"]);
        assert_eq!(r.messages[1].content, "Checking.");
        assert_eq!(
            r.messages[1].tool_calls[0].function.arguments,
            json!({"city": "Paris"})
        );
        assert_eq!(r.messages[2].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(r.messages[2].content, "sunny");
    }

    #[test]
    fn a_streamed_call_is_a_tool_use_block_of_its_own() {
        let mut blocks = Blocks::default();
        let mut out = Vec::new();
        piece_events(Piece::Text("Let me see.".into()), &mut blocks, &mut out);
        let call = ToolCall::new(None, "f", json!({"x": 1}));
        piece_events(Piece::ToolCall(call), &mut blocks, &mut out);
        let f = Finish {
            finish_reason: FinishReason::ToolCalls,
            usage: Usage::default(),
            timings: Default::default(),
        };
        piece_events(Piece::Done(f), &mut blocks, &mut out);
        let events: Vec<Value> = out
            .iter()
            .filter_map(|o| match o {
                Out::Bytes(b) => {
                    let t = String::from_utf8_lossy(b);
                    serde_json::from_str(t.split("data: ").nth(1)?.trim()).ok()
                }
                Out::Fail => None,
            })
            .collect();
        let kinds: Vec<(String, Value)> = events
            .iter()
            .map(|e| (e["type"].as_str().unwrap().to_string(), e["index"].clone()))
            .collect();
        let kind = |k: &str, i: Value| (k.to_string(), i);
        assert_eq!(
            kinds,
            [
                kind("content_block_start", json!(0)),
                kind("content_block_delta", json!(0)),
                kind("content_block_stop", json!(0)),
                kind("content_block_start", json!(1)),
                kind("content_block_delta", json!(1)),
                kind("content_block_stop", json!(1)),
                kind("message_delta", Value::Null),
                kind("message_stop", Value::Null),
            ]
        );
        assert_eq!(events[3]["content_block"]["type"], "tool_use");
        assert_eq!(events[4]["delta"]["partial_json"], r#"{"x":1}"#);
        assert_eq!(events[6]["delta"]["stop_reason"], "tool_use");
    }

    #[test]
    fn the_stream_ends_with_message_stop_or_breaks_off() {
        let mut out = Vec::new();
        let f = Finish {
            finish_reason: FinishReason::Length,
            usage: Usage {
                prompt_tokens: 3,
                cached_tokens: 1,
                completion_tokens: 2,
            },
            timings: Default::default(),
        };
        let mut blocks = Blocks::default();
        assert!(piece_events(Piece::Done(f), &mut blocks, &mut out));
        let text: Vec<String> = out
            .iter()
            .map(|o| match o {
                Out::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
                Out::Fail => "FAIL".into(),
            })
            .collect();
        assert!(
            text[0].starts_with("event: content_block_start"),
            "an empty answer has a text block"
        );
        assert!(text[1].starts_with("event: content_block_stop"));
        assert!(
            text[2].contains(r#""stop_reason":"max_tokens""#)
                && text[2].contains(r#""output_tokens":2"#)
                && text[2].contains(r#""input_tokens":2"#)
        );
        assert!(text[3].starts_with("event: message_stop"));
        let mut out = Vec::new();
        assert!(piece_events(Piece::broken("gone"), &mut blocks, &mut out));
        assert!(matches!(out.last(), Some(Out::Fail)));
    }
}
