//! ZeRO-3's resume without the whole model. Every rank reads its own pieces of the
//! parameters out of the checkpoint's `model.safetensors`, one tensor at a time
//! ([`WeightsReader`]), the running statistics (whole on every rank) and its own optimizer
//! shard file, where it sees rank 0's checkpoint (the same `checksums.json` at the same
//! path: one host, or a directory every host mounts; the files it reads checked against
//! it); for a rank that does not, rank 0 reads them and sends them, one rank at a time. So
//! no rank holds the whole parameters, and none but rank 0 reads another's shard. The
//! weights file is the same at any world size; the optimizer state of a checkpoint sharded
//! otherwise (another world size, an unsharded run) is cut for each rank out of its state
//! files, reading only what meets the rank's shard (`shard_source.rs`).

use std::path::Path;
use std::time::Instant;

use flotilla_engine::{Engine, ParamLayout, WeightsPlan, WeightsReader, shard_pieces};
use flotilla_tcp::{CommError, Tag, tags};

use super::shard_source::ShardSource;
use super::{Zero, owned_ranges};
use crate::bucket::BucketPlan;
use crate::checkpoint::CheckpointState;
use crate::checkpoint_offer::{all_listed, offer_of, offered_dir};
use crate::error::{Result, TrainError};
use crate::model_file::{buffer_values, shard_values};

/// Rank 0's offer of the checkpoint, to every other rank.
const OFFER_TAG: Tag = tags::RESERVED + 0x108;
/// A rank's answer: `1` when it read its part itself.
const READ_TAG: Tag = tags::RESERVED + 0x109;
/// A rank's part sent by rank 0: its values (parameter pieces, then statistics), then its
/// optimizer shard's bytes.
const PART_TAG: Tag = tags::RESERVED + 0x10a;

/// What a rank loads: its pieces' values and the running statistics, and its optimizer
/// shard's bytes.
struct Part {
    values: Vec<f32>,
    buffers: Vec<f32>,
    optimizer: Vec<u8>,
}

/// What a resume loads from: the checkpoint's state and whether its optimizer state is
/// sharded as this run's (`same`), and this rank's shard (its flat ranges).
struct Resuming<'a> {
    state: &'a CheckpointState,
    same: bool,
    owned: Vec<std::ops::Range<usize>>,
}

impl Zero {
    /// Every rank's part of a resume from the checkpoint of `state` (found on rank 0 in
    /// `dir`) into this rank's shard and `engine`'s running statistics; collective.
    pub fn load_released(
        &mut self,
        dir: Option<&Path>,
        engine: &mut dyn Engine,
        plan: &BucketPlan,
        state: &CheckpointState,
    ) -> Result<()> {
        let same = state.zero.as_ref().map(|z| &z.shards) == Some(&self.manifest(plan).shards);
        let weights = engine.weights_plan()?;
        let layout = engine.layout().clone();
        let (n, r) = (self.comm.size(), self.comm.rank());
        let owned = owned_ranges(plan, n, r);
        let resuming = Resuming { state, same, owned };
        let part = match (r, dir) {
            (0, Some(dir)) => self.serve(dir, (&weights, &layout), plan, &resuming)?,
            (0, None) => {
                return Err(TrainError::config("resume", "rank 0 has no checkpoint"));
            }
            _ => self.fetch((&weights, &layout), engine.buffer_layout().total, &resuming)?,
        };
        if part.values.len() != self.optimizer.len() {
            return Err(TrainError::Divergence(format!(
                "ZeRO-3's resume: {} values for a shard of {}",
                part.values.len(),
                self.optimizer.len()
            )));
        }
        self.params = part.values;
        engine.write_buffers(&part.buffers)?;
        self.optimizer.load_state(part.optimizer)?;
        Ok(())
    }

    /// Rank 0: offers `dir`, reads and sends each rank that does not see it its part, one
    /// rank at a time, and reads its own.
    fn serve(
        &self,
        dir: &Path,
        (weights, layout): (&WeightsPlan, &ParamLayout),
        plan: &BucketPlan,
        resuming: &Resuming<'_>,
    ) -> Result<Part> {
        let comm = &*self.comm;
        let n = comm.size();
        let offer = offer_of(dir)?;
        for r in 1..n {
            comm.send(r, OFFER_TAG, &offer)?;
        }
        let source = ShardSource::new(dir, resuming.state, resuming.same)?;
        let reader = WeightsReader::open(&dir.join("model.safetensors"))?;
        for r in 1..n {
            let read = comm.recv(r, READ_TAG, Instant::now() + comm.timeout())?;
            if read != [1] {
                let owned = owned_ranges(plan, n, r);
                let pieces = shard_pieces(layout, &owned)?;
                let mut values = shard_values(&reader, weights, layout, &pieces)?;
                values.extend(buffer_values(&reader, weights, layout)?);
                comm.send_large(r, PART_TAG, bytemuck::cast_slice(&values))?;
                drop(values);
                comm.send_large(r, PART_TAG, &source.shard(r, layout, &owned)?)?;
            }
        }
        Ok(Part {
            values: shard_values(&reader, weights, layout, self.optimizer.pieces())?,
            buffers: buffer_values(&reader, weights, layout)?,
            optimizer: source.shard(0, layout, &resuming.owned)?,
        })
    }

    /// A rank but 0: reads its part where it sees rank 0's checkpoint (its optimizer shard
    /// cut out of the checkpoint's state files when they are sharded otherwise), else
    /// receives it.
    fn fetch(
        &self,
        (weights, layout): (&WeightsPlan, &ParamLayout),
        buffers: usize,
        resuming: &Resuming<'_>,
    ) -> Result<Part> {
        let comm = &*self.comm;
        let deadline = Instant::now() + comm.timeout();
        let offer = comm.recv(0, OFFER_TAG, deadline)?;
        let own = offered_dir(&offer).and_then(|(dir, sums)| {
            let source = ShardSource::new(&dir, resuming.state, resuming.same).ok()?;
            let file = "model.safetensors".to_owned();
            let names = source.names(comm.rank());
            if !all_listed(&dir, &sums, std::iter::once(&file).chain(&names)) {
                return None;
            }
            let reader = WeightsReader::open(&dir.join("model.safetensors")).ok()?;
            let values = shard_values(&reader, weights, layout, self.optimizer.pieces()).ok()?;
            let buffers = buffer_values(&reader, weights, layout).ok()?;
            let optimizer = source.shard(comm.rank(), layout, &resuming.owned).ok()?;
            Some(Part {
                values,
                buffers,
                optimizer,
            })
        });
        comm.send(0, READ_TAG, &[u8::from(own.is_some())])?;
        if let Some(own) = own {
            return Ok(own);
        }
        let (values, buffers) = receive_values(comm, buffers, deadline)?;
        Ok(Part {
            values,
            buffers,
            optimizer: comm.recv_large(0, PART_TAG, deadline)?,
        })
    }
}

/// A shard's values and the running statistics, as rank 0 sends them.
fn receive_values(
    comm: &dyn flotilla_tcp::ProcessGroup,
    buffers: usize,
    deadline: Instant,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let bytes = comm.recv_large(0, PART_TAG, deadline)?;
    if bytes.len() % 4 != 0 {
        let detail = format!("a shard of {} bytes", bytes.len());
        return Err(CommError::Protocol { peer: 0, detail }.into());
    }
    let mut values: Vec<f32> = (bytes.chunks_exact(4))
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let shard = values.len().saturating_sub(buffers);
    let buffers = values.split_off(shard);
    Ok((values, buffers))
}
