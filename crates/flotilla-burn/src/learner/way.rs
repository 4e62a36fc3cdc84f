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
        format!("strategy {arch:?} (parameter servers or a pipeline)")
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
