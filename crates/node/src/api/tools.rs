//! What the three protocols share about tools: the function definitions a request
//! offers (OpenAI's shape, which Ollama uses too and Anthropic's is mapped into) and the
//! calls a model makes, written back in each protocol's form.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use shoal_runner::control::ToolCall;

/// A function the model may call: `{"type": "function", "function": {…}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct FunctionTool {
    #[serde(rename = "type")]
    pub kind: FunctionKind,
    pub function: FunctionDef,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub(crate) enum FunctionKind {
    Function,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct FunctionDef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON schema of the arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    /// OpenAI's strict schema adherence: shoal does not constrain decoding, so only
    /// `false` (or none) is taken.
    #[serde(default, skip_serializing)]
    pub strict: Option<bool>,
}

impl FunctionTool {
    pub fn new(name: String, description: Option<String>, parameters: Option<Value>) -> Self {
        Self {
            kind: FunctionKind::Function,
            function: FunctionDef {
                name,
                description,
                parameters,
                strict: None,
            },
        }
    }
}

/// The tools as the runner's request carries them, or why they cannot be taken.
pub(crate) fn for_runner(tools: Vec<FunctionTool>) -> Result<Vec<Value>, String> {
    let mut names = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(tools.len());
    for t in tools {
        if t.function.name.is_empty() {
            return Err("a tool needs a name".into());
        }
        if !names.insert(t.function.name.clone()) {
            return Err(format!("two tools are named {:?}", t.function.name));
        }
        if t.function.strict == Some(true) {
            return Err(
                "strict tool schemas are not supported (decoding is not constrained)".into(),
            );
        }
        out.push(serde_json::to_value(&t).map_err(|e| e.to_string())?);
    }
    Ok(out)
}

/// A call's arguments as the JSON text OpenAI's protocol carries.
pub(crate) fn arguments_text(call: &ToolCall) -> String {
    call.function.arguments.to_string()
}

/// Arguments a client sent back as JSON text (OpenAI's form), as the object templates
/// write; text that is not JSON stays text.
pub(crate) fn arguments_value(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tools_are_checked_and_passed_in_openais_shape() {
        let t: FunctionTool = serde_json::from_value(json!({
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": false},
        }))
        .unwrap();
        assert_eq!(
            for_runner(vec![t.clone()]).unwrap(),
            [
                json!({"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}})
            ]
        );
        assert!(
            for_runner(vec![t.clone(), t.clone()]).is_err(),
            "one name twice"
        );
        let mut strict = t;
        strict.function.strict = Some(true);
        assert!(for_runner(vec![strict]).is_err());
        assert!(
            serde_json::from_value::<FunctionTool>(
                json!({"type": "retrieval", "function": {"name": "f"}})
            )
            .is_err()
        );
    }

    #[test]
    fn arguments_go_both_ways() {
        let call = ToolCall::new(None, "f", json!({"a": 1, "b": "x"}));
        assert_eq!(arguments_text(&call), r#"{"a":1,"b":"x"}"#);
        assert_eq!(arguments_value(r#"{"a": 1}"#), json!({"a": 1}));
        assert_eq!(arguments_value("not json"), json!("not json"));
    }
}
