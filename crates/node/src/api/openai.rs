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
use serde_json::{Value, json};
use shoal_runner::control::{FinishReason, GenerateRequest, ToolCall, Usage};
use tokio::sync::mpsc;

use super::tools::arguments_text;
use super::{
    Answer, Api, Out, RawBody, Refusal, ask, collect, event_stream, read_json, response_id, submit,
};
use crate::daemon::ApiCall;
use crate::supervisor::Piece;

mod request;

use request::{ChatRequest, CompletionRequest};

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

/// An error body in OpenAI's shape.
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
