//! The asynchronous all-reduce's background cycle over an in-memory world: submission order
//! does not matter, sums are exact, the shutdown is collective, and a tensor some rank never
//! submits is named by the stall inspector on every rank before a clean abort.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use flotilla_tcp::{CommConfig, CommError, ProcessGroup, StallPolicy, TcpGroup};
use flotilla_train::strategy::allreduce::cycle::{CycleConfig, CycleReducer};

/// Runs `body(rank, reducer)` on every rank of an in-memory world of `n`, one thread each;
/// the reducer runs on a group of its own, as the training role uses it.
fn with_reducers<T: Send + 'static>(
    n: usize,
    config: CycleConfig,
    body: impl Fn(usize, CycleReducer) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let cfg = CommConfig::new(Some(0), n).with_timeout(Duration::from_secs(20));
    let comms = TcpGroup::in_memory(n, cfg).expect("world");
    let body = Arc::new(body);
    let started = Instant::now();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let body = body.clone();
            thread::spawn(move || {
                let world: Arc<dyn ProcessGroup> = Arc::new(c);
                let all: Vec<usize> = (0..n).collect();
                let group = world.group(&all).expect("group");
                let reducer = CycleReducer::start(group, config).expect("cycle");
                let out = body(r, reducer);
                drop(world);
                out
            })
        })
        .collect();
    let out = handles
        .into_iter()
        .map(|h| h.join().expect("rank panicked"))
        .collect();
    assert!(started.elapsed() < Duration::from_secs(60), "took too long");
    out
}

fn value(rank: usize, name: usize, step: usize, i: usize) -> f32 {
    ((rank + 1) * 1000 + name * 100 + step) as f32 + i as f32 * 0.25
}

#[test]
fn ranks_submitting_in_different_orders_get_the_serial_sums() {
    let (n, names, steps, len) = (3, 5, 6, 1000);
    let config = CycleConfig {
        cycle: Duration::from_millis(2),
        buffer_bytes: 1500 * 4,
        ..CycleConfig::default()
    };
    let results = with_reducers(n, config, move |r, reducer| {
        let mut pending = Vec::new();
        for step in 0..steps {
            // Rank r submits names in a rotated (and on odd ranks reversed) order, and a
            // later step's tensor of a name before the earlier one was reduced.
            let mut order: Vec<usize> = (0..names).map(|k| (k + r) % names).collect();
            if r % 2 == 1 {
                order.reverse();
            }
            for k in order {
                let data = (0..len).map(|i| value(r, k, step, i)).collect();
                pending.push((k, step, reducer.submit(&format!("t{k}"), data)));
            }
            thread::sleep(Duration::from_millis(r as u64));
        }
        let out: Vec<_> = pending
            .into_iter()
            .map(|(k, step, p)| (k, step, p.wait().expect("reduced")))
            .collect();
        let stats = reducer.shutdown().expect("collective shutdown");
        (out, stats)
    });
    for (out, stats) in results {
        assert_eq!(out.len(), names * steps);
        for (k, step, sum) in out {
            let want: Vec<f32> = (0..len)
                .map(|i| (0..n).map(|r| value(r, k, step, i)).sum())
                .collect();
            assert_eq!(sum, want, "tensor t{k} of step {step}");
        }
        assert_eq!(stats.tensors, (names * steps) as u64);
        // 1500 values per buffer: at most one 1000-value tensor each, so no fusion of two.
        assert_eq!(stats.all_reduces, stats.tensors);
    }
}

#[test]
fn fusion_packs_ready_tensors_into_one_all_reduce() {
    let config = CycleConfig {
        cycle: Duration::from_millis(50),
        ..CycleConfig::default()
    };
    let results = with_reducers(2, config, |r, reducer| {
        let p: Vec<_> = (0..8)
            .map(|k| reducer.submit(&format!("g{k}"), vec![(r * 10 + k) as f32; 3]))
            .collect();
        let sums: Vec<f32> = p.into_iter().map(|p| p.wait().expect("sum")[2]).collect();
        (sums, reducer.shutdown().expect("shutdown"))
    });
    for (sums, stats) in results {
        assert_eq!(
            sums,
            (0..8).map(|k| (10 + 2 * k) as f32).collect::<Vec<_>>()
        );
        // Submitted within one 50 ms cycle: registered in one cycle, reduced in the next,
        // as one buffer.
        assert_eq!(stats.tensors, 8);
        assert!(stats.all_reduces <= 2, "{stats:?}");
    }
}

#[test]
fn a_withheld_tensor_is_named_on_every_rank_then_everyone_aborts() {
    let config = CycleConfig {
        cycle: Duration::from_millis(5),
        buffer_bytes: 0,
        stall: StallPolicy {
            warning: Duration::from_millis(200),
            shutdown: Some(Duration::from_millis(1000)),
        },
    };
    let results = with_reducers(3, config, |r, reducer| {
        let started = Instant::now();
        let a = reducer.submit("fc1.weight", vec![1.0; 4]);
        // Rank 2 never submits fc2.bias.
        let b = (r != 2).then(|| reducer.submit("fc2.bias", vec![1.0; 2]));
        let a = a.wait();
        let b = b.map(|b| b.wait());
        // After the abort, every later submission fails with the same error, at once.
        let later = b
            .is_some()
            .then(|| reducer.submit("fc1.weight", vec![1.0; 4]).wait());
        let shutdown = reducer.shutdown();
        (r, a, b, later, shutdown, started.elapsed())
    });
    for (r, a, b, later, shutdown, took) in results {
        assert_eq!(a.expect("fc1.weight is submitted everywhere"), vec![3.0; 4]);
        let err = match b {
            Some(b) => b.expect_err("fc2.bias never completes"),
            None => shutdown.expect_err("the cycle ended in a stall"),
        };
        let CommError::Stalled {
            waiting_for, what, ..
        } = &err
        else {
            panic!("rank {r}: {err}")
        };
        assert_eq!(waiting_for, &vec![2], "rank {r}: {err}");
        assert!(
            what.contains("\"fc2.bias\"") && what.contains("waits for rank(s) 2"),
            "rank {r}: {what}"
        );
        if let Some(later) = later {
            assert!(matches!(later, Err(CommError::Stalled { .. })), "{later:?}");
        }
        assert!(
            took < Duration::from_secs(5),
            "rank {r} aborted after {took:?}"
        );
    }
}

#[test]
fn a_tensor_of_the_wrong_length_is_refused_naming_the_rank() {
    let results = with_reducers(2, CycleConfig::default(), |r, reducer| {
        let out = reducer.submit("w", vec![1.0; 4 + r]).wait();
        let _ = reducer.shutdown();
        out
    });
    // Which rank's length was registered first, and which rank sees the mismatch, depend on
    // arrival.
    for out in results {
        let err = out.expect_err("lengths differ").to_string();
        // The rank that saw the mismatch names both lengths; a rank told only that another
        // gave up names the tensor and the rank it waits for.
        let mismatch = (err.contains("rank 0 submitted") || err.contains("rank 1 submitted"))
            && err.contains('4')
            && err.contains('5');
        let told = err.contains("waits for rank(s) ") && err.contains("another rank gave up");
        let named = err.contains("\"w\"") && (mismatch || told);
        assert!(named, "{err}");
    }
}

/// The other interleaving: rank 0's tensor is registered before rank 1 submits its own of
/// another length, so only rank 1 sees the mismatch; every rank must still fail (this hung:
/// rank 0 waited for rank 1's tensor forever).
#[test]
fn a_late_tensor_of_the_wrong_length_fails_every_rank() {
    let results = with_reducers(2, CycleConfig::default(), |r, reducer| {
        if r == 1 {
            thread::sleep(Duration::from_millis(200));
        }
        let out = reducer.submit("w", vec![1.0; 4 + r]).wait();
        let _ = reducer.shutdown();
        out
    });
    for (r, out) in results.into_iter().enumerate() {
        let err = out.expect_err("lengths differ");
        assert!(err.to_string().contains("\"w\""), "rank {r}: {err}");
        if r == 1 {
            assert!(err.to_string().contains("rank 1"), "{err}");
        }
    }
}
