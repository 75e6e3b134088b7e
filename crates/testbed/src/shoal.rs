//! shoal nodes on the testbed's hosts, started with the flags a user would type (a key
//! file and a data directory; no addresses, no peers: they find each other by mDNS), and
//! asked through the CLI inside their own host, as a user on that machine would.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::{Proc, Testbed, children};

/// One host's node.
pub struct Node {
    /// The host it runs on (1-based).
    pub host: usize,
    /// Its `--data-dir` (models go in `models/<name>/`); `node.log` holds its log.
    pub dir: PathBuf,
    ns: String,
    bin: PathBuf,
    key: PathBuf,
    env: Vec<(String, String)>,
    args: Vec<String>,
    proc: Option<Proc>,
}

impl Node {
    /// An environment variable for the node (set before [`Node::start`]).
    pub fn env(&mut self, key: &str, value: &str) {
        self.env.push((key.to_string(), value.to_string()));
    }

    /// More `shoal node` arguments (set before [`Node::start`]).
    pub fn args(&mut self, args: &[&str]) {
        self.args.extend(args.iter().map(|a| a.to_string()));
    }

    pub fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("node.log"))
            .expect("node log");
        let mut cmd = self.command();
        cmd.arg("node")
            .arg("--cluster-key-file")
            .arg(&self.key)
            .arg("--data-dir")
            .arg(&self.dir)
            .args(["--runner-threads", "1"])
            .args(&self.args)
            .env("SHOAL_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        self.proc = Some(Proc::new(cmd.spawn().expect("start shoal node")));
    }

    /// `shoal` inside this node's host, with the node's environment (so a key the node
    /// was given in `SHOAL_API_KEY` is the one its CLI sends).
    pub fn command(&self) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns]).arg(&self.bin);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// Runs `shoal ARGS…` inside this node's host.
    pub fn cli(&self, args: &[&str]) -> Output {
        self.command().args(args).output().expect("run shoal")
    }

    /// `shoal status --json` of this node, when it answers.
    pub fn status(&self) -> Option<Value> {
        let out = self.cli(&["status", "--json"]);
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).ok())
            .flatten()
    }

    pub fn id(&self) -> Option<String> {
        self.status()?["node_id"].as_str().map(str::to_string)
    }

    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().and_then(Proc::pid)
    }

    /// The runner processes of this node.
    pub fn runners(&self) -> Vec<u32> {
        self.pid().map(children).unwrap_or_default()
    }

    /// kill -9 (its runners die with their node: they watch its socket).
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    pub fn freeze(&self) {
        if let Some(p) = &self.proc {
            p.freeze();
        }
    }

    pub fn thaw(&self) {
        if let Some(p) = &self.proc {
            p.thaw();
        }
    }

    /// Whether the process still runs.
    pub fn alive(&mut self) -> bool {
        self.proc.as_mut().is_some_and(Proc::alive)
    }

    fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.dir.join("node.log")).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// A node on every host of a testbed, sharing one cluster key. Fields drop in order:
/// the nodes first, then the testbed.
pub struct Cluster {
    pub nodes: Vec<Node>,
    pub bed: Testbed,
    root: PathBuf,
}

impl Cluster {
    /// Nodes (not started) for every host of `bed`, running the `shoal` binary at `bin`.
    pub fn new(bed: Testbed, bin: &Path) -> Cluster {
        let root = std::env::temp_dir().join(format!("{}-data", bed.name()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("testbed data dir");
        let key = root.join("cluster.key");
        let out = Command::new(bin).arg("keygen").output().expect("keygen");
        assert!(out.status.success(), "shoal keygen failed");
        std::fs::write(&key, &out.stdout).expect("write the key");
        let nodes = (1..=bed.hosts())
            .map(|host| {
                let dir = root.join(format!("n{host}"));
                std::fs::create_dir_all(&dir).expect("node dir");
                Node {
                    host,
                    dir,
                    ns: bed.host_ns(host),
                    bin: bin.to_path_buf(),
                    key: key.clone(),
                    env: Vec::new(),
                    args: Vec::new(),
                    proc: None,
                }
            })
            .collect();
        Cluster { nodes, bed, root }
    }

    pub fn start(&mut self) {
        for n in &mut self.nodes {
            n.start();
        }
    }

    /// The node whose id is `id`.
    pub fn by_id(&self, id: &str) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| n.id().as_deref() == Some(id))
    }

    /// The master's id and the state's index when the nodes `which` all answer with the
    /// same master, index, member list and instances, and see each other as members.
    pub fn agree(&self, which: &[usize]) -> Option<(String, u64)> {
        let s: Vec<Value> = which
            .iter()
            .map(|&i| self.nodes[i].status())
            .collect::<Option<_>>()?;
        let first = s.first()?;
        let master = first["master_id"].as_str()?.to_string();
        let index = first["index"].as_u64()?;
        let members = |v: &Value| -> Vec<String> {
            v["nodes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|n| n["id"].as_str().map(str::to_string))
                .collect()
        };
        let all = s.iter().all(|v| {
            v["master_id"].as_str() == Some(master.as_str())
                && v["index"].as_u64() == Some(index)
                && members(v).len() >= which.len()
                && members(v) == members(first)
                && v["instances"] == first["instances"]
        });
        all.then_some((master, index))
    }

    /// Every node's address is 10.231.0.host; a place for the harness's own files.
    pub fn root(&self) -> &Path {
        &self.root
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for n in &self.nodes {
                let status = n
                    .status()
                    .map_or("no answer".to_string(), |s| s.to_string());
                eprintln!("---- host {} status ----\n{status}", n.host);
            }
        }
        for n in &mut self.nodes {
            n.kill();
        }
        if std::thread::panicking() {
            for n in &self.nodes {
                eprintln!(
                    "---- host {} ({}) node.log, last lines ----\n{}",
                    n.host,
                    Testbed::addr(n.host),
                    n.log_tail(60)
                );
            }
        } else if std::env::var_os("SHOAL_KEEP_TESTBED").is_some() {
            eprintln!(
                "the nodes' files and logs are kept in {}",
                self.root.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

/// One host's node up with a ready single-node instance of `model` (installed from the
/// local store first): the start of every test of serving on one machine.
pub fn serving_one(
    bed: crate::Testbed,
    bin: &Path,
    model: &str,
    ctx: usize,
    args: &[&str],
    env: &[(&str, &str)],
) -> Cluster {
    serving_split(bed, bin, model, ctx, args, env, "pipeline")
}

/// A node on every host of `bed`, each with `model` installed and started with `args`
/// and `env`, and one instance of it split over all of them by `strategy` (on one host:
/// the whole model), ready.
pub fn serving_split(
    bed: crate::Testbed,
    bin: &Path,
    model: &str,
    ctx: usize,
    args: &[&str],
    env: &[(&str, &str)],
    strategy: &str,
) -> Cluster {
    let c = meeting(bed, bin, model, args, env);
    place_ready(&c, model, ctx, strategy);
    c
}

/// A node on every host of `bed`, each with `model` installed and started with `args`
/// and `env`, all of them in one cluster with a master; nothing placed.
pub fn meeting(
    bed: crate::Testbed,
    bin: &Path,
    model: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Cluster {
    let mut c = Cluster::new(bed, bin);
    for node in &mut c.nodes {
        install_from_store(bin, model, &node.dir);
        node.args(args);
        for (k, v) in env {
            node.env(k, v);
        }
    }
    c.start();
    let hosts = c.nodes.len();
    let node = &c.nodes[0];
    eventually(Duration::from_secs(30), "the nodes meet", || {
        node.status().is_some_and(|s| {
            s["master_id"].is_string() && s["nodes"].as_array().is_some_and(|n| n.len() == hosts)
        })
    });
    c
}

/// Places `model` over every node of `c` by `strategy` and waits until it is ready.
pub fn place_ready(c: &Cluster, model: &str, ctx: usize, strategy: &str) {
    let node = &c.nodes[0];
    let (ctx, ranks) = (ctx.to_string(), c.nodes.len().to_string());
    succeed(
        node.cli(&[
            "place",
            model,
            "--ctx",
            &ctx,
            "--nodes",
            &ranks,
            "--strategy",
            strategy,
        ]),
        "shoal place",
    );
    eventually(Duration::from_secs(60), "the instance ready", || {
        node.status().is_some_and(|s| {
            s["instances"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|i| i["status"]["state"] == "ready")
        })
    });
}

/// Waits until `check` holds, at most `within`; returns how long it took.
pub fn eventually(within: Duration, what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    start.elapsed()
}

/// The stdout of a command that must succeed; otherwise the test fails with its stderr.
pub fn succeed(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Copies model `name` from this machine's store (installed there first if needed, with
/// `bin pull`) into the `models/` folder of a node's data directory.
pub fn install_from_store(bin: &Path, name: &str, data_dir: &Path) {
    let find = || -> Option<PathBuf> {
        let out = succeed(
            Command::new(bin).args(["models", "--json"]).output().ok()?,
            "shoal models",
        );
        let v: Value = serde_json::from_str(&out).ok()?;
        v.as_array()?.iter().find(|m| m["name"] == name)?["path"]
            .as_str()
            .map(PathBuf::from)
    };
    let path = find().unwrap_or_else(|| {
        succeed(
            Command::new(bin)
                .args(["pull", name])
                .output()
                .expect("shoal pull"),
            "shoal pull",
        );
        find().expect("the model after pulling it")
    });
    let src = path.parent().expect("model dir");
    let dst = data_dir.join("models").join(name);
    std::fs::create_dir_all(&dst).expect("model dir");
    for entry in std::fs::read_dir(src).expect("read the store") {
        let entry = entry.expect("entry");
        let file = entry.file_name();
        let file = file.to_string_lossy();
        if file.ends_with(".gguf") || file == ".sha256" {
            std::fs::copy(entry.path(), dst.join(&*file)).expect("copy the model");
        }
    }
}
