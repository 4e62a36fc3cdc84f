//! The `allreduce:` section: how data-parallel peers reduce gradients — synchronously
//! (every step waits for its own gradient) or through the asynchronous background cycle —
//! and the stall inspector's limits.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// Sync or async all-reduce (`strategy: sync_allreduce | async_allreduce` sets it too).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllReduceMode {
    /// Each step all-reduces its own gradients and applies them (Horovod / DDP).
    #[default]
    Sync,
    /// Gradients are submitted by name to a background cycle every `cycle_duration_ms`; the
    /// optimizer applies the gradient reduced `staleness` steps earlier.
    Async,
}

/// How an async peer makes up for applying a stale gradient.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StaleCorrection {
    /// Weight prediction: compute each step's gradient at the parameters it will be applied
    /// to, extrapolated from the last update (`w + k·(w − w_prev)` with `k` steps in flight).
    #[default]
    Predict,
    /// None: the gradient of parameters `staleness` updates old is applied as it is.
    None,
}

/// Data-parallel all-reduce settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AllReduceSection {
    /// `sync` (default) or `async`.
    pub mode: AllReduceMode,
    /// Sync: run backward in groups of about `comm.bucket_mb` and start each bucket's
    /// all-reduce as soon as its group's gradients exist (bitwise the same result).
    pub overlap: bool,
    /// Sync: every batch norm trains with the statistics of the global batch (every rank's
    /// samples), as PyTorch's `SyncBatchNorm`: two small all-reduces per batch norm in the
    /// forward pass and two in the backward. Off by default (each rank's own batch).
    pub sync_batch_norm: bool,
    /// Sync: ZeRO stage (`zero`): 0 every rank holds the whole optimizer state; 1 each rank
    /// steps the optimizer on its shard of every bucket only (1/N of the state), then the
    /// parameters are all-gathered; 2 as 1, and the buckets are reduce-scattered instead of
    /// all-reduced (each rank keeps only its shard's gradient sums and one bucket's wire
    /// buffer). On one rank every stage is 0 (nothing to shard). A pipeline (`arch:
    /// pipeline`) runs 1 among each stage's `data_parallel` replicas.
    pub zero: u8,
    /// ZeRO stage 3: start each backward group's parameter all-gather while the group before
    /// it computes (PyTorch FSDP's prefetch; the gathered values are the same). On by default;
    /// off, each group's all-gather waits for the group before it.
    pub prefetch: bool,
    /// ZeRO stage 3: release each backward group's gathered parameters after its forward
    /// (PyTorch FSDP2's `reshard_after_forward`), gathering them again and recomputing the
    /// forward in backward. On by default; off, each group's parameters are gathered once a
    /// step and kept, with its activations, until its backward: no second gather and no
    /// recomputed forward, for every group's parameters and activations held at the end of
    /// forward (the same gradients).
    pub reshard_after_forward: bool,
    /// ZeRO 1 to 3 (and a pipeline's replicas under ZeRO-1): keep this rank's shard of the
    /// optimizer state in files, not in memory (DeepSpeed's `offload_optimizer` to NVMe), in
    /// a new directory of its own under this one, removed at the end of the run. A step
    /// streams through the shard about 2 M values at a time (one chunk's state read, stepped,
    /// written back), with the same bits; what it costs is those reads and writes every step.
    /// Give it a local disk with room for the shard's state (Adam: 8 bytes a parameter / N).
    /// None (default): in memory.
    pub offload: Option<PathBuf>,
    /// Micro-batches of `batch_size` samples per optimizer step (DDP's `no_sync`,
    /// DeepSpeed's `gradient_accumulation_steps`): a rank differentiates each, sums their
    /// gradients locally and reduces once, after the last (unless
    /// `reduce_each_micro_batch`) (sync, any ZeRO stage, or async;
    /// pipelines: that many times the micro-batches); the step's global batch is
    /// `batch_size × accumulation_steps × ranks`. 1: every batch is a step.
    pub accumulation_steps: u32,
    /// Sync, with `accumulation_steps` > 1: reduce every micro-batch's gradients as its
    /// backward gives them and add the reductions up (DDP without `no_sync`, FSDP's default,
    /// DeepSpeed's ZeRO-2/3), instead of summing the micro-batches on the rank and reducing
    /// once. Under ZeRO-2 and 3 a rank then never holds a whole gradient, only its shard (ZeRO-3
    /// without it keeps a whole model's worth of summed gradients while it accumulates); the
    /// price is one reduction per micro-batch. The same values under every ZeRO stage, bitwise.
    /// Off by default.
    pub reduce_each_micro_batch: bool,
    /// Clip the averaged gradient to this global L2 norm before the optimizer step
    /// (PyTorch's `clip_grad_norm_`: scaled by `min(1, max / (norm + 1e-6))`), the norm over
    /// every parameter also under ZeRO and across pipeline stages; async: each applied
    /// (stale) average; a parameter server holding every parameter: each mean gradient it
    /// applies. None: no clipping.
    pub clip_grad_norm: Option<f64>,
    /// Async: time between the starts of two background cycles, in milliseconds.
    pub cycle_duration_ms: f64,
    /// Async: fusion buffer size in bytes (0: one all-reduce per tensor).
    pub all_reduce_buffer_size: u64,
    /// Async: the optimizer applies the gradient of this many steps earlier (0: its own, as
    /// sync does, through the same machinery).
    pub staleness: u64,
    /// Async: `predict` (default) or `none`; see [`StaleCorrection`].
    pub correction: StaleCorrection,
    /// Warn (on every rank, again at this interval) when some ranks submitted a tensor or
    /// entered a collective and others have not for this many seconds.
    pub stall_warning_s: f64,
    /// Abort the job when such a wait reaches this many seconds (default: never).
    pub stall_shutdown_s: Option<f64>,
}

impl Default for AllReduceSection {
    fn default() -> Self {
        Self {
            mode: AllReduceMode::Sync,
            overlap: true,
            sync_batch_norm: false,
            zero: 0,
            prefetch: true,
            reshard_after_forward: true,
            offload: None,
            accumulation_steps: 1,
            reduce_each_micro_batch: false,
            clip_grad_norm: None,
            cycle_duration_ms: 5.0,
            all_reduce_buffer_size: 64 << 20,
            staleness: 1,
            correction: StaleCorrection::Predict,
            stall_warning_s: 60.0,
            stall_shutdown_s: None,
        }
    }
}

impl AllReduceSection {
    /// Checks the ranges; errors name the key.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, msg: String| {
            TrainError::config("config", format!("`allreduce.{key}`: {msg}"))
        };
        let finite_positive = |v: f64| v.is_finite() && v > 0.0;
        if !finite_positive(self.cycle_duration_ms) || self.cycle_duration_ms > 60_000.0 {
            return Err(bad(
                "cycle_duration_ms",
                format!(
                    "must be a positive number of milliseconds up to 60000, got {}",
                    self.cycle_duration_ms
                ),
            ));
        }
        if self.zero > 3 {
            return Err(bad(
                "zero",
                format!(
                    "is the ZeRO stage: 0 (unsharded), 1 (optimizer state sharded), 2 \
                     (optimizer state and gradients sharded) or 3 (parameters too), got {}",
                    self.zero
                ),
            ));
        }
        if self.staleness > 16 {
            return Err(bad(
                "staleness",
                format!("must be at most 16, got {}", self.staleness),
            ));
        }
        if self.offload.is_some() && self.zero == 0 {
            return Err(bad(
                "offload",
                "moves ZeRO's shard of the optimizer state to files: set zero 1, 2 or 3".into(),
            ));
        }
        if !finite_positive(self.stall_warning_s) {
            return Err(bad(
                "stall_warning_s",
                format!(
                    "must be a positive number of seconds, got {}",
                    self.stall_warning_s
                ),
            ));
        }
        if let Some(s) = self.stall_shutdown_s
            && !finite_positive(s)
        {
            return Err(bad(
                "stall_shutdown_s",
                format!("must be a positive number of seconds, got {s}"),
            ));
        }
        Ok(())
    }

    /// The background cycle's settings.
    pub fn cycle(&self) -> crate::strategy::allreduce::cycle::CycleConfig {
        crate::strategy::allreduce::cycle::CycleConfig {
            cycle: Duration::from_secs_f64(self.cycle_duration_ms / 1000.0),
            buffer_bytes: usize::try_from(self.all_reduce_buffer_size).unwrap_or(usize::MAX),
            stall: self.stall_policy(),
        }
    }

    /// The stall inspector's limits.
    pub fn stall_policy(&self) -> flotilla_tcp::StallPolicy {
        flotilla_tcp::StallPolicy {
            warning: Duration::from_secs_f64(self.stall_warning_s),
            shutdown: self.stall_shutdown_s.map(Duration::from_secs_f64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainConfig;
    use flotilla_cluster::Arch;

    #[test]
    fn strategy_async_allreduce_and_the_sections_keys() {
        let c = TrainConfig::from_yaml(
            "strategy: async_allreduce\ncycle_duration_ms: 2\nstaleness: 0\ncorrection: none\n",
            "a.yaml",
        )
        .expect("parse");
        c.validate().expect("valid");
        assert_eq!(c.topology.arch, Arch::Allreduce);
        let a = &c.allreduce;
        assert_eq!(
            (a.mode, a.staleness, a.correction),
            (AllReduceMode::Async, 0, StaleCorrection::None)
        );
        assert_eq!(a.cycle().cycle, Duration::from_millis(2));
        let sync =
            TrainConfig::from_yaml("arch: sync_allreduce\noverlap: false\n", "s").expect("parse");
        assert_eq!(sync.allreduce.mode, AllReduceMode::Sync);
        assert!(!sync.allreduce.overlap);
        assert_eq!(
            TrainConfig::default().allreduce.stall_policy().shutdown,
            None,
            "no abort unless asked"
        );
        for (text, key) in [
            ("staleness: 17\n", "allreduce.staleness"),
            ("zero: 4\n", "allreduce.zero"),
            ("offload: /tmp\n", "allreduce.offload"),
            (
                "zero: 3\noffload: /tmp\nworld_size: 1\n",
                "allreduce.offload",
            ),
            (
                "zero: 1\noffload: /tmp\nstrategy: pipeline\nstages: 2\nworld_size: 2\n",
                "allreduce.offload",
            ),
            ("strategy: async_allreduce\nzero: 1\n", "allreduce.zero"),
            (
                "zero: 2\narch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\n",
                "allreduce.zero",
            ),
            ("cycle_duration_ms: 0\n", "allreduce.cycle_duration_ms"),
            ("stall_warning_s: 0\n", "allreduce.stall_warning_s"),
            ("stall_shutdown_s: -1\n", "allreduce.stall_shutdown_s"),
            (
                "allreduce: {mode: async}\narch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\n",
                "allreduce.mode",
            ),
        ] {
            let err = TrainConfig::from_yaml(text, "bad.yaml")
                .and_then(|c| c.validate().map(|_| ()))
                .expect_err(text);
            assert!(err.to_string().contains(key), "{text}: {err}");
        }
    }
}
