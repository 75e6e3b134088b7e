//! `GET /openapi.json`: the API's description, generated from the handlers' request types
//! (utoipa), with the `model` fields narrowed to the models this cluster knows now, so a
//! client (or a schema-driven fuzzer) sees which names are served.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use utoipa::OpenApi;

use super::{Api, ask};
use crate::daemon::ApiCall;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "shoal",
        description = "One cluster of your own machines serving large language models: \
            the OpenAI, Anthropic and Ollama APIs on every node, and shoal's own."
    ),
    paths(
        super::openai::chat_completions,
        super::openai::completions,
        super::openai::models,
        super::anthropic::messages,
        super::anthropic::count_tokens,
        super::ollama::chat,
        super::ollama::generate,
        super::ollama::tags,
        super::ollama::show,
        super::ollama::ps,
        super::ollama::pull,
        super::ollama::version,
        super::health,
        super::dashboard::catalog,
        super::status,
        super::state,
        super::state_events,
        super::place,
        super::instances,
        super::delete_instance,
        super::run,
        super::metrics::metrics,
    )
)]
struct Document;

/// The request schemas whose `model` names a model.
const WITH_MODEL: [&str; 7] = [
    "Conversation",
    "ShowRequest",
    "OpenAiChatRequest",
    "CompletionRequest",
    "MessagesRequest",
    "OllamaChatRequest",
    "GenerateBody",
];

pub(crate) async fn document(State(api): State<Api>) -> Response {
    let mut doc = match serde_json::to_value(Document::openapi()) {
        Ok(d) => d,
        Err(e) => {
            return super::error(axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
        }
    };
    if let Ok(status) = ask(&api.calls, ApiCall::Status).await {
        narrow_models(&mut doc, &super::models_of(&status));
    }
    Json(doc).into_response()
}

fn narrow_models(doc: &mut Value, models: &[String]) {
    if models.is_empty() {
        return;
    }
    for name in WITH_MODEL {
        let model = &mut doc["components"]["schemas"][name]["properties"]["model"];
        if model.is_object() {
            model["enum"] = Value::from(models.to_vec());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_describes_every_route_and_its_request_types() {
        let mut doc = serde_json::to_value(Document::openapi()).expect("json");
        for path in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/messages",
            "/api/chat",
            "/api/generate",
            "/v1/models",
            "/health",
        ] {
            assert!(doc["paths"][path].is_object(), "{path}");
        }
        let chat = &doc["components"]["schemas"]["OpenAiChatRequest"];
        assert_eq!(chat["additionalProperties"], false, "{chat}");
        let required: Vec<&str> = chat["required"]
            .as_array()
            .expect("required")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(required, ["model", "messages"]);
        narrow_models(&mut doc, &["m".to_string()]);
        for name in WITH_MODEL {
            assert_eq!(
                doc["components"]["schemas"][name]["properties"]["model"]["enum"],
                serde_json::json!(["m"]),
                "{name}"
            );
        }
    }
}
