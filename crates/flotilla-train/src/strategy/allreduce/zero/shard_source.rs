//! Where a ZeRO resume takes each rank's optimizer shard from: the checkpoint's file of that
//! rank when the checkpoint is sharded as this run is; else (another world size, an
//! unsharded run's `optimizer.bpk`) cut for the rank out of the checkpoint's state files,
//! reading only the tensors that meet its shard ([`recut_shard`]). So no rank puts the whole
//! optimizer state together: a re-cut holds one shard and one state tensor at a time.

use std::ops::Range;
use std::path::{Path, PathBuf};

use flotilla_engine::{ParamLayout, StateFile, recut_shard};

use crate::checkpoint::{self, CheckpointState};
use crate::error::Result;

/// The shards of a ZeRO resume from one checkpoint.
pub(crate) struct ShardSource {
    dir: PathBuf,
    /// The checkpoint's state files, when it is not sharded as this run.
    recut: Option<Vec<StateFile>>,
}

impl ShardSource {
    /// The shards of the checkpoint in `dir` (whose `state.json` says `state`), sharded as
    /// this run (`same`) or not.
    pub(crate) fn new(dir: &Path, state: &CheckpointState, same: bool) -> Result<Self> {
        let recut = match same {
            true => None,
            false => Some(checkpoint::state_files(dir, state)?),
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            recut,
        })
    }

    /// The names of the checkpoint's files rank `r`'s shard is read from.
    pub(crate) fn names(&self, r: usize) -> Vec<String> {
        match &self.recut {
            None => vec![checkpoint::zero_file(r)],
            Some(files) => (files.iter())
                .filter_map(|(_, path)| Some(path.file_name()?.to_str()?.to_owned()))
                .collect(),
        }
    }

    /// Rank `r`'s shard, of flat ranges `owned` over a model of `layout`.
    pub(crate) fn shard(
        &self,
        r: usize,
        layout: &ParamLayout,
        owned: &[Range<usize>],
    ) -> Result<Vec<u8>> {
        let Some(files) = &self.recut else {
            return checkpoint::read_file(&self.dir, &checkpoint::zero_file(r));
        };
        Ok(recut_shard(layout, files, owned)?)
    }
}
