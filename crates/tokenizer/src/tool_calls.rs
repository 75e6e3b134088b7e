//! A model's tool calls, read out of its answer as it streams.
//!
//! Qwen2.5, Qwen3 and the Hermes models write a call as
//! `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` (their templates say so to
//! the model). [`ToolCallStream`] takes the answer's text piece by piece and gives back
//! text to show, each call once its closing tag arrived, and — for a call whose JSON does
//! not parse — the raw text, marked malformed, so the client gets what the model wrote
//! and is told why it is not a call. Text that may be the start of a tag is held back
//! until it is known not to be.
//!
//! Small models often leave the tags out and answer with the bare object
//! (`{"name": "get_weather", "arguments": {…}}`, Qwen2.5-coder-0.5B does so greedily).
//! An answer that opens with an object is held until the object closes: if it names an
//! offered function it is a call, and anything else is text as written.

use serde_json::{Map, Value};

use crate::chat::{ChatTemplate, ToolCall};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// How a model writes its tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallSyntax {
    /// `<tool_call>{json}</tool_call>`.
    Hermes,
}

impl ToolCallSyntax {
    /// The syntax the model's template teaches it, if the template takes tools at all.
    pub fn of(template: &ChatTemplate) -> Option<Self> {
        (template.takes_tools() && template.mentions(OPEN)).then_some(Self::Hermes)
    }

    /// The tags the reader needs to see (vocabularies may make them special tokens,
    /// which text normally leaves out).
    pub fn tags(self) -> [&'static str; 2] {
        match self {
            Self::Hermes => [OPEN, CLOSE],
        }
    }
}

/// What a piece of the answer holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    Text(String),
    Call(ToolCall),
    /// A call the model wrote but that does not parse, as it wrote it.
    Malformed(String),
}

/// Reads calls out of an answer's text as it arrives.
#[derive(Debug, Default)]
pub struct ToolCallStream {
    /// Text not yet given back: part of an open call, or what may begin a tag.
    held: String,
    inside: bool,
    /// Whitespace-only text, given back only when more text follows (the newlines
    /// between and after calls are not an answer).
    blank: String,
    calls: usize,
    /// The functions offered: a bare object is a call only when it names one.
    names: Vec<String>,
    /// Nothing but whitespace and bare calls so far: an object may still be a call.
    bare: bool,
}

impl ToolCallStream {
    /// A reader for an answer that may call the functions `names`.
    pub fn new(names: Vec<String>) -> Self {
        Self {
            names,
            bare: true,
            ..Self::default()
        }
    }

    /// The events `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.bare && !self.inside {
                let start = self.held.len() - self.held.trim_start().len();
                let rest = &self.held[start..];
                if rest.is_empty() {
                    break;
                }
                if rest.starts_with('{') {
                    let Some(end) = object_end(rest) else {
                        break;
                    };
                    let object = &rest[..end];
                    match parse_call(object).filter(|c| self.names.contains(&c.function.name)) {
                        Some(call) => {
                            self.held.drain(..start + end);
                            self.blank.clear();
                            self.calls += 1;
                            out.push(ToolEvent::Call(call));
                            continue;
                        }
                        None => self.bare = false,
                    }
                } else {
                    self.bare = false;
                }
            }
            if self.inside {
                let Some(at) = self.held.find(CLOSE) else {
                    break;
                };
                let body: String = self.held.drain(..at).collect();
                self.held.drain(..CLOSE.len());
                self.inside = false;
                self.blank.clear();
                match parse_call(&body) {
                    Some(call) => {
                        self.calls += 1;
                        out.push(ToolEvent::Call(call));
                    }
                    None => out.push(ToolEvent::Malformed(format!("{OPEN}{body}{CLOSE}"))),
                }
            } else if let Some(at) = self.held.find(OPEN) {
                let before: String = self.held.drain(..at).collect();
                self.held.drain(..OPEN.len());
                self.text(before, &mut out);
                self.inside = true;
            } else {
                let keep = partial_tag_len(&self.held);
                let ready: String = self.held.drain(..self.held.len() - keep).collect();
                self.text(ready, &mut out);
                break;
            }
        }
        out
    }

    /// The rest at the answer's end: held text, and an unclosed call as malformed.
    pub fn finish(mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        if self.inside {
            out.push(ToolEvent::Malformed(format!("{OPEN}{held}")));
        } else {
            self.text(held, &mut out);
            if self.calls == 0 && !self.blank.is_empty() {
                out.push(ToolEvent::Text(std::mem::take(&mut self.blank)));
            }
        }
        out
    }

    fn text(&mut self, text: String, out: &mut Vec<ToolEvent>) {
        if text.is_empty() {
            return;
        }
        self.bare = false;
        if text.trim().is_empty() {
            self.blank.push_str(&text);
            return;
        }
        let mut all = std::mem::take(&mut self.blank);
        all.push_str(&text);
        out.push(ToolEvent::Text(all));
    }
}

/// Where the JSON object `text` opens with ends (just past its closing brace), once it
/// has; strings and their escapes are skipped.
fn object_end(text: &str) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (i, c) in text.char_indices() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => depth += 1,
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// How many bytes at the end of `text` could begin `<tool_call>`.
fn partial_tag_len(text: &str) -> usize {
    (1..OPEN.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && OPEN.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// `{"name": "f", "arguments": {…}}` (arguments may also come as a JSON string, or be
/// called `parameters`; none means no arguments).
fn parse_call(body: &str) -> Option<ToolCall> {
    let Value::Object(mut call) = serde_json::from_str::<Value>(body.trim()).ok()? else {
        return None;
    };
    let Some(Value::String(name)) = call.remove("name") else {
        return None;
    };
    let arguments = match call
        .remove("arguments")
        .or_else(|| call.remove("parameters"))
    {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(&s).ok()? {
            v @ Value::Object(_) => v,
            _ => return None,
        },
        Some(v @ Value::Object(_)) => v,
        Some(_) => return None,
    };
    Some(ToolCall::new(None, name, arguments))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Feeds `pieces` one by one, as a stream would.
    fn events(pieces: &[&str]) -> Vec<ToolEvent> {
        let mut s = ToolCallStream::new(names());
        let mut out: Vec<ToolEvent> = pieces.iter().flat_map(|p| s.push(p)).collect();
        out.extend(s.finish());
        out
    }

    fn names() -> Vec<String> {
        ["get_weather", "a", "b", "f"].map(String::from).to_vec()
    }

    fn text(t: &str) -> ToolEvent {
        ToolEvent::Text(t.into())
    }

    fn call(name: &str, args: Value) -> ToolEvent {
        ToolEvent::Call(ToolCall::new(None, name, args))
    }

    #[test]
    fn plain_text_passes_through_as_it_comes() {
        let mut s = ToolCallStream::new(names());
        assert_eq!(s.push("Hello"), [text("Hello")]);
        assert_eq!(s.push(", world <b>"), [text(", world <b>")]);
        assert_eq!(s.push("\n"), [], "whitespace waits for what follows");
        assert_eq!(s.finish(), [text("\n")], "and is kept when no call came");
    }

    #[test]
    fn a_call_split_across_pieces_is_one_call() {
        let got = events(&[
            "<tool",
            "_call>\n{\"name\": \"get_weather\", ",
            "\"arguments\": {\"city\": \"Paris\"}}\n</tool_",
            "call>",
        ]);
        assert_eq!(got, [call("get_weather", json!({"city": "Paris"}))]);
    }

    #[test]
    fn text_before_and_two_calls_in_a_row() {
        let got = events(&[
            "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n",
            "<tool_call>\n{\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 1}\"}\n</tool_call>\n",
        ]);
        assert_eq!(
            got,
            [
                text("Let me check.\n"),
                call("a", json!({})),
                call("b", json!({"x": 1}))
            ]
        );
    }

    #[test]
    fn what_only_looks_like_a_tag_is_given_back() {
        let mut s = ToolCallStream::new(names());
        assert_eq!(s.push("a <tool"), [text("a ")]);
        assert_eq!(s.push("box> b"), [text("<toolbox> b")]);
        assert_eq!(s.push("<"), []);
        assert_eq!(s.finish(), [text("<")]);
    }

    #[test]
    fn malformed_calls_come_back_as_written() {
        assert_eq!(
            events(&["<tool_call>\n{\"name\": \"f\", \"arguments\": {oops}\n</tool_call>"]),
            [ToolEvent::Malformed(
                "<tool_call>\n{\"name\": \"f\", \"arguments\": {oops}\n</tool_call>".into()
            )]
        );
        assert_eq!(
            events(&["<tool_call>\n[1, 2]\n</tool_call>"]),
            [ToolEvent::Malformed(
                "<tool_call>\n[1, 2]\n</tool_call>".into()
            )],
            "a call is an object with a name"
        );
        assert_eq!(
            events(&["ok <tool_call>\n{\"name\": \"f\", \"argu"]),
            [
                text("ok "),
                ToolEvent::Malformed("<tool_call>\n{\"name\": \"f\", \"argu".into())
            ],
            "an answer cut inside a call"
        );
    }

    #[test]
    fn a_bare_object_naming_an_offered_function_is_a_call() {
        let mut s = ToolCallStream::new(names());
        assert_eq!(s.push("{\""), [], "an opening object is held");
        assert_eq!(
            s.push("name\": \"get_weather\", \"arguments\": {\"city\": \"}\"}"),
            []
        );
        assert_eq!(
            s.push("}\n"),
            [call("get_weather", json!({"city": "}"}))],
            "a brace inside a string does not close it"
        );
        assert_eq!(
            s.push("{\"name\": \"a\", \"arguments\": {}}"),
            [call("a", json!({}))]
        );
        assert_eq!(s.finish(), []);
    }

    #[test]
    fn other_objects_and_objects_after_text_are_text() {
        assert_eq!(
            events(&["{\"name\": \"unknown\", ", "\"arguments\": {}} and more"]),
            [text("{\"name\": \"unknown\", \"arguments\": {}} and more")]
        );
        assert_eq!(
            events(&["Here: ", "{\"name\": \"a\", \"arguments\": {}}"]),
            [text("Here: "), text("{\"name\": \"a\", \"arguments\": {}}")]
        );
        assert_eq!(events(&["{\"unclosed\": "]), [text("{\"unclosed\": ")]);
    }

    #[test]
    fn multibyte_text_before_a_partial_tag_is_not_split() {
        assert_eq!(
            events(&["é<tool_c", "all>{\"name\": \"f\"}</tool_call>"]),
            [text("é"), call("f", json!({}))]
        );
    }
}
