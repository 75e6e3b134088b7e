//! NCCL between the GPUs of one machine: the all-reduce of tensor parallelism on device
//! memory, without a trip through the host.
//!
//! NCCL is a second channel beside a [`crate::Group`]: the group (TCP) still carries the
//! steps, hands out the NCCL id at setup and watches the peers with heartbeats; NCCL
//! carries only the reductions. NCCL itself waits for its peers forever, so every
//! communicator comes with a [`Watchdog`]: when a step runs past its deadline, or the
//! group's links report a dead or frozen peer, it aborts the communicator, the GPU work
//! waiting on it ends with an error, and the rank fails the way a TCP rank would.
//!
//! NVLink multicast (NVLS) should stay off: on shared hosts it can take the GPUs out of
//! service. The `shoal` binary sets `NCCL_NVLS_ENABLE=0` at start-up unless the user set
//! it; [`Communicator::join`] warns when it is not set.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{NcclType, result, sys};

use crate::{CollectiveError, Group, Health, Result, Transport};

fn nccl_err(what: &str) -> impl FnOnce(result::NcclError) -> CollectiveError + '_ {
    move |e| CollectiveError::Invalid(format!("NCCL {what} failed: {:?}", e.0))
}

/// The raw communicator, shared with the watchdog so it can abort it from its thread.
struct Raw {
    comm: sys::ncclComm_t,
    /// Set once the communicator was aborted (or destroyed): no call may use it after.
    gone: AtomicBool,
    why: Mutex<Option<String>>,
}

// SAFETY: an NCCL communicator may be used from one thread while another aborts it
// (that is what ncclCommAbort is for); every other use goes through `Communicator`,
// which one thread owns.
unsafe impl Send for Raw {}
unsafe impl Sync for Raw {}

impl Raw {
    /// Aborts the communicator once; NCCL work in flight on it ends.
    fn abort(&self, why: String) {
        if self.gone.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Ok(mut w) = self.why.lock() {
            *w = Some(why);
        }
        // SAFETY: `comm` came from ncclCommInitRank and `gone` guarantees one abort.
        unsafe {
            let _ = result::comm_abort(self.comm);
        }
    }

    fn why(&self) -> String {
        self.why
            .lock()
            .ok()
            .and_then(|w| w.clone())
            .unwrap_or_else(|| "the NCCL communicator was aborted".into())
    }
}

/// One rank's NCCL communicator, bound to the stream its tensors are computed on.
pub struct Communicator {
    raw: Arc<Raw>,
    stream: Arc<CudaStream>,
    rank: usize,
    /// When the current step began, in milliseconds since `epoch`; 0 when idle.
    busy_since: Arc<AtomicU64>,
    epoch: Instant,
}

/// A communicator handle to move off the thread that made it.
struct SendComm(sys::ncclComm_t);
// SAFETY: the handle is only moved between threads here, never used from two at once.
unsafe impl Send for SendComm {}

/// Where the init thread and the waiting caller meet.
enum InitState {
    Waiting,
    /// The caller gave up; the init thread aborts whatever it makes.
    Abandoned,
}

/// `ncclCommInitRank` on a helper thread, waited for with a deadline. NCCL's bootstrap
/// waits for every rank without a limit: a peer that died after the id was sent would
/// hold this rank forever. Instead the caller gets an error when the group's link
/// health reports a failure or when `deadline` passes, and the helper thread, should
/// NCCL ever return, aborts the communicator nobody will use (the process normally
/// exits on the error first).
fn init_within(
    stream: &Arc<CudaStream>,
    id: sys::ncclUniqueId,
    (rank, world): (usize, usize),
    health: Health,
    deadline: Duration,
) -> Result<sys::ncclComm_t> {
    let context = stream.context().clone();
    let state = Arc::new(Mutex::new(InitState::Waiting));
    let (tx, rx) = std::sync::mpsc::channel();
    let shared = Arc::clone(&state);
    std::thread::Builder::new()
        .name("shoal-nccl-init".into())
        .spawn(move || {
            let made = context
                .bind_to_thread()
                .map_err(|e| CollectiveError::Invalid(format!("CUDA context: {e}")))
                .and_then(|()| {
                    let mut comm = std::mem::MaybeUninit::uninit();
                    // SAFETY: `comm` is written by NCCL before it is read; the id is the
                    // one rank 0 made, the same on every rank.
                    unsafe {
                        result::comm_init_rank(comm.as_mut_ptr(), world as i32, id, rank as i32)
                            .map_err(nccl_err("init"))?;
                        Ok(SendComm(comm.assume_init()))
                    }
                });
            let state = shared.lock().unwrap_or_else(|p| p.into_inner());
            match (&*state, made) {
                (InitState::Abandoned, Ok(comm)) => {
                    // SAFETY: nobody else holds this communicator.
                    let _ = unsafe { result::comm_abort(comm.0) };
                }
                (_, made) => {
                    let _ = tx.send(made);
                }
            }
        })
        .map_err(|e| CollectiveError::Setup(format!("starting the NCCL init thread: {e}")))?;
    let started = Instant::now();
    let give_up = |why: String| -> CollectiveError {
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
        *s = InitState::Abandoned;
        // An answer that arrived in the meantime is aborted here, under the same lock.
        if let Ok(Ok(comm)) = rx.try_recv() {
            // SAFETY: nobody else holds this communicator.
            let _ = unsafe { result::comm_abort(comm.0) };
        }
        CollectiveError::Setup(why)
    };
    loop {
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(made) => return made.map(|c| c.0),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(CollectiveError::Setup(
                    "the NCCL init thread ended without an answer".into(),
                ));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if let Some(why) = health.failure() {
                    return Err(give_up(format!(
                        "NCCL init abandoned: a link of the group failed ({why})"
                    )));
                }
                if started.elapsed() >= deadline {
                    return Err(give_up(format!(
                        "NCCL init: not every rank joined within {deadline:?} (a peer may \
                         have died or failed before its own init)"
                    )));
                }
            }
        }
    }
}

impl Communicator {
    /// Joins the ranks of `group` into one NCCL communicator: rank 0 makes the id and
    /// sends it over the group; every rank then initialises its part on `stream`.
    /// Every rank of the group must call this at the same point of its program. The
    /// init is bounded by the group's deadline and its links' health (`init_within`).
    pub fn join<T: Transport>(group: &mut Group<T>, stream: Arc<CudaStream>) -> Result<Self> {
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            tracing::warn!("NCCL_NVLS_ENABLE is not set: NCCL may use NVLink multicast");
        }
        let (rank, world) = (group.rank(), group.world());
        let mut id_bytes = if rank == 0 {
            let id = result::get_uniqueid().map_err(nccl_err("get unique id"))?;
            id.internal.iter().map(|&c| c as u8).collect()
        } else {
            Vec::new()
        };
        group.broadcast(0, &mut id_bytes)?;
        let internal: [std::ffi::c_char; 128] = id_bytes
            .iter()
            .map(|&b| b as std::ffi::c_char)
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|_| {
                CollectiveError::Invalid("rank 0 sent an NCCL id of the wrong size".into())
            })?;
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| CollectiveError::Invalid(format!("CUDA context: {e}")))?;
        let comm = init_within(
            &stream,
            sys::ncclUniqueId { internal },
            (rank, world),
            group.health(),
            group.deadline(),
        )?;
        tracing::info!(rank, world, "NCCL communicator ready");
        Ok(Self {
            raw: Arc::new(Raw {
                comm,
                gone: AtomicBool::new(false),
                why: Mutex::new(None),
            }),
            stream,
            rank,
            busy_since: Arc::new(AtomicU64::new(0)),
            epoch: Instant::now(),
        })
    }

    /// The stream the reductions run on (the tensors' stream).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn check(&self) -> Result<()> {
        if self.raw.gone.load(Ordering::SeqCst) {
            return Err(CollectiveError::Invalid(self.raw.why()));
        }
        Ok(())
    }

    /// `dst = sum over ranks of src`, queued on the stream (it does not wait for it).
    pub fn all_reduce_sum<T: NcclType>(
        &self,
        src: &impl DevicePtr<T>,
        dst: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.check()?;
        if src.len() != dst.len() {
            return Err(CollectiveError::Invalid(format!(
                "all-reduce of {} values into {}",
                src.len(),
                dst.len()
            )));
        }
        let (s, _read) = src.device_ptr(&self.stream);
        let (d, _write) = dst.device_ptr_mut(&self.stream);
        // SAFETY: both pointers are live device buffers of `len` values on this stream's
        // device; the events recorded by `_read`/`_write` keep them ordered.
        unsafe {
            result::all_reduce(
                s as _,
                d as _,
                src.len(),
                T::as_nccl_type(),
                sys::ncclRedOp_t::ncclSum,
                self.raw.comm,
                self.stream.cu_stream() as _,
            )
        }
        .map_err(nccl_err("all-reduce"))?;
        Ok(())
    }

    /// Marks the start of a step for the watchdog's deadline.
    pub fn step_started(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.busy_since.store(ms.max(1), Ordering::SeqCst);
    }

    /// Marks the end of a step. Returns the abort's cause if the watchdog aborted the
    /// communicator meanwhile: the step's results cannot be trusted.
    pub fn step_finished(&self) -> Result<()> {
        self.busy_since.store(0, Ordering::SeqCst);
        self.check()
    }

    /// Starts the watchdog: it aborts this communicator when a step has run longer than
    /// `deadline`, or when `health` reports a failed link during a step. It ends with
    /// the communicator.
    pub fn watch(&self, health: Health, deadline: Duration) -> Result<Watchdog> {
        let raw = Arc::downgrade(&self.raw);
        let busy = Arc::clone(&self.busy_since);
        let epoch = self.epoch;
        let rank = self.rank;
        let handle = std::thread::Builder::new()
            .name(format!("shoal-nccl-watchdog-{rank}"))
            .spawn(move || watch_loop(raw, busy, epoch, health, deadline))
            .map_err(|e| CollectiveError::Io {
                what: "spawn the NCCL watchdog".into(),
                source: e,
            })?;
        Ok(Watchdog { _thread: handle })
    }
}

/// The thread that aborts a stuck communicator (see [`Communicator::watch`]).
pub struct Watchdog {
    _thread: std::thread::JoinHandle<()>,
}

fn watch_loop(
    raw: Weak<Raw>,
    busy: Arc<AtomicU64>,
    epoch: Instant,
    health: Health,
    deadline: Duration,
) {
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let Some(raw) = raw.upgrade() else {
            return; // the communicator is gone
        };
        if raw.gone.load(Ordering::SeqCst) {
            return;
        }
        let since = busy.load(Ordering::SeqCst);
        if since == 0 {
            continue;
        }
        let running = epoch.elapsed().saturating_sub(Duration::from_millis(since));
        if let Some(why) = health.failure() {
            tracing::error!(%why, "a peer failed during a step: aborting NCCL");
            raw.abort(format!("NCCL aborted: {why}"));
            return;
        }
        if running > deadline {
            tracing::error!(?running, "a step outlived its deadline: aborting NCCL");
            raw.abort(format!(
                "NCCL aborted: a step ran {running:?}, past the deadline of {deadline:?}"
            ));
            return;
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if !self.raw.gone.swap(true, Ordering::SeqCst) {
            // SAFETY: the communicator is live and nothing else uses it any more.
            unsafe {
                let _ = result::comm_abort(self.raw.comm);
            }
        }
    }
}
