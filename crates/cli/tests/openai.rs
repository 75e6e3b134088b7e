//! The official `openai` Python client against a node on a host of its own: chat streamed
//! and not, completions, models, and bad requests (OpenAI's error shape, the right
//! status, the instance still serving). The checks are in `clients/openai_client.py`;
//! `.ci/run` installs the client, pinned.

use shoal_testbed::{Testbed, serving_one};
use std::path::Path;

const MODEL: &str = "smollm2-135m";

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_shoal"))
}

#[test]
fn the_openai_client_chats_completes_lists_and_is_refused_properly() {
    let Some(bed) = Testbed::for_test(1) else {
        return;
    };
    let c = serving_one(bed, bin(), MODEL, 2048, &[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_client.py");
    let out = c
        .bed
        .command(1, "python3")
        .arg(&script)
        .args(["http://127.0.0.1:52415/v1", MODEL])
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the openai client's checks failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
