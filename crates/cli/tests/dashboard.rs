//! The dashboard in a real browser: `dashboard/dashboard.py` drives Debian's Chromium
//! (Playwright for Python, `executable_path`) against a 2-host cluster whose nodes
//! listen on their network address with an API key, as a user would start them. The
//! page asks for the key, shows both machines, previews and launches a pipeline over
//! both (copying the model to host 2, which lacks it), chats, stops a long answer, is
//! checked at 375 px in dark mode, deletes the instance, and sees host 2's node leave
//! when it is killed. Screenshots go to `$SHOAL_ARTIFACTS/dashboard` (CI sets it), else
//! the target's temporary folder.

use shoal_testbed::{Cluster, Testbed, eventually, install_from_store};
use std::path::{Path, PathBuf};
use std::time::Duration;

const MODEL: &str = "smollm2-135m";
const KEY: &str = "dashboard-test-key";

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_shoal"))
}

fn screenshots() -> PathBuf {
    let root = std::env::var_os("SHOAL_ARTIFACTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    root.join("dashboard")
}

#[test]
fn the_dashboard_shows_the_cluster_places_chats_stops_and_sees_a_machine_leave() {
    let Some(bed) = Testbed::for_test(2) else {
        return;
    };
    let mut c = Cluster::new(bed, bin());
    // Only host 1 has the model: launching the pipeline copies it to host 2 first.
    install_from_store(bin(), MODEL, &c.nodes[0].dir);
    for node in &mut c.nodes {
        node.args(&["--listen", "0.0.0.0:52415"]);
        node.env("SHOAL_API_KEY", KEY);
    }
    c.start();
    let first = &c.nodes[0];
    eventually(Duration::from_secs(30), "the nodes meet", || {
        first.status().is_some_and(|s| {
            s["master_id"].is_string() && s["nodes"].as_array().is_some_and(|n| n.len() == 2)
        })
    });
    let victim = c.nodes[1].pid().expect("host 2's node runs");
    let out = screenshots();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/dashboard/dashboard.py");
    let base = format!("http://{}:52415", Testbed::addr(1));
    let run = c
        .bed
        .command(1, "python3")
        .arg(&script)
        .args([&base, KEY, MODEL, "2", &victim.to_string()])
        .arg(&out)
        .output()
        .expect("run python3 (Playwright for Python and Debian's chromium: .ci/run installs them)");
    let stdout = String::from_utf8_lossy(&run.stdout);
    println!("{stdout}");
    assert!(
        run.status.success(),
        "the dashboard's checks failed (screenshots in {}):\n{stdout}\n{}",
        out.display(),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(out.join("08-machine-left.png").exists());
}
