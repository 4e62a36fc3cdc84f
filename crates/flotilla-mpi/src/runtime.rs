//! The process's MPI: initialised once, on first use, at `MPI_THREAD_MULTIPLE` (a group's
//! collectives run on its own worker thread, receives on the progress thread, sends on the
//! caller's); what every group of the process shares (failure state, traffic counters, the
//! list of live groups for the progress thread); and [`finalize`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::Threading;
use mpi::environment::Universe;
use mpi::traits::Communicator as _;

use flotilla_group::{CommError, CommStats};

use crate::stats::Counters;

/// What the progress thread does for each live group.
pub(crate) trait Served: Send + Sync {
    /// Moves the group's waiting point-to-point messages into its mailbox; how many.
    fn drain(&self) -> usize;
    /// Fails the group's collectives past their deadline or after an abort.
    fn watch_deadlines(&self);
}

/// Why MPI could not be started for Flotilla.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MpiInitError {
    /// The MPI library does not support concurrent calls from several threads.
    #[error(
        "MPI provides thread level {provided:?}, but Flotilla's MPI backend needs MPI_THREAD_MULTIPLE (an Open MPI built with thread support, e.g. Debian's libopenmpi)"
    )]
    ThreadLevel {
        /// The level MPI granted.
        provided: String,
    },
    /// Something else in the process initialised MPI first.
    #[error("MPI was already initialised by other code in this process")]
    AlreadyInitialized,
    /// [`finalize`] already ran in this process (MPI cannot start twice).
    #[error("MPI was already finalized in this process")]
    Finalized,
    /// The progress thread could not be started.
    #[error("cannot start the MPI progress thread: {0}")]
    Thread(String),
}

impl From<MpiInitError> for CommError {
    fn from(e: MpiInitError) -> Self {
        CommError::Config(e.to_string())
    }
}

/// What every group of the process shares.
pub(crate) struct Runtime {
    universe: Mutex<Option<Universe>>,
    /// This process's rank in `MPI_COMM_WORLD`.
    pub(crate) world_rank: usize,
    /// The first failure: every later collective fails with it.
    poisoned: Mutex<Option<CommError>>,
    /// Traffic counters.
    pub(crate) stats: Counters,
    groups: Mutex<Vec<Weak<dyn Served>>>,
    progress: Mutex<Option<JoinHandle<()>>>,
    /// Tells the progress thread to end.
    pub(crate) stop: AtomicBool,
    finalized: AtomicBool,
}

static RUNTIME: OnceLock<Result<Runtime, MpiInitError>> = OnceLock::new();

fn init() -> Result<Runtime, MpiInitError> {
    let (universe, provided) = mpi::initialize_with_threading(Threading::Multiple)
        .ok_or(MpiInitError::AlreadyInitialized)?;
    if provided != Threading::Multiple {
        // Dropping the universe finalizes MPI: nothing else may use it now.
        drop(universe);
        return Err(MpiInitError::ThreadLevel {
            provided: format!("{provided:?}"),
        });
    }
    let world_rank = universe.world().rank().max(0) as usize;
    Ok(Runtime {
        universe: Mutex::new(Some(universe)),
        world_rank,
        poisoned: Mutex::new(None),
        stats: Counters::default(),
        groups: Mutex::new(Vec::new()),
        progress: Mutex::new(None),
        stop: AtomicBool::new(false),
        finalized: AtomicBool::new(false),
    })
}

/// The process's MPI runtime, initialising MPI and starting the progress thread on first use.
pub(crate) fn runtime() -> Result<&'static Runtime, MpiInitError> {
    let rt = RUNTIME.get_or_init(init).as_ref().map_err(Clone::clone)?;
    if rt.finalized.load(Ordering::SeqCst) {
        return Err(MpiInitError::Finalized);
    }
    let mut progress = rt.progress.lock().unwrap_or_else(|p| p.into_inner());
    if progress.is_none() {
        let handle = std::thread::Builder::new()
            .name("flotilla-mpi-progress".into())
            .spawn(move || rt.progress_loop())
            .map_err(|e| MpiInitError::Thread(e.to_string()))?;
        *progress = Some(handle);
    }
    Ok(rt)
}

impl Runtime {
    /// The failure that made collectives unusable, if any.
    pub(crate) fn poisoned(&self) -> Option<CommError> {
        self.poisoned.lock().ok().and_then(|p| p.clone())
    }

    /// Records the first failure; later ones keep the first. Returns whether this was it.
    pub(crate) fn poison(&self, e: &CommError) -> bool {
        let mut p = self.poisoned.lock().unwrap_or_else(|p| p.into_inner());
        let first = p.is_none();
        if first {
            *p = Some(e.clone());
        }
        first
    }

    /// The traffic counters as the trait reports them.
    pub(crate) fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    /// Makes the progress thread serve `g` (drain its messages, watch its deadlines).
    pub(crate) fn register(&self, g: Weak<dyn Served>) {
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        groups.retain(|w| w.strong_count() > 0);
        groups.push(g);
    }

    /// The live groups.
    pub(crate) fn groups(&self) -> Vec<Arc<dyn Served>> {
        let groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        groups.iter().filter_map(Weak::upgrade).collect()
    }

    /// The progress thread: drains every group's incoming point-to-point messages into its
    /// mailbox (so `send` completes while the receiver computes, as on TCP, and two ranks
    /// sending to each other never deadlock), and a few times a second fails collectives
    /// past their deadline or after an abort. It polls (`MPI_Improbe`) rather than blocking
    /// in MPI, so that it can stop and watch the clock: right after a message it polls again
    /// at once; when idle it backs off to a 1 ms sleep. Ends when [`Runtime::stop`] is set.
    fn progress_loop(&self) {
        const WATCH_EVERY: Duration = Duration::from_millis(50);
        const MAX_IDLE: Duration = Duration::from_millis(1);
        let mut idle = Duration::from_micros(20);
        let mut watched = Instant::now();
        while !self.stop.load(Ordering::SeqCst) {
            let groups = self.groups();
            let got: usize = groups.iter().map(|g| g.drain()).sum();
            if watched.elapsed() >= WATCH_EVERY {
                groups.iter().for_each(|g| g.watch_deadlines());
                watched = Instant::now();
            }
            // The last handle of a group may be the one held here: the group (and its MPI
            // communicator) is then freed on this thread.
            drop(groups);
            if got > 0 {
                idle = Duration::from_micros(20);
            } else {
                std::thread::sleep(idle);
                idle = (idle * 2).min(MAX_IDLE);
            }
        }
    }

    /// Waits until every group is gone (handles dropped, workers ended), up to `limit`.
    fn groups_gone(&self, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        loop {
            let alive = self
                .groups
                .lock()
                .map(|g| g.iter().any(|w| w.strong_count() > 0))
                .unwrap_or(true);
            if !alive {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// How [`finalize`] ended MPI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finalized {
    /// MPI was never started in this process: nothing to do.
    NotStarted,
    /// `MPI_Finalize` returned: every group was gone and nothing had failed.
    Clean,
}

/// Ends MPI for this process; call it once, from the thread that started MPI (the one that
/// first built an [`crate::MpiGroup`]), after dropping every group.
///
/// With `success` and no failed collective, it waits (up to 10 s) for every group's worker
/// to end and calls `MPI_Finalize`. Otherwise — the run failed, a collective failed or timed
/// out, or a worker is still inside an MPI call that cannot be cancelled — it calls
/// `MPI_Abort` on `MPI_COMM_WORLD` with exit code 1, which ends this process and makes
/// `mpirun` end the others (so a failure never leaves ranks waiting forever).
pub fn finalize(success: bool) -> Finalized {
    let Some(Ok(rt)) = RUNTIME.get() else {
        return Finalized::NotStarted;
    };
    if rt.finalized.swap(true, Ordering::SeqCst) {
        return Finalized::NotStarted;
    }
    rt.stop.store(true, Ordering::SeqCst);
    let progress = rt.progress.lock().ok().and_then(|mut p| p.take());
    if let Some(h) = progress {
        let _ = h.join();
    }
    let clean = success && rt.poisoned().is_none() && rt.groups_gone(Duration::from_secs(10));
    let universe = rt.universe.lock().ok().and_then(|mut u| u.take());
    let Some(universe) = universe else {
        return Finalized::NotStarted;
    };
    if !clean {
        tracing::error!(
            rank = rt.world_rank,
            "ending the MPI job with MPI_Abort (the run failed or a collective is stuck)"
        );
        universe.world().abort(1);
    }
    drop(universe);
    Finalized::Clean
}
