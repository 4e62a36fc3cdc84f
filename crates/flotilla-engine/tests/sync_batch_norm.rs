//! Synchronized batch norm: N ranks with a part of the batch each train as one rank with the
//! whole batch (gradients, running statistics, parameters after steps), ranks being threads
//! whose reducer sums through shared memory.

mod common;

use std::sync::{Arc, Condvar, Mutex};

use flotilla_engine::collective::Reducer;
use flotilla_engine::{BatchRef, BurnEngine, Engine, EngineError, ModelSpec, ModelState};

/// Sums buffers across `world` threads: each adds its buffer, the last to arrive wakes the
/// others, and each copies the total out.
struct ThreadSum {
    world: usize,
    state: Mutex<Round>,
    turn: Condvar,
}

#[derive(Default)]
struct Round {
    total: Vec<f32>,
    arrived: usize,
    left: usize,
    generation: u64,
}

impl ThreadSum {
    fn new(world: usize) -> Arc<Self> {
        Arc::new(Self {
            world,
            state: Mutex::new(Round::default()),
            turn: Condvar::new(),
        })
    }
}

impl Reducer for ThreadSum {
    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<(), String> {
        let mut s = self.state.lock().map_err(|e| e.to_string())?;
        // Wait until the previous round's readers are gone.
        while s.left > 0 {
            s = self.turn.wait(s).map_err(|e| e.to_string())?;
        }
        if s.arrived == 0 {
            s.total = vec![0.0; values.len()];
        }
        if s.total.len() != values.len() {
            return Err(format!("{} values against {}", values.len(), s.total.len()));
        }
        // Add in arrival order: the sum is exact for the small integers of the count and within
        // rounding for the rest, which the tolerances allow.
        for (t, v) in s.total.iter_mut().zip(values.iter()) {
            *t += *v;
        }
        s.arrived += 1;
        let generation = s.generation;
        if s.arrived == self.world {
            s.arrived = 0;
            s.left = self.world;
            s.generation += 1;
            self.turn.notify_all();
        } else {
            while s.generation == generation {
                s = self.turn.wait(s).map_err(|e| e.to_string())?;
            }
        }
        values.copy_from_slice(&s.total);
        s.left -= 1;
        if s.left == 0 {
            self.turn.notify_all();
        }
        Ok(())
    }

    fn world(&self) -> usize {
        self.world
    }
}

/// A reducer whose every sum fails.
struct Broken;

impl Reducer for Broken {
    fn all_reduce_sum(&self, _: &mut [f32]) -> Result<(), String> {
        Err("peer 1 went away".into())
    }
    fn world(&self) -> usize {
        2
    }
}

const GLOBAL: usize = 8;

fn engine(groups: bool) -> BurnEngine {
    let spec = ModelSpec::builtin("resnet-bn").expect("resnet-bn");
    let mut e = BurnEngine::new(&spec, &common::plain_sgd(0.05), "flex", 7).expect("engine");
    if groups {
        e.set_backward_group_bytes(40_000).expect("groups");
        assert!(
            e.backward_plan().len() > 1,
            "the grouped backward is exercised"
        );
    }
    e
}

/// `steps` batches of GLOBAL MNIST-shaped samples.
fn batches(steps: usize) -> Vec<(Vec<f32>, Vec<i64>)> {
    let mut x = 0x9e37_79b9_u32;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    (0..steps)
        .map(|_| {
            let images = (0..GLOBAL * 784)
                .map(|_| (next() % 1000) as f32 / 400.0 - 1.0)
                .collect();
            let labels = (0..GLOBAL).map(|_| i64::from(next() % 10)).collect();
            (images, labels)
        })
        .collect()
}

/// What one rank saw in each step: its gradients, then its buffers after the step.
type Trace = Vec<(Vec<f32>, Vec<f32>)>;

/// Trains `e` on its part (`rank` of `world`) of each batch; each step applies the gradient
/// averaged over the ranks (`average`, which every rank calls with its own).
fn train(
    mut e: BurnEngine,
    rank: usize,
    world: usize,
    data: &[(Vec<f32>, Vec<i64>)],
    average: &dyn Fn(&mut [f32]),
    streaming: bool,
) -> (Trace, Vec<f32>) {
    let part = GLOBAL / world;
    let mut trace = Vec::new();
    for (images, labels) in data {
        let batch = BatchRef {
            images: &images[rank * part * 784..(rank + 1) * part * 784],
            labels: &labels[rank * part..(rank + 1) * part],
        };
        if streaming {
            e.forward_backward_streaming(batch, &mut |_, _| Ok(()))
                .expect("forward");
        } else {
            e.forward_backward(batch).expect("forward");
        }
        let mut g = vec![0.0; e.num_params()];
        e.read_grads(&mut g).expect("grads");
        average(&mut g);
        e.apply_grads(&g, 0.05).expect("step");
        let mut b = vec![0.0; e.buffer_layout().total];
        e.read_buffers(&mut b).expect("buffers");
        trace.push((g, b));
    }
    let mut p = vec![0.0; e.num_params()];
    e.read_params(&mut p).expect("params");
    (trace, p)
}

/// Two ranks as threads; the gradient average through a second reducer.
fn two_ranks(sync: bool, streaming: bool, data: &[(Vec<f32>, Vec<i64>)]) -> Vec<(Trace, Vec<f32>)> {
    let (stats, grads) = (ThreadSum::new(2), ThreadSum::new(2));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let (stats, grads) = (stats.clone(), grads.clone());
                s.spawn(move || {
                    let mut e = engine(streaming);
                    if sync {
                        e.set_batch_norm_sync(Some(stats)).expect("sync");
                    }
                    let average = |g: &mut [f32]| {
                        grads.all_reduce_sum(g).expect("sum");
                        g.iter_mut().for_each(|v| *v /= 2.0);
                    };
                    train(e, rank, 2, data, &average, streaming)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    })
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn compare(ranks: &[(Trace, Vec<f32>)], one: &(Trace, Vec<f32>)) -> f32 {
    let mut worst = 0f32;
    for (trace, params) in ranks {
        for ((g, b), (g1, b1)) in trace.iter().zip(&one.0) {
            worst = worst.max(max_rel(g, g1)).max(max_rel(b, b1));
        }
        worst = worst.max(max_rel(params, &one.1));
    }
    worst
}

#[test]
fn two_synchronized_ranks_with_half_batches_train_as_one_rank_with_the_whole_batch() {
    let data = batches(3);
    let one = train(engine(false), 0, 1, &data, &|_| {}, false);
    for streaming in [false, true] {
        let ranks = two_ranks(true, streaming, &data);
        let worst = compare(&ranks, &one);
        assert!(
            worst < 1e-5,
            "streaming {streaming}: synchronized ranks differ from one rank by {worst:e}"
        );
    }
    // Without synchronization each rank normalizes with its own half's statistics: the same
    // comparison must see it (this is what makes the test above able to fail).
    let unsynced = compare(&two_ranks(false, false, &data), &one);
    assert!(
        unsynced > 1e-3,
        "unsynchronized ranks differ by only {unsynced:e}"
    );
}

#[test]
fn one_synchronized_rank_is_an_ordinary_batch_norm() {
    let data = batches(2);
    let one = train(engine(false), 0, 1, &data, &|_| {}, false);
    let mut e = engine(false);
    e.set_batch_norm_sync(Some(ThreadSum::new(1)))
        .expect("sync");
    let synced = train(e, 0, 1, &data, &|_| {}, false);
    let worst = compare(std::slice::from_ref(&synced), &one);
    assert!(worst < 1e-5, "one synchronized rank differs by {worst:e}");
}

#[test]
fn a_failed_sum_fails_the_pass() {
    let mut e = engine(false);
    e.set_batch_norm_sync(Some(Arc::new(Broken))).expect("sync");
    let data = batches(1);
    let (images, labels) = &data[0];
    let batch = BatchRef {
        images: &images[..4 * 784],
        labels: &labels[..4],
    };
    match e.forward_backward(batch) {
        Err(EngineError::BatchNormSync(msg)) => assert!(msg.contains("peer 1"), "{msg}"),
        other => panic!(
            "expected a batch norm sync error, got {:?}",
            other.map(|_| ())
        ),
    }
}
