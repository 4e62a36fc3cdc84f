//! Whether a rank's process is frozen: stopped by a signal (SIGSTOP, SIGTSTP, a debugger),
//! so that no grace lets it finish. Read from `/proc/PID/stat` (Linux; elsewhere nothing is
//! frozen): a dozen bytes a turn, a crate for it would be more than the read.

/// Whether process `pid` is stopped (state `T`, or `t` when a tracer stopped it).
pub fn frozen(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `PID (COMM) STATE ...`: COMM may hold spaces and parentheses, the state follows the
    // last `)`.
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next());
    matches!(state, Some("T" | "t"))
}

#[cfg(test)]
mod tests {
    use super::frozen;
    use std::process::Command;
    use std::time::{Duration, Instant};

    #[test]
    fn a_stopped_process_is_frozen_and_a_running_one_is_not() {
        let mut child = Command::new("sleep").arg("30").spawn().expect("sleep");
        let pid = child.id();
        assert!(!frozen(pid));
        // SAFETY: kill(2) on our own child's pid, which has not been reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) };
        let start = Instant::now();
        while !frozen(pid) && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(frozen(pid), "a stopped process is frozen");
        let _ = child.kill();
        let _ = child.wait();
        assert!(!frozen(u32::MAX), "no such process");
    }
}
