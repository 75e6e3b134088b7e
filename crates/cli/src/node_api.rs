//! A node's own JSON API from the CLI's long-running commands (bench, sweep, load): one
//! call with the API key, a deadline, the status checked and the body parsed.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// `method path` on `node` (its --listen address) with `body` for a POST; the answer's
/// JSON, or an error naming the call and what the node said.
pub(crate) fn call(
    node: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<Value> {
    let url = format!("http://{node}{path}");
    let a: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .build()
        .into();
    use crate::client::keyed;
    let resp = match (method, body) {
        ("POST", Some(b)) => keyed(a.post(&url)).send_json(b),
        ("POST", None) => keyed(a.post(&url)).send_empty(),
        ("DELETE", _) => keyed(a.delete(&url)).call(),
        _ => keyed(a.get(&url)).call(),
    }
    .with_context(|| format!("cannot reach the node at {node}"))?;
    let status = resp.status().as_u16();
    let text = resp.into_body().read_to_string().unwrap_or_default();
    if status != 200 {
        bail!("{method} {path}: the node answered {status}: {text}");
    }
    serde_json::from_str(&text).with_context(|| format!("{method} {path}: not JSON"))
}

/// `GET path` with a short deadline.
pub(crate) fn get(node: &str, path: &str) -> Result<Value> {
    call(node, "GET", path, None, Duration::from_secs(10))
}
