//! The dashboard: one page (`GET /`) and its scripts and style (`GET /ui/…`), compiled
//! into the binary from `crates/node/ui/` (plain JavaScript modules, no build step), and
//! `GET /v1/catalog`, the models this build knows, for its model pickers.
//!
//! The page and its files need no API key: the page asks for the key once and sends it
//! with every call it makes, like any other client.

use axum::Json;
use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// The page's files: name, content type, text.
const FILES: &[(&str, &str, &str)] = &[
    (
        "index.html",
        "text/html; charset=utf-8",
        include_str!("../../ui/index.html"),
    ),
    (
        "style.css",
        "text/css; charset=utf-8",
        include_str!("../../ui/style.css"),
    ),
    ("app.js", JS, include_str!("../../ui/app.js")),
    ("api.js", JS, include_str!("../../ui/api.js")),
    ("topology.js", JS, include_str!("../../ui/topology.js")),
    ("models.js", JS, include_str!("../../ui/models.js")),
    ("instances.js", JS, include_str!("../../ui/instances.js")),
    ("place.js", JS, include_str!("../../ui/place.js")),
    ("chat.js", JS, include_str!("../../ui/chat.js")),
    ("markdown.js", JS, include_str!("../../ui/markdown.js")),
    ("chart.js", JS, include_str!("../../ui/chart.js")),
    ("util.js", JS, include_str!("../../ui/util.js")),
    (
        "icon.svg",
        "image/svg+xml",
        include_str!("../../ui/icon.svg"),
    ),
];
const JS: &str = "text/javascript; charset=utf-8";

/// Paths anyone may read, key or not.
pub(crate) fn is_open(path: &str) -> bool {
    path == "/" || path == "/favicon.ico" || path.starts_with("/ui/")
}

fn file(name: &str) -> Response {
    match FILES.iter().find(|(n, _, _)| *n == name) {
        Some((_, kind, text)) => (
            [
                (header::CONTENT_TYPE, *kind),
                // The files change with the binary; a reload after an upgrade sees them.
                (header::CACHE_CONTROL, "no-cache"),
            ],
            *text,
        )
            .into_response(),
        None => super::error(StatusCode::NOT_FOUND, format!("no file {name}")),
    }
}

pub(crate) async fn page() -> Response {
    file("index.html")
}

/// Browsers ask for `/favicon.ico` whatever the page says.
pub(crate) async fn favicon() -> Response {
    file("icon.svg")
}

pub(crate) async fn asset(Path(name): Path<String>) -> Response {
    file(&name)
}

/// A model this build can install, as the dashboard shows it.
#[derive(Serialize, utoipa::ToSchema)]
pub(crate) struct Known {
    name: String,
    description: String,
    parameters: String,
    /// The file's size in bytes.
    size: u64,
    context_length: u32,
    /// Whether its chat template takes tools.
    tools: bool,
}

#[utoipa::path(get, path = "/v1/catalog", tag = "shoal",
    responses((status = 200, description = "The models this build knows (its model cards): name, description, parameters, file size, context length, tool calling", body = [Known])))]
pub(crate) async fn catalog() -> Json<Vec<Known>> {
    Json(
        shoal_store::builtin_cards()
            .into_iter()
            .map(|c| Known {
                name: c.name,
                description: c.description,
                parameters: c.parameters,
                size: c.size,
                context_length: c.context_length,
                tools: c.tools,
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_module_the_page_imports_is_served() {
        let served: Vec<&str> = FILES.iter().map(|(n, _, _)| *n).collect();
        for (name, _, text) in FILES {
            for line in text
                .lines()
                .filter(|l| l.trim_start().starts_with("import "))
            {
                let Some(from) = line.split(['"', '\'']).nth(1) else {
                    continue;
                };
                let target = from.trim_start_matches("./").trim_start_matches("/ui/");
                assert!(
                    served.contains(&target),
                    "{name} imports {from}, not served"
                );
            }
        }
        let page = FILES[0].2;
        assert!(page.contains("/ui/app.js") && page.contains("/ui/style.css"));
    }

    #[test]
    fn only_the_page_and_its_files_are_open() {
        assert!(is_open("/") && is_open("/ui/app.js") && is_open("/favicon.ico"));
        assert!(!is_open("/v1/status") && !is_open("/v1/catalog") && !is_open("/events"));
    }
}
