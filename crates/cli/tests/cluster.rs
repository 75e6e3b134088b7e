//! The cluster end to end: `shoal node` processes on loopback with static peers.
//!
//! - Three nodes with one cluster key elect one master and hold the same state; a fourth
//!   with another key can neither join nor get a message in.
//! - kill -9 the master: the others elect a new one within 5 s and keep serving the
//!   instances whose nodes live; the killed node, restarted, keeps its id and catches up.
//! - smollm2-135m, installed on one node only, placed with pipeline over 2 nodes and
//!   tensor over 3 answers prompts through the cluster, the others having copied the
//!   file from that node.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

struct Node {
    dir: PathBuf,
    http: String,
    p2p: String,
    key: PathBuf,
    peers: Vec<String>,
    child: Option<Child>,
}

impl Node {
    fn start(&mut self) {
        let mut cmd = shoal();
        cmd.args([
            "node",
            "--no-mdns",
            "--runner-threads",
            "1",
            "--stall-timeout",
            "30",
        ])
        .arg("--data-dir")
        .arg(&self.dir)
        .args(["--listen", &self.http, "--p2p-listen", &self.p2p])
        .arg("--cluster-key-file")
        .arg(&self.key)
        .env("SHOAL_LOG", "info")
        .stdout(Stdio::null())
        .stderr(
            std::fs::File::create(self.dir.join("node.log"))
                .map(Stdio::from)
                .unwrap_or_else(|_| Stdio::null()),
        );
        for p in &self.peers {
            if p != &self.p2p {
                cmd.args(["--peer", p]);
            }
        }
        self.child = Some(cmd.spawn().expect("start node"));
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn status(&self) -> Option<Value> {
        let out = shoal()
            .args(["status", "--json", "--node", &self.http])
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).ok())
            .flatten()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

fn cluster(name: &str, n: usize, key: &Path) -> Vec<Node> {
    let root = std::env::temp_dir().join(format!("shoal-cluster-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let p2p: Vec<String> = (0..n)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    (0..n)
        .map(|i| {
            let dir = root.join(format!("node{i}"));
            std::fs::create_dir_all(&dir).expect("dir");
            Node {
                dir,
                http: format!("127.0.0.1:{}", free_port()),
                p2p: p2p[i].clone(),
                key: key.to_path_buf(),
                peers: p2p.clone(),
                child: None,
            }
        })
        .collect()
}

fn keyfile(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("shoal-key-{}-{name}", std::process::id()));
    let out = shoal().arg("keygen").output().expect("keygen");
    assert!(out.status.success());
    std::fs::write(&path, &out.stdout).expect("write key");
    path
}

/// Waits until `check` holds, at most `within`.
fn eventually(within: Duration, what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    start.elapsed()
}

fn agree(nodes: &[&Node]) -> Option<(String, u64)> {
    let s: Vec<Value> = nodes.iter().map(|n| n.status()).collect::<Option<_>>()?;
    let master = s[0]["master_id"].as_str()?.to_string();
    let index = s[0]["index"].as_u64()?;
    let ids = |v: &Value| -> Vec<String> {
        v["nodes"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|n| n["id"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let all = s.iter().all(|v| {
        v["master_id"].as_str() == Some(master.as_str())
            && v["index"].as_u64() == Some(index)
            && ids(v).len() == nodes.len()
            && ids(v) == ids(&s[0])
            && v["instances"] == s[0]["instances"]
    });
    all.then_some((master, index))
}

#[test]
fn three_nodes_elect_one_master_share_state_and_keep_strangers_out() {
    let key = keyfile("a");
    let mut nodes = cluster("elect", 3, &key);
    for n in &mut nodes {
        n.start();
    }
    let refs: Vec<&Node> = nodes.iter().collect();
    let mut agreed = None;
    eventually(Duration::from_secs(20), "one master, same state", || {
        agreed = agree(&refs);
        agreed.is_some()
    });
    let (master, _) = agreed.expect("agreement");
    let ids: Vec<String> = nodes
        .iter()
        .filter_map(|n| {
            n.status()
                .and_then(|s| s["node_id"].as_str().map(str::to_string))
        })
        .collect();
    assert!(ids.contains(&master));

    // A stranger with another key, dialling every node.
    let bad_key = keyfile("b");
    let mut stranger = cluster("stranger", 1, &bad_key).remove(0);
    stranger.peers = nodes.iter().map(|n| n.p2p.clone()).collect();
    stranger.start();
    std::thread::sleep(Duration::from_secs(5));
    let s = stranger.status().expect("stranger status");
    assert_eq!(
        s["peers"].as_array().map_or(0, Vec::len),
        0,
        "a stranger connected: {s}"
    );
    assert_eq!(s["nodes"].as_array().map_or(0, Vec::len), 1, "{s}");
    let (still, _) = agree(&refs).expect("the three still agree");
    assert_eq!(still, master, "the stranger moved the mastership");
    for n in &nodes {
        let st = n.status().expect("status");
        assert_eq!(st["nodes"].as_array().map_or(0, Vec::len), 3, "{st}");
        assert_eq!(st["peers"].as_array().map_or(0, Vec::len), 2, "{st}");
    }
}

fn install_smollm2(node: &Node) {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_shoal"));
    shoal_testbed::install_from_store(bin, "smollm2-135m", &node.dir);
}

fn place(node: &Node, strategy: &str, n: usize) -> String {
    let out = shoal()
        .args([
            "place",
            "smollm2-135m",
            "--json",
            "--ctx",
            "512",
            "--node",
            &node.http,
        ])
        .args(["--strategy", strategy, "--nodes", &n.to_string()])
        .output()
        .expect("place");
    assert!(
        out.status.success(),
        "place: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    v["id"].as_str().expect("id").to_string()
}

fn ready(node: &Node, id: &str) -> bool {
    node.status().is_some_and(|s| {
        s["instances"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|i| i["id"] == id && i["status"]["state"] == "ready")
    })
}

fn ask(node: &Node) -> String {
    let out = shoal()
        .args(["run", "-n", "16", "--node", &node.http])
        .arg("What is the capital of France? Answer in one word.")
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn placed_instances_answer_through_the_cluster_and_survive_the_masters_death() {
    let key = keyfile("c");
    let mut nodes = cluster("serve", 3, &key);
    install_smollm2(&nodes[0]);
    for n in &mut nodes {
        n.start();
    }
    {
        let refs: Vec<&Node> = nodes.iter().collect();
        eventually(Duration::from_secs(20), "one master", || {
            agree(&refs).is_some()
        });
    }
    // Pipeline over 2 nodes, asked through every node.
    let pipeline = place(&nodes[1], "pipeline", 2);
    eventually(Duration::from_secs(60), "pipeline instance ready", || {
        ready(&nodes[2], &pipeline)
    });
    for n in &nodes {
        let answer = ask(n);
        assert!(answer.contains("Paris"), "through {}: {answer:?}", n.http);
    }
    // Tensor over 3 nodes (3 KV groups, one each).
    let tensor = place(&nodes[2], "tensor", 3);
    eventually(Duration::from_secs(60), "tensor instance ready", || {
        ready(&nodes[0], &tensor)
    });
    // Every node copied the file from node 0 and verified it.
    for n in &nodes[1..] {
        let marker = n.dir.join("models/smollm2-135m/.sha256");
        assert!(marker.exists(), "{} has no verified copy", n.dir.display());
    }

    // Kill the master.
    let master = nodes[0]
        .status()
        .and_then(|s| s["master_id"].as_str().map(str::to_string));
    let m = nodes
        .iter()
        .position(|n| {
            n.status()
                .and_then(|s| s["node_id"].as_str().map(str::to_string))
                == master
        })
        .expect("the master is one of the nodes");
    let master_id = master.expect("master id");
    nodes[m].kill();
    let rest: Vec<usize> = (0..3).filter(|&i| i != m).collect();
    let took = eventually(Duration::from_secs(5), "a new master", || {
        rest.iter().all(|&i| {
            nodes[i].status().is_some_and(|s| {
                s["master_id"].as_str().is_some_and(|x| x != master_id)
                    && s["master_id"] == nodes[rest[0]].status().unwrap_or_default()["master_id"]
            })
        })
    });
    eprintln!("new master after {took:?}");
    // An instance whose nodes all live keeps answering; one that lost a node is placed
    // again on what remains. Either way the survivors answer.
    eventually(
        Duration::from_secs(60),
        "a ready instance after the loss",
        || {
            nodes[rest[0]].status().is_some_and(|s| {
                s["instances"].as_array().into_iter().flatten().any(|i| {
                    i["status"]["state"] == "ready"
                        && i["ranks"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .all(|r| r["node"].as_str() != Some(master_id.as_str()))
                })
            })
        },
    );
    let answer = ask(&nodes[rest[0]]);
    assert!(answer.contains("Paris"), "after the loss: {answer:?}");

    // The killed node comes back with its id and catches up.
    nodes[m].start();
    let refs: Vec<&Node> = nodes.iter().collect();
    eventually(
        Duration::from_secs(20),
        "the restarted node catches up",
        || agree(&refs).is_some(),
    );
    let back = nodes[m].status().expect("status");
    assert_eq!(
        back["node_id"].as_str(),
        Some(master_id.as_str()),
        "kept its id"
    );
}
