//! The group queue's order and deadline, with a stand-in for the communicator (no GPU
//! here): collectives run in the order issued; one that hangs fails at the group's timeout
//! with a `Deadline` naming the group and its other ranks, the communicator is aborted
//! once, and every later collective fails at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use flotilla_group::{CommError, Members};

use crate::ops::Op;
use crate::queue::{Collectives, Queue};

/// Adds its call number to every element (so the order shows), and hangs on the call
/// numbered `hang` until aborted.
struct StandIn {
    calls: AtomicUsize,
    hang: usize,
    aborted: Mutex<usize>,
    woken: Condvar,
}

impl Collectives for Arc<StandIn> {
    fn execute(&self, op: Op, _me: (usize, usize)) -> Result<Vec<f32>, String> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if n == self.hang {
            let mut aborted = self.aborted.lock().expect("lock");
            while *aborted == 0 {
                aborted = self.woken.wait(aborted).expect("wait");
            }
            return Err("aborted".into());
        }
        let Op::AllReduce(buf) = op else {
            return Err("only all-reduces here".into());
        };
        Ok(buf.iter().map(|v| v + n as f32).collect())
    }

    fn abort(&self) -> bool {
        *self.aborted.lock().expect("lock") += 1;
        self.woken.notify_all();
        // ncclCommAbort returns after the collective in flight has failed: let the worker
        // hand over its own error ("aborted") before the abort returns.
        std::thread::sleep(Duration::from_millis(50));
        true
    }
}

fn queue(hang: usize, timeout: Duration) -> (Arc<Queue>, Arc<StandIn>) {
    let s = Arc::new(StandIn {
        calls: AtomicUsize::new(0),
        hang,
        aborted: Mutex::new(0),
        woken: Condvar::new(),
    });
    let members = Members::new(vec![4, 7, 9], 1);
    let q = Queue::start(
        Box::new(s.clone()),
        members,
        timeout,
        "of world ranks [4, 7, 9]".into(),
    )
    .expect("queue");
    (q, s)
}

#[test]
fn collectives_run_in_the_order_issued() {
    let (q, _s) = queue(usize::MAX, Duration::from_secs(30));
    let pending: Vec<_> = (0..5)
        .map(|_| q.submit(Op::AllReduce(vec![10.0; 3])))
        .collect();
    for (i, p) in pending.into_iter().enumerate() {
        assert_eq!(p.wait().expect("ran"), vec![10.0 + i as f32; 3]);
    }
    assert_eq!(q.activity().issued, 5);
    q.detach();
}

#[test]
fn a_hung_collective_fails_at_the_deadline_naming_the_group_and_aborts_once() {
    let timeout = Duration::from_millis(300);
    let (q, s) = queue(1, timeout);
    q.submit(Op::AllReduce(vec![1.0]))
        .wait()
        .expect("the first runs");
    let started = Instant::now();
    let e = q
        .submit(Op::AllReduce(vec![1.0]))
        .wait()
        .expect_err("hangs");
    let waited = started.elapsed();
    assert!(waited >= timeout && waited < timeout * 10, "{waited:?}");
    match &e {
        CommError::Deadline {
            waiting_for,
            op,
            after,
        } => {
            assert_eq!(waiting_for, &[4, 9]);
            assert!(
                op.contains("NCCL all_reduce #1 of group of world ranks [4, 7, 9]"),
                "{op}"
            );
            assert_eq!(*after, timeout);
        }
        e => panic!("not a deadline: {e}"),
    }
    // The communicator was aborted once, and what follows fails at once with the cause.
    let later = q
        .submit(Op::AllReduce(vec![1.0]))
        .wait()
        .expect_err("poisoned");
    assert!(
        matches!(&later, CommError::Poisoned(inner) if inner.to_string() == e.to_string()),
        "{later}"
    );
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(*s.aborted.lock().expect("lock"), 1);
    q.detach();
}
