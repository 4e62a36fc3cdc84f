//! A pipeline job's plan: where the model is cut (explicit ranges, split points, or the
//! automatic partition by measured cost within each host's memory) and what every stage is
//! estimated to cost. Printed before training and by `flotilla config`.

use std::ops::Range;

use flotilla_engine::{LayerCost, StageEstimate, StageHost, check_cut, partition};
use flotilla_engine::{ModelSpec, StageCut, ranges_from_points};

use crate::config::{StagesSetting, TrainConfig};
use crate::error::{Result, TrainError};

/// Timed rounds over the model's prefixes when profiling (see `flotilla_engine::profile`).
const PROFILE_ROUNDS: usize = 8;

/// Where a pipeline is cut, and the estimates of each stage.
#[derive(Debug, Clone)]
pub struct PipelinePlan {
    /// The cut.
    pub cut: StageCut,
    /// Per stage: layers, parameters, time per micro-batch and peak memory.
    pub stages: Vec<StageEstimate>,
    /// Each stage's host (memory limit, speed, micro-batches in flight).
    pub hosts: Vec<StageHost>,
    /// Whether the cut was chosen automatically.
    pub automatic: bool,
    /// Samples per micro-batch the estimates are for.
    pub samples: usize,
}

/// Plans the pipeline of `config` for `spec`: profiles every layer on this machine (forward
/// and backward of one micro-batch), then takes the configured cut or chooses one. A cut
/// that leaves a layer out or places one twice, or a stage that does not fit its host's
/// memory, is an error with the numbers.
pub fn plan(config: &TrainConfig, spec: &ModelSpec) -> Result<PipelinePlan> {
    let p = &config.pipeline;
    let stages = p.num_stages();
    let samples = config.data.batch_size.div_ceil(p.micro_batches.max(1));
    let costs = flotilla_engine::profile(
        spec,
        &config.optimizer,
        &config.model.device,
        (samples, PROFILE_ROUNDS),
        profile_window(config, spec)?,
    )?;
    let costs = sharded_costs(costs, config);
    let hosts = hosts(config, stages)?;
    let (ranges, automatic) = stage_ranges(config, spec, &costs, &hosts)?;
    let cut = StageCut::new(spec, ranges.clone())
        .map_err(|e| TrainError::config("pipeline.stages", e.to_string()))?;
    let stages = check_cut(&costs, &ranges, &hosts)
        .map_err(|e| TrainError::config("pipeline", e.to_string()))?;
    Ok(PipelinePlan {
        cut,
        stages,
        hosts,
        automatic,
        samples,
    })
}

/// The most parameters the profile builds at once: a rank's share of the model (a stage's,
/// 1/D of it under ZeRO-3 among D replicas), so that profiling never holds more of the model
/// than training does.
fn profile_window(config: &TrainConfig, spec: &ModelSpec) -> Result<u64> {
    let p = &config.pipeline;
    let replicas = match config.allreduce.zero {
        3 => p.data_parallel.max(1),
        _ => 1,
    };
    let parts = (p.num_stages() * replicas).max(1) as u64;
    Ok(spec.param_count()?.div_ceil(parts))
}

/// The measured costs of a layer as a replica of its stage holds it under ZeRO among the
/// stage's `data_parallel` replicas (`allreduce.zero`): stages 1 and 2 keep 1/D of the
/// optimizer state (the gradient is summed whole over the micro-batches, as PyTorch's
/// pipelining does); stage 3 keeps 1/D of the parameters, gradient and optimizer state, and
/// holds a layer's whole values and gradient while it is gathered (twice that when the next
/// one is prefetched; a group of small layers holds up to `bucket_mb`, not counted here).
fn sharded_costs(mut costs: Vec<LayerCost>, config: &TrainConfig) -> Vec<LayerCost> {
    let d = config.pipeline.data_parallel.max(1) as u64;
    let zero = config.allreduce.zero;
    if d == 1 || zero == 0 {
        return costs;
    }
    for c in &mut costs {
        let whole = 4 * c.params * 2;
        if zero < 3 {
            c.fixed_bytes = whole + c.fixed_bytes.saturating_sub(whole).div_ceil(d);
        } else {
            c.fixed_bytes = c.fixed_bytes.div_ceil(d);
            c.gathered_bytes = whole * (1 + u64::from(config.allreduce.prefetch));
        }
    }
    costs
}

/// Every stage's host, from `pipeline.hosts` (default: speed 1, and the memory of
/// [`stage_memory`]), with the micro-batches of activations its schedule keeps alive.
fn hosts(config: &TrainConfig, stages: usize) -> Result<Vec<StageHost>> {
    let p = &config.pipeline;
    (0..stages)
        .map(|s| {
            let h = p.hosts.get(s).cloned().unwrap_or_default();
            let device = match h.memory_mb {
                Some(_) => None,
                None => stage_device_memory(config, s, stages)?,
            };
            Ok(StageHost {
                memory_bytes: stage_memory(h.memory_mb, device),
                speed: h.speed,
                in_flight: p.schedule.peak_in_flight(stages, s, p.micro_batches) as u64,
            })
        })
        .collect()
}

/// A stage host's memory limit, BossMan's rule: the config's `memory_mb` beats what the
/// stage's device reports, which beats the CPU's rule (no device report: unlimited, as
/// before; the launcher checks the host's RAM for the whole job, `flotilla` `capacity.rs`).
pub fn stage_memory(configured_mb: Option<f64>, device_bytes: Option<u64>) -> Option<u64> {
    match configured_mb {
        Some(mb) => Some((mb * (1u64 << 20) as f64) as u64),
        None => device_bytes,
    }
}

/// The memory the GPU of stage `stage` reports (`None` on a CPU backend): the least of the
/// GPUs its replicas run on (rank `stage + k·stages` of a local launch on GPU
/// `rank mod G`, or the configured index), the driver's total (`cuDeviceTotalMem` for
/// `cuda`); `None` for `wgpu` too, which reports no memory size (the CPU's rule).
fn stage_device_memory(config: &TrainConfig, stage: usize, stages: usize) -> Result<Option<u64>> {
    let bad = |e: flotilla_engine::EngineError| TrainError::config("model.device", e.to_string());
    let spec = flotilla_engine::DeviceSpec::parse(&config.model.device).map_err(bad)?;
    let Some(kind) = spec.gpu() else {
        return Ok(None);
    };
    let gpus = flotilla_engine::gpu_count(kind).map_err(bad)?;
    let replicas = config.pipeline.data_parallel.max(1);
    let mut least: Option<u64> = None;
    for k in 0..replicas {
        let index = spec
            .index
            .unwrap_or_else(|| flotilla_engine::device_index(stage + k * stages, gpus));
        // wgpu reports no memory size: the stage takes the CPU's rule.
        let Some(bytes) = flotilla_engine::gpu_memory(kind, index).map_err(bad)? else {
            return Ok(None);
        };
        least = Some(least.map_or(bytes, |l| l.min(bytes)));
    }
    Ok(least)
}

/// The layer ranges of the stages, and whether they were chosen automatically.
fn stage_ranges(
    config: &TrainConfig,
    spec: &ModelSpec,
    costs: &[LayerCost],
    hosts: &[StageHost],
) -> Result<(Vec<Range<usize>>, bool)> {
    if let Some(ranges) = configured_cut(config, spec) {
        return Ok((ranges, false));
    }
    let chosen =
        partition(costs, hosts).map_err(|e| TrainError::config("pipeline", e.to_string()))?;
    Ok((chosen.into_iter().map(|e| e.layers).collect(), true))
}

/// The layer ranges the config gives explicitly (ranges or split points), unchecked; `None`
/// when the cut is to be chosen automatically.
pub fn configured_cut(config: &TrainConfig, spec: &ModelSpec) -> Option<Vec<Range<usize>>> {
    let p = &config.pipeline;
    match (&p.split_points, &p.stages) {
        (Some(points), _) => Some(ranges_from_points(points, spec.layers.len())),
        (None, StagesSetting::Ranges(r)) => Some(
            r.iter()
                .map(|[first, last]| *first..last.saturating_add(1))
                .collect(),
        ),
        (None, StagesSetting::Count(_)) => None,
    }
}

/// Whether starting the job needs the profile: an automatic cut, or a memory limit to check
/// the cut against. (`flotilla launch` hands the ranks the cut it chose, so they do not
/// profile again unless a stage host has a memory limit.)
pub fn needs_profile(config: &TrainConfig, spec: &ModelSpec) -> bool {
    configured_cut(config, spec).is_none()
        || config.pipeline.hosts.iter().any(|h| h.memory_mb.is_some())
}

impl PipelinePlan {
    /// The stages' layer ranges (what every rank must agree on).
    pub fn ranges(&self) -> Vec<Range<usize>> {
        self.cut.ranges.clone()
    }

    /// The slowest stage's estimated time over the mean (1.0: perfectly balanced).
    pub fn balance(&self) -> f64 {
        let times: Vec<f64> = self.stages.iter().map(|s| s.time_s).collect();
        let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
        let max = times.iter().copied().fold(0.0, f64::max);
        if mean > 0.0 { max / mean } else { 1.0 }
    }

    /// The plan as a table, one stage per row.
    pub fn describe(&self, config: &TrainConfig) -> String {
        let p = &config.pipeline;
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1 << 20) as f64);
        let mut out = format!(
            "pipeline: {} stages × {} replica{}, schedule {}, {} micro-batches of {} samples, cut {}\n",
            self.stages.len(),
            p.data_parallel,
            if p.data_parallel == 1 { "" } else { "s" },
            p.schedule,
            p.micro_batches,
            self.samples,
            if self.automatic {
                "automatically by measured cost"
            } else {
                "as configured"
            }
        );
        if config.allreduce.zero > 0 && p.data_parallel <= 1 {
            out.push_str(&format!(
                "zero: {} shards a stage's state among its replicas: with one replica a stage \
                 (`data_parallel: 1`), nothing is sharded\n",
                config.allreduce.zero
            ));
        }
        out.push_str(
            "stage  layers      params  ms/micro-batch  memory (est.)  host memory  speed\n",
        );
        for (k, (s, h)) in self.stages.iter().zip(&self.hosts).enumerate() {
            out.push_str(&format!(
                "{k:<6} {:<10} {:>7} {:>15.2} {:>14} {:>12} {:>6.2}\n",
                format!("{}-{}", s.layers.start, s.layers.end.saturating_sub(1)),
                s.params,
                s.time_s * 1e3,
                mib(s.memory_bytes),
                h.memory_bytes.map_or("unlimited".into(), mib),
                h.speed
            ));
        }
        let crossings: Vec<String> = self
            .cut
            .crossings
            .iter()
            .map(|c| format!("{} {}→{}", c.name, c.from, c.to))
            .collect();
        out.push_str(&format!(
            "crossings: {}\nbalance (slowest stage / mean): {:.2}\n",
            crossings.join(", "),
            self.balance()
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_memory_beats_the_device_report_which_beats_the_cpu_rule() {
        let gib = 1u64 << 30;
        // The config wins over what the device reports.
        assert_eq!(stage_memory(Some(64.0), Some(16 * gib)), Some(64 << 20));
        // Without it, the device's report is the limit.
        assert_eq!(stage_memory(None, Some(16 * gib)), Some(16 * gib));
        // A CPU backend reports nothing: unlimited, as before.
        assert_eq!(stage_memory(None, None), None);
        assert_eq!(stage_memory(Some(0.5), None), Some(1 << 19));
    }

    /// Adam (two slots): 16 bytes a parameter whole; among 2 replicas ZeRO-1 and 2 keep
    /// values and gradient whole and half the moments, ZeRO-3 half of everything and the
    /// layer's values and gradient while gathered, twice with prefetching.
    #[test]
    fn zero_among_the_replicas_shrinks_what_a_stage_holds() {
        let measured = vec![LayerCost {
            time_s: 1.0,
            fixed_bytes: 16 * 1000,
            activation_bytes: 7,
            params: 1000,
            gathered_bytes: 0,
        }];
        let at = |zero: u8, d: usize, prefetch: bool| {
            let mut config = TrainConfig::default();
            config.allreduce.zero = zero;
            config.allreduce.prefetch = prefetch;
            config.pipeline.data_parallel = d;
            let c = sharded_costs(measured.clone(), &config)[0];
            assert_eq!((c.time_s, c.activation_bytes, c.params), (1.0, 7, 1000));
            (c.fixed_bytes, c.gathered_bytes)
        };
        assert_eq!(at(0, 2, true), (16_000, 0));
        assert_eq!(at(3, 1, true), (16_000, 0), "one replica: nothing sharded");
        assert_eq!(at(1, 2, true), (12_000, 0));
        assert_eq!(at(2, 2, true), (12_000, 0));
        assert_eq!(at(3, 2, false), (8_000, 8_000));
        assert_eq!(at(3, 2, true), (8_000, 16_000));
        assert_eq!(at(3, 4, true), (4_000, 16_000));
    }

    #[test]
    fn a_cpu_stage_has_no_device_memory() {
        let config = TrainConfig::default();
        assert_eq!(stage_device_memory(&config, 1, 2).expect("cpu"), None);
    }
}
