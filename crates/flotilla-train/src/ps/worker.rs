//! A parameter-server worker: pull parameters, compute on a batch of its shard, push the
//! gradient (or, with `local_steps > 1`, the weight delta of that many local steps), repeat
//! until its server says stop.

use std::time::{Duration, Instant};

use flotilla_data::{DistributedSampler, fill_batch};
use flotilla_engine::BatchRef;

use super::protocol::PsMessage;
use super::{PsContext, RoleSummary, send};
use crate::error::{Result, TrainError};
use crate::fault::FaultAction;

/// Runs worker number `index` (of `ctx.num_workers`) under its server(s): `parents[i]` holds
/// the parameters of `ranges[i]` (one parent holding everything, or the shard servers of a
/// sharded flat topology).
pub fn run(
    ctx: &mut PsContext<'_>,
    index: usize,
    parents: &[usize],
    ranges: &[std::ops::Range<usize>],
) -> Result<RoleSummary> {
    let n = ctx.engine.num_params();
    let sampler = DistributedSampler::new(
        ctx.train.len(),
        ctx.num_workers,
        index,
        ctx.config.model.seed,
        true,
    )?;
    let batch = ctx.config.data.batch_size;
    let steps_per_epoch = sampler.steps_per_epoch(batch);
    if steps_per_epoch == 0 {
        return Err(TrainError::config(
            "config",
            format!(
                "`batch_size` {batch} x {} workers exceeds the training set",
                ctx.num_workers
            ),
        ));
    }
    let local_steps = ctx.config.topology.local_steps.max(1);
    let averaging = local_steps > 1;
    let (mut images, mut labels) = (Vec::new(), Vec::new());
    let mut grad = vec![0.0f32; n];
    let mut local = vec![0.0f32; n];
    let (mut epoch, mut batches, mut next) = (0u64, sampler.batches(0, batch), 0usize);
    let mut rounds = 0u64;
    let (mut compute, mut push, mut wait) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let mut last_loss = f32::NAN;

    let layout = ctx.engine.layout().clone();
    let mut params = vec![0.0f32; n];
    let mut versions = vec![0u64; parents.len()];
    for &p in parents {
        send(ctx.comm, p, &PsMessage::Pull)?;
    }
    // A parent other than the first that cannot be reached may just have stopped: the
    // first parent (the root, for shards) then has a stop for this worker too.
    let mut unreachable: Option<TrainError> = None;
    loop {
        let t = Instant::now();
        for (i, &parent) in parents.iter().enumerate() {
            if unreachable.is_some() && i > 0 {
                break;
            }
            loop {
                let deadline = Instant::now() + Duration::from_secs_f64(ctx.config.comm.timeout_s);
                let bytes = match ctx.comm.recv(parent, super::protocol::TAG, deadline) {
                    Ok(b) => b,
                    Err(e) if i > 0 => {
                        unreachable = Some(e.into());
                        break;
                    }
                    Err(e) => return Err(e.into()),
                };
                match PsMessage::decode(&bytes, parent)? {
                    PsMessage::Params { version, values } => {
                        let range = ranges[i].clone();
                        if values.len() != range.len() {
                            return Err(TrainError::Protocol {
                                peer: parent,
                                message: format!(
                                    "sent {} parameters, this worker expects {} from it",
                                    values.len(),
                                    range.len()
                                ),
                            });
                        }
                        params[range].copy_from_slice(&values);
                        versions[i] = version;
                        break;
                    }
                    PsMessage::Stop { reason } => {
                        wait += t.elapsed();
                        ctx.log(&format!(
                            "stop from rank {parent} ({reason}) after {rounds} rounds; compute {:.1}s push {:.1}s wait {:.1}s",
                            compute.as_secs_f64(),
                            push.as_secs_f64(),
                            wait.as_secs_f64()
                        ))?;
                        return Ok(RoleSummary {
                            rounds,
                            loss: last_loss,
                        });
                    }
                    PsMessage::Reject { reason } => {
                        ctx.log(&format!(
                            "push rejected by rank {parent}: {reason}; pulling again"
                        ))?;
                        send(ctx.comm, parent, &PsMessage::Pull)?;
                    }
                    other => {
                        return Err(TrainError::Protocol {
                            peer: parent,
                            message: format!(
                                "a worker expects params, stop or reject, got {}",
                                other.name()
                            ),
                        });
                    }
                }
            }
        }
        wait += t.elapsed();
        if let Some(e) = unreachable.take() {
            return Err(e);
        }
        let t = Instant::now();
        ctx.engine.write_params(&params)?;
        let mut loss_sum = 0.0f32;
        for _ in 0..local_steps {
            if next == batches.len() {
                epoch += 1;
                batches = sampler.batches(epoch, batch);
                next = 0;
            }
            fill_batch(ctx.train, &batches[next], &mut images, &mut labels)?;
            next += 1;
            loss_sum += ctx.engine.forward_backward(BatchRef {
                images: &images,
                labels: &labels,
            })?;
            ctx.engine.for_each_grad(&mut |i, g| {
                let p = &layout.params[i];
                grad[p.offset..p.offset + p.len].copy_from_slice(g);
                Ok(())
            })?;
            if averaging {
                ctx.engine.apply_grads(&grad, ctx.config.base_lr())?;
            }
        }
        if averaging {
            ctx.engine.read_params(&mut local)?;
            for ((d, l), g) in grad.iter_mut().zip(&local).zip(&params) {
                *d = l - g;
            }
        }
        if ctx.fault.and_then(|f| f.at(rounds + 1)) == Some(FaultAction::BadLength) {
            eprintln!("FLOTILLA_FAULT: pushing a gradient of the wrong length");
            grad.truncate(n / 2);
        }
        last_loss = loss_sum / local_steps as f32;
        compute += t.elapsed();
        let t = Instant::now();
        for (i, &parent) in parents.iter().enumerate() {
            let msg = PsMessage::Push {
                version: versions[i],
                staleness: 0,
                samples: (batch * local_steps) as u32,
                loss: last_loss,
                delta: averaging,
                values: grad[ranges[i].start.min(grad.len())..ranges[i].end.min(grad.len())]
                    .to_vec(),
            };
            if let Err(e) = send(ctx.comm, parent, &msg) {
                if i == 0 {
                    return Err(e);
                }
                unreachable = Some(e);
            }
        }
        grad.resize(n, 0.0);
        push += t.elapsed();
        rounds += 1;
        if rounds.is_multiple_of(100) {
            ctx.log_quiet(&format!(
                "round {rounds} v{} loss={last_loss:.4} compute {:.2}s push {:.2}s wait {:.2}s",
                versions[0],
                compute.as_secs_f64(),
                push.as_secs_f64(),
                wait.as_secs_f64()
            ))?;
        }
    }
}
