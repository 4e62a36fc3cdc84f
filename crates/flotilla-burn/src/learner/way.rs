//! Which ways of training [`super::LearnerStrategy`] runs: sync all-reduce (whole, or ZeRO-1
//! by parameter with the `Learner`'s optimizer) in its own loop, async all-reduce through the
//! one stack's run; the others are refused by name.

use flotilla_cluster::Arch;
use flotilla_train::config::AllReduceMode;
use flotilla_train::{TrainConfig, TrainError};

use crate::error::{DistError, Result};

/// Whether the job's way of training goes through the one stack's run (async all-reduce);
/// an error naming the way when the strategy does not run it yet.
pub(super) fn through_run(settings: &TrainConfig) -> Result<bool> {
    let (arch, all) = (&settings.topology.arch, &settings.allreduce);
    let way = if *arch != Arch::Allreduce {
        format!("strategy {arch} (parameter servers or a pipeline)")
    } else if all.mode != AllReduceMode::Sync {
        if all.zero > 0 {
            format!("async all-reduce with ZeRO stage {}", all.zero)
        } else {
            return Ok(true);
        }
    } else if all.zero > 1 {
        format!("ZeRO stage {}", all.zero)
    } else {
        return Ok(false);
    };
    Err(DistError::Settings(TrainError::config(
        "strategy",
        format!(
            "the Learner strategy trains sync all-reduce (whole or ZeRO-1) and async \
             all-reduce; {way} is not on it yet: train the module with flotilla_burn::train \
             or flotilla_burn::session, which run every way"
        ),
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
    fn sync_and_zero_1_run_in_the_strategys_loop_async_through_the_run_the_rest_is_refused() {
        use AllReduceMode::{Async, Sync};
        assert!(!through_run(&settings(Arch::Allreduce, Sync, 0)).expect("sync"));
        assert!(!through_run(&settings(Arch::Allreduce, Sync, 1)).expect("ZeRO-1"));
        assert!(through_run(&settings(Arch::Allreduce, Async, 0)).expect("async"));
        for (arch, mode, zero, named) in [
            (Arch::Allreduce, Sync, 2, "ZeRO stage 2"),
            (
                Arch::Allreduce,
                Async,
                1,
                "async all-reduce with ZeRO stage 1",
            ),
            (Arch::Flat, Sync, 0, "strategy flat"),
            (Arch::Hierarchical, Sync, 0, "strategy hierarchical"),
            (Arch::Pipeline, Sync, 0, "strategy pipeline"),
        ] {
            let e = through_run(&settings(arch, mode, zero)).expect_err(named);
            assert!(e.to_string().contains(named), "{e}");
        }
    }
}
