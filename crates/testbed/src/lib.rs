//! Machines as test hosts: N Linux network namespaces joined by a switch, one `shoal node`
//! per host started with the flags a user would type, and the faults a real network has.
//!
//! Topology, for host `i` (1-based, address `10.231.0.i/24`):
//!
//! ```text
//!  host ns `…-hI`          switch ns `…-sw`
//!  eth0 ──veth── rI  ⇄ relay ⇄  qI ──veth── pI ── br0 ── (other hosts' pI)
//! ```
//!
//! Every frame a host sends or receives passes through a user-space relay
//! ([`relay`]) because this kernel has no `netem` qdisc: the relay adds one-way delay,
//! limits the rate, or drops everything (a cut cable whose carrier stays up: the worst
//! kind, seen only by timeouts). Processes are ordinary children of the test
//! ([`Proc`]): kill -9, SIGSTOP and SIGCONT them, or find their children (a node's
//! runners).
//!
//! Everything is torn down on drop, also when a test panics; namespaces left by a test
//! process that was itself killed are removed by the next [`Testbed::new`].
//!
//! Root is required. [`Testbed::for_test`] fails the test when namespaces cannot be
//! made, unless `SHOAL_SKIP_NETNS` is set (for local runs without root only).

pub mod chaos;
mod netns;
mod process;
mod relay;
mod shoal;

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub use process::{Proc, children};
pub use relay::Shape;
pub use shoal::{
    Cluster, Node, eventually, install_from_store, meeting, place_ready, serving_one,
    serving_split, succeed,
};

/// What went wrong making or driving the testbed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("network namespaces need root (this process runs as uid {0})")]
    NotRoot(u32),
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// Namespaces of one testbed are named `shoal-t<pid>-<n>-…`.
const PREFIX: &str = "shoal-t";

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// N hosts on one switch.
pub struct Testbed {
    name: String,
    hosts: usize,
    relays: Vec<relay::Relay>,
}

impl Testbed {
    /// Makes `hosts` namespaces on a switch, each with its relay.
    pub fn new(hosts: usize) -> Result<Testbed> {
        let uid = unsafe { libc::geteuid() };
        if uid != 0 {
            return Err(Error::NotRoot(uid));
        }
        netns::remove_stale(PREFIX);
        let name = format!(
            "{PREFIX}{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        // From here on, drop tears down whatever was made.
        let mut bed = Testbed {
            name,
            hosts: 0,
            relays: Vec::new(),
        };
        let sw = bed.switch();
        netns::add(&sw)?;
        netns::ip(&sw, &["link", "add", "br0", "type", "bridge"])?;
        netns::ip(&sw, &["link", "set", "br0", "up"])?;
        for i in 1..=hosts {
            let h = bed.host_ns(i);
            netns::add(&h)?;
            bed.hosts = i;
            let (r, q, p) = (format!("r{i}"), format!("q{i}"), format!("p{i}"));
            netns::ip_root(&[
                "link", "add", "eth0", "netns", &h, "type", "veth", "peer", "name", &r, "netns",
                &sw,
            ])?;
            netns::ip_root(&[
                "link", "add", &q, "netns", &sw, "type", "veth", "peer", "name", &p, "netns", &sw,
            ])?;
            let addr = format!("{}/24", Self::addr(i));
            netns::ip(&h, &["addr", "add", &addr, "dev", "eth0"])?;
            netns::ip(&h, &["link", "set", "eth0", "up"])?;
            netns::ip(&h, &["link", "set", "lo", "up"])?;
            // Multicast (mDNS) leaves by the one real interface.
            netns::ip(&h, &["route", "add", "224.0.0.0/4", "dev", "eth0"])?;
            for dev in [&r, &q] {
                netns::ip(&sw, &["link", "set", dev, "up"])?;
            }
            netns::ip(&sw, &["link", "set", &p, "master", "br0"])?;
            netns::ip(&sw, &["link", "set", &p, "up"])?;
            bed.relays.push(relay::Relay::start(&sw, &r, &q)?);
        }
        Ok(bed)
    }

    /// A testbed for a test: `None` (said loudly) only when namespaces cannot be made and
    /// `SHOAL_SKIP_NETNS` is set; otherwise a failure to make one fails the test.
    pub fn for_test(hosts: usize) -> Option<Testbed> {
        match Testbed::new(hosts) {
            Ok(bed) => Some(bed),
            Err(e) if std::env::var_os("SHOAL_SKIP_NETNS").is_some() => {
                eprintln!("SKIPPED (SHOAL_SKIP_NETNS is set): no network namespaces: {e}");
                None
            }
            Err(e) => panic!(
                "cannot make network namespaces: {e}\n(tests of separate hosts need root; \
                 set SHOAL_SKIP_NETNS=1 to skip them on a machine without it, never in CI)"
            ),
        }
    }

    pub fn hosts(&self) -> usize {
        self.hosts
    }

    /// Host `i`'s address (1-based).
    pub fn addr(i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 231, 0, i as u8)
    }

    /// The testbed's name (its namespaces are `NAME-hI` and `NAME-sw`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `f` on a thread inside host `i` (sockets it makes belong to that host).
    pub fn within<T: Send + 'static>(
        &self,
        i: usize,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<T> {
        netns::within(&self.host_ns(i), f)
    }

    /// Host `i`'s namespace name.
    pub fn host_ns(&self, i: usize) -> String {
        format!("{}-h{i}", self.name)
    }

    fn switch(&self) -> String {
        format!("{}-sw", self.name)
    }

    /// `program` to be run inside host `i`.
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.host_ns(i)]).arg(program);
        cmd
    }

    /// Sets what host `i`'s cable does to frames, both ways.
    pub fn shape(&self, i: usize, shape: Shape) {
        self.relays[i - 1].set(shape);
    }

    /// Cuts host `i`'s cable: every frame in or out is dropped; the carrier stays up.
    pub fn cut(&self, i: usize) {
        self.relays[i - 1].cut(true);
    }

    /// Joins host `i`'s cable again.
    pub fn heal(&self, i: usize) {
        self.relays[i - 1].cut(false);
    }

    /// Delay added to each frame one way, for host `i`.
    pub fn delay(&self, i: usize) -> Duration {
        self.relays[i - 1].shape().delay
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        for i in 1..=self.hosts {
            netns::kill_all(&self.host_ns(i));
        }
        for r in &mut self.relays {
            r.stop();
        }
        for i in 1..=self.hosts {
            netns::del(&self.host_ns(i));
        }
        netns::del(&self.switch());
    }
}
