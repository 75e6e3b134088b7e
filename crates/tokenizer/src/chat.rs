//! Chat templates: the model's own Jinja template (rendered with minijinja), or ChatML.

use serde::Serialize;

use crate::{Result, TokenizerError};

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
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

    /// Renders the conversation; with `add_generation_prompt` the text ends where the
    /// assistant's answer begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let mut env = minijinja::Environment::new();
        // Hugging Face renders templates with these jinja2 settings.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
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
            tools => minijinja::Value::UNDEFINED,
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
            .render(&[ChatMessage::new("user", "Hi")], true)
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
            .render(&[ChatMessage::new("user", "  hello ")], true)
            .expect("render");
        assert_eq!(text, "USER:hello|A:");
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let src = "{{ raise_exception('no system role') }}";
        let t = ChatTemplate::new(Some(src.into()), String::new(), String::new());
        let err = t.render(&[], true).expect_err("must fail");
        assert!(err.to_string().contains("no system role"), "{err}");
    }
}
