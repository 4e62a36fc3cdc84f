//! Parameter servers for a user's module: a sync job (one server, or two servers each owning
//! part of the tensors) equals one process training on the global batch; an async server
//! follows its update formula bit for bit on a scripted sequence of pushes.

use std::sync::Arc;
use std::time::Duration;

use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use flotilla_engine::ParamLayout;
use flotilla_engine::any_module::put_grads;
use flotilla_group::ProcessGroup;
use flotilla_ps::{PsMessage, TAG};

use crate::data_parallel_tests::{
    Net, Optim, STEPS, batch, max_relative_difference, net, params, train_alone, world,
};
use crate::ps::{Aggregation, PsConfig, Worker, serve};
use crate::{DistError, Result};

const WORKERS: usize = 2;

fn config(servers: usize, aggregation: Aggregation) -> PsConfig {
    PsConfig {
        servers,
        aggregation,
        timeout: Duration::from_secs(20),
        batch_size: 6,
    }
}

/// Worker `i` of the job: each round its shard of the global batch, until told to stop.
fn work(group: Arc<dyn ProcessGroup>, model: Net, c: PsConfig) -> Result<usize> {
    let i = group.rank() - c.servers;
    let mut worker = Worker::new(group, &model, c)?;
    let mut step = 0;
    while let Some(m) = worker.pull(&model)? {
        let (x, y) = batch(step, i, WORKERS);
        let loss = (m.forward(x) - y).powf_scalar(2.0).mean();
        let l = loss.clone().into_scalar::<f32>();
        let grads = GradientsParams::from_grads(loss.backward(), &m);
        worker.push(&m, grads, 6, l)?;
        step += 1;
    }
    Ok(step)
}

/// A sync job of `servers` servers and [`WORKERS`] workers for [`STEPS`] rounds: the
/// parameters rank 0 returns.
fn sync_job(servers: usize) -> Vec<f32> {
    let c = config(servers, Aggregation::Sync);
    let n = servers + WORKERS;
    let models: Vec<Net> = (0..n as u64).map(|r| net(r, 16)).collect();
    let handles: Vec<_> = world(n)
        .into_iter()
        .zip(models)
        .map(|(g, m)| {
            std::thread::spawn(move || {
                if g.rank() < c.servers {
                    let mut optim = Optim::Sgd.init();
                    let (m, stats) = serve(g, m, &mut optim, |_| 0.01, STEPS as u64, c)?;
                    assert_eq!(stats.version, STEPS as u64);
                    Ok(Some(params(&m)))
                } else {
                    let steps = work(g, m, c)?;
                    assert_eq!(steps, STEPS, "a worker's rounds");
                    Ok(None)
                }
            })
        })
        .collect();
    let results: Vec<Result<Option<Vec<f32>>>> = handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect();
    let errors: Vec<String> = results
        .iter()
        .enumerate()
        .filter_map(|(rank, r)| r.as_ref().err().map(|e| format!("rank {rank}: {e}")))
        .collect();
    assert!(errors.is_empty(), "{servers} servers: {errors:#?}");
    results
        .into_iter()
        .next()
        .and_then(|r| r.ok().flatten())
        .expect("rank 0's model")
}

#[test]
fn a_sync_parameter_server_job_equals_one_process_on_the_global_batch() {
    let reference = train_alone(Optim::Sgd);
    let flat = sync_job(1);
    let d = max_relative_difference(&flat, &reference);
    assert!(
        d <= 1e-5,
        "1 server vs the plain loop: relative difference {d}"
    );
    let sharded = sync_job(2);
    assert!(
        sharded == flat,
        "2 servers differ from 1 (relative difference {})",
        max_relative_difference(&sharded, &flat)
    );
}

fn sgd() -> ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
        .init()
}

fn lr(version: u64) -> f64 {
    0.1 / (1.0 + version as f64)
}

/// Gradient number `k` of the script (any numbers of the model's length).
fn gradient(k: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + k * 13) as f32 * 0.37).sin() * 0.5)
        .collect()
}

/// The async script: (worker rank, version computed on, gradient number). Pushes that must
/// be refused without changing anything: gradient 99 holds a NaN, 98 claims `u32::MAX`
/// samples (more than the batch), 97's finite values overflow once weighted by its samples.
const SCRIPT: [(usize, u64, usize); 8] = [
    (1, 0, 0),
    (2, 0, 1),  // 1 stale
    (1, 1, 2),  // 1 stale
    (2, 0, 99), // refused
    (1, 2, 98), // refused
    (2, 2, 97), // refused
    (2, 2, 3),  // 1 stale
    (1, 1, 4),  // 3 stale: the last update, answered with stop
];

/// What the server must say when it refuses gradient `k` of [`SCRIPT`].
fn refusal(k: usize) -> Option<&'static str> {
    match k {
        99 => Some("non-finite"),
        98 => Some("claims 4294967295 samples, more than the 6"),
        97 => Some("overflow"),
        _ => None,
    }
}

fn push(version: u64, samples: u32, values: Vec<f32>) -> Vec<u8> {
    PsMessage::Push {
        version,
        staleness: 0,
        samples,
        loss: 0.5,
        delta: false,
        values,
    }
    .encode()
}

fn reply(g: &dyn ProcessGroup) -> PsMessage {
    let bytes = g
        .recv(0, TAG, std::time::Instant::now() + Duration::from_secs(10))
        .expect("reply");
    PsMessage::decode(&bytes, 0).expect("decode")
}

/// The formula: an SGD-momentum step with the sample-weighted mean push `(4·g)·¼` at
/// `lr(version) / (1 + staleness)`.
struct Reference {
    model: Net,
    layout: ParamLayout,
    optim: ModuleOptimizer,
    version: u64,
}

impl Reference {
    fn apply(&mut self, g: &[f32], staleness: u64) {
        let mean: Vec<f32> = g.iter().map(|v| (4.0 * v) * (1.0 / 4.0)).collect();
        let mut grads = GradientsParams::new();
        let all = 0..self.layout.params.len();
        put_grads(&self.model, &mut grads, &self.layout, all, &mean).expect("put");
        let rate = lr(self.version) / (1.0 + staleness as f64);
        self.model = self.optim.step(rate, self.model.clone(), grads);
        self.version += 1;
    }
}

/// The gradient and sample count of the script's push `k` (97-99: the pushes refused).
fn scripted_push(k: usize, total: usize) -> (Vec<f32>, u32) {
    let mut values = gradient(k, total);
    let mut samples = 4;
    match k {
        99 => values[3] = f32::NAN,
        98 => samples = u32::MAX,
        97 => values.iter_mut().for_each(|v| *v = 3e38),
        _ => {}
    }
    (values, samples)
}

#[test]
fn an_async_server_follows_its_formula_on_a_scripted_sequence_of_pushes() {
    let c = config(
        1,
        Aggregation::Async {
            max_staleness: None,
            staleness_lr: true,
        },
    );
    let groups = world(3);
    let server_group = groups[0].clone();
    let model = net(0, 8);
    let server = std::thread::spawn(move || {
        let mut optim = sgd();
        serve(server_group, model, &mut optim, lr, 5, c)
    });
    let joins: Vec<_> = groups[1..]
        .iter()
        .map(|g| {
            let (g, m) = (g.clone(), net(g.rank() as u64, 8));
            std::thread::spawn(move || Worker::new(g, &m, c).map(|_| ()))
        })
        .collect();
    joins
        .into_iter()
        .for_each(|j| j.join().expect("join").expect("worker"));
    let start = net(0, 8);
    let layout = ParamLayout::of(&start);
    let mut reference = Reference {
        model: start,
        layout: layout.clone(),
        optim: sgd(),
        version: 0,
    };
    for g in &groups[1..] {
        assert!(matches!(reply(&**g), PsMessage::Params { version: 0, .. }));
    }
    for (i, &(w, version, k)) in SCRIPT.iter().enumerate() {
        let (values, samples) = scripted_push(k, layout.total);
        groups[w]
            .send(0, TAG, &push(version, samples, values.clone()))
            .expect("send");
        let answer = reply(&*groups[w]);
        if let Some(why) = refusal(k) {
            match answer {
                PsMessage::Reject { reason } => assert!(reason.contains(why), "{reason}"),
                other => panic!("push {i}: expected a refusal, got {other:?}"),
            }
            continue;
        }
        reference.apply(&values, reference.version - version);
        match answer {
            PsMessage::Params { version, values } => {
                assert_eq!(version, reference.version, "push {i}: version answered");
                assert!(
                    values == params(&reference.model),
                    "push {i}: parameters answered"
                );
            }
            PsMessage::Stop { .. } => assert_eq!(i, SCRIPT.len() - 1, "stopped early"),
            other => panic!("push {i}: {other:?}"),
        }
    }
    groups[2]
        .send(0, TAG, &PsMessage::Pull.encode())
        .expect("pull");
    assert!(matches!(reply(&*groups[2]), PsMessage::Stop { .. }));
    let (model, stats) = server.join().expect("server").expect("serve");
    assert!(
        params(&model) == params(&reference.model),
        "the served model"
    );
    assert_eq!(
        (stats.version, stats.rejected, stats.max_staleness),
        (5, 3, 3)
    );
}

#[test]
fn layouts_that_cannot_work_are_refused_before_anything_starts() {
    let a = Aggregation::Async {
        max_staleness: None,
        staleness_lr: true,
    };
    for (c, expected) in [
        (config(2, a), "one server"),
        (config(3, Aggregation::Sync), "no worker"),
        (config(0, Aggregation::Sync), "at least one server"),
    ] {
        let g = world(3).remove(1);
        match Worker::new(g, &net(0, 4), c) {
            Err(DistError::Config(why)) => assert!(why.contains(expected), "{why}"),
            other => panic!("expected a config error, got {other:?}"),
        }
    }
}

#[test]
fn an_async_server_goes_on_without_a_lost_worker_and_fails_when_none_is_left() {
    let c = config(
        1,
        Aggregation::Async {
            max_staleness: None,
            staleness_lr: true,
        },
    );
    let mut groups = world(3);
    let server_group = groups.remove(0);
    let server = std::thread::spawn(move || {
        let mut optim = sgd();
        serve(server_group, net(0, 8), &mut optim, lr, 1000, c)
    });
    // Both workers join, then leave without a push: each is lost, one after the other.
    let joins: Vec<_> = groups
        .into_iter()
        .map(|g| std::thread::spawn(move || Worker::new(g, &net(1, 8), c).map(|_| ())))
        .collect();
    joins
        .into_iter()
        .for_each(|j| j.join().expect("join").expect("worker"));
    match server.join().expect("server") {
        Err(DistError::Peer { message, .. }) => assert!(
            message.contains("every worker was lost ([1, 2]") || message.contains("([2, 1]"),
            "{message}"
        ),
        other => panic!("expected the lost workers named, got {other:?}"),
    }
}
