//! The checks of a whole config: ranges, counts, the topology and the all-reduce mode it
//! allows, the placement on an inventory; every error names the key.

use flotilla_cluster::Arch;
use flotilla_engine::ModelSpec;

use super::{AllReduceMode, Backend, TrainConfig};
use crate::error::{Result, TrainError};

impl TrainConfig {
    /// Checks ranges and resolves the model spec; errors name the offending key.
    pub fn validate(&self) -> Result<ModelSpec> {
        self.validate_counts()?;
        self.validate_ranges()?;
        self.validate_wire()?;
        self.validate_topology()?;
        self.optimizer
            .validate()
            .map_err(|e| bad("optimizer", e.to_string()))?;
        flotilla_engine::check_device(&self.model.device)
            .map_err(|e| bad("model.device", e.to_string()))?;
        let spec =
            ModelSpec::resolve(&self.model.spec).map_err(|e| bad("model.spec", e.to_string()))?;
        self.check_tie(&spec)?;
        Ok(spec)
    }

    /// A model whose head is tied to its embedding (`tie_embedding`) keeps the two in one
    /// process: a pipeline's stages would part them.
    fn check_tie(&self, spec: &ModelSpec) -> Result<()> {
        if !spec.ties_embedding() || self.topology.arch != Arch::Pipeline {
            return Ok(());
        }
        Err(bad(
            "topology.arch",
            "the model's head is tied to its embedding (tie_embedding), a table a pipeline's \
             stages would part; train it with data parallelism"
                .into(),
        ))
    }

    /// The counts that must be at least 1.
    fn validate_counts(&self) -> Result<()> {
        let (s, t) = (&self.schedule, &self.topology);
        let at_least_one = |key: &str, ok: bool| {
            if ok {
                Ok(())
            } else {
                Err(bad(key, "must be at least 1".into()))
            }
        };
        at_least_one("schedule.epochs", s.epochs > 0 || s.max_steps.is_some())?;
        at_least_one("data.batch_size", self.data.batch_size > 0)?;
        at_least_one("topology.world_size", t.world_size > 0)?;
        at_least_one("topology.local_steps", t.local_steps > 0)?;
        at_least_one("schedule.num_server_rounds", s.num_server_rounds != Some(0))?;
        at_least_one("schedule.eval_every_steps", s.eval_every_steps != Some(0))?;
        at_least_one("data.train_limit", self.data.train_limit != Some(0))?;
        at_least_one("data.test_limit", self.data.test_limit != Some(0))
    }

    /// The numbers that must be positive or within a range, and the backend this build has.
    fn validate_ranges(&self) -> Result<()> {
        let (s, t, c) = (&self.schedule, &self.topology, &self.comm);
        if c.backend == Backend::Mpi && !cfg!(feature = "mpi") {
            return Err(TrainError::config(
                "config",
                "`comm.backend: mpi`: this binary was built without the `mpi` feature; rebuild with `cargo build --release --features mpi`",
            ));
        }
        if c.backend == Backend::Nccl && !cfg!(feature = "nccl") {
            return Err(TrainError::config(
                "config",
                "`comm.backend: nccl`: this binary was built without the `nccl` feature; rebuild with `cargo build --release --features nccl`",
            ));
        }
        positive("comm.bucket_mb", c.bucket_mb, "number of MiB")?;
        positive("comm.timeout_s", c.timeout_s, "number of seconds")?;
        positive("comm.join_timeout_s", c.join_timeout_s, "number of seconds")?;
        positive("optimizer.lr", self.optimizer.lr(), "number")?;
        if let Some(a) = s.target_accuracy
            && !(0.0..=1.0).contains(&a)
        {
            return Err(bad(
                "schedule.target_accuracy",
                format!("must be in [0, 1], got {a}"),
            ));
        }
        if let Some(l) = s.target_loss {
            positive("schedule.target_loss", l, "number of nats")?;
        }
        if !(0.0..=1.0).contains(&s.min_lr_ratio) {
            return Err(bad(
                "schedule.min_lr_ratio",
                format!("must be in [0, 1], got {}", s.min_lr_ratio),
            ));
        }
        if let Some(m) = t.async_momentum
            && !(0.0..1.0).contains(&m)
        {
            return Err(bad(
                "topology.async_momentum",
                format!("must be in [0, 1), got {m}"),
            ));
        }
        Ok(())
    }

    /// The TCP transport's sizes, each within what the transport takes (its largest frame).
    fn validate_wire(&self) -> Result<()> {
        let c = &self.comm;
        let frame_kb = flotilla_tcp::CommConfig::default().max_frame_bytes >> 10;
        let within = |key: &str, v: usize, lo: usize, hi: usize, unit: &str| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(bad(
                    key,
                    format!("must be from {lo} to {hi} {unit}, got {v}"),
                ))
            }
        };
        within(
            "comm.small_all_reduce_kb",
            c.small_all_reduce_kb,
            0,
            frame_kb,
            "KiB (the largest frame)",
        )?;
        within(
            "comm.chunk_kb",
            c.chunk_kb,
            1,
            frame_kb,
            "KiB (the largest frame)",
        )?;
        within("comm.shm_chunk_kb", c.shm_chunk_kb, 4, 1 << 20, "KiB")?;
        if !c.shm_chunk_kb.is_multiple_of(4) {
            return Err(bad(
                "comm.shm_chunk_kb",
                format!(
                    "must be a multiple of 4 (whole pages), got {}",
                    c.shm_chunk_kb
                ),
            ));
        }
        // At least two frames: a frame must fit beside another one queued.
        within(
            "comm.max_queued_mb",
            c.max_queued_mb,
            2 * (frame_kb >> 10),
            usize::MAX >> 20,
            "MiB (two frames)",
        )?;
        within("comm.threads", c.threads, 1, 1024, "threads")?;
        if let Some(kb) = c.socket_buffer_kb {
            within("comm.socket_buffer_kb", kb, 1, 1 << 20, "KiB")?;
        }
        Ok(())
    }

    /// The architecture's own sections, the all-reduce mode it allows, and the placement on
    /// the inventory's hosts.
    fn validate_topology(&self) -> Result<()> {
        let t = &self.topology;
        if t.arch == Arch::Pipeline {
            self.validate_pipeline()?;
        }
        if let Some(min) = t.min_world_size {
            self.validate_elastic(min)?;
        }
        if t.arch == Arch::Flat && t.parameter_server.is_none() && t.world_size <= t.servers {
            return Err(bad(
                "topology.world_size",
                format!(
                    "`arch: flat` without a `parameter_server` section makes every rank after \
                     the {} server(s) a sync worker: {} rank(s) leave none (at least {}, or \
                     e.g. `parameter_server: {{aggr_type: sync, num_workers: 2}}`)",
                    t.servers,
                    t.world_size,
                    t.servers + 1
                ),
            ));
        }
        self.allreduce.validate()?;
        if self.allreduce.mode == AllReduceMode::Async && t.arch != Arch::Allreduce {
            return Err(bad(
                "allreduce.mode",
                format!(
                    "async is a mode of data-parallel all-reduce, not of arch {}",
                    t.arch
                ),
            ));
        }
        let sync_mode = t.arch == Arch::Allreduce && self.allreduce.mode == AllReduceMode::Sync;
        if self.allreduce.sync_batch_norm && !sync_mode {
            return Err(bad(
                "allreduce.sync_batch_norm",
                format!(
                    "synchronized batch norm runs in the forward pass of sync data-parallel \
                     all-reduce only, not under arch {} with mode {:?}",
                    t.arch, self.allreduce.mode
                ),
            ));
        }
        let pipeline_zero = t.arch == Arch::Pipeline;
        if self.allreduce.zero > 0 && !sync_mode && !pipeline_zero {
            return Err(bad(
                "allreduce.zero",
                format!(
                    "ZeRO shards the optimizer step of sync data-parallel all-reduce (stages 1 \
                     to 3) and of a pipeline's replicas only, not stage {} under \
                     arch {} with mode {:?}",
                    self.allreduce.zero, t.arch, self.allreduce.mode
                ),
            ));
        }
        self.check_offload()?;
        self.check_reshard()?;
        if self.model.recompute && t.arch == Arch::Pipeline {
            return Err(bad(
                "model.recompute",
                "a pipeline stage keeps its micro-batches' activations for their backward: \
                 recomputation is for the whole model of data parallelism and parameter \
                 servers (set recompute: false)"
                    .into(),
            ));
        }
        self.check_step_shaping()?;
        let topology = self.topology()?;
        if let Some(path) = &t.inventory {
            let inventory = flotilla_cluster::Inventory::load(path)
                .map_err(|e| bad("topology.inventory", e.to_string()))?;
            flotilla_cluster::place(&topology, &inventory)
                .map_err(|e| bad("topology.inventory", e.to_string()))?;
        }
        Ok(())
    }
}

impl TrainConfig {
    /// `allreduce.reshard_after_forward: false` keeps ZeRO-3's gathered parameters from
    /// forward to backward: it needs ZeRO-3 of data parallelism, and it recomputes nothing.
    fn check_reshard(&self) -> Result<()> {
        if self.allreduce.reshard_after_forward {
            return Ok(());
        }
        let why = if self.allreduce.zero != 3 || self.topology.arch != Arch::Allreduce {
            "keeps ZeRO stage 3's gathered parameters from a block's forward to its backward: \
             it needs zero: 3 of data parallelism (arch: allreduce)"
        } else if self.model.recompute {
            "keeps each block's forward, with its parameters, for its backward, and \
             recompute: true recomputes it: drop one of them"
        } else {
            return Ok(());
        };
        Err(TrainError::config(
            "allreduce.reshard_after_forward",
            why.to_string(),
        ))
    }

    /// `allreduce.offload` needs a shard: two or more ranks sharing ZeRO's optimizer state
    /// (a pipeline: replicas of a stage).
    fn check_offload(&self) -> Result<()> {
        let t = &self.topology;
        let sharers = match t.arch {
            Arch::Pipeline => self.pipeline.data_parallel,
            _ => t.world_size,
        };
        if self.allreduce.offload.is_some() && sharers < 2 {
            return Err(TrainError::config(
                "allreduce.offload",
                format!(
                    "offloads each rank's shard of the optimizer state under ZeRO, and one \
                     rank{} shares nothing (ZeRO runs unsharded): run 2 or more, or drop it",
                    if t.arch == Arch::Pipeline {
                        " a stage"
                    } else {
                        ""
                    }
                ),
            ));
        }
        Ok(())
    }
}

impl TrainConfig {
    /// Gradient accumulation and clipping by global norm: in range, and clipping only where
    /// a strategy does it (all-reduce, sync with any `zero` or async; pipelines; a parameter
    /// server holding every parameter, which clips each mean gradient it applies; every
    /// strategy accumulates).
    fn check_step_shaping(&self) -> Result<()> {
        let a = &self.allreduce;
        if a.accumulation_steps == 0 {
            return Err(bad(
                "allreduce.accumulation_steps",
                "must be at least 1, got 0".into(),
            ));
        }
        let sync = self.topology.arch == Arch::Allreduce && a.mode == AllReduceMode::Sync;
        if a.reduce_each_micro_batch && !sync {
            return Err(bad(
                "allreduce.reduce_each_micro_batch",
                "reduces each micro-batch of sync all-reduce (any `zero`); async all-reduce, \
                 pipelines and parameter servers reduce a step's sum once (set it to false)"
                    .into(),
            ));
        }
        let Some(max) = a.clip_grad_norm else {
            return Ok(());
        };
        positive("allreduce.clip_grad_norm", max, "norm")?;
        let t = &self.topology;
        let why = match t.arch {
            Arch::Allreduce | Arch::Pipeline => return Ok(()),
            _ if t.local_steps > 1 => format!(
                "is not done under model averaging (topology.local_steps {}: workers step \
                 their own optimizers and push weight deltas, not gradients)",
                t.local_steps
            ),
            Arch::Flat if t.servers > 1 => format!(
                "runs at a parameter server that holds every parameter, not over {} shard \
                 servers (topology.servers: the norm of a step spans every shard's slice)",
                t.servers
            ),
            _ => return Ok(()),
        };
        Err(bad("allreduce.clip_grad_norm", why))
    }
}

/// A config error naming `key`.
pub(super) fn bad(key: &str, msg: String) -> TrainError {
    TrainError::config("config", format!("`{key}`: {msg}"))
}

/// `Ok` when `v` is a positive finite number, else an error naming `key`.
fn positive(key: &str, v: f64, what: &str) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(bad(
            key,
            format!("must be a finite positive {what}, got {v}"),
        ))
    }
}

impl TrainConfig {
    /// What an elastic job (`topology.min_world_size`) takes today: sync all-reduce (`zero`
    /// 0 to 2), async all-reduce, a pipeline's replicas (without ZeRO), or a
    /// parameter server's workers (flat, one server or shards, or hierarchical; sync or
    /// async, any `local_steps`) over TCP, `1 <= min <= world_size`, and a parameter server's
    /// minimum leaves its servers a worker at least. Each refusal names the setting.
    fn validate_elastic(&self, min: usize) -> Result<()> {
        let key = "topology.min_world_size";
        let t = &self.topology;
        let world = self.effective_world_size()?;
        if min == 0 || min > world {
            return Err(bad(
                key,
                format!("must be between 1 and world_size ({world}), not {min}"),
            ));
        }
        let not_yet = |what: &str| {
            Err(bad(
                key,
                format!(
                    "an elastic job trains with sync or async all-reduce, a pipeline's replicas \
                     or a parameter server's workers, over TCP so far; {what} keeps a fixed size (drop MIN: \
                     `-n {world}`, and `--max-restarts` restarts the whole job from its checkpoint)"
                ),
            ))
        };
        if matches!(t.arch, Arch::Flat | Arch::Hierarchical) {
            let servers = world - self.topology()?.num_workers();
            if min <= servers {
                return Err(bad(
                    key,
                    format!(
                        "must leave the {servers} server(s) at least one worker: {} or more, \
                         not {min}",
                        servers + 1
                    ),
                ));
            }
        } else if t.arch == Arch::Pipeline {
            let s = self.elastic_unit();
            if !min.is_multiple_of(s) || !t.world_size.is_multiple_of(s) {
                return Err(bad(
                    key,
                    format!(
                        "an elastic pipeline of {s} stages runs whole replicas: MIN and MAX must \
                         be multiples of {s}, not {min}:{}",
                        t.world_size
                    ),
                ));
            }
        }
        if self.comm.backend != super::Backend::Tcp {
            return not_yet("an MPI or NCCL backend");
        }
        if self.allreduce.zero == 3 {
            return not_yet("ZeRO stage 3 (parameters sharded; stages 1 and 2 are elastic)");
        }
        if self.allreduce.zero > 0 && t.arch == Arch::Pipeline {
            return not_yet("ZeRO among a pipeline's replicas");
        }
        if self.allreduce.offload.is_some() {
            return not_yet("an offloaded optimizer state (`allreduce.offload`)");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulation_runs_everywhere_and_clipping_is_refused_where_no_strategy_does_it() {
        let check = |yaml: &str| TrainConfig::from_yaml(yaml, "r").expect("parse").validate();
        for yaml in [
            "accumulation_steps: 4\nzero: 1\n",
            "accumulation_steps: 4\nzero: 2\n",
            "accumulation_steps: 2\nstrategy: pipeline\n",
            "accumulation_steps: 2\nstrategy: async_allreduce\n",
            "accumulation_steps: 2\narch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\n",
        ] {
            check(yaml).expect(yaml);
        }
        let e = check("accumulation_steps: 0\n").expect_err("0").to_string();
        assert!(e.contains("allreduce.accumulation_steps"), "{e}");
        for zero in 0..=3 {
            let yaml =
                format!("accumulation_steps: 2\nzero: {zero}\nreduce_each_micro_batch: true\n");
            check(&yaml).expect(&yaml);
        }
        for yaml in [
            "accumulation_steps: 2\nstrategy: pipeline\nreduce_each_micro_batch: true\n",
            "accumulation_steps: 2\nstrategy: async_allreduce\nreduce_each_micro_batch: true\n",
            "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nreduce_each_micro_batch: true\n",
        ] {
            let e = check(yaml).expect_err(yaml).to_string();
            assert!(
                e.contains("allreduce.reduce_each_micro_batch"),
                "{yaml}: {e}"
            );
        }
        for yaml in [
            "clip_grad_norm: 1.0\nzero: 1\n",
            "clip_grad_norm: 1.0\nzero: 2\n",
            "clip_grad_norm: 1.0\nstrategy: pipeline\n",
            "clip_grad_norm: 1.0\nstrategy: async_allreduce\n",
            "clip_grad_norm: 1.0\narch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\n",
            "clip_grad_norm: 1.0\narch: flat\nparameter_server: {aggr_type: async, num_workers: 2}\n",
            "clip_grad_norm: 1.0\narch: hierarchical\nglobal_server: {aggr_type: sync, local_servers: [{aggr_type: async, num_workers: 2}]}\n",
        ] {
            check(yaml).expect(yaml);
        }
        for yaml in [
            "clip_grad_norm: 0\n",
            "clip_grad_norm: -1\n",
            "clip_grad_norm: 1.0\narch: flat\nservers: 2\nparameter_server: {aggr_type: sync, num_workers: 2}\n",
            "clip_grad_norm: 1.0\narch: flat\nlocal_steps: 4\nparameter_server: {aggr_type: sync, num_workers: 2}\n",
        ] {
            let e = check(yaml).expect_err(yaml).to_string();
            assert!(e.contains("allreduce.clip_grad_norm"), "{yaml}: {e}");
        }
    }

    #[test]
    fn bad_values_name_the_key() {
        let c = TrainConfig::from_yaml("batch_size: 0\n", "r").expect("parse");
        let e = c.validate().expect_err("zero batch").to_string();
        assert!(e.contains("data.batch_size"), "{e}");
        let c = TrainConfig::from_yaml("model: resnet999\n", "r").expect("parse");
        let e = c.validate().expect_err("model").to_string();
        assert!(e.contains("model") && e.contains("resnet999"), "{e}");
        let c = TrainConfig::from_yaml("optimizer: {name: sgd, lr: -1}\n", "r").expect("parse");
        assert!(c.validate().expect_err("lr").to_string().contains("lr"));
        let c = TrainConfig::from_yaml("device: tpu\n", "r").expect("parse");
        assert!(
            c.validate()
                .expect_err("device")
                .to_string()
                .contains("tpu")
        );
        let e = TrainConfig::from_yaml("epochs: many\n", "r")
            .expect_err("type")
            .to_string();
        assert!(e.contains("epochs"), "{e}");
    }

    #[test]
    fn keeping_the_gathered_parameters_needs_zero_3_and_no_recomputation() {
        let check = |yaml: &str| TrainConfig::from_yaml(yaml, "r").expect("parse").validate();
        let kept = "world_size: 2\nreshard_after_forward: false\n";
        check(&format!("{kept}zero: 3\n")).expect("zero 3");
        for other in [
            "zero: 2\n",
            "zero: 3\nrecompute: true\n",
            "zero: 1\nstrategy: pipeline\nstages: 2\n",
        ] {
            let e = check(&format!("{kept}{other}"))
                .expect_err(other)
                .to_string();
            assert!(
                e.contains("allreduce.reshard_after_forward"),
                "{other}: {e}"
            );
        }
    }

    #[test]
    fn a_pipeline_shards_its_replicas_at_any_zero_stage() {
        let check = |yaml: &str| TrainConfig::from_yaml(yaml, "r").expect("parse").validate();
        let pipeline = "strategy: pipeline\nstages: 2\ndata_parallel: 2\nworld_size: 4\n";
        for zero in 1..=3 {
            check(&format!("{pipeline}zero: {zero}\n")).expect("zero");
        }
        let async_ = "strategy: async_allreduce\nworld_size: 2\nzero: 1\n";
        let e = check(async_).expect_err("refused").to_string();
        assert!(
            e.contains("allreduce.zero") && e.contains("pipeline's replicas only"),
            "{e}"
        );
    }

    #[test]
    fn an_elastic_job_takes_all_reduce_pipeline_replicas_or_server_workers_and_refuses_the_rest() {
        let check = |yaml: &str| TrainConfig::from_yaml(yaml, "r").expect("parse").validate();
        let flat =
            "arch: flat\nworld_size: 3\nparameter_server: {aggr_type: sync, num_workers: 2}\n";
        // 6 ranks: the global server, 2 local servers, 3 workers.
        let hier = "arch: hierarchical\nglobal_server: {aggr_type: sync, local_servers: [{aggr_type: sync, num_workers: 2}, {aggr_type: async, num_workers: 1}]}\n";
        for yaml in [
            "world_size: 3\nmin_world_size: 2\n".to_string(),
            "world_size: 3\nmin_world_size: 2\nzero: 2\n".to_string(),
            format!("{flat}min_world_size: 2\n"),
            format!("{flat}min_world_size: 2\nlocal_steps: 4\n"),
            "strategy: pipeline\nstages: 2\nworld_size: 4\nmin_world_size: 2\n".into(),
            "arch: flat\nworld_size: 4\nservers: 2\nmin_world_size: 3\n".into(),
            "world_size: 3\nmin_world_size: 2\naccumulation_steps: 4\nzero: 1\n".into(),
            "world_size: 3\nmin_world_size: 2\naccumulation_steps: 2\nstrategy: async_allreduce\n"
                .into(),
            format!("{flat}min_world_size: 2\naccumulation_steps: 2\n"),
            format!("{hier}min_world_size: 5\n"),
            "strategy: pipeline\nstages: 2\nworld_size: 4\nmin_world_size: 2\naccumulation_steps: 2\n"
                .into(),
            format!("{hier}min_world_size: 6\n"),
        ] {
            check(&yaml).unwrap_or_else(|e| panic!("{yaml}: {e}"));
        }
        for (yaml, why) in [
            (format!("{flat}min_world_size: 1\n"), "at least one worker"),
            (
                "arch: flat\nworld_size: 4\nservers: 2\nmin_world_size: 2\n".into(),
                "2 server(s) at least one worker: 3 or more, not 2",
            ),
            (
                "strategy: pipeline\nstages: 2\nworld_size: 4\nmin_world_size: 3\n".into(),
                "multiples of 2, not 3:4",
            ),
            (
                format!("{hier}min_world_size: 3\n"),
                "3 server(s) at least one worker: 4 or more, not 3",
            ),
            (
                format!("{hier}min_world_size: 7\n"),
                "between 1 and world_size (6), not 7",
            ),
            (
                "strategy: pipeline\nstages: 2\nworld_size: 4\nmin_world_size: 2\nzero: 1\n".into(),
                "ZeRO among a pipeline's replicas keeps a fixed size",
            ),
        ] {
            let e = check(&yaml).expect_err(&yaml).to_string();
            assert!(
                e.contains("min_world_size") && e.contains(why),
                "{yaml}: {e}"
            );
        }
    }
}
