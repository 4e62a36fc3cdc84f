//! The hierarchical all-reduce piece by piece ([`crate::hier`], for a buffer larger than
//! [`crate::CommConfig::hier_pipeline_bytes`]): the buffer is cut into pieces of that size
//! (the last shorter), each going through the three phases of `hier.rs`, and the phases of
//! neighbouring pieces overlap:
//!
//! ```text
//! caller's task:  reduce 0 | reduce 1 | gather 0 | reduce 2 | gather 1 | ... | gather P-1
//! crossing task:             cross 0 ------------ cross 1 ------------- ... cross P-1
//! ```
//!
//! The shared-memory phases block their thread (`shm::run_blocking`) while the TCP phase is
//! async, so the TCP phase runs as its own task on the communicator's runtime (the
//! *crossing* task): it owns a copy of this rank's segment of each piece, sent to it over a
//! channel as soon as the host's sum of the piece is ready, and sends it back all-reduced
//! between the hosts. It takes the cross-host group's turns itself, piece after piece, and
//! the caller's task takes the host group's, so each group sees its collectives in the same
//! order on every member. While the crossing task carries piece `p`, the caller gathers
//! piece `p - 1` on the host and reduces piece `p + 1`, then waits for piece `p` to come
//! back (the drawing above).
//!
//! **Same bits, same bytes.** Every element is summed over its host in rank order by the
//! segment's all-reduce, whatever piece it is in; between hosts each piece's segment goes
//! through the algorithm its size picks. With two hosts that is one addition of the two
//! hosts' sums, commutative in `f32`, so the result is bitwise the unpieced one; with more
//! hosts the order of the hosts' sums is the algorithm's over the piece (the same on every
//! rank). Each host still sends `2 (H-1)/H` of its segment of every piece, so the
//! inter-host payload is the unpieced one (plus one frame header per piece and step).
//!
//! **Failures.** An error on either side ends the all-reduce with that error (the crossing
//! task's comes back over the channel); the crossing task is aborted when the caller's
//! side fails or is dropped, and awaited before the all-reduce returns. Deadlines, abort
//! notices and lost peers are watched by each phase as in the unpieced all-reduce.

use std::ops::Range;
use std::sync::Arc;

use flotilla_group::{CommError, shard};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::task::JoinHandle;

use crate::hier::{cross_reduce, host_gather, host_reduce};
use crate::world::{GroupState, Levels};

/// What the crossing task sends back: this rank's segment of a piece, all-reduced.
type Crossed = Result<Vec<f32>, CommError>;

/// The crossing task: all-reduces each segment it receives over `cross`, in order, and
/// sends it back; ends when the sender is dropped or after the first failure.
async fn crossing(
    cross: Arc<GroupState>,
    mut segments: UnboundedReceiver<Vec<f32>>,
    back: UnboundedSender<Crossed>,
) {
    while let Some(mut mine) = segments.recv().await {
        let r = cross_reduce(&cross, &mut mine).await.map(|()| mine);
        let failed = r.is_err();
        if back.send(r).is_err() || failed {
            return;
        }
    }
}

/// Aborts the crossing task when dropped before it was awaited (the caller's all-reduce
/// cancelled).
struct Crossing(Option<JoinHandle<()>>);

impl Drop for Crossing {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

/// The all-reduce of `buf` over `lv` in pieces of `piece` floats (see the module doc).
pub(crate) async fn all_reduce(
    lv: &Levels,
    buf: &mut [f32],
    piece: usize,
) -> Result<(), CommError> {
    let (to_cross, segments) = unbounded_channel();
    let (back, mut from_cross) = unbounded_channel();
    let mut task = Crossing(Some(tokio::spawn(crossing(
        lv.cross.clone(),
        segments,
        back,
    ))));
    let r = pipeline(lv, buf, piece, &to_cross, &mut from_cross).await;
    drop(to_cross);
    let Some(h) = task.0.take() else {
        return r;
    };
    if r.is_err() {
        h.abort();
    }
    match h.await {
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        _ => r,
    }
}

/// The caller's side: reduces each piece on the host, hands its segment to the crossing
/// task, and lands the previous piece while this one crosses.
async fn pipeline(
    lv: &Levels,
    buf: &mut [f32],
    piece: usize,
    to_cross: &UnboundedSender<Vec<f32>>,
    from_cross: &mut UnboundedReceiver<Crossed>,
) -> Result<(), CommError> {
    let (k, i) = (lv.local.members.len(), lv.local.me());
    let len = buf.len();
    let pieces: Vec<Range<usize>> = (0..len.div_ceil(piece))
        .map(|p| p * piece..((p + 1) * piece).min(len))
        .collect();
    let mut spare: Vec<Vec<f32>> = Vec::new();
    for (p, r) in pieces.iter().enumerate() {
        let part = &mut buf[r.clone()];
        host_reduce(&lv.local, part).await?;
        let mut mine = spare.pop().unwrap_or_default();
        mine.clear();
        mine.extend_from_slice(&part[shard::segment(part.len(), k, i)]);
        to_cross.send(mine).map_err(|_| CommError::Shutdown)?;
        if p > 0 {
            let prev = &mut buf[pieces[p - 1].clone()];
            land(lv, prev, from_cross, &mut spare).await?;
        }
    }
    if let Some(r) = pieces.last() {
        land(lv, &mut buf[r.clone()], from_cross, &mut spare).await?;
    }
    Ok(())
}

/// Waits for this rank's segment of `part` back from the crossing task, puts it in place
/// and gathers the piece on the host; keeps the segment's buffer for the next piece.
async fn land(
    lv: &Levels,
    part: &mut [f32],
    from_cross: &mut UnboundedReceiver<Crossed>,
    spare: &mut Vec<Vec<f32>>,
) -> Result<(), CommError> {
    let (k, i) = (lv.local.members.len(), lv.local.me());
    let mine = from_cross.recv().await.ok_or(CommError::Shutdown)??;
    let seg = shard::segment(part.len(), k, i);
    part[seg].copy_from_slice(&mine);
    spare.push(mine);
    host_gather(&lv.local, part).await
}
