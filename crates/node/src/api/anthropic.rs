//! The Anthropic protocol on the serving core: `POST /v1/messages`, one JSON message or a
//! stream of server-sent events (`message_start`, `content_block_start`, `ping`,
//! `content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`).
//!
//! Requests are typed and strict (unknown fields and wrong types are 400s, as Anthropic's
//! own API answers); what shoal cannot honour yet (tools, images, extended thinking) is
//! refused by name. Errors have Anthropic's shape: `{"type": "error", "error": {"type",
//! "message"}}`. A failure after the stream began is an `error` event, then the body is
//! broken off without `message_stop`.

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use shoal_runner::control::{ChatMessage, FinishReason, GenerateRequest, Usage};

use super::{Api, Out, Refusal, collect, event_stream, response_id, submit};
use crate::supervisor::{Finish, Piece};

/// `POST /v1/messages`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MessagesRequest {
    model: String,
    max_tokens: usize,
    messages: Vec<Message>,
    #[serde(default)]
    system: Option<Content>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<usize>,
    #[serde(default)]
    stop_sequences: Vec<String>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    thinking: Option<Value>,
    /// Accepted and not used: the caller's tags.
    #[serde(default)]
    #[allow(dead_code)]
    metadata: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Message {
    role: Role,
    content: Content,
}

#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum Role {
    User,
    Assistant,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
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
    ToolUse {},
    ToolResult {},
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

fn text_of(c: Content, field: &'static str) -> Result<String, Unsupported> {
    match c {
        Content::Text(t) => Ok(t),
        Content::Blocks(blocks) => {
            let mut out = String::new();
            for b in blocks {
                match b {
                    Block::Text { text, .. } => out.push_str(&text),
                    Block::ToolUse {} | Block::ToolResult {} => {
                        return Err(unsupported(field, "tool use is not supported yet"));
                    }
                    Block::Image {} | Block::Document {} => {
                        return Err(unsupported(field, "only text content is supported"));
                    }
                }
            }
            Ok(out)
        }
    }
}

impl MessagesRequest {
    /// The runner's request, and whether to stream.
    pub(crate) fn into_generate(self) -> Result<(GenerateRequest, bool), Unsupported> {
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) || self.tool_choice.is_some() {
            return Err(unsupported("tools", "tool use is not supported yet"));
        }
        if self.thinking.is_some() {
            return Err(unsupported(
                "thinking",
                "extended thinking is not supported",
            ));
        }
        if self.max_tokens == 0 {
            return Err(unsupported("max_tokens", "max_tokens must be at least 1"));
        }
        if self.messages.is_empty() {
            return Err(unsupported("messages", "messages must not be empty"));
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
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = self.system {
            messages.push(ChatMessage::new("system", text_of(system, "system")?));
        }
        for m in self.messages {
            let role = match m.role {
                Role::User => "user",
                Role::Assistant => "assistant",
            };
            messages.push(ChatMessage::new(role, text_of(m.content, "messages")?));
        }
        let mut r = GenerateRequest::new("");
        r.messages = messages;
        r.model = Some(self.model);
        r.max_tokens = self.max_tokens;
        r.temperature = t;
        r.top_p = p;
        r.top_k = self.top_k.unwrap_or(0);
        r.stop = self.stop_sequences;
        Ok((r, self.stream))
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
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
    })
}

pub(crate) async fn messages(State(api): State<Api>, body: Bytes) -> Response {
    let request: MessagesRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            let what = if e.is_syntax() || e.is_eof() {
                "the body is not valid JSON"
            } else {
                "the request does not fit the API"
            };
            return anthropic_error(StatusCode::BAD_REQUEST, &format!("{what}: {e}"));
        }
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
        let mut out = vec![
            Out::Bytes(sse("message_start", &start)),
            Out::Bytes(sse(
                "content_block_start",
                &json!({ "type": "content_block_start", "index": 0,
                    "content_block": { "type": "text", "text": "" } }),
            )),
            Out::Bytes(sse("ping", &json!({ "type": "ping" }))),
        ];
        let over = piece_events(first, &mut out);
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(event_stream(out, over, rx, piece_events)))
            .unwrap_or_else(|_| anthropic_error(StatusCode::INTERNAL_SERVER_ERROR, "response"));
    }
    match collect(first, rx).await {
        Ok((text, f)) => Json(whole(&id, &model, &text, &f)).into_response(),
        Err(r) => anthropic_error(r.status, &r.message),
    }
}

fn whole(id: &str, model: &str, text: &str, f: &Finish) -> Value {
    json!({
        "id": id, "type": "message", "role": "assistant", "model": model,
        "content": [{ "type": "text", "text": text }],
        "stop_reason": stop_reason(f.finish_reason), "stop_sequence": null,
        "usage": usage_json(&f.usage),
    })
}

fn sse(event: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

/// The events one piece makes; true when the answer is over.
fn piece_events(piece: Piece, out: &mut Vec<Out>) -> bool {
    match piece {
        Piece::Text(t) => {
            out.push(Out::Bytes(sse(
                "content_block_delta",
                &json!({ "type": "content_block_delta", "index": 0,
                    "delta": { "type": "text_delta", "text": t } }),
            )));
            false
        }
        Piece::Keepalive => {
            out.push(Out::Bytes(sse("ping", &json!({ "type": "ping" }))));
            false
        }
        Piece::Done(f) => {
            out.push(Out::Bytes(sse(
                "content_block_stop",
                &json!({ "type": "content_block_stop", "index": 0 }),
            )));
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
            (
                "tools",
                json!([{"name": "f", "input_schema": {"type": "object"}}]),
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
        assert!(piece_events(Piece::Done(f), &mut out));
        let text: Vec<String> = out
            .iter()
            .map(|o| match o {
                Out::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
                Out::Fail => "FAIL".into(),
            })
            .collect();
        assert!(text[0].starts_with("event: content_block_stop"));
        assert!(
            text[1].contains(r#""stop_reason":"max_tokens""#)
                && text[1].contains(r#""output_tokens":2"#)
        );
        assert!(text[2].starts_with("event: message_stop"));
        let mut out = Vec::new();
        assert!(piece_events(Piece::broken("gone"), &mut out));
        assert!(matches!(out.last(), Some(Out::Fail)));
    }
}
