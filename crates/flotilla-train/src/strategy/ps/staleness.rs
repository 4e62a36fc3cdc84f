//! Staleness-aware defaults of the servers that apply updates (the root and the shard
//! servers).
//!
//! Asynchrony acts like momentum: with `N` workers pushing in turn to an async server, each
//! gradient is about `s = N − 1` versions stale, and plain SGD on such gradients behaves like
//! SGD with an extra, implicit momentum of about `s / (1 + s)` (Mitliagkas et al.,
//! "Asynchrony begets momentum", 2016). Explicit momentum on top of it adds up: a sync
//! optimizer's momentum 0.9 under 4 async workers acts like about 0.975, which is too much
//! and the run stays at chance (issue 10: flat, 4 async workers, lr 0.04, momentum 0.9).
//!
//! Two remedies were measured on that run (README, parameter servers): scaling each
//! update's learning rate by `1 / (1 + staleness)` (its own staleness, so a straggler's
//! very stale push counts little), and lowering the explicit momentum to the `μ'` that,
//! combined with the implicit one, gives back the configured `μ`:
//! `1 − μ = (1 − μ')(1 − s/(1+s))`, i.e. `μ' = max(0, 1 − (1 − μ)(1 + s))` (0.9 → 0.6 for
//! 4 workers). Both train; the scaled learning rate reached the target soonest, and it
//! works for any optimizer, so it is the default of an async server (`topology.staleness_lr`,
//! unset: on at async servers; a sync server over async local servers averages their pushes
//! and measured slightly better without it). `topology.async_momentum`
//! sets the server's momentum; the divergence advice suggests `μ'`.

use flotilla_cluster::{Aggregation, Arch, RoleKind, Topology};
use flotilla_engine::OptimizerSpec;

use crate::config::TrainConfig;

/// The staleness that the updates of server `rank` are expected to carry: `children − 1`
/// at an async server, plus one for async local servers below it (a local server answers
/// its workers with the parameters it has while its own push is under way). 0 for a
/// sync tree and for ranks that apply no updates.
pub fn expected_staleness(topology: &Topology, rank: usize) -> f64 {
    let Some(role) = topology.role(rank) else {
        return 0.0;
    };
    if !matches!(
        role.kind,
        RoleKind::GlobalServer | RoleKind::ShardServer { .. }
    ) {
        return 0.0;
    }
    let own = match role.aggregation {
        Some(Aggregation::Async) => role.children.len().saturating_sub(1) as f64,
        _ => 0.0,
    };
    let below = role.children.iter().any(|&c| {
        topology
            .role(c)
            .is_some_and(|r| r.is_server() && r.aggregation == Some(Aggregation::Async))
    });
    own + if below { 1.0 } else { 0.0 }
}

/// The momentum that asynchrony of staleness `s` adds by itself: `s / (1 + s)`.
pub fn implicit_momentum(staleness: f64) -> f64 {
    let s = staleness.max(0.0);
    s / (1.0 + s)
}

/// The explicit momentum that, with the implicit momentum of staleness `s`, amounts to
/// `configured`: `max(0, 1 − (1 − configured)(1 + s))`.
pub fn explicit_momentum(configured: f64, staleness: f64) -> f64 {
    (1.0 - (1.0 - configured) * (1.0 + staleness.max(0.0))).max(0.0)
}

/// How an updating server treats stale updates, and the line that says so.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerOptimizer {
    /// The optimizer to build.
    pub optimizer: OptimizerSpec,
    /// Scale each update's learning rate by `1 / (1 + staleness)`.
    pub staleness_lr: bool,
    /// What applies and how to change it (`None`: a server without stale updates, as
    /// configured).
    pub note: Option<String>,
}

/// The policy of a server whose updates carry `staleness` (expected), async itself or not
/// (`async_server`), given `topology.staleness_lr` and `topology.async_momentum` (the
/// user's settings win): by default an async server scales its learning rate by staleness,
/// measured best (BENCHMARKS.md §11); a sync server over async local servers averages every
/// local server's push and does not (measured slightly worse with it); SGD's momentum
/// changes only when `async_momentum` is set.
pub fn server_optimizer(
    configured: &OptimizerSpec,
    staleness: f64,
    async_server: bool,
    staleness_lr: Option<bool>,
    async_momentum: Option<f64>,
) -> ServerOptimizer {
    let mut out = ServerOptimizer {
        optimizer: configured.clone(),
        staleness_lr: staleness_lr.unwrap_or(false),
        note: None,
    };
    if staleness <= 0.0 {
        return out;
    }
    out.staleness_lr = staleness_lr.unwrap_or(async_server);
    let mut parts = vec![if out.staleness_lr {
        format!(
            "learning rate scaled by 1/(1+staleness) per update (expected staleness {staleness:.0}){}",
            if staleness_lr.is_none() {
                "; set topology.staleness_lr: false to turn off"
            } else {
                ""
            }
        )
    } else {
        format!(
            "learning rate not scaled by staleness (expected staleness {staleness:.0}; topology.staleness_lr: true scales it)"
        )
    }];
    if let (Some(m), OptimizerSpec::Sgd { momentum, .. }) = (async_momentum, &mut out.optimizer) {
        parts.push(format!(
            "momentum {momentum} -> {m} (topology.async_momentum)"
        ));
        *momentum = m;
    }
    out.note = Some(format!("async server: {}", parts.join("; ")));
    out
}

/// What a job's ranks need to know of the servers' optimizer.
#[derive(Debug, Clone, PartialEq)]
pub struct JobOptimizers {
    /// The optimizer of this rank's engine and its staleness policy.
    pub own: ServerOptimizer,
    /// The root's momentum, and the momentum that makes up for its expected staleness, when
    /// its updates are stale (for advice); else `None`.
    pub root_async_momentum: Option<(f64, f64)>,
}

/// The optimizer of `rank`'s engine in the job of `config`: the staleness policy on the
/// servers that apply stale gradients (not with model averaging, where the workers'
/// optimizers train and the servers add weight deltas); the configured one elsewhere.
pub fn for_job(config: &TrainConfig, topology: &Topology, rank: usize) -> JobOptimizers {
    let t = &config.topology;
    let ps = matches!(t.arch, Arch::Flat | Arch::Hierarchical) && t.local_steps <= 1;
    let of = |r: usize| {
        let s = if ps {
            expected_staleness(topology, r)
        } else {
            0.0
        };
        let own_async = topology
            .role(r)
            .is_some_and(|role| role.aggregation == Some(Aggregation::Async));
        let policy = server_optimizer(
            &config.optimizer,
            s,
            own_async,
            t.staleness_lr,
            t.async_momentum,
        );
        (s, policy)
    };
    let (root_staleness, root) = of(topology.root());
    JobOptimizers {
        own: of(rank).1,
        root_async_momentum: (root_staleness > 0.0).then(|| {
            let now = f64::from(root.optimizer.momentum());
            (now, explicit_momentum(now, root_staleness))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_cluster::TopologySpec;
    use flotilla_engine::DecayParams;

    fn topology(yaml: &str) -> Topology {
        let c = crate::config::TrainConfig::from_yaml(yaml, "t").expect("parse");
        let spec: TopologySpec = c.topology_spec();
        Topology::build(&spec).expect("topology")
    }

    fn sgd(momentum: f64) -> OptimizerSpec {
        OptimizerSpec::Sgd {
            lr: 0.04,
            momentum,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 5e-4,
            decay_params: DecayParams::All,
        }
    }

    #[test]
    fn staleness_follows_the_async_levels_of_the_tree() {
        let flat = |a: &str| {
            topology(&format!(
                "arch: flat\nparameter_server: {{aggr_type: {a}, num_workers: 4}}\n"
            ))
        };
        assert_eq!(expected_staleness(&flat("async"), 0), 3.0);
        assert_eq!(expected_staleness(&flat("sync"), 0), 0.0);
        // Workers apply nothing.
        assert_eq!(expected_staleness(&flat("async"), 1), 0.0);
        let hier = |g: &str, l: &str| {
            topology(&format!(
                "arch: hierarchical\nglobal_server:\n  aggr_type: {g}\n  local_servers:\n    - {{aggr_type: {l}, num_workers: 2}}\n    - {{aggr_type: {l}, num_workers: 2}}\n"
            ))
        };
        assert_eq!(expected_staleness(&hier("sync", "async"), 0), 1.0);
        assert_eq!(expected_staleness(&hier("async", "async"), 0), 2.0);
        assert_eq!(expected_staleness(&hier("async", "sync"), 0), 1.0);
        assert_eq!(expected_staleness(&hier("sync", "sync"), 0), 0.0);
    }

    #[test]
    fn stale_servers_scale_the_lr_by_default_and_the_user_wins() {
        assert!((implicit_momentum(3.0) - 0.75).abs() < 1e-12);
        assert!((explicit_momentum(0.9, 3.0) - 0.6).abs() < 1e-12);
        assert_eq!(explicit_momentum(0.5, 3.0), 0.0);
        assert_eq!(explicit_momentum(0.9, 0.0), 0.9);
        let s = server_optimizer(&sgd(0.9), 3.0, true, None, None);
        assert!(s.staleness_lr);
        assert_eq!(s.optimizer, sgd(0.9));
        let note = s.note.expect("note");
        assert!(
            note.contains("1/(1+staleness)") && note.contains("staleness_lr: false"),
            "{note}"
        );
        // The user's settings win.
        let s = server_optimizer(&sgd(0.9), 3.0, true, Some(false), Some(0.6));
        assert!(!s.staleness_lr);
        assert!((s.optimizer.momentum() - 0.6).abs() < 1e-6);
        let note = s.note.expect("note");
        assert!(note.contains("momentum 0.9 -> 0.6"), "{note}");
        // A sync tree: as configured, nothing to say (an explicit staleness_lr still holds).
        let s = server_optimizer(&sgd(0.9), 0.0, false, None, Some(0.6));
        assert_eq!(
            (s.optimizer, s.staleness_lr, s.note),
            (sgd(0.9), false, None)
        );
        assert!(server_optimizer(&sgd(0.9), 0.0, false, Some(true), None).staleness_lr);
        // A sync root over async local servers: stale, not scaled unless asked, and says so.
        let s = server_optimizer(&sgd(0.5), 1.0, false, None, None);
        assert!(!s.staleness_lr);
        assert!(
            s.note
                .expect("note")
                .contains("staleness_lr: true scales it")
        );
    }
}
