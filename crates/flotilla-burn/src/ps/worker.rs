//! [`Worker`]: a parameter-server worker in the user's own loop: pull, compute, push.

use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use flotilla_engine::{ParamLayout, any_module};
use flotilla_group::ProcessGroup;
use flotilla_ps::{PsMessage, TAG};

use super::{PsConfig, Shard, shards};
use crate::data_parallel::DataParallel;
use crate::error::{DistError, Result};

/// A worker of a parameter-server job (see the [module documentation](super)):
///
/// ```no_run
/// # use burn::prelude::*;
/// # use burn::nn::{Linear, LinearConfig};
/// # use burn::optim::GradientsParams;
/// # #[derive(Module, Debug)] struct Net { fc: Linear }
/// # fn batch() -> (Tensor<2>, Tensor<2>) { unimplemented!() }
/// # let group = flotilla_burn::init()?;
/// # let net = Net { fc: LinearConfig::new(4, 1).init(&Device::default().autodiff()) };
/// let mut worker = flotilla_burn::ps::Worker::new(group, &net, Default::default())?;
/// while let Some(net) = worker.pull(&net)? {
///     let (x, y) = batch();
///     let loss = (net.fc.forward(x) - y).powf_scalar(2.0).mean();
///     let grads = GradientsParams::from_grads(loss.backward(), &net);
///     worker.push(&net, grads, 16, loss.into_scalar::<f32>())?;
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Worker {
    group: Arc<dyn ProcessGroup>,
    layout: ParamLayout,
    shards: Vec<Shard>,
    config: PsConfig,
    /// The pulled parameters, then this rank's gradient.
    params: Vec<f32>,
    grad: Vec<f32>,
    /// The version each server's part was pulled at.
    versions: Vec<u64>,
}

impl Worker {
    /// Joins the job as a worker for `model`. Collective with every rank's [`Worker::new`] or
    /// [`super::serve`]: checks that all ranks have the same parameter list and takes rank 0's
    /// initial parameters, then asks every server for its part.
    pub fn new<M: Module>(
        group: Arc<dyn ProcessGroup>,
        model: &M,
        config: PsConfig,
    ) -> Result<Self> {
        config.check(group.size())?;
        if group.rank() < config.servers {
            return Err(DistError::Config(format!(
                "rank {} is a server (ranks 0..{}): run flotilla_burn::ps::serve there",
                group.rank(),
                config.servers
            )));
        }
        let dp = DataParallel::new(group.clone(), model)?;
        dp.broadcast_model(model.clone())?;
        let layout = dp.layout().clone();
        for s in 0..config.servers {
            group.send(s, TAG, &PsMessage::Pull.encode())?;
        }
        Ok(Self {
            group,
            shards: shards(&layout, config.servers),
            params: vec![0.0; layout.total],
            grad: vec![0.0; layout.total],
            versions: vec![0; config.servers],
            layout,
            config,
        })
    }

    /// `model` with the servers' newest parameters (ids kept), or `None` once the servers said
    /// stop. Call it before each step's forward pass. Every server's answer is read, stop or
    /// not, so that a worker leaves only once every server finished its last round with it.
    pub fn pull<M: Module>(&mut self, model: &M) -> Result<Option<M>> {
        let mut stopped = false;
        for s in 0..self.config.servers {
            loop {
                let deadline = Instant::now() + self.config.timeout;
                let bytes = self.group.recv(s, TAG, deadline)?;
                match PsMessage::decode(&bytes, s)? {
                    PsMessage::Params { version, values } => {
                        let range = self.shards[s].values.clone();
                        if values.len() != range.len() {
                            return Err(DistError::Peer {
                                rank: s,
                                message: format!(
                                    "server rank {s} sent {} parameters, its part has {}",
                                    values.len(),
                                    range.len()
                                ),
                            });
                        }
                        self.params[range].copy_from_slice(&values);
                        self.versions[s] = version;
                        break;
                    }
                    PsMessage::Stop { .. } => {
                        stopped = true;
                        break;
                    }
                    PsMessage::Abort { reason } => {
                        return Err(DistError::Peer {
                            rank: s,
                            message: format!("server rank {s} failed: {reason}"),
                        });
                    }
                    PsMessage::Reject { reason } => {
                        tracing::warn!(target: "flotilla::burn", "push refused by rank {s}: {reason}; pulling again");
                        self.group.send(s, TAG, &PsMessage::Pull.encode())?;
                    }
                    other => {
                        return Err(DistError::Peer {
                            rank: s,
                            message: format!(
                                "a worker expects params, stop or reject from server rank {s}, got {}",
                                other.name()
                            ),
                        });
                    }
                }
            }
        }
        if stopped {
            return Ok(None);
        }
        let model = any_module::write_params(model.clone(), &self.layout, &self.params)?;
        Ok(Some(model))
    }

    /// Sends every server its part of `grads` (computed on the model [`Worker::pull`] gave,
    /// over `samples` samples, the weight of this push in a sync round, with mean loss `loss`).
    /// The servers answer with the next parameters, taken by the next pull.
    pub fn push<M: Module>(
        &mut self,
        model: &M,
        mut grads: GradientsParams,
        samples: u32,
        loss: f32,
    ) -> Result<()> {
        let all = 0..self.layout.params.len();
        any_module::take_grads(model, &mut grads, &self.layout, all, &mut self.grad)?;
        for (s, shard) in self.shards.iter().enumerate() {
            let msg = PsMessage::Push {
                version: self.versions[s],
                staleness: 0,
                samples,
                loss,
                delta: false,
                values: self.grad[shard.values.clone()].to_vec(),
            };
            self.group.send(s, TAG, &msg.encode())?;
        }
        Ok(())
    }

    /// The parameter version last pulled from server 0.
    pub fn version(&self) -> u64 {
        self.versions.first().copied().unwrap_or(0)
    }
}
