//! The four APIs a load client speaks, each as a request body and a reader of its
//! stream: every line becomes a [`Seen`] (text, the answer's end, an error, or nothing).
//! Pure, so each protocol's end and error shapes are tested here.

use serde_json::{Value, json};

/// An API a node answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    OpenAi,
    Anthropic,
    Ollama,
    /// shoal's own `/v1/run`.
    Run,
}

impl Api {
    pub const ALL: [Api; 4] = [Api::OpenAi, Api::Anthropic, Api::Ollama, Api::Run];

    pub fn parse(s: &str) -> Result<Vec<Api>, String> {
        Ok(match s {
            "all" => Self::ALL.to_vec(),
            "openai" => vec![Api::OpenAi],
            "anthropic" => vec![Api::Anthropic],
            "ollama" => vec![Api::Ollama],
            "run" => vec![Api::Run],
            other => {
                return Err(format!(
                    "unknown API {other:?} (openai, anthropic, ollama, run or all)"
                ));
            }
        })
    }

    pub fn path(self) -> &'static str {
        match self {
            Api::OpenAi => "/v1/chat/completions",
            Api::Anthropic => "/v1/messages",
            Api::Ollama => "/api/chat",
            Api::Run => "/v1/run",
        }
    }

    /// A streamed chat request for `messages` (role/content pairs).
    pub fn body(self, model: &str, messages: &[(&str, String)], max_tokens: usize) -> Value {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|(role, content)| json!({ "role": role, "content": content }))
            .collect();
        match self {
            Api::OpenAi => json!({
                "model": model, "messages": msgs, "max_tokens": max_tokens, "stream": true,
                "temperature": 0.7, "seed": 1,
            }),
            Api::Anthropic => {
                // Anthropic's system prompt is a field of its own.
                let system: Vec<&String> = messages
                    .iter()
                    .filter(|(r, _)| *r == "system")
                    .map(|(_, c)| c)
                    .collect();
                let rest: Vec<&Value> = msgs.iter().filter(|m| m["role"] != "system").collect();
                let mut b = json!({
                    "model": model, "messages": rest, "max_tokens": max_tokens, "stream": true,
                    "temperature": 0.7,
                });
                if let Some(s) = system.first() {
                    b["system"] = json!(s);
                }
                b
            }
            Api::Ollama => json!({
                "model": model, "messages": msgs, "stream": true,
                "options": { "num_predict": max_tokens, "temperature": 0.7 },
            }),
            Api::Run => json!({
                "model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0.7,
            }),
        }
    }

    /// Whether the stream is server-sent events (else JSON lines).
    pub fn is_sse(self) -> bool {
        matches!(self, Api::OpenAi | Api::Anthropic)
    }
}

/// What one line of an answer's stream says.
#[derive(Debug, PartialEq)]
pub enum Seen {
    Text,
    End,
    Error(String),
    Nothing,
}

/// Reads one stream line by line; SSE lines carry `event:` before their `data:`.
#[derive(Default)]
pub struct Reader {
    event: Option<String>,
}

impl Reader {
    pub fn line(&mut self, api: Api, line: &str) -> Seen {
        let line = line.trim_end_matches('\r');
        if api.is_sse() {
            if let Some(e) = line.strip_prefix("event:") {
                self.event = Some(e.trim().to_string());
                return Seen::Nothing;
            }
            let Some(data) = line.strip_prefix("data:") else {
                return Seen::Nothing; // comments (keepalives, progress) and blank lines
            };
            let event = self.event.take();
            sse(api, event.as_deref(), data.trim())
        } else if line.trim().is_empty() {
            Seen::Nothing // keepalive
        } else {
            lines(api, line)
        }
    }
}

fn error_text(v: &Value) -> String {
    match &v["error"] {
        Value::String(s) => s.clone(),
        e => e["message"].as_str().map_or(e.to_string(), str::to_string),
    }
}

fn sse(api: Api, event: Option<&str>, data: &str) -> Seen {
    if api == Api::OpenAi && data == "[DONE]" {
        return Seen::End;
    }
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return Seen::Error(format!("not JSON in the stream: {data}"));
    };
    if v.get("error").is_some() {
        return Seen::Error(error_text(&v));
    }
    match api {
        Api::OpenAi => {
            let text = &v["choices"][0]["delta"]["content"];
            if text.as_str().is_some_and(|t| !t.is_empty()) {
                Seen::Text
            } else {
                Seen::Nothing
            }
        }
        _ => match event.or(v["type"].as_str()) {
            Some("content_block_delta") => Seen::Text,
            Some("message_stop") => Seen::End,
            _ => Seen::Nothing,
        },
    }
}

fn lines(api: Api, line: &str) -> Seen {
    let Ok(v) = serde_json::from_str::<Value>(line) else {
        return Seen::Error(format!("not JSON in the stream: {line}"));
    };
    if v.get("error").is_some() {
        return Seen::Error(error_text(&v));
    }
    let text = match api {
        Api::Ollama => &v["message"]["content"],
        _ => &v["text"],
    };
    if v["done"] == true {
        Seen::End
    } else if text.as_str().is_some_and(|t| !t.is_empty()) {
        Seen::Text
    } else {
        Seen::Nothing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(api: Api, text: &str) -> Vec<Seen> {
        let mut r = Reader::default();
        text.lines()
            .map(|l| r.line(api, l))
            .filter(|s| *s != Seen::Nothing)
            .collect()
    }

    #[test]
    fn openai_streams_end_with_done_and_fail_with_an_error_event() {
        let ok = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n: keepalive\n\
                  data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: [DONE]\n";
        assert_eq!(read(Api::OpenAi, ok), [Seen::Text, Seen::End]);
        let failed = "data: {\"error\":{\"message\":\"rank 1 died\",\"type\":\"x\"}}\n";
        assert_eq!(
            read(Api::OpenAi, failed),
            [Seen::Error("rank 1 died".into())]
        );
    }

    #[test]
    fn anthropic_streams_are_read_by_their_event_names() {
        let ok = "event: message_start\ndata: {\"type\":\"message_start\"}\n\n\
                  event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"a\"}}\n\n\
                  event: message_stop\ndata: {\"type\":\"message_stop\"}\n";
        assert_eq!(read(Api::Anthropic, ok), [Seen::Text, Seen::End]);
        let failed = "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"gone\"}}\n";
        assert_eq!(read(Api::Anthropic, failed), [Seen::Error("gone".into())]);
    }

    #[test]
    fn json_line_streams_end_with_done_and_skip_keepalives() {
        let ollama = "{\"message\":{\"content\":\"a\"},\"done\":false}\n\n{\"message\":{\"content\":\"\"},\"done\":true}\n";
        assert_eq!(read(Api::Ollama, ollama), [Seen::Text, Seen::End]);
        let run = "{\"text\":\"a\"}\n\n{\"progress\":{}}\n{\"done\":true}\n";
        assert_eq!(read(Api::Run, run), [Seen::Text, Seen::End]);
        assert_eq!(
            read(Api::Run, "{\"error\":\"busy\"}\n"),
            [Seen::Error("busy".into())]
        );
        assert!(matches!(read(Api::Run, "garbage")[..], [Seen::Error(_)]));
    }

    #[test]
    fn anthropic_takes_the_system_prompt_apart() {
        let b = Api::Anthropic.body(
            "m",
            &[("system", "Be brief.".into()), ("user", "Hi".into())],
            9,
        );
        assert_eq!(b["system"], "Be brief.");
        assert_eq!(b["messages"].as_array().map(Vec::len), Some(1));
        assert_eq!(Api::Ollama.body("m", &[], 5)["options"]["num_predict"], 5);
    }
}
