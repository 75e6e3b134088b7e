//! Chaos on the testbed: a fault plan (what, when, where, for how long) read from a TOML
//! file, so a failing run can be replayed exactly, and the executor that carries it out
//! on a [`Cluster`] while a load runs.
//!
//! ```toml
//! [[fault]]
//! at = 20          # seconds from the start
//! what = "kill_node"
//! host = 2
//! lasts = 5        # restarted after 5 s
//! ```
//!
//! Faults: `kill_runner` (kill -9 one of the host's runners: its node must notice and
//! the instance come back), `stop_runner` (SIGSTOP, SIGCONT after `lasts`), `kill_node`
//! (kill -9, started again after `lasts`), `partition` (the host's cable cut, joined
//! again after `lasts`), `slow_link` (`delay_ms` each way and `rate_mbit`, for `lasts`).

use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::{Cluster, Shape};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum What {
    KillRunner,
    StopRunner,
    KillNode,
    Partition,
    SlowLink,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// Seconds from the start.
    pub at: f64,
    pub what: What,
    /// The host (1-based).
    pub host: usize,
    /// Seconds until it is undone (thawed, restarted, healed); 0: never (a killed runner
    /// is its node's to replace).
    #[serde(default)]
    pub lasts: f64,
    #[serde(default)]
    pub delay_ms: u64,
    #[serde(default)]
    pub rate_mbit: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    #[serde(rename = "fault")]
    pub faults: Vec<Fault>,
}

/// A step of a plan: a fault made, or undone.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    Make(Fault),
    Undo(Fault),
}

impl Plan {
    pub fn parse(text: &str) -> Result<Plan, String> {
        let plan: Plan = toml::from_str(text).map_err(|e| e.to_string())?;
        for f in &plan.faults {
            if f.host == 0 {
                return Err(format!(
                    "a fault at {} s names host 0 (hosts count from 1)",
                    f.at
                ));
            }
            if f.lasts == 0.0 && f.what != What::KillRunner {
                return Err(format!("the {:?} at {} s needs `lasts`", f.what, f.at));
            }
        }
        Ok(plan)
    }

    /// The faults before `seconds`, for a shorter run of the same plan.
    pub fn until(&self, seconds: f64) -> Plan {
        Plan {
            faults: self
                .faults
                .iter()
                .filter(|f| f.at < seconds)
                .cloned()
                .collect(),
        }
    }

    /// Every step at its time, in order (a fault's undoing after its making when both
    /// fall at one time).
    pub fn timeline(&self) -> Vec<(f64, Step)> {
        let mut steps: Vec<(f64, Step)> = Vec::new();
        for f in &self.faults {
            steps.push((f.at, Step::Make(f.clone())));
            if f.lasts > 0.0 {
                steps.push((f.at + f.lasts, Step::Undo(f.clone())));
            }
        }
        steps.sort_by(|a, b| a.0.total_cmp(&b.0));
        steps
    }
}

/// What the executor did, with when.
#[derive(Debug, Default)]
pub struct Record {
    pub log: Vec<String>,
    /// Per node restart or partition healed: seconds until `ready` held again.
    pub recoveries: Vec<(String, f64)>,
}

/// Carries `plan` out on `c` from `start`. After each node comes back (restarted, or its
/// cable joined), waits up to `within` for `ready(c)` and records how long it took.
pub fn execute(
    plan: &Plan,
    c: &mut Cluster,
    start: Instant,
    within: Duration,
    ready: impl Fn(&Cluster) -> bool,
) -> Record {
    let mut r = Record::default();
    // Runners stopped by the plan, to thaw: (host, pid).
    let mut stopped: Vec<(usize, u32)> = Vec::new();
    for (at, step) in plan.timeline() {
        let due = start + Duration::from_secs_f64(at);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let t = start.elapsed().as_secs_f64();
        let (host, what) = match &step {
            Step::Make(f) | Step::Undo(f) => (f.host, f.what),
        };
        let node = &mut c.nodes[host - 1];
        let came_back = match step {
            Step::Make(f) => {
                let note = match f.what {
                    What::KillRunner => match node.runners().first() {
                        Some(&pid) => {
                            crate::process::signal(pid, libc::SIGKILL);
                            format!("killed runner {pid}")
                        }
                        None => "no runner to kill".into(),
                    },
                    What::StopRunner => match node.runners().first() {
                        Some(&pid) => {
                            crate::process::signal(pid, libc::SIGSTOP);
                            stopped.push((host, pid));
                            format!("stopped runner {pid}")
                        }
                        None => "no runner to stop".into(),
                    },
                    What::KillNode => {
                        node.kill();
                        "killed the node".into()
                    }
                    What::Partition => {
                        c.bed.cut(host);
                        "cut the cable".into()
                    }
                    What::SlowLink => {
                        c.bed.shape(
                            host,
                            Shape {
                                delay: Duration::from_millis(f.delay_ms),
                                rate: f.rate_mbit.map(|m| m * 1_000_000),
                            },
                        );
                        format!(
                            "slowed the link: {} ms, {:?} Mbit/s",
                            f.delay_ms, f.rate_mbit
                        )
                    }
                };
                r.log.push(format!("{t:6.1} s host {host}: {note}"));
                false
            }
            Step::Undo(_) => {
                let note = match what {
                    What::KillRunner => String::new(),
                    What::StopRunner => {
                        for (_, pid) in stopped.iter().filter(|(h, _)| *h == host) {
                            crate::process::signal(*pid, libc::SIGCONT);
                        }
                        stopped.retain(|(h, _)| *h != host);
                        "thawed its runner".into()
                    }
                    What::KillNode => {
                        node.start();
                        "started the node again".into()
                    }
                    What::Partition => {
                        c.bed.heal(host);
                        "joined the cable again".into()
                    }
                    What::SlowLink => {
                        c.bed.shape(host, Shape::default());
                        "the link is fast again".into()
                    }
                };
                r.log.push(format!("{t:6.1} s host {host}: {note}"));
                matches!(what, What::KillNode | What::Partition)
            }
        };
        if came_back {
            let back = Instant::now();
            while !ready(c) && back.elapsed() < within {
                std::thread::sleep(Duration::from_millis(100));
            }
            let took = back.elapsed().as_secs_f64();
            let label = format!("host {host} back at {t:.1} s");
            r.log.push(format!("{label}: ready after {took:.1} s"));
            r.recoveries.push((label, took));
        }
    }
    for (_, pid) in stopped {
        crate::process::signal(pid, libc::SIGCONT);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLAN: &str = r#"
        [[fault]]
        at = 20
        what = "stop_runner"
        host = 2
        lasts = 8

        [[fault]]
        at = 5
        what = "kill_runner"
        host = 1

        [[fault]]
        at = 25
        what = "slow_link"
        host = 2
        lasts = 10
        delay_ms = 200
    "#;

    #[test]
    fn a_plan_is_read_and_laid_out_in_time() {
        let plan = Plan::parse(PLAN).expect("parses");
        let times: Vec<f64> = plan.timeline().iter().map(|(t, _)| *t).collect();
        assert_eq!(times, [5.0, 20.0, 25.0, 28.0, 35.0]);
        assert!(matches!(&plan.timeline()[3].1, Step::Undo(f) if f.what == What::StopRunner));
        assert_eq!(plan.until(21.0).faults.len(), 2);
    }

    #[test]
    fn a_plan_that_cannot_be_carried_out_is_refused() {
        let never_undone = "[[fault]]\nat = 1\nwhat = \"partition\"\nhost = 1\n";
        assert!(Plan::parse(never_undone).unwrap_err().contains("lasts"));
        let host_zero = "[[fault]]\nat = 1\nwhat = \"kill_runner\"\nhost = 0\n";
        assert!(Plan::parse(host_zero).unwrap_err().contains("host 0"));
        let typo = "[[fault]]\nat = 1\nwhat = \"kill_runner\"\nhots = 1\n";
        assert!(Plan::parse(typo).is_err());
        assert!(Plan::parse("[[fault]]\nat = 1\nwhat = \"melt\"\nhost = 1\n").is_err());
    }
}
