//! LeNet-5 cut into two pipeline stages on two processes, trained on MNIST with a loop as
//! plain as PyTorch's: forward, the loss and its gradient on the last stage, backward, step.
//!
//! ```text
//! cargo run --release -p flotilla-train --example pipeline_mnist
//! ```
//!
//! Without `WORLD_SIZE` in the environment, the example starts one process per stage itself
//! (each with `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, as torchrun would) and waits
//! for them; with those variables set it is one rank of such a job. Settings (environment):
//! `STAGES` (2 or 3), `DATA_PARALLEL` (replicas of each stage, default 1), `ZERO` (0 to 3
//! among the replicas, default 0; 3: each replica holds its shard of its stage's parameters,
//! gathered in groups of at most 1 MiB for each use), `MICRO_BATCHES`
//! (default 4), `SCHEDULE` (unset: the plain loop; `gpipe` or `1f1b`: `train_batch` with that
//! schedule), `BATCH` (samples per replica per step, default 64), `EPOCHS` (default 1),
//! `STEPS` (instead of epochs), `MNIST_DIR` (default `data/mnist`).

use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use flotilla_data::{Mnist, Normalization, Split as DataSplit, default_cache_dir};
use flotilla_engine::{DecayParams, ModelSpec, OptimizerSpec, StageCut, cross_entropy};
use flotilla_train::batches::{Batches, Position};
use flotilla_train::pipeline::{Pipeline, PipelineOptions, Schedule};

fn setting(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .with_context(|| format!("{name}={v:?} is not a number")),
        Err(_) => Ok(default),
    }
}

/// Where LeNet-5 is cut (its layers: conv relu pool conv relu pool | flatten linear relu
/// linear relu linear).
fn cut_points(stages: usize) -> Result<&'static [usize]> {
    match stages {
        2 => Ok(&[6]),
        3 => Ok(&[3, 8]),
        n => bail!("STAGES={n}: this example cuts LeNet-5 into 2 or 3 stages"),
    }
}

/// Without SCHEDULE: the plain loop (forward, loss, backward, step; GPipe order). With
/// SCHEDULE=gpipe or 1f1b: `train_batch`, which runs that schedule.
fn schedule_setting() -> Result<(Schedule, bool)> {
    match std::env::var("SCHEDULE").as_deref() {
        Err(_) => Ok((Schedule::GPipe, true)),
        Ok("gpipe") => Ok((Schedule::GPipe, false)),
        Ok("1f1b") => Ok((Schedule::OneFOneB, false)),
        Ok(other) => bail!("SCHEDULE={other:?}: expected gpipe or 1f1b"),
    }
}

fn main() -> Result<()> {
    if std::env::var_os("WORLD_SIZE").is_none() {
        return launch();
    }
    let stages = setting("STAGES", 2)?;
    let spec = ModelSpec::builtin("lenet5").context("the built-in lenet5 spec")?;
    let cut = StageCut::at(&spec, cut_points(stages)?)?;
    let (schedule, one_batch_loop) = schedule_setting()?;
    let opts = PipelineOptions {
        micro_batches: setting("MICRO_BATCHES", 4)?,
        schedule,
        data_parallel: setting("DATA_PARALLEL", 1)?,
        lr: 0.05,
        optimizer: OptimizerSpec::Sgd {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            decay_params: DecayParams::All,
        },
        device: "flex".into(),
        seed: 42,
        clip_grad_norm: None,
        zero: u8::try_from(setting("ZERO", 0)?).context("ZERO is 0 to 3")?,
        group_bytes: 1 << 20,
        prefetch: true,
        offload: None,
    };
    let (_settings, world) = flotilla_train::program::join_from_env()?;
    let mut pipe = Pipeline::new(&spec, cut, opts, world.clone())?;

    let dir = std::env::var("MNIST_DIR").unwrap_or_else(|_| "data/mnist".into());
    // The training images stay in their file: each epoch, the batches' thread reads this
    // replica's shard alone.
    let train = Arc::new(Mnist::open(&dir, Normalization::MNIST, &default_cache_dir()?)?.train);
    let test = Mnist::load_split(&dir, DataSplit::Test, Normalization::MNIST)?;
    // Every stage of a replica reads the same shard in the same order: the first stage uses
    // the images, the last the labels.
    let replicas = pipe.options().data_parallel;
    let mut batches = Batches::new(
        train,
        (replicas, pipe.replica()),
        42,
        setting("BATCH", 64)?,
        Position::default(),
    )?;
    let per_epoch = batches.steps_per_epoch();
    let epochs = setting("EPOCHS", 1)? as u64;
    let total = setting("STEPS", (epochs * per_epoch) as usize)? as u64;
    let started = Instant::now();
    for epoch in 0..total.div_ceil(per_epoch) {
        for step in 0..per_epoch.min(total - epoch * per_epoch) {
            // Linear warm-up over 100 steps, then cosine decay to zero.
            pipe.set_lr(learning_rate(epoch * per_epoch + step, total));
            let (_, batch) = batches.next_batch()?;
            let loss = match one_batch_loop {
                true => plain_step(&mut pipe, batch.images, batch.labels)?,
                false => pipe.train_batch(batch.images, batch.labels)?,
            };
            if let Some(loss) = loss.filter(|_| step % 200 == 0) {
                println!("epoch {epoch} step {step}: loss {loss:.4}");
            }
        }
    }
    let stats = pipe.evaluate(&test.normalized_images(), &labels(test.labels()), 1000)?;
    if world.rank() == 0 {
        println!(
            "stage {} of {}: test accuracy {:.4}, loss {:.4}, {:.1} s",
            pipe.stage_index(),
            stages,
            stats.accuracy(),
            stats.loss(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// One batch the way a PyTorch loop reads: forward, the loss and its gradient on the last
/// stage, backward, step. Returns the loss on the last stage.
fn plain_step(pipe: &mut Pipeline, images: &[f32], labels: &[i64]) -> Result<Option<f32>> {
    let logits = pipe.forward(images, labels.len())?;
    let (loss, grad) = match logits {
        Some(logits) => {
            let (loss, grad) = cross_entropy(&logits, labels);
            (Some(loss), Some(grad))
        }
        None => (None, None),
    };
    pipe.backward(grad.as_deref())?;
    pipe.step()?;
    Ok(loss)
}

fn learning_rate(step: u64, total: u64) -> f64 {
    const PEAK: f64 = 0.05;
    const WARMUP: u64 = 100;
    if step < WARMUP {
        return PEAK * (step + 1) as f64 / WARMUP as f64;
    }
    let progress = (step - WARMUP) as f64 / total.saturating_sub(WARMUP).max(1) as f64;
    PEAK * 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())
}

fn labels(bytes: &[u8]) -> Vec<i64> {
    bytes.iter().map(|&l| i64::from(l)).collect()
}

/// Starts one process per rank on this machine and waits for all of them; the first failure
/// stops the others.
fn launch() -> Result<()> {
    let stages = setting("STAGES", 2)?;
    cut_points(stages)?;
    schedule_setting()?;
    let world = stages * setting("DATA_PARALLEL", 1)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let exe = std::env::current_exe()?;
    // Every connection between the ranks proves a secret: the user's, or one for this run.
    let secret = match flotilla_tcp::Secret::from_env()? {
        Some(_) => None,
        None => {
            Some(String::from_utf8_lossy(flotilla_tcp::Secret::generate().bytes()).into_owned())
        }
    };
    let mut children: Vec<Child> = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            if let Some(s) = &secret {
                cmd.env(flotilla_tcp::SECRET_ENV, s);
            }
            cmd.env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RAYON_NUM_THREADS", "1")
                .spawn()
                .with_context(|| format!("starting rank {rank}"))
        })
        .collect::<Result<_>>()?;
    let outcome = wait_all(&mut children);
    for child in &mut children {
        let _ = child.kill();
        let _ = child.wait();
    }
    outcome
}

fn wait_all(children: &mut [Child]) -> Result<()> {
    let mut done = vec![false; children.len()];
    while done.iter().any(|d| !d) {
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    bail!("rank {rank} failed ({status})");
                }
                done[rank] = true;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}
