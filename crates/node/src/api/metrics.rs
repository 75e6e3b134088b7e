//! `GET /metrics`: the node's serving figures in Prometheus' text format.
//!
//! Every answer that passes through this node's API is counted as it ends (by model and
//! outcome, with its prompt, cached and generated tokens, its time to first token and
//! its whole time); the sequences each local rank 0 holds (running, prefilling, waiting)
//! are read from the node's state at scrape time.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::{Api, ask};
use crate::daemon::ApiCall;
use crate::supervisor::Piece;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    model: String,
    /// `done` or the failure's kind (`invalid`, `busy`, `broken`), or `gone` (the client
    /// left first).
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Held {
    instance: String,
    state: String,
}

/// The node's metrics, shared by the API's handlers.
pub struct Metrics {
    registry: Registry,
    answers: Family<Outcome, Counter>,
    prompt_tokens: Family<ModelLabel, Counter>,
    cached_tokens: Family<ModelLabel, Counter>,
    generated_tokens: Family<ModelLabel, Counter>,
    first_token: Family<ModelLabel, Histogram>,
    answer_time: Family<ModelLabel, Histogram>,
    sequences: Family<Held, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("shoal");
        let answers = Family::<Outcome, Counter>::default();
        let prompt_tokens = Family::<ModelLabel, Counter>::default();
        let cached_tokens = Family::<ModelLabel, Counter>::default();
        let generated_tokens = Family::<ModelLabel, Counter>::default();
        let seconds = || Histogram::new(exponential_buckets(0.005, 2.0, 16));
        let first_token = Family::<ModelLabel, Histogram>::new_with_constructor(seconds);
        let answer_time = Family::<ModelLabel, Histogram>::new_with_constructor(seconds);
        let sequences = Family::<Held, Gauge>::default();
        registry.register(
            "answers",
            "Answers ended, by model and outcome",
            answers.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens of finished answers",
            prompt_tokens.clone(),
        );
        registry.register(
            "cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            cached_tokens.clone(),
        );
        registry.register(
            "generated_tokens",
            "Tokens generated",
            generated_tokens.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "From the request to the first piece of its answer",
            first_token.clone(),
        );
        registry.register(
            "answer_seconds",
            "From the request to the end of its answer",
            answer_time.clone(),
        );
        registry.register(
            "sequences",
            "Sequences a local rank 0 holds, by state (running, prefilling, waiting)",
            sequences.clone(),
        );
        Self {
            registry,
            answers,
            prompt_tokens,
            cached_tokens,
            generated_tokens,
            first_token,
            answer_time,
            sequences,
        }
    }
}

/// One answer on its way through the API: what it was, and when it began.
pub struct Watch {
    metrics: Arc<Metrics>,
    model: String,
    started: Instant,
    first: bool,
    ended: bool,
}

impl Watch {
    pub fn new(metrics: Arc<Metrics>, model: Option<&str>) -> Self {
        Self {
            metrics,
            model: model.unwrap_or("any").to_string(),
            started: Instant::now(),
            first: false,
            ended: false,
        }
    }

    fn label(&self) -> ModelLabel {
        ModelLabel {
            model: self.model.clone(),
        }
    }

    /// A piece of the answer passed.
    pub fn saw(&mut self, piece: &Piece) {
        let m = &self.metrics;
        if !self.first && !matches!(piece, Piece::Keepalive | Piece::Progress(_)) {
            self.first = true;
            let s = self.started.elapsed().as_secs_f64();
            m.first_token.get_or_create(&self.label()).observe(s);
        }
        let outcome = match piece {
            Piece::Done(f) => {
                let l = self.label();
                m.prompt_tokens
                    .get_or_create(&l)
                    .inc_by(f.usage.prompt_tokens as u64);
                m.cached_tokens
                    .get_or_create(&l)
                    .inc_by(f.usage.cached_tokens as u64);
                m.generated_tokens
                    .get_or_create(&l)
                    .inc_by(f.usage.completion_tokens as u64);
                m.answer_time
                    .get_or_create(&l)
                    .observe(self.started.elapsed().as_secs_f64());
                "done".to_string()
            }
            Piece::Error(f) => serde_json::to_value(f.kind)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_else(|| "error".into()),
            _ => return,
        };
        self.end(outcome);
    }

    /// The answer was refused before it reached a runner. An unknown model is counted
    /// under `unknown`, not its name: clients must not be able to grow the label set.
    pub fn refused(&mut self, outcome: &str, known_model: bool) {
        if !known_model {
            self.model = "unknown".into();
        }
        self.end(outcome.to_string());
    }

    fn end(&mut self, outcome: String) {
        if self.ended {
            return;
        }
        self.ended = true;
        let o = Outcome {
            model: self.model.clone(),
            outcome,
        };
        self.metrics.answers.get_or_create(&o).inc();
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // Neither done nor failed: the client went away first.
        self.end("gone".into());
    }
}

#[utoipa::path(get, path = "/metrics", tag = "shoal",
    responses((status = 200, description = "Prometheus' text format", content_type = "text/plain")))]
pub(crate) async fn metrics(State(api): State<Api>) -> Response {
    let m = &api.metrics;
    if let Ok(status) = ask(&api.calls, ApiCall::Status).await {
        m.sequences.clear();
        for s in status["serving"].as_array().into_iter().flatten() {
            let instance = s["instance"].as_str().unwrap_or("?").to_string();
            for state in ["running", "prefilling", "waiting"] {
                let held = Held {
                    instance: instance.clone(),
                    state: state.into(),
                };
                m.sequences
                    .get_or_create(&held)
                    .set(s[state].as_i64().unwrap_or(0));
            }
        }
    }
    let mut text = String::new();
    if prometheus_client::encoding::text::encode(&mut text, &m.registry).is_err() {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            "cannot encode the metrics",
        )
            .into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        prometheus_text(&text),
    )
        .into_response()
}

/// OpenMetrics text (what the crate writes) as Prometheus' classic text format, which
/// every scraper and `promtool` read: a counter's family is named with its `_total`
/// suffix, and there is no `# EOF`.
fn prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 64);
    for line in openmetrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::prometheus_text;

    #[test]
    fn counters_are_named_with_their_total_and_the_eof_goes() {
        let om = "# HELP a Things.\n# TYPE a counter\na_total{x=\"1\"} 2\n# HELP b B.\n# TYPE b gauge\nb 1\n# EOF\n";
        assert_eq!(
            prometheus_text(om),
            "# HELP a_total Things.\n# TYPE a_total counter\na_total{x=\"1\"} 2\n# HELP b B.\n# TYPE b gauge\nb 1\n"
        );
    }
}
