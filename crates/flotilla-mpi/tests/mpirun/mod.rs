//! Starting this test binary again under `mpirun`, with a bounded wait.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The variable that tells a re-executed test binary which scenario to run as a rank.
pub const SCENARIO: &str = "FLOTILLA_MPI_SCENARIO";

/// What an `mpirun` job left behind.
pub struct Job {
    /// Whether `mpirun` exited with status 0.
    pub success: bool,
    /// Every rank's stdout and stderr, as `mpirun` forwarded them.
    pub output: String,
    /// How long it ran.
    pub took: Duration,
}

/// Runs test `entry` of this binary as `np` ranks of scenario `scenario` under
/// `mpirun --oversubscribe`, killing the job after `limit`.
pub fn mpirun(np: usize, entry: &str, scenario: &str, limit: Duration) -> Job {
    let exe = std::env::current_exe().expect("test binary path");
    // Open MPI makes its session directory under TMPDIR, named by host and user only: jobs
    // started at once raced to create the same one ("mkdir ... File exists"). One each.
    let session = tempfile::tempdir().expect("a session directory for mpirun");
    let started = Instant::now();
    let mut child = Command::new("mpirun")
        .args(["--oversubscribe", "-np", &np.to_string()])
        .arg(exe)
        .args([
            "--exact",
            entry,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SCENARIO, scenario)
        .env("TMPDIR", session.path())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun (Debian: apt-get install openmpi-bin libopenmpi-dev)");
    let (mut out, mut err) = (child.stdout.take(), child.stderr.take());
    let out_reader = std::thread::spawn(move || read_all(out.as_mut()));
    let err_reader = std::thread::spawn(move || read_all(err.as_mut()));
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for mpirun") {
            break Some(s);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = format!(
        "{}{}",
        out_reader.join().unwrap_or_default(),
        err_reader.join().unwrap_or_default()
    );
    assert!(
        status.is_some(),
        "mpirun {scenario} killed after {limit:?}:\n{output}"
    );
    Job {
        success: status.is_some_and(|s| s.success()),
        output,
        took: started.elapsed(),
    }
}

fn read_all(r: Option<&mut impl std::io::Read>) -> String {
    let mut s = String::new();
    if let Some(r) = r {
        let _ = r.read_to_string(&mut s);
    }
    s
}
