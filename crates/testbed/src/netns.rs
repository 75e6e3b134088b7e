//! Network namespaces through iproute2, and running a closure inside one.

use std::os::fd::AsRawFd;
use std::process::Command;

use crate::{Error, Result, io_err};

fn run(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(io_err("cannot run ip (iproute2)"))?;
    if !out.status.success() {
        return Err(Error::Command {
            command: format!("ip {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

pub(crate) fn add(ns: &str) -> Result<()> {
    run(&["netns", "add", ns]).map(drop)
}

/// `ip -n NS ARGS…`.
pub(crate) fn ip(ns: &str, args: &[&str]) -> Result<()> {
    let mut all = vec!["-n", ns];
    all.extend_from_slice(args);
    run(&all).map(drop)
}

/// `ip ARGS…` in this process's namespace.
pub(crate) fn ip_root(args: &[&str]) -> Result<()> {
    run(args).map(drop)
}

/// kill -9 every process in `ns` and waits (a bounded while) until they are gone.
pub(crate) fn kill_all(ns: &str) {
    for _ in 0..50 {
        let pids: Vec<i32> = run(&["netns", "pids", ns])
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        if pids.is_empty() {
            return;
        }
        for p in pids {
            // SAFETY: kill with a pid read from the kernel; at worst ESRCH.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

pub(crate) fn del(ns: &str) {
    let _ = run(&["netns", "del", ns]);
}

/// Removes namespaces a killed test process left: `PREFIX<pid>-…` whose pid is gone.
pub(crate) fn remove_stale(prefix: &str) {
    let Ok(list) = run(&["netns", "list"]) else {
        return;
    };
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()) {
            kill_all(name);
            del(name);
        }
    }
}

/// Runs `f` on a thread that has entered `ns` (sockets made there belong to `ns`).
pub(crate) fn within<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let path = format!("/run/netns/{ns}");
    let file = std::fs::File::open(&path).map_err(io_err(format!("open {path}")))?;
    std::thread::spawn(move || {
        // SAFETY: setns on this thread only, with an open namespace file.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(Error::Io {
                what: "setns".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        f()
    })
    .join()
    .expect("the namespace thread panicked")
}
