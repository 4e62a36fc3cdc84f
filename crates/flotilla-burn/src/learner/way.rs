//! Which ways of training [`super::LearnerStrategy`] runs: sync all-reduce (whole, or ZeRO-1
//! by parameter with the `Learner`'s optimizer) in its own loop; async all-reduce, parameter
//! servers, model averaging and an elastic job's sync or async peers through the one stack's run;
//! the others are refused by name.

use flotilla_cluster::Arch;
use flotilla_train::config::AllReduceMode;
use flotilla_train::{TrainConfig, TrainError};

use crate::error::{DistError, Result};

/// Whether the job's way of training goes through the one stack's run (async all-reduce,
/// parameter servers, elastic peers); an error naming the way when the strategy does not
/// run it.
pub(super) fn through_run(settings: &TrainConfig) -> Result<bool> {
    if settings.model.recompute {
        // burn's Learner runs the module's own forward and backward.
        return Err(DistError::from(TrainError::config(
            "model.recompute",
            "burn's Learner runs the model's own forward: recomputation is for a YAML model \
             (set recompute: false)"
                .to_string(),
        )));
    }
    let generations = super::elastic(settings);
    let (arch, all) = (&settings.topology.arch, &settings.allreduce);
    if let (true, Some(min)) = (generations, settings.topology.min_world_size) {
        // Members of sync or async all-reduce through the run's generations
        // (super::elastic); sync ones with ZeRO-1, the Learner's optimizer state cut by whole
        // parameter among them (the run's ZeRO by parameter, engine.rs).
        let sync = all.mode == AllReduceMode::Sync;
        if *arch == Arch::Allreduce && (all.zero == 0 || (all.zero == 1 && sync)) {
            return Ok(true);
        }
        return Err(DistError::from(TrainError::config(
            "topology.min_world_size",
            format!(
                "an elastic job ({min}:{}) runs burn's Learner on sync all-reduce peers (whole or \
                 ZeRO-1), async ones without ZeRO, and on an elastic parameter server's workers; \
                 a program trains the \
                 other ways elastic on flotilla_burn::train or ::session, or in its own loop \
                 under flotilla_burn::elastic::run",
                settings.topology.world_size
            ),
        )));
    }
    let refused = match arch {
        Arch::Pipeline => "strategy pipeline (a middle stage has no batches for a Learner: cut \
                           the model into stage modules for flotilla_burn::train or \
                           flotilla_burn::session)"
            .to_string(),
        Arch::Flat | Arch::Hierarchical => return Ok(true),
        Arch::Allreduce if all.mode != AllReduceMode::Sync && all.zero > 0 => {
            format!("async all-reduce with ZeRO stage {}", all.zero)
        }
        Arch::Allreduce if all.mode != AllReduceMode::Sync => return Ok(true),
        Arch::Allreduce if all.zero > 1 => format!(
            "ZeRO stage {} (flotilla_burn::train or flotilla_burn::session run it)",
            all.zero
        ),
        Arch::Allreduce => return Ok(false),
    };
    Err(DistError::from(TrainError::config(
        "strategy",
        format!(
            "the Learner strategy trains sync all-reduce (whole or ZeRO-1), async all-reduce \
             and parameter servers (with model averaging), not {refused}"
        ),
    )))
}

/// Whether the `Learner`'s checkpoint holds every rank's optimizer state for the job of
/// `settings`: it holds rank 0's (the only one, or the same on every rank, under async
/// all-reduce and a parameter server that is one rank); an error naming what it lacks
/// otherwise.
pub(super) fn resumable(settings: &TrainConfig) -> Result<()> {
    let lacks = if settings.allreduce.zero > 0 {
        "the other ranks' parts of it (ZeRO-1)"
    } else if settings.topology.local_steps > 1 {
        "each worker's own optimizer state (model averaging)"
    } else if settings.topology.servers > 1 {
        "the optimizer state of every shard server but the root"
    } else {
        return Ok(());
    };
    Err(DistError::Optimizer(format!(
        "the Learner's checkpoint holds rank 0's optimizer state, not {lacks}: \
         burn-train 0.22.1's checkpointer writes one optimizer file, of the rank that \
         checkpoints (flotilla_burn::session resumes every way)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(arch: Arch, mode: AllReduceMode, zero: u8) -> TrainConfig {
        let mut c = TrainConfig::default();
        c.topology.arch = arch;
        c.allreduce.mode = mode;
        c.allreduce.zero = zero;
        c
    }

    #[test]
    fn sync_and_zero_1_run_in_the_strategys_loop_async_and_servers_through_the_run() {
        use AllReduceMode::{Async, Sync};
        assert!(!through_run(&settings(Arch::Allreduce, Sync, 0)).expect("sync"));
        assert!(!through_run(&settings(Arch::Allreduce, Sync, 1)).expect("ZeRO-1"));
        assert!(through_run(&settings(Arch::Allreduce, Async, 0)).expect("async"));
        assert!(through_run(&settings(Arch::Flat, Sync, 0)).expect("flat"));
        assert!(through_run(&settings(Arch::Hierarchical, Async, 0)).expect("hierarchical"));
        for (arch, mode, zero, named) in [
            (Arch::Allreduce, Sync, 2, "ZeRO stage 2"),
            (
                Arch::Allreduce,
                Async,
                1,
                "async all-reduce with ZeRO stage 1",
            ),
            (Arch::Pipeline, Sync, 0, "strategy pipeline"),
        ] {
            let e = through_run(&settings(arch, mode, zero)).expect_err(named);
            assert!(e.to_string().contains(named), "{e}");
        }
    }

    #[test]
    fn elastic_peers_with_zero_1_at_most_and_an_elastic_servers_workers_run_the_rest_is_refused() {
        use AllReduceMode::{Async, Sync};
        for (mode, zero) in [(Sync, 0), (Sync, 1), (Async, 0)] {
            let mut c = settings(Arch::Allreduce, mode, zero);
            c.topology.min_world_size = Some(2);
            assert!(
                through_run(&c).expect("elastic peers"),
                "{mode:?} ZeRO-{zero}: through the run"
            );
        }
        for (mode, zero) in [(Sync, 2), (Async, 1)] {
            let mut c = settings(Arch::Allreduce, mode, zero);
            c.topology.min_world_size = Some(2);
            let e = through_run(&c).expect_err("refused").to_string();
            assert!(e.contains("sync all-reduce peers (whole or ZeRO-1)"), "{e}");
        }
        let mut c = settings(Arch::Flat, AllReduceMode::Sync, 0);
        c.topology.min_world_size = Some(2);
        assert!(through_run(&c).expect("an elastic server's workers"));
    }

    #[test]
    fn a_learner_resumes_where_its_checkpoint_holds_every_ranks_optimizer_state() {
        use AllReduceMode::{Async, Sync};
        for (arch, mode) in [
            (Arch::Allreduce, Async),
            (Arch::Flat, Sync),
            (Arch::Flat, Async),
            (Arch::Hierarchical, Sync),
        ] {
            resumable(&settings(arch, mode, 0)).expect("resumes");
        }
        let mut averaging = settings(Arch::Flat, Sync, 0);
        averaging.topology.local_steps = 2;
        let mut shards = settings(Arch::Flat, Sync, 0);
        shards.topology.servers = 2;
        let zero = settings(Arch::Allreduce, Sync, 1);
        for (c, named) in [
            (averaging, "model averaging"),
            (shards, "shard server"),
            (zero, "ZeRO-1"),
        ] {
            let e = resumable(&c).expect_err(named);
            assert!(e.to_string().contains(named), "{e}");
        }
    }
}
