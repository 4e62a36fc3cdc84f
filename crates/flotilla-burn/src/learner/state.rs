//! The `Learner`'s optimizer and learning-rate scheduler state as bytes another process
//! loads: what a member of an elastic job sends a joiner (and the one whose step stood sends
//! the others) over the wire, with no file. burn-train 0.22.1 lets only a
//! `LearningCheckpointer` read a `Learner`'s optimizer and scheduler, so the state is taken
//! by a checkpointer whose three checkpointers keep their record in memory.
//!
//! The optimizer's record is keyed by parameter id, and ids are this process's own (a
//! module's ids are drawn where it is built): the bytes key each parameter by its position
//! in flat order instead, and the loader maps positions to its own ids. The scheduler's
//! scalars ride in the same burnpack under [`SCHEDULER`], so the bytes stay one burnpack (the
//! format every engine's optimizer state has, which the run measures).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use burn::module::ParamId;
use burn::optim::OptimizerRecord;
use burn::optim::lr_scheduler::LrSchedulerRecord;
use burn::store::ModuleRecord;
use burn::store::burn_pack::{Reader, Scalar, Tensor, Writer};
use burn::tensor::Bytes;
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpoint, Checkpointer, CheckpointerError, CheckpointingAction,
    CheckpointingStrategy,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel, LearningCheckpointer};
use flotilla_engine::any_module;

/// The prefix of the scheduler's scalars in the bytes (no parameter's position starts so).
const SCHEDULER: &str = "lr_scheduler/";

/// A checkpointer that keeps the last record it is given, for the caller to take.
struct Kept<R>(Arc<Mutex<Option<R>>>);

impl<R: Checkpoint> Checkpointer<R> for Kept<R> {
    fn save(&self, _epoch: usize, record: R) -> Result<(), CheckpointerError> {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(record);
        Ok(())
    }

    fn delete(&self, _epoch: usize) -> Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(&self, _epoch: usize) -> Result<R, CheckpointerError> {
        Err(CheckpointerError::Unknown(
            "kept in memory, not restored".into(),
        ))
    }
}

/// Saves at every call.
struct Always;

impl CheckpointingStrategy for Always {
    fn checkpointing(&mut self, _: usize, _: &EventStoreClient) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

fn kept<R: Checkpoint>() -> (Arc<Mutex<Option<R>>>, AsyncCheckpointer<R>) {
    let slot = Arc::new(Mutex::new(None));
    (slot.clone(), AsyncCheckpointer::new(Kept(slot)))
}

fn take<R>(slot: &Mutex<Option<R>>, what: &str) -> Result<R, String> {
    slot.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
        .ok_or_else(|| format!("the Learner's checkpointer gave no {what} record"))
}

/// The `Learner`'s optimizer and scheduler state, keyed by parameter position (see the
/// module docs). `store` is the training's event store (the checkpointer's strategy is
/// given it; this one does not read it).
pub(crate) fn export<M: LearnerModel>(
    learner: &Learner<M>,
    store: &EventStoreClient,
) -> Result<Vec<u8>, String> {
    let (optim, scheduler) = {
        let (_, model) = kept::<ModuleRecord>();
        let (optim, optim_checkpointer) = kept::<OptimizerRecord>();
        let (scheduler, scheduler_checkpointer) = kept::<LrSchedulerRecord>();
        let mut checkpointer = LearningCheckpointer::<M>::new(
            model,
            optim_checkpointer,
            scheduler_checkpointer,
            Box::new(Always),
        );
        checkpointer.checkpoint(learner, 0, store);
        // Dropped: its threads have saved every record.
        (optim, scheduler)
    };
    let optim = take(&optim, "optimizer")?;
    let scheduler = take(&scheduler, "learning-rate scheduler")?;
    let optim = Reader::from_bytes(optim.into_bytes().map_err(|e| format!("{e:?}"))?)
        .map_err(|e| format!("{e:?}"))?;
    let scheduler = Reader::from_bytes(scheduler.into_bytes().map_err(|e| format!("{e:?}"))?)
        .map_err(|e| format!("{e:?}"))?;
    let ids = any_module::param_ids(&learner.model());
    let to: BTreeMap<u64, u64> = (0u64..).zip(&ids).map(|(i, id)| (id.val(), i)).collect();
    let mut writer = rekeyed(optim, &to)?;
    for (key, value) in scheduler.scalars() {
        writer = writer.with_scalar(&format!("{SCHEDULER}{key}"), *value);
    }
    Ok(writer.into_bytes().map_err(|e| format!("{e:?}"))?.to_vec())
}

/// Loads the state of [`export`]'s bytes into `learner` (its parameters keyed by position
/// there, by this process's ids here); empty bytes leave it alone.
pub(crate) fn import<M: LearnerModel>(
    learner: &mut Learner<M>,
    bytes: &[u8],
) -> Result<(), String> {
    if bytes.is_empty() {
        return Ok(());
    }
    let reader =
        Reader::from_bytes(Bytes::from_bytes_vec(bytes.to_vec())).map_err(|e| format!("{e:?}"))?;
    let mut scheduler = LrSchedulerRecord::new();
    for (key, value) in reader.scalars() {
        if let Some(key) = key.strip_prefix(SCHEDULER) {
            scheduler = scheduler.with_scalar(key, *value);
        }
    }
    let ids: Vec<ParamId> = any_module::param_ids(&learner.model());
    let to: BTreeMap<u64, u64> = (0u64..).zip(&ids).map(|(i, id)| (i, id.val())).collect();
    let optim = rekeyed(reader, &to)?
        .into_bytes()
        .map_err(|e| format!("{e:?}"))?;
    let optim = OptimizerRecord::from_bytes(optim).map_err(|e| format!("{e:?}"))?;
    learner.load_optim(optim);
    learner.load_scheduler(scheduler);
    Ok(())
}

/// The state put together from `parts` (each of [`export`]'s bytes, or a part of them):
/// every entry of a parameter whose position `keep` holds, and every entry not of a parameter
/// (the scheduler's, the format's own), each name from the first part that has it; empty
/// parts are skipped. So one part and a `keep` give that part's parameters (a member's share
/// under ZeRO), and the parts of disjoint parameters give their union.
pub(crate) fn combine(parts: &[&[u8]], keep: &dyn Fn(u64) -> bool) -> Result<Vec<u8>, String> {
    let wanted = |name: &str| {
        let head = name.split_once('.').map_or(name, |(h, _)| h);
        head.parse::<u64>().map_or(true, keep)
    };
    let mut seen = std::collections::BTreeSet::new();
    let (mut tensors, mut scalars, mut paths) = (Vec::new(), Vec::new(), Vec::new());
    for part in parts.iter().filter(|p| !p.is_empty()) {
        let reader = Reader::from_bytes(Bytes::from_bytes_vec(part.to_vec()))
            .map_err(|e| format!("{e:?}"))?;
        let mut fresh =
            |kind: &str, name: &str| wanted(name) && seen.insert(format!("{kind}{name}"));
        for (k, v) in reader.scalars() {
            if fresh("s", k) {
                scalars.push((k.clone(), *v));
            }
        }
        for (k, v) in reader.metadata() {
            if fresh("m", k) {
                paths.push((k.clone(), v.clone()));
            }
        }
        for t in reader.into_tensors().map_err(|e| format!("{e:?}"))? {
            let (name, dtype, shape, id, bytes) = t.into_parts().map_err(|e| format!("{e:?}"))?;
            if fresh("t", &name) {
                tensors.push(Tensor::new(name, dtype, shape, id, bytes));
            }
        }
    }
    let mut writer = Writer::new(tensors);
    for (k, v) in scalars {
        writer = writer.with_scalar(&k, v);
    }
    for (k, v) in paths {
        writer = writer.with_metadata(&k, &v);
    }
    Ok(writer.into_bytes().map_err(|e| format!("{e:?}"))?.to_vec())
}

/// The optimizer state of `reader` with each parameter key `k` (a tensor's id and name
/// prefix, a scalar's and a path's prefix) as `to[k]`; the scheduler's scalars left out.
/// A parameter key `to` does not hold is an error: the state is of another model.
fn rekeyed(reader: Reader, to: &BTreeMap<u64, u64>) -> Result<Writer, String> {
    let key = |name: &str| -> Result<String, String> {
        let (head, rest) = name.split_once('.').unwrap_or((name, ""));
        let Ok(k) = head.parse::<u64>() else {
            // Not a parameter's (the format's own).
            return Ok(name.to_string());
        };
        let id = to
            .get(&k)
            .ok_or_else(|| format!("optimizer state of an unknown parameter ({name})"))?;
        Ok(if rest.is_empty() {
            id.to_string()
        } else {
            format!("{id}.{rest}")
        })
    };
    let scalars: Vec<(String, Scalar)> = reader
        .scalars()
        .iter()
        .filter(|(k, _)| !k.starts_with(SCHEDULER))
        .map(|(k, v)| Ok((key(k)?, *v)))
        .collect::<Result<_, String>>()?;
    let paths: Vec<(String, String)> = reader
        .metadata()
        .iter()
        .map(|(k, v)| Ok((key(k)?, v.clone())))
        .collect::<Result<_, String>>()?;
    let mut tensors = Vec::new();
    for t in reader.into_tensors().map_err(|e| format!("{e:?}"))? {
        let (name, dtype, shape, id, bytes) = t.into_parts().map_err(|e| format!("{e:?}"))?;
        let id = id.and_then(|k| to.get(&k).copied());
        tensors.push(Tensor::new(key(&name)?, dtype, shape, id, bytes));
    }
    let mut writer = Writer::new(tensors);
    for (k, v) in scalars {
        writer = writer.with_scalar(&k, v);
    }
    for (k, v) in paths {
        writer = writer.with_metadata(&k, &v);
    }
    Ok(writer)
}
