//! Starting the ranks of a job (N local copies of this binary, or `ssh` clients that run them
//! on inventory hosts) and supervising them: their output is relayed line by line, and the
//! first rank to fail stops all the others and is named. Ctrl-C (or SIGTERM) on the launcher
//! stops every rank too.
//!
//! Around it: the `flotilla launch` command ([`cmd`]; [`program`] for `-- PROGRAM`), what
//! the launcher does with its ranks' lines ([`relay`](mod@relay)), jobs on inventory hosts
//! ([`inventory`], over [`remote`]'s ssh) and their TLS files ([`tls`]).

pub(crate) mod cmd;
pub(crate) mod elastic;
mod frozen;
pub(crate) mod inventory;
pub mod memory_limit;
pub(crate) mod program;
mod relay;
pub(crate) mod remote;
pub(crate) mod replace;
mod tls;

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use flotilla_telemetry::RankEvent;
use flotilla_train::TrainConfig;

use crate::rendezvous_socket::RendezvousSocket;

/// Lines of a failed rank's stderr shown in the launcher's error.
const STDERR_TAIL: usize = 20;

/// How long the other ranks may keep reporting after the first failure is seen.
const FAILURE_GRACE: Duration = Duration::from_millis(1500);

/// How long tolerated ranks may keep running once every rank the job needs has finished,
/// unless [`LocalJob::stop_stragglers_after`] says otherwise (the default `timeout_s`).
const STRAGGLER_GRACE: Duration = Duration::from_secs(60);

/// Which stream a relayed line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// A line from a rank.
#[derive(Debug)]
pub struct RankLine {
    /// The rank.
    pub rank: usize,
    /// The stream.
    pub stream: Stream,
    /// The text, without its newline.
    pub text: String,
}

/// Set by the Ctrl-C / SIGTERM handler of [`stop_on_interrupt`].
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Makes Ctrl-C and SIGTERM end a supervised job cleanly (every rank stopped, remote ones
/// included) instead of killing the launcher first. Call before starting ranks; the handler
/// is installed once per process (`flotilla compare` launches several jobs in turn).
pub fn stop_on_interrupt() -> Result<()> {
    static INSTALLED: std::sync::OnceLock<std::result::Result<(), String>> =
        std::sync::OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst))
                .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|e| anyhow::anyhow!("installing the Ctrl-C handler: {e}"))
}

/// Whether Ctrl-C or SIGTERM reached the launcher.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// What [`LocalJob::reap`] found: the first failed rank the job needs, and the tolerated
/// ranks that failed with their exit status.
type Reaped = (Option<usize>, Vec<(usize, ExitStatus)>);

/// What stops ranks the launcher cannot reach by killing its own children (remote ones).
pub type StopHook = Box<dyn FnMut() + Send>;

/// The running ranks of a job, each a child process of the launcher (the rank itself, or the
/// `ssh` client that runs it on its host).
pub struct LocalJob {
    children: Vec<(usize, Child)>,
    lines: Receiver<RankLine>,
    /// The sending end of `lines`, kept while ranks may still be started again.
    tx: Option<Sender<RankLine>>,
    respawn: Option<Respawn>,
    respawns: u32,
    stderr_tails: Vec<VecDeque<String>>,
    /// When each rank was seen to exit.
    exited_at: Vec<Option<Instant>>,
    blamed: Vec<Option<usize>>,
    tolerated: Vec<bool>,
    straggler_grace: Duration,
    on_stop: Option<StopHook>,
    /// Lines read before [`LocalJob::supervise`] (while waiting for rank 0's port), relayed
    /// first by it.
    early: Vec<RankLine>,
    /// Asked at every turn: a reason the whole job must stop ([`LocalJob::fail_when`]).
    fail_when: Option<FailWhen>,
}

/// A check of the job as a whole (see [`LocalJob::fail_when`]).
pub type FailWhen = Box<dyn FnMut() -> Option<String> + Send>;

impl LocalJob {
    /// Starts `n` copies of this executable with `args`; `env(rank)` gives each its extra
    /// environment; rank 0 inherits `socket`, the job's rendezvous listener, when given.
    pub fn spawn(
        n: usize,
        args: &[OsString],
        env: impl Fn(usize) -> Vec<(String, String)>,
        socket: Option<&RendezvousSocket>,
    ) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the flotilla executable")?;
        let commands = (0..n).map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.args(args);
            for (k, v) in env(rank) {
                cmd.env(k, v);
            }
            if let (0, Some(s)) = (rank, socket) {
                s.hand_to(&mut cmd);
            }
            cmd
        });
        Self::start(commands, None)
    }

    /// Starts one command per rank, in rank order (stdin closed, output relayed).
    /// `on_stop` runs when ranks are stopped before they all ended, before the children are
    /// killed (e.g. to end remote ranks over ssh).
    pub fn start(
        commands: impl IntoIterator<Item = Command>,
        on_stop: Option<StopHook>,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let mut job = LocalJob {
            children: Vec::new(),
            lines: rx,
            tx: Some(tx),
            respawn: None,
            respawns: 0,
            stderr_tails: Vec::new(),
            exited_at: Vec::new(),
            blamed: Vec::new(),
            tolerated: Vec::new(),
            straggler_grace: STRAGGLER_GRACE,
            on_stop,
            early: Vec::new(),
            fail_when: None,
        };
        job.start_more(commands)?;
        Ok(job)
    }

    /// Waits until rank 0 says the rendezvous port it bound ([`flotilla_tcp::announced_port`])
    /// and returns it; fails (its stderr shown) if it exits first, or after `within`. The
    /// lines read meanwhile are relayed by [`Self::supervise`].
    pub fn announced_port(&mut self, within: Duration) -> Result<u16> {
        let until = Instant::now() + within;
        loop {
            if let Ok(line) = self.lines.recv_timeout(Duration::from_millis(50)) {
                self.remember(&line);
                let port = flotilla_tcp::announced_port(&line.text).filter(|_| line.rank == 0);
                self.early.push(line);
                if let Some(port) = port {
                    return Ok(port);
                }
                continue;
            }
            let exited = match self.children.first_mut() {
                Some((_, c)) => c.try_wait().context("waiting for rank 0")?,
                None => bail!("rank 0 was not started"),
            };
            let why = match exited {
                Some(status) => format!("rank 0 exited ({}) before", describe(status)),
                None if INTERRUPTED.load(Ordering::SeqCst) => "interrupted before rank 0".into(),
                None if Instant::now() >= until => format!("rank 0 did not say within {within:?}"),
                None => continue,
            };
            while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
                self.remember(&line);
            }
            self.kill_all();
            let tail: Vec<&str> = self.stderr_tails[0].iter().map(String::as_str).collect();
            bail!(
                "{why} it listened for the other ranks (they were not started)\n--- last lines \
                 of rank 0's stderr ---\n{}",
                tail.join("\n")
            );
        }
    }

    /// Starts the next ranks (numbered on from those running: all of them from
    /// [`Self::start`], the others once rank 0's port is known); on failure every rank is
    /// stopped.
    pub fn start_more(&mut self, commands: impl IntoIterator<Item = Command>) -> Result<()> {
        let Some(tx) = self.tx.clone() else {
            bail!("the job's ranks are already supervised");
        };
        for mut cmd in commands {
            let rank = self.children.len();
            let child = match start_child(&mut cmd, rank, &tx) {
                Ok(c) => c,
                Err(e) => {
                    self.kill_all();
                    return Err(e);
                }
            };
            self.children.push((rank, child));
            self.stderr_tails.push(VecDeque::new());
            self.exited_at.push(None);
            self.blamed.push(None);
            self.tolerated.push(false);
        }
        Ok(())
    }

    /// Lets tolerated ranks be started again, alone, after they fail (each start by
    /// `respawn.make`, at most `respawn.left` in all): a worker of an asynchronous
    /// parameter server rejoins the running job.
    pub fn respawn_with(&mut self, respawn: Respawn) {
        self.respawn = Some(respawn);
    }

    /// Starts tolerated rank `i` again if the budget allows; says so either way.
    fn try_respawn(&mut self, i: usize, how: ExitStatus) -> bool {
        let rank = self.children[i].0;
        let ending = |r: &Respawn| r.ending.as_ref().is_some_and(|e| e.load(Ordering::SeqCst));
        let Some(r) = self
            .respawn
            .as_mut()
            .filter(|r| r.left > 0 && r.ranks.contains(&rank) && !interrupted() && !ending(r))
        else {
            eprintln!(
                "[launcher] rank {rank} exited ({}); the job goes on without it",
                describe_rank(rank, how)
            );
            return false;
        };
        let Some(tx) = self.tx.as_ref() else {
            return false;
        };
        r.left -= 1;
        r.used += 1;
        self.respawns += 1;
        eprintln!(
            "[launcher] restart {}/{} after: rank {rank} failed ({}); it rejoins the running job",
            r.used,
            r.total,
            describe_rank(rank, how)
        );
        match (r.make)(rank).and_then(|mut cmd| start_child(&mut cmd, rank, tx)) {
            Ok(child) => {
                self.children[i].1 = child;
                self.blamed[i] = None;
                self.stderr_tails[i].clear();
                true
            }
            Err(e) => {
                eprintln!("[launcher] could not restart rank {rank}: {e:#}");
                false
            }
        }
    }

    /// Asks `check` at every turn of [`LocalJob::supervise`]: a reason it gives stops every
    /// rank and ends the job with it (an elastic job's lighthouse below the minimum).
    pub fn fail_when(&mut self, check: FailWhen) {
        self.fail_when = Some(check);
    }

    /// Ranks of this job started again so far.
    pub fn respawned(&self) -> u32 {
        self.respawns
    }

    /// Ranks whose failure does not stop the job (e.g. workers of an asynchronous parameter
    /// server, which trains on without them); their exit is reported and the job goes on.
    pub fn tolerate(&mut self, ranks: impl IntoIterator<Item = usize>) {
        for r in ranks {
            if let Some(t) = self.tolerated.get_mut(r) {
                *t = true;
            }
        }
    }

    /// Once every rank that is not tolerated has finished successfully, tolerated ranks still
    /// running `grace` later are stuck (a stopped worker of an asynchronous server): they are
    /// named and stopped, and the job ends as the ranks it needs did.
    pub fn stop_stragglers_after(&mut self, grace: Duration) {
        self.straggler_grace = grace;
    }

    /// Kills every rank still running and reaps them all (first the stop hook, if some rank
    /// is still running).
    pub fn kill_all(&mut self) {
        let running = self
            .children
            .iter_mut()
            .any(|(_, c)| matches!(c.try_wait(), Ok(None)));
        if running && let Some(stop) = self.on_stop.as_mut() {
            stop();
        }
        for (_, c) in &mut self.children {
            let _ = c.kill();
        }
        for (_, c) in &mut self.children {
            let _ = c.wait();
        }
    }

    /// Relays lines to `on_line` until every rank has exited. When a rank fails, the others
    /// get a short grace period to report what they saw, then all are stopped; the error names
    /// the root cause: following each failed rank's `failed` event ([`RankEvent::Failed`]) to the rank it
    /// blames (a rank that died, or one still running but stuck), and shows its stderr.
    /// `deadline` bounds the whole job.
    pub fn supervise(
        &mut self,
        deadline: Option<Duration>,
        on_line: &mut dyn FnMut(&RankLine),
    ) -> Result<()> {
        let started = Instant::now();
        let n = self.children.len();
        let mut status: Vec<Option<ExitStatus>> = vec![None; n];
        let mut first_failure: Option<usize> = None;
        let mut grace_until: Option<Instant> = None;
        let mut stragglers_since: Option<Instant> = None;
        if self.respawn.is_none() {
            // Nothing more will start: the line channel ends with the last rank's output.
            self.tx = None;
        }
        for line in std::mem::take(&mut self.early) {
            on_line(&line);
        }
        loop {
            if let Ok(line) = self.lines.recv_timeout(Duration::from_millis(20)) {
                self.remember(&line);
                on_line(&line);
                while let Ok(line) = self.lines.try_recv() {
                    self.remember(&line);
                    on_line(&line);
                }
            }
            let (failed, restart) = self.reap(&mut status)?;
            if first_failure.is_none()
                && let Some(i) = failed.or_else(|| self.blames_a_needed_rank(&status))
            {
                first_failure = Some(i);
                grace_until = Some(Instant::now() + FAILURE_GRACE);
            }
            for (i, how) in restart {
                if first_failure.is_none() && self.try_respawn(i, how) {
                    status[i] = None;
                }
            }
            if INTERRUPTED.load(Ordering::SeqCst) {
                self.kill_all();
                self.drain(on_line);
                bail!("interrupted (Ctrl-C or SIGTERM): stopped all ranks");
            }
            if let Some(why) = self.fail_when.as_mut().and_then(|check| check()) {
                self.drain(on_line);
                self.kill_all();
                bail!("{why}; stopped all ranks");
            }
            let all_done = status.iter().all(Option::is_some);
            if let Some(first) = first_failure
                && (all_done || grace_until.is_some_and(|t| Instant::now() >= t))
            {
                self.kill_all();
                self.drain(on_line);
                return Err(self.failure_report(first, &status));
            }
            if all_done {
                self.drain(on_line);
                // Tolerated ranks go on without one another, but a job none of whose ranks
                // succeeded failed (every process of an elastic job refused at its start).
                if status.iter().all(|s| s.is_some_and(|s| !s.success())) {
                    return Err(self.failure_report(0, &status));
                }
                return Ok(());
            }
            if first_failure.is_none() && self.stragglers_stopped(&status, &mut stragglers_since) {
                self.drain(on_line);
                return Ok(());
            }
            if let Some(limit) = deadline
                && started.elapsed() > limit
            {
                let alive: Vec<String> = (0..n)
                    .filter(|i| status[*i].is_none())
                    .map(|i| i.to_string())
                    .collect();
                self.kill_all();
                bail!(
                    "job exceeded its deadline of {limit:?}; ranks still running: {}",
                    alive.join(", ")
                );
            }
        }
    }

    /// Records the ranks that exited since the last call; returns the first that failed and
    /// is not tolerated, and the tolerated ones that failed (to start again, or to report as
    /// absorbed: [`Self::try_respawn`]).
    fn reap(&mut self, status: &mut [Option<ExitStatus>]) -> Result<Reaped> {
        let mut failed = None;
        let mut tolerated = Vec::new();
        for (i, (rank, child)) in self.children.iter_mut().enumerate() {
            if status[i].is_some() {
                continue;
            }
            match child.try_wait() {
                Ok(Some(s)) => {
                    status[i] = Some(s);
                    self.exited_at[i] = Some(Instant::now());
                    if !s.success() && self.tolerated[i] {
                        tolerated.push((i, s));
                    } else if !s.success() && failed.is_none() {
                        failed = Some(i);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    let rank = *rank;
                    self.kill_all();
                    return Err(e).with_context(|| format!("waiting for rank {rank}"));
                }
            }
        }
        Ok((failed, tolerated))
    }

    /// A tolerated rank that failed blaming a rank the job cannot go on without (one not
    /// tolerated that has not finished successfully: a stuck or dead server) reports that
    /// rank's failure, not a loss the job absorbs. Blame can arrive after the exit is seen,
    /// so this is asked again at every turn.
    fn blames_a_needed_rank(&self, status: &[Option<ExitStatus>]) -> Option<usize> {
        (0..status.len()).find(|&i| {
            self.tolerated[i]
                && status[i].is_some_and(|s| !s.success())
                && self.blamed[i].is_some_and(|b| {
                    b != i
                        && b < status.len()
                        && !self.tolerated[b]
                        && !status[b].is_some_and(|s| s.success())
                })
        })
    }

    /// Whether tolerated ranks were still running [`Self::straggler_grace`] after every
    /// needed rank finished successfully (in a job without one, an elastic job's: after one
    /// rank did); if so they are named and killed.
    fn stragglers_stopped(
        &mut self,
        status: &[Option<ExitStatus>],
        since: &mut Option<Instant>,
    ) -> bool {
        let needed_done = if self.tolerated.iter().all(|t| *t) {
            // No rank needed by name (an elastic job): it ended once one finished.
            status.iter().any(|s| s.is_some_and(|s| s.success()))
        } else {
            (0..status.len())
                .filter(|&i| !self.tolerated[i])
                .all(|i| status[i].is_some_and(|s| s.success()))
        };
        if !needed_done {
            return false;
        }
        let since = since.get_or_insert_with(Instant::now);
        let running: Vec<usize> = (0..status.len()).filter(|&i| status[i].is_none()).collect();
        // A stopped process cannot finish, whatever the grace.
        let frozen = running.iter().all(|&i| {
            let pid = self.children.get(i).map(|(_, c)| c.id());
            pid.is_some_and(frozen::frozen)
        });
        if !frozen && since.elapsed() < self.straggler_grace {
            return false;
        }
        let names: Vec<String> = running.iter().map(usize::to_string).collect();
        let why = if frozen {
            "frozen (stopped by a signal)".to_string()
        } else {
            format!("{:?} (stuck)", self.straggler_grace)
        };
        eprintln!(
            "[launcher] rank(s) {} still running after the job ended, {why}; stopped them",
            names.join(", ")
        );
        self.kill_all();
        true
    }

    /// The root cause of a failure: blame followed from `first`. When blame goes round in a
    /// circle (ranks that timed out waiting for each other while the rank at fault was
    /// silent), the root cause is a rank some failed rank blames that is still running: the
    /// stuck one.
    fn root_cause(&self, first: usize, status: &[Option<ExitStatus>]) -> usize {
        let blamed = |r: usize| {
            self.blamed
                .get(r)
                .copied()
                .flatten()
                .filter(|&b| b != r && b < status.len())
        };
        let mut root = first;
        let mut seen = vec![false; status.len()];
        while let Some(b) = blamed(root) {
            seen[root] = true;
            if seen[b] {
                let stuck = (0..status.len())
                    .filter(|&r| status[r].is_some())
                    .filter_map(blamed)
                    .find(|&b| status[b].is_none());
                return stuck.unwrap_or(root);
            }
            root = b;
        }
        root
    }

    /// Builds the error of a failed job, starting from the first rank seen failing and
    /// following blame to the root cause.
    fn failure_report(&self, first: usize, status: &[Option<ExitStatus>]) -> anyhow::Error {
        let root = self.root_cause(first, status);
        let tail = |r: usize| {
            self.stderr_tails[r]
                .iter()
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        };
        let what = match status[root] {
            // ssh's own failure code: the connection ended, or the remote shell was killed.
            Some(s) if self.on_stop.is_some() && s.code() == Some(255) => format!(
                "rank {root} failed (ssh exit code 255: the connection to its host ended, or \
                 the rank was killed there)"
            ),
            Some(s) if !s.success() => format!("rank {root} failed ({})", describe_rank(root, s)),
            Some(_) => format!("rank {root} exited early"),
            None => {
                format!("rank {root} stopped responding (still running when the others gave up)")
            }
        };
        let mut msg = format!("{what}; stopped all ranks.");
        // Ranks that ended well before the failure: the likely reason the others waited.
        let failed_at = self.exited_at[first];
        let left: Vec<String> = (0..status.len())
            .filter(|&r| status[r].is_some_and(|s| s.success()))
            .filter(|&r| self.exited_at[r].zip(failed_at).is_some_and(|(e, f)| e < f))
            .map(|r| r.to_string())
            .collect();
        if !left.is_empty() {
            msg.push_str(&format!(
                " Rank(s) {} had exited (code 0) while the others still ran: a rank that ends \
                 early, before joining or before the last collective, leaves the others waiting.",
                left.join(", ")
            ));
        }
        if root != first {
            msg.push_str(&format!("\n--- rank {first} reported ---\n{}", tail(first)));
        }
        msg.push_str(&format!(
            "\n--- last lines of rank {root}'s stderr ---\n{}",
            tail(root)
        ));
        anyhow::anyhow!(msg)
    }

    fn remember(&mut self, line: &RankLine) {
        if line.stream == Stream::Stdout
            && let Some(Ok(RankEvent::Failed { blamed })) = RankEvent::parse(&line.text)
            && let Some(slot) = self.blamed.get_mut(line.rank)
        {
            *slot = Some(blamed);
        }
        if line.stream == Stream::Stderr
            && let Some(tail) = self.stderr_tails.get_mut(line.rank)
        {
            if tail.len() == STDERR_TAIL {
                tail.pop_front();
            }
            tail.push_back(line.text.clone());
        }
    }

    /// Relays what is left in the pipes of exited ranks (bounded wait). No rank starts after
    /// it: the channel's own sender goes, so that it ends with the last rank's output instead
    /// of at the bound (an elastic job kept it for its replacements).
    fn drain(&mut self, on_line: &mut dyn FnMut(&RankLine)) {
        self.tx = None;
        let until = Instant::now() + Duration::from_millis(500);
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.remember(&line);
                    on_line(&line);
                }
                Err(_) => break,
            }
        }
    }
}

impl Drop for LocalJob {
    fn drop(&mut self) {
        // Never leave ranks behind, whatever path left the launcher.
        self.kill_all();
    }
}

/// Makes the child get SIGKILL when the launcher dies, however it dies (even by SIGKILL or
/// the OOM killer, where no cleanup code runs): Linux's parent-death signal. A child whose
/// launcher is already gone when it starts exits at once.
fn die_with_launcher(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let launcher = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the forked child before exec, where only
        // async-signal-safe calls are allowed (another thread of the parent may have held the
        // allocator's lock at the fork): it calls prctl and getppid and builds its errors
        // with `from_raw_os_error` (an `io::Error` that holds the number, no allocation, as
        // `last_os_error` does), from values copied before the fork (`launcher`); nothing in it
        // allocates or formats. Checked by reading it: no `String`, `Box`, `Vec`, `format!`,
        // `Error::other` or `Error::new` (which box their message) is reached.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != launcher {
                    // The launcher exited between the fork and here: no one is left to read
                    // a message; "no such process" is the launcher's.
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// How tolerated ranks are started again (see [`LocalJob::respawn_with`]).
pub struct Respawn {
    /// The command that starts rank `r` again.
    pub make: Box<dyn FnMut(usize) -> Result<Command> + Send>,
    /// The ranks it may start again (others that fail are left out, as before).
    pub ranks: Vec<usize>,
    /// Starts still allowed.
    pub left: u32,
    /// The budget as given (for the "restart k/R" lines).
    pub total: u32,
    /// Restarts counted against the budget so far (of the job or of single ranks).
    pub used: u32,
    /// Once set, no rank is started again (an elastic job that is ending: a replacement
    /// would be refused).
    pub ending: Option<Arc<AtomicBool>>,
}

/// Starts one rank's process: stdin closed, output relayed to `tx`, ended with the launcher.
fn start_child(cmd: &mut Command, rank: usize, tx: &Sender<RankLine>) -> Result<Child> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_launcher(cmd);
    crate::binding::bind_child(cmd);
    // Held open until the child has entered its cgroup (it writes its pid there).
    let _cgroup = memory_limit::confine_child(cmd, rank)?;
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting rank {rank} ({})", cmd.get_program().display()))?;
    if let Some(out) = child.stdout.take() {
        relay(out, rank, Stream::Stdout, tx.clone());
    }
    if let Some(err) = child.stderr.take() {
        relay(err, rank, Stream::Stderr, tx.clone());
    }
    Ok(child)
}

fn relay<R: Read + Send + 'static>(stream: R, rank: usize, which: Stream, tx: Sender<RankLine>) {
    thread::spawn(move || {
        let reader = BufReader::new(stream);
        for line in reader.split(b'\n') {
            let Ok(bytes) = line else { break };
            let text = String::from_utf8_lossy(&bytes)
                .trim_end_matches('\r')
                .to_string();
            if tx
                .send(RankLine {
                    rank,
                    stream: which,
                    text,
                })
                .is_err()
            {
                break;
            }
        }
    });
}

/// How rank `rank` ended: [`describe`], and the OOM killer when its memory cgroup says so
/// (`--memory-per-rank`).
fn describe_rank(rank: usize, status: ExitStatus) -> String {
    let how = describe(status);
    match memory_limit::oom_cause(rank, status) {
        Some(cause) => format!("{how}: {cause}"),
        None => how,
    }
}

fn describe(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exit code {code}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("killed by signal {sig}");
        }
    }
    "abnormal exit".to_string()
}

/// The default device burn should use in a rank of `config` (`BURN_DEVICE`, see
/// [`flotilla_engine::burn_device_for`]), unless the user set one: the variable for each
/// rank's environment, local or remote, `flotilla train`'s or a program's.
pub fn burn_device_env(config: &TrainConfig) -> Option<(String, String)> {
    if std::env::var_os(flotilla_engine::BURN_DEVICE_ENV).is_some() {
        return None;
    }
    let device = flotilla_engine::burn_device_for(&config.model.device)?;
    Some((
        flotilla_engine::BURN_DEVICE_ENV.to_string(),
        device.to_string(),
    ))
}

/// Before restart `restarts.0` of `restarts.1` of a job that failed with `failure`: says why
/// and where from (the newest checkpoint, or the start), and makes the next start resume
/// (a config job's ranks and a program's alike: `schedule.resume`).
pub fn restart_for(config: &mut TrainConfig, failure: &anyhow::Error, restarts: (u32, u32)) {
    let from = match flotilla_train::checkpoint::latest(&config.telemetry.output) {
        Ok(Some(dir)) => format!("resuming from {}", dir.display()),
        _ => "from the start (no checkpoint yet: set checkpoint_every)".to_owned(),
    };
    let cause = format!("{failure:#}");
    let cause = cause
        .lines()
        .next()
        .unwrap_or_default()
        .trim_end_matches('.');
    eprintln!(
        "[launcher] restart {}/{} after: {cause}; {from}",
        restarts.0, restarts.1
    );
    config.schedule.resume = true;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sh -c script` as a rank.
    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    fn supervise(job: &mut LocalJob) -> (Result<()>, Duration) {
        let started = Instant::now();
        let r = job.supervise(Some(Duration::from_secs(20)), &mut |_| {});
        (r, started.elapsed())
    }

    /// A tolerated rank still running after every needed rank finished is stuck: named,
    /// stopped, and the job ends as the needed ranks did.
    #[test]
    fn a_stuck_tolerated_rank_is_stopped_after_the_job_ended() {
        let mut job = LocalJob::start([sh("sleep 0.2"), sh("sleep 30")], None).expect("start");
        job.tolerate([1]);
        job.stop_stragglers_after(Duration::from_millis(300));
        let (r, took) = supervise(&mut job);
        assert!(r.is_ok(), "{r:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    /// Tolerated ranks that all fail (an elastic job's processes, each refused as it
    /// starts) fail the job, naming the first's error; one success among them is a job
    /// that went on without the others.
    #[test]
    fn a_job_whose_tolerated_ranks_all_failed_failed() {
        let mut job =
            LocalJob::start([sh("echo no >&2; exit 3"), sh("exit 3")], None).expect("start");
        job.tolerate([0, 1]);
        let e = format!("{:#}", supervise(&mut job).0.expect_err("the job fails"));
        assert!(e.contains("rank 0") && e.contains("no"), "{e}");
        let mut job = LocalJob::start([sh("exit 3"), sh("sleep 0.2")], None).expect("start");
        job.tolerate([0, 1]);
        assert!(supervise(&mut job).0.is_ok());
    }

    /// Only the ranks a respawn names are started again: another tolerated rank that fails
    /// (a local server under an async global one) is left out, the budget untouched.
    #[test]
    fn only_the_ranks_a_respawn_names_start_again() {
        let mut job = LocalJob::start(
            [sh("sleep 0.5"), sh("exit 3"), sh("sleep 0.2; exit 3")],
            None,
        )
        .expect("start");
        job.tolerate([1, 2]);
        job.respawn_with(Respawn {
            make: Box::new(|_| Ok(sh("exit 0"))),
            ranks: vec![2],
            left: 5,
            total: 5,
            used: 0,
            ending: None,
        });
        assert!(supervise(&mut job).0.is_ok());
        assert_eq!(job.respawned(), 1, "rank 2 once, rank 1 never");
    }

    /// A tolerated rank that fails blaming a needed rank (its stuck server) ends the job,
    /// which names the server.
    #[test]
    fn a_tolerated_rank_blaming_its_stuck_server_ends_the_job() {
        let failed = RankEvent::Failed { blamed: 0 }.line();
        let worker = sh(&format!("echo '{failed}'; exit 1"));
        let mut job = LocalJob::start([sh("sleep 30"), worker], None).expect("start");
        job.tolerate([1]);
        let (r, took) = supervise(&mut job);
        let e = format!("{:#}", r.expect_err("the job fails"));
        assert!(e.contains("rank 0 stopped responding"), "{e}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    /// Ranks that timed out waiting for each other blame each other in a circle; the rank
    /// at fault is the one a failed rank blames that is still running (stuck), as a
    /// parameter server's ranks do when one of them is stopped.
    #[test]
    fn a_circle_of_blame_names_the_stuck_rank() {
        let blaming = |b: usize, delay: &str| {
            let failed = RankEvent::Failed { blamed: b }.line();
            sh(&format!("sleep {delay}; echo '{failed}'; exit 1"))
        };
        let ranks = [
            sh("sleep 30"),
            blaming(0, "0.3"),
            blaming(3, "0"),
            blaming(2, "0"),
        ];
        let mut job = LocalJob::start(ranks, None).expect("start");
        let (r, took) = supervise(&mut job);
        let e = format!("{:#}", r.expect_err("the job fails"));
        assert!(e.contains("rank 0 stopped responding"), "{e}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    /// A tolerated rank failing on its own (or blaming another tolerated rank) is absorbed.
    #[test]
    fn a_tolerated_rank_failing_on_its_own_is_absorbed() {
        let failed = RankEvent::Failed { blamed: 2 }.line();
        let ranks = [
            sh("sleep 0.5"),
            sh(&format!("echo '{failed}'; exit 1")),
            sh("exit 1"),
        ];
        let mut job = LocalJob::start(ranks, None).expect("start");
        job.tolerate([1, 2]);
        let (r, _) = supervise(&mut job);
        assert!(r.is_ok(), "{r:?}");
    }
}
