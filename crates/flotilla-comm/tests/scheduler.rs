//! The collective scheduler: submissions from several threads, in different orders on
//! different ranks, run in one agreed order; disagreements and absentees are named.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use flotilla_comm::{
    Collective, CommConfig, CommError, Communicator, Output, ProcessGroup, ReduceOp, Scheduler,
};

/// Runs `body(rank, scheduler)` on every rank of an in-memory world of `n` (deadline
/// `timeout` for every wait), one thread per rank.
fn with_schedulers<T: Send + 'static>(
    n: usize,
    timeout: Duration,
    body: impl Fn(usize, Arc<Scheduler>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let cfg = CommConfig::new(Some(0), n).with_timeout(timeout);
    let comms = Communicator::in_memory(n, cfg).expect("world");
    let body = Arc::new(body);
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let body = body.clone();
            thread::spawn(move || {
                let group: Arc<dyn ProcessGroup> = Arc::new(c);
                let s = Arc::new(Scheduler::new(group).expect("scheduler"));
                body(r, s)
            })
        })
        .collect();
    let started = Instant::now();
    let out = handles
        .into_iter()
        .map(|h| h.join().expect("rank panicked"))
        .collect();
    assert!(started.elapsed() < Duration::from_secs(60), "took too long");
    out
}

#[test]
fn two_threads_submitting_in_different_orders_agree() {
    let steps = 20;
    let res = with_schedulers(3, Duration::from_secs(10), move |r, s| {
        // A "background cycle" thread and the "training" thread submit concurrently, and
        // on odd ranks in the opposite order: only an agreed order keeps them apart.
        let bg = {
            let s = s.clone();
            thread::spawn(move || {
                (0..steps)
                    .map(|i| {
                        let v = vec![(r + 1) as f32 * 1000.0 + i as f32; 5000];
                        let out = s.run(&format!("cycle/{i}"), Collective::AllReduceSum(v));
                        out.map(|o| o.into_f32().expect("f32")[4999])
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
        };
        let mut train = Vec::new();
        for i in 0..steps {
            let names = [format!("eval/{i}"), format!("flags/{i}")];
            let order: Vec<&String> = if r % 2 == 0 {
                names.iter().collect()
            } else {
                names.iter().rev().collect()
            };
            let mut pending = Vec::new();
            for name in order {
                let op = if name.starts_with("eval") {
                    Collective::AllReduceSum(vec![r as f32 + i as f32; 3])
                } else {
                    Collective::AllReduceU64(vec![1 << r], ReduceOp::Or)
                };
                pending.push((name.clone(), s.submit(name, op)));
            }
            for (name, p) in pending {
                train.push((name, p.wait()));
            }
        }
        (bg.join().expect("bg"), train)
    });
    for (bg, train) in res {
        let bg = bg.expect("cycle all-reduces");
        for (i, v) in bg.iter().enumerate() {
            assert_eq!(*v, 6000.0 + 3.0 * i as f32);
        }
        for (name, out) in train {
            let i: f32 = name.split('/').nth(1).expect("i").parse().expect("num");
            match out.expect("train collective") {
                Output::F32(v) => assert_eq!(v, vec![3.0 + 3.0 * i; 3], "{name}"),
                Output::U64(v) => assert_eq!(v, vec![0b111], "{name}"),
                o => panic!("{o:?}"),
            }
        }
    }
}

#[test]
fn a_rank_that_never_submits_is_named_at_the_deadline() {
    let res = with_schedulers(3, Duration::from_millis(800), |r, s| {
        if r == 2 {
            // Rank 2 never submits "late"; it stays alive until the others are done.
            thread::sleep(Duration::from_secs(3));
            return None;
        }
        let t = Instant::now();
        let e = s.run("late", Collective::Barrier);
        Some((e, t.elapsed()))
    });
    for (r, x) in res.into_iter().enumerate().take(2) {
        let (e, took) = x.expect("result");
        match e {
            Err(e @ CommError::Deadline { .. }) => {
                assert!(e.to_string().contains("rank(s) 2"), "rank {r}: {e}")
            }
            other => panic!("rank {r}: {other:?}"),
        }
        assert!(took < Duration::from_secs(3), "rank {r} waited {took:?}");
    }
}

#[test]
fn members_disagreeing_on_a_collective_fail_naming_a_rank() {
    let res = with_schedulers(2, Duration::from_secs(5), |r, s| {
        let len = if r == 1 { 7 } else { 5 };
        s.run("grads", Collective::AllReduceSum(vec![1.0; len]))
    });
    for (r, out) in res.into_iter().enumerate() {
        match out {
            Err(e @ CommError::Protocol { .. }) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("length 7") && msg.contains("length 5"),
                    "{r}: {msg}"
                );
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn a_name_in_flight_cannot_be_submitted_twice() {
    // Rank 1 submits only after rank 0 has submitted "x" twice, so rank 0's first "x"
    // is certainly still in flight at its second submission.
    let gate = Arc::new(std::sync::Barrier::new(2));
    let res = with_schedulers(2, Duration::from_secs(5), move |r, s| {
        let op = || Collective::AllReduceSum(vec![r as f32]);
        if r == 0 {
            let first = s.submit("x", op());
            let again = s.submit("x", op()).wait();
            gate.wait();
            (first.wait(), Some(again))
        } else {
            gate.wait();
            (s.submit("x", op()).wait(), None)
        }
    });
    for (first, again) in res {
        assert_eq!(first.expect("first"), Output::F32(vec![1.0]));
        if let Some(again) = again {
            assert!(
                matches!(again, Err(CommError::InvalidArgument(_))),
                "{again:?}"
            );
        }
    }
}
