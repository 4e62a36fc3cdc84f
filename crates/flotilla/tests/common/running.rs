//! A `flotilla` process the fault-injection suite watches while it runs: every line it
//! prints, with the instant it arrived, and a bounded wait for its exit. Killed when dropped
//! (see [`super::Proc`]).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::Proc;

/// One line of a process's stdout or stderr and when the test read it.
#[derive(Debug, Clone)]
pub struct Line {
    /// When it was read.
    pub at: Instant,
    /// The text, without its newline.
    pub text: String,
}

/// A running process and the lines it printed so far.
pub struct Running {
    proc: Proc,
    lines: Arc<Mutex<Vec<Line>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
    status: Option<ExitStatus>,
    /// When the test first saw it exited (as precise as the polling of [`Running::wait_exit`]).
    ended: Option<Instant>,
    /// When it was started.
    pub started: Instant,
}

impl Running {
    /// Starts `cmd` (stdin closed, both output streams read line by line).
    pub fn start(mut cmd: Command) -> Self {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut proc = Proc(cmd.spawn().expect("spawn flotilla"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = proc.0.stdout.take().expect("stdout");
        let err = proc.0.stderr.take().expect("stderr");
        let readers = vec![
            read_lines(out, lines.clone()),
            read_lines(err, lines.clone()),
        ];
        Running {
            proc,
            lines,
            readers,
            status: None,
            ended: None,
            started: Instant::now(),
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.proc.0.id()
    }

    /// Every line so far.
    pub fn lines(&self) -> Vec<Line> {
        self.lines.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// All output so far, one string.
    pub fn text(&self) -> String {
        let lines: Vec<String> = self.lines().into_iter().map(|l| l.text).collect();
        lines.join("\n")
    }

    /// The first line so far that `pred` accepts.
    pub fn find(&self, pred: impl Fn(&str) -> bool) -> Option<Line> {
        self.lines().into_iter().find(|l| pred(&l.text))
    }

    /// Waits (at most `limit`) for `n` lines that `pred` accepts; the instant of the last.
    pub fn wait_lines(
        &self,
        n: usize,
        limit: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Option<Instant> {
        let until = Instant::now() + limit;
        loop {
            let hits: Vec<Line> = self.lines().into_iter().filter(|l| pred(&l.text)).collect();
            if hits.len() >= n {
                return hits.last().map(|l| l.at);
            }
            if Instant::now() > until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits at most `limit` for the exit; `None` if it still runs. Once it exited, the
    /// output is complete.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let until = Instant::now() + limit;
        while self.status.is_none() {
            if let Some(s) = self.proc.0.try_wait().expect("try_wait") {
                self.status = Some(s);
                self.ended = Some(Instant::now());
                // The pipes close with the process (bounded: a descendant could hold them).
                let drained = Instant::now() + Duration::from_secs(2);
                while !self.readers.iter().all(|r| r.is_finished()) && Instant::now() < drained {
                    std::thread::sleep(Duration::from_millis(5));
                }
                break;
            }
            if Instant::now() > until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.status
    }

    /// Its exit status, if it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.wait_exit(Duration::ZERO)
    }

    /// When the test first saw it exited, if it has.
    pub fn ended(&self) -> Option<Instant> {
        self.ended
    }
}

/// Reads `stream` line by line into `lines` on a thread of its own.
fn read_lines<R: Read + Send + 'static>(
    stream: R,
    lines: Arc<Mutex<Vec<Line>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).split(b'\n') {
            let Ok(bytes) = line else { break };
            let text = String::from_utf8_lossy(&bytes).trim_end().to_string();
            if let Ok(mut l) = lines.lock() {
                l.push(Line {
                    at: Instant::now(),
                    text,
                });
            }
        }
    })
}
