//! A process of the test, to kill -9, freeze and thaw; children found through /proc.

use std::process::Child;

/// A child process the test started (inside a host, through `ip netns exec`, which execs:
/// the pid is the program's own).
pub struct Proc {
    child: Option<Child>,
}

impl Proc {
    pub fn new(child: Child) -> Proc {
        Proc { child: Some(child) }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// kill -9 and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(c.id(), libc::SIGCONT);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP: frozen, its sockets open, answering nothing.
    pub fn freeze(&self) {
        if let Some(p) = self.pid() {
            signal(p, libc::SIGSTOP);
        }
    }

    pub fn thaw(&self) {
        if let Some(p) = self.pid() {
            signal(p, libc::SIGCONT);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends `sig` to `pid`.
pub fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) has no memory effects; a gone pid is ESRCH.
    unsafe { libc::kill(pid as i32, sig) };
}

/// The live children of `pid`, from /proc.
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| parent(p) == Some(pid))
        .collect()
}

fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
    let after = &stat[stat.rfind(')')? + 1..];
    let mut fields = after.split_whitespace();
    let state = fields.next()?;
    if state == "Z" {
        return None;
    }
    fields.next()?.parse().ok()
}
