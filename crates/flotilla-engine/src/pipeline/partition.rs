//! Choosing where to cut a model: contiguous stages balanced by measured per-layer cost,
//! within each stage host's memory.
//!
//! Each layer has a time (forward + backward of one micro-batch, measured by
//! [`crate::profile`]), a fixed memory (parameters, gradient, optimizer state) and an
//! activation memory per sample (what backward keeps). Stage `s` runs on a host with relative
//! `speed` and a memory limit, and keeps `in_flight[s]` micro-batches of activations alive
//! (the schedule decides: M for GPipe, `S − s` for 1F1B). The partition minimises the time of
//! the slowest stage (time / speed), the pipeline's bottleneck, over every contiguous cut that
//! fits every stage's memory; it is exact (dynamic programming over cut points). When no cut
//! fits, the error says how much the model needs against what the hosts have.

use std::ops::Range;

use crate::error::{EngineError, Result};

/// What one layer costs.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LayerCost {
    /// Seconds of forward + backward for one micro-batch.
    pub time_s: f64,
    /// Bytes of parameters, their gradient and optimizer state.
    pub fixed_bytes: u64,
    /// Bytes of activations kept for backward, per micro-batch.
    pub activation_bytes: u64,
    /// Number of parameters.
    pub params: u64,
    /// Bytes held only while this layer's parameters are gathered (ZeRO-3 among a stage's
    /// replicas: its whole values and gradient, and the next layer's when prefetched); a
    /// stage holds its largest layer's at once, on top of the fixed bytes.
    pub gathered_bytes: u64,
}

/// What one stage's host offers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageHost {
    /// Memory limit in bytes (`None`: unlimited).
    pub memory_bytes: Option<u64>,
    /// Relative speed (1.0: the machine the costs were measured on).
    pub speed: f64,
    /// Micro-batches of activations alive at once on this stage.
    pub in_flight: u64,
}

/// One stage of a chosen partition, with its estimates.
#[derive(Debug, Clone, PartialEq)]
pub struct StageEstimate {
    /// Its layers.
    pub layers: Range<usize>,
    /// Estimated seconds per micro-batch on its host (time / speed).
    pub time_s: f64,
    /// Estimated peak bytes (fixed + activations × in flight + the largest gathered layer).
    pub memory_bytes: u64,
    /// Number of parameters.
    pub params: u64,
}

/// Estimated time and memory of `layers` on `host`.
pub fn estimate(costs: &[LayerCost], layers: Range<usize>, host: &StageHost) -> StageEstimate {
    let slice = &costs[layers.clone()];
    let time: f64 = slice.iter().map(|c| c.time_s).sum();
    let fixed: u64 = slice.iter().map(|c| c.fixed_bytes).sum();
    let act: u64 = slice.iter().map(|c| c.activation_bytes).sum();
    let gathered = slice.iter().map(|c| c.gathered_bytes).max().unwrap_or(0);
    StageEstimate {
        layers,
        time_s: time / host.speed.max(f64::MIN_POSITIVE),
        memory_bytes: fixed
            .saturating_add(gathered)
            .saturating_add(act.saturating_mul(host.in_flight)),
        params: slice.iter().map(|c| c.params).sum(),
    }
}

/// The estimates of a given cut (`ranges`, one per host); an error with the numbers when a
/// stage does not fit its host's memory.
pub fn check(
    costs: &[LayerCost],
    ranges: &[Range<usize>],
    hosts: &[StageHost],
) -> Result<Vec<StageEstimate>> {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mut out = Vec::with_capacity(ranges.len());
    for (k, (r, host)) in ranges.iter().zip(hosts).enumerate() {
        let e = estimate(costs, r.clone(), host);
        if let Some(limit) = host.memory_bytes
            && e.memory_bytes > limit
        {
            let slice = &costs[r.clone()];
            let gathered = slice.iter().map(|c| c.gathered_bytes).max().unwrap_or(0);
            let fixed = slice.iter().map(|c| c.fixed_bytes).sum::<u64>() + gathered;
            return Err(EngineError::InvalidSpec(format!(
                "stage {k} (layers {}..{}) does not fit its host: it needs {:.1} MiB \
                 ({:.1} MiB of parameters and optimizer state, the rest activations of {} \
                 micro-batches in flight) and its host has {:.1} MiB",
                r.start,
                r.end,
                mib(e.memory_bytes),
                mib(fixed),
                host.in_flight,
                mib(limit)
            )));
        }
        out.push(e);
    }
    Ok(out)
}

/// The best contiguous partition of `costs` into `hosts.len()` non-empty stages (see the
/// module documentation).
pub fn partition(costs: &[LayerCost], hosts: &[StageHost]) -> Result<Vec<StageEstimate>> {
    let (n, s) = (costs.len(), hosts.len());
    if s == 0 || s > n {
        return Err(EngineError::InvalidSpec(format!(
            "cannot cut {n} layers into {s} non-empty stages"
        )));
    }
    // best[k][j]: the smallest bottleneck placing layers 0..j on stages 0..k (k + 1 stages);
    // cut[k][j]: where stage k starts in that placement.
    let mut best = vec![vec![f64::INFINITY; n + 1]; s];
    let mut cut = vec![vec![0usize; n + 1]; s];
    for (j, slot) in best[0].iter_mut().enumerate().skip(1) {
        let e = estimate(costs, 0..j, &hosts[0]);
        if fits(&e, &hosts[0]) {
            *slot = e.time_s;
        }
    }
    for k in 1..s {
        for j in k + 1..=n {
            for i in k..j {
                if !best[k - 1][i].is_finite() {
                    continue;
                }
                let e = estimate(costs, i..j, &hosts[k]);
                if !fits(&e, &hosts[k]) {
                    continue;
                }
                let v = best[k - 1][i].max(e.time_s);
                if v < best[k][j] {
                    best[k][j] = v;
                    cut[k][j] = i;
                }
            }
        }
    }
    if !best[s - 1][n].is_finite() {
        return Err(does_not_fit(costs, hosts));
    }
    let mut ends = vec![n];
    for k in (1..s).rev() {
        let end = ends[ends.len() - 1];
        ends.push(cut[k][end]);
    }
    ends.push(0);
    ends.reverse();
    Ok((0..s)
        .map(|k| estimate(costs, ends[k]..ends[k + 1], &hosts[k]))
        .collect())
}

fn fits(e: &StageEstimate, host: &StageHost) -> bool {
    host.memory_bytes.is_none_or(|m| e.memory_bytes <= m)
}

/// Why no partition fits, with the numbers.
fn does_not_fit(costs: &[LayerCost], hosts: &[StageHost]) -> EngineError {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let (worst, worst_layer) = costs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let act = c.activation_bytes * hosts.iter().map(|h| h.in_flight).min().unwrap_or(1);
            (c.fixed_bytes + c.gathered_bytes + act, i)
        })
        .max()
        .unwrap_or((0, 0));
    let total: u64 = costs.iter().map(|c| c.fixed_bytes).sum();
    let offered: Vec<String> = hosts
        .iter()
        .map(|h| {
            h.memory_bytes
                .map_or("unlimited".into(), |m| format!("{:.1}", mib(m)))
        })
        .collect();
    EngineError::InvalidSpec(format!(
        "the model does not fit the stages' memory: its parameters and optimizer state need {:.1} MiB, \
         and layer {worst_layer} alone needs {:.1} MiB with its activations; the stages have [{}] MiB \
         (raise memory_mb, add stages, or use fewer micro-batches in flight)",
        mib(total),
        mib(worst),
        offered.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(time_s: f64, fixed_bytes: u64, activation_bytes: u64) -> LayerCost {
        LayerCost {
            time_s,
            fixed_bytes,
            activation_bytes,
            params: fixed_bytes / 4,
            gathered_bytes: 0,
        }
    }

    fn host(memory_bytes: Option<u64>, speed: f64) -> StageHost {
        StageHost {
            memory_bytes,
            speed,
            in_flight: 1,
        }
    }

    fn layers(p: &[StageEstimate]) -> Vec<Range<usize>> {
        p.iter().map(|e| e.layers.clone()).collect()
    }

    /// Every contiguous cut, the slow way: the smallest bottleneck among those that fit.
    fn brute(costs: &[LayerCost], hosts: &[StageHost]) -> Option<f64> {
        fn go(costs: &[LayerCost], hosts: &[StageHost], start: usize, k: usize) -> Option<f64> {
            let n = costs.len();
            if k + 1 == hosts.len() {
                let e = estimate(costs, start..n, &hosts[k]);
                return (start < n && fits(&e, &hosts[k])).then_some(e.time_s);
            }
            (start + 1..n)
                .filter_map(|end| {
                    let e = estimate(costs, start..end, &hosts[k]);
                    if !fits(&e, &hosts[k]) {
                        return None;
                    }
                    go(costs, hosts, end, k + 1).map(|rest| rest.max(e.time_s))
                })
                .min_by(f64::total_cmp)
        }
        go(costs, hosts, 0, 0)
    }

    #[test]
    fn balances_time_and_places_every_layer_once() {
        let costs: Vec<LayerCost> = [4.0, 1.0, 1.0, 1.0, 1.0, 4.0]
            .iter()
            .map(|&t| layer(t, 0, 0))
            .collect();
        let p = partition(&costs, &[host(None, 1.0), host(None, 1.0)]).expect("fits");
        assert_eq!(layers(&p), vec![0..3, 3..6]);
        assert_eq!(p[0].time_s, 6.0);
        // A host twice as fast takes more layers.
        let p = partition(&costs, &[host(None, 2.0), host(None, 1.0)]).expect("fits");
        assert_eq!(layers(&p), vec![0..5, 5..6]);
    }

    #[test]
    fn memory_limits_move_the_cut_and_activations_count_per_micro_batch_in_flight() {
        let costs = vec![layer(1.0, 100, 10); 6];
        // Unlimited: an even cut.
        let p = partition(&costs, &[host(None, 1.0), host(None, 1.0)]).expect("fits");
        assert_eq!(layers(&p), vec![0..3, 3..6]);
        // Stage 0 holds at most 2 layers (220 bytes) with one micro-batch in flight...
        let small = host(Some(250), 1.0);
        let p = partition(&costs, &[small, host(None, 1.0)]).expect("fits");
        assert_eq!(layers(&p), vec![0..2, 2..6]);
        assert_eq!(p[0].memory_bytes, 220);
        // ...and one with four in flight (2 × 100 + 2 × 10 × 4 = 280 > 250).
        let busy = StageHost {
            in_flight: 4,
            ..small
        };
        let p = partition(&costs, &[busy, host(None, 1.0)]).expect("fits");
        assert_eq!(layers(&p), vec![0..1, 1..6]);
    }

    #[test]
    fn a_stage_holds_its_largest_gathered_layer_on_top_of_its_fixed_bytes() {
        let mut costs = vec![
            layer(1.0, 100, 10),
            layer(1.0, 100, 10),
            layer(1.0, 100, 10),
        ];
        for (c, g) in costs.iter_mut().zip([30, 50, 40]) {
            c.gathered_bytes = g;
        }
        let one = host(None, 1.0);
        assert_eq!(estimate(&costs, 0..3, &one).memory_bytes, 300 + 30 + 50);
        assert_eq!(estimate(&costs, 2..3, &one).memory_bytes, 100 + 10 + 40);
        // 190 bytes a stage: only one layer each, with its own gathered bytes.
        let hosts = [
            host(Some(190), 1.0),
            host(Some(190), 1.0),
            host(Some(190), 1.0),
        ];
        let p = partition(&costs, &hosts).expect("fits");
        assert_eq!(layers(&p), [0..1, 1..2, 2..3]);
        costs[1].gathered_bytes = 81;
        assert!(
            partition(&costs, &hosts).is_err(),
            "layer 1 needs 191 bytes"
        );
    }

    #[test]
    fn a_model_that_does_not_fit_is_refused_with_numbers() {
        let costs = vec![layer(1.0, 3 << 20, 1 << 20); 4];
        let tight = host(Some(5 << 20), 1.0);
        let err = partition(&costs, &[tight, tight]).unwrap_err().to_string();
        assert!(err.contains("need 12.0 MiB"), "{err}");
        assert!(err.contains("alone needs 4.0 MiB"), "{err}");
        assert!(err.contains("[5.0, 5.0] MiB"), "{err}");
        let err = partition(&costs, &[host(None, 1.0); 5])
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot cut 4 layers into 5"), "{err}");
    }

    #[test]
    fn the_cut_is_optimal_against_every_alternative() {
        // Deterministic pseudo-random costs and limits; compare with exhaustive search.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..200 {
            let n = 2 + next(7) as usize;
            let s = 1 + next(n.min(4) as u64) as usize;
            let costs: Vec<LayerCost> = (0..n)
                .map(|_| layer(1.0 + next(9) as f64, next(50), next(20)))
                .collect();
            let hosts: Vec<StageHost> = (0..s)
                .map(|_| StageHost {
                    memory_bytes: (next(3) > 0).then(|| 40 + next(200)),
                    speed: 0.5 + next(4) as f64 / 2.0,
                    in_flight: 1 + next(4),
                })
                .collect();
            match (partition(&costs, &hosts), brute(&costs, &hosts)) {
                (Ok(p), Some(best)) => {
                    let bottleneck = p.iter().map(|e| e.time_s).fold(0.0, f64::max);
                    assert!((bottleneck - best).abs() < 1e-9, "{bottleneck} vs {best}");
                    let covered: Vec<usize> = p.iter().flat_map(|e| e.layers.clone()).collect();
                    assert_eq!(covered, (0..n).collect::<Vec<_>>());
                    assert!(
                        p.iter()
                            .zip(&hosts)
                            .all(|(e, h)| fits(e, h) && !e.layers.is_empty())
                    );
                }
                (Err(_), None) => {}
                (p, b) => panic!("partition {p:?} but exhaustive search {b:?}"),
            }
        }
    }
}
