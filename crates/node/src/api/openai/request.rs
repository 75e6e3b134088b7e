//! Reading OpenAI's requests: typed shapes that refuse unknown fields and wrong types,
//! turned into the runner's [`GenerateRequest`] by pure functions; what shoal cannot
//! honour is an [`Unsupported`] naming the parameter.

use serde::Deserialize;
use serde_json::Value;
use shoal_runner::control::{ChatMessage, GenerateRequest, ToolCall};

use crate::api::tools::{self, FunctionTool};

/// The default answer length when a request names none (OpenAI's is the model's room).
const DEFAULT_MAX_TOKENS: usize = 1024;

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[schema(as = OpenAiChatRequest)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatRequest {
    pub(super) model: String,
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
    pub(super) model: String,
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
    kind: tools::FunctionKind,
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
        let tools = tools::for_runner(tools).map_err(|m| unsupported("tools", m))?;
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
                let arguments = tools::arguments_value(&c.function.arguments);
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
}
