//! A cable as a user-space relay: frames read from one interface of the switch namespace
//! (AF_PACKET) are written to another after the cable's delay and rate, or dropped while
//! it is cut.
//!
//! The sockets use `PACKET_VNET_HDR`, so a frame keeps its offload metadata (a 64 KiB TCP
//! segment still to be split, a checksum still to be filled in) across the relay exactly
//! as a virtual NIC would; without it the veths' offloads would have to be switched off
//! with ethtool. `PACKET_IGNORE_OUTGOING` keeps a socket from reading back what the
//! relay itself wrote.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{Error, Result, netns};

const PACKET_VNET_HDR: libc::c_int = 15;
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;
/// A GSO frame with its virtio header fits.
const FRAME: usize = 70 * 1024;
/// Frames a direction holds (a switch's buffer); beyond, the kernel drops them.
const QUEUE: usize = 4096;
/// How often blocked threads look at the stop flag.
const POLL: Duration = Duration::from_millis(100);

/// What a cable does to each frame, each way.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Shape {
    /// Added one-way delay. Frames to and from a host pass its cable once each way, so
    /// between two shaped hosts the delays add.
    pub delay: Duration,
    /// Bits per second each way; `None` is as fast as the relay goes.
    pub rate: Option<u64>,
}

struct Shared {
    shape: Mutex<Shape>,
    cut: AtomicBool,
    stop: AtomicBool,
}

pub(crate) struct Relay {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Relay {
    /// Relays between `a` and `b`, two interfaces of namespace `ns`.
    pub(crate) fn start(ns: &str, a: &str, b: &str) -> Result<Relay> {
        let (a, b) = (a.to_string(), b.to_string());
        let (fa, fb) = netns::within(ns, move || Ok((open(&a)?, open(&b)?)))?;
        let (fa, fb) = (Arc::new(fa), Arc::new(fb));
        let shared = Arc::new(Shared {
            shape: Mutex::new(Shape::default()),
            cut: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let mut threads = Vec::new();
        for (from, to) in [(fa.clone(), fb.clone()), (fb, fa)] {
            let (tx, rx) = sync_channel(QUEUE);
            let s = shared.clone();
            threads.push(std::thread::spawn(move || read_frames(&from, &tx, &s)));
            let s = shared.clone();
            threads.push(std::thread::spawn(move || write_frames(&to, &rx, &s)));
        }
        Ok(Relay { shared, threads })
    }

    pub(crate) fn set(&self, shape: Shape) {
        *self.shared.shape.lock().expect("shape lock") = shape;
    }

    pub(crate) fn shape(&self) -> Shape {
        *self.shared.shape.lock().expect("shape lock")
    }

    pub(crate) fn cut(&self, cut: bool) {
        self.shared.cut.store(cut, Ordering::SeqCst);
    }

    pub(crate) fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop();
    }
}

fn os_err(what: &str) -> Error {
    Error::Io {
        what: what.to_string(),
        source: std::io::Error::last_os_error(),
    }
}

fn set_int(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> Result<()> {
    // SAFETY: a c_int option value of the right size.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(os_err("setsockopt"));
    }
    Ok(())
}

/// A packet socket on `dev` (in the calling thread's namespace).
fn open(dev: &str) -> Result<OwnedFd> {
    let name = std::ffi::CString::new(dev).expect("interface name");
    // SAFETY: plain libc calls; the fd is owned at once.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(os_err(&format!("no interface {dev}")));
    }
    // Protocol 0 until bound: a socket made with ETH_P_ALL would read every interface.
    let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(os_err("packet socket"));
    }
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    set_int(&fd, libc::SOL_PACKET, PACKET_VNET_HDR, 1)?;
    set_int(&fd, libc::SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)?;
    set_int(&fd, libc::SOL_SOCKET, libc::SO_RCVBUF, 4 << 20)?;
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: POLL.as_micros() as libc::suseconds_t,
    };
    // SAFETY: a timeval of the right size.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(os_err("SO_RCVTIMEO"));
    }
    // SAFETY: zeroed sockaddr_ll is valid; the fields set are the ones bind reads.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
    addr.sll_ifindex = index as i32;
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(os_err(&format!("bind a packet socket to {dev}")));
    }
    Ok(fd)
}

fn read_frames(from: &OwnedFd, out: &SyncSender<(Instant, Vec<u8>)>, s: &Shared) {
    let mut buf = vec![0u8; FRAME];
    while !s.stop.load(Ordering::Relaxed) {
        // SAFETY: reads at most buf.len() bytes into buf.
        let n = unsafe { libc::recv(from.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n <= 0 || s.cut.load(Ordering::Relaxed) {
            continue; // timeout (to look at the stop flag), or a cut cable
        }
        if out
            .send((Instant::now(), buf[..n as usize].to_vec()))
            .is_err()
        {
            return;
        }
    }
}

fn write_frames(to: &OwnedFd, frames: &Receiver<(Instant, Vec<u8>)>, s: &Shared) {
    // When the cable is next free: a frame leaves after its delay and after the frames
    // before it have had their time on the wire.
    let mut free = Instant::now();
    loop {
        let (arrived, frame) = match frames.recv_timeout(POLL) {
            Ok(f) => f,
            Err(RecvTimeoutError::Timeout) if !s.stop.load(Ordering::Relaxed) => continue,
            Err(_) => return,
        };
        let shape = *s.shape.lock().expect("shape lock");
        let leave = (arrived + shape.delay).max(free);
        if let Some(rate) = shape.rate.filter(|&r| r > 0) {
            free = leave + Duration::from_secs_f64(frame.len() as f64 * 8.0 / rate as f64);
        }
        let now = Instant::now();
        if leave > now {
            std::thread::sleep(leave - now);
        }
        if s.cut.load(Ordering::Relaxed) {
            continue;
        }
        // SAFETY: writes frame.len() bytes from frame.
        unsafe { libc::send(to.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
    }
}
