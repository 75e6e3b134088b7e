//! Chat templates: the model's own Jinja template (rendered with minijinja), or ChatML.
//!
//! Templates see what Hugging Face's `apply_chat_template` gives them: `messages` (with an
//! assistant turn's `tool_calls` and a tool turn's `tool_call_id`), `tools` (the
//! functions in OpenAI's shape) when there are any, and a `tojson` that writes JSON as
//! Python's `json.dumps` does, so a prompt is the text the model was trained on.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{Result, TokenizerError};

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// The functions an assistant turn called.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Which call a tool turn answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// A call of one function, as a template reads it (`tool_call.function.name`,
/// `tool_call.function.arguments`) and as a model's answer is parsed into.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default = "function")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// A JSON object (templates write it with `tojson`).
    pub arguments: Value,
}

fn function() -> String {
    "function".into()
}

impl ToolCall {
    pub fn new(id: Option<String>, name: impl Into<String>, arguments: Value) -> Self {
        Self {
            id,
            kind: function(),
            function: FunctionCall {
                name: name.into(),
                arguments,
            },
        }
    }
}

/// JSON as Python's `json.dumps` writes it by default: `", "` between items and `": "`
/// after keys (templates were written against it).
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        comma(writer, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        comma(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

fn comma<W: ?Sized + std::io::Write>(writer: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        writer.write_all(b", ")
    }
}

/// The `tojson` filter: Python's layout, or an indented one with `indent=N`.
fn tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let f = serde_json::ser::PrettyFormatter::with_indent(&pad);
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, f))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonFormatter,
        )),
    };
    written.map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::BadSerialization, e.to_string())
    })?;
    let text = String::from_utf8(out).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::BadSerialization, e.to_string())
    })?;
    Ok(minijinja::Value::from_safe_string(text))
}

/// ChatML, for models that ship no template.
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// A model's chat template with the BOS/EOS texts it may refer to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    source: Option<String>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: Option<String>, bos_token: String, eos_token: String) -> Self {
        Self {
            source,
            bos_token,
            eos_token,
        }
    }

    /// Whether the model brought its own template (otherwise ChatML is used).
    pub fn is_model_template(&self) -> bool {
        self.source.is_some()
    }

    /// Whether the template's source holds `text`.
    pub fn mentions(&self, text: &str) -> bool {
        self.source.as_deref().is_some_and(|s| s.contains(text))
    }

    /// Whether the template writes the tools it is given (otherwise a request with tools
    /// is refused: the model would never see them).
    pub fn takes_tools(&self) -> bool {
        self.source.as_deref().is_some_and(|s| s.contains("tools"))
    }

    /// Renders the conversation; with `add_generation_prompt` the text ends where the
    /// assistant's answer begins. `tools` are functions in OpenAI's shape
    /// (`{"type": "function", "function": {"name", "description", "parameters"}}`).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut env = minijinja::Environment::new();
        // Hugging Face renders templates with these jinja2 settings.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        let source = self.source.as_deref().unwrap_or(CHATML);
        let ctx = minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => if tools.is_empty() {
                minijinja::Value::UNDEFINED
            } else {
                minijinja::Value::from(minijinja::value::Serde(tools))
            },
        };
        env.render_str(source, ctx)
            .map_err(|e| TokenizerError::Template(format!("{e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_fallback_renders_a_generation_prompt() {
        let t = ChatTemplate::new(None, String::new(), String::new());
        let text = t
            .render(&[ChatMessage::new("user", "Hi")], &[], true)
            .expect("render");
        assert_eq!(
            text,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn model_template_with_python_methods_renders() {
        let src = "{% for m in messages %}{{ m.role.upper() }}:{{ m['content'].strip() }}|{% endfor %}{% if add_generation_prompt %}A:{% endif %}";
        let t = ChatTemplate::new(Some(src.into()), String::new(), String::new());
        let text = t
            .render(&[ChatMessage::new("user", "  hello ")], &[], true)
            .expect("render");
        assert_eq!(text, "USER:hello|A:");
    }

    #[test]
    fn tools_and_tool_calls_reach_the_template_in_pythons_json() {
        let src = "{% if tools %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}\
            {% for m in messages %}{% for c in m.tool_calls %}{% set c = c.function %}\
            {{ c.name }}={{ c.arguments | tojson }}\n{% endfor %}\
            {% if m.role == 'tool' %}[{{ m.tool_call_id }}]{{ m.content }}{% endif %}{% endfor %}";
        let t = ChatTemplate::new(Some(src.into()), String::new(), String::new());
        assert!(t.takes_tools());
        let tools = [
            serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {"b": [1, 2], "a": "<x>"}}}),
        ];
        let mut asked = ChatMessage::new("assistant", "");
        asked.tool_calls = vec![ToolCall::new(
            Some("c1".into()),
            "f",
            serde_json::json!({"city": "Paris"}),
        )];
        let mut answered = ChatMessage::new("tool", "sunny");
        answered.tool_call_id = Some("c1".into());
        let text = t.render(&[asked, answered], &tools, false).expect("render");
        assert_eq!(
            text,
            "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"b\": [1, 2], \"a\": \"<x>\"}}}\n\
             f={\"city\": \"Paris\"}\n[c1]sunny"
        );
        let plain = t
            .render(&[ChatMessage::new("user", "hi")], &[], false)
            .expect("render");
        assert_eq!(plain, "", "no tools: the template's `if tools` is false");
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let src = "{{ raise_exception('no system role') }}";
        let t = ChatTemplate::new(Some(src.into()), String::new(), String::new());
        let err = t.render(&[], &[], true).expect_err("must fail");
        assert!(err.to_string().contains("no system role"), "{err}");
    }
}
