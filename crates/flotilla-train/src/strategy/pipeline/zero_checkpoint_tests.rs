//! A checkpoint of a pipeline whose stages' replicas shard their optimizer state (ZeRO
//! among them; 2 stages × 2 replicas of threads, Adam, one micro-batch a batch so that
//! ZeRO-3 gives zero 0's bits): every replica writes its own shard's file, none the stage's
//! whole state; the shards put together are the whole state replica 0 gathers; a run
//! resumed from it at the same shards (each replica reading its own file), at other shards
//! (ZeRO-1's from ZeRO-3's, each replica that sees the checkpoint cutting its shard out of the
//! files; ZeRO-3's from an unsharded run's whole state) or without ZeRO (the shards put
//! together) ends on the
//! uninterrupted run's bits, whether the ranks read their files themselves or rank 0 sends
//! them (ranks blind to its directory, as on other hosts).

use std::ops::Range;
use std::path::{Path, PathBuf};

use flotilla_engine::{ModelState, Stage, StageCut};

use super::tests::train_batch;
use super::{Pipeline, PipelineOptions, Schedule, restore, state};
use crate::checkpoint;
use crate::testkit::{adam, assert_bitwise, checkpoint_at, tensor_bytes, world};

/// Options of 2 replicas at ZeRO `zero`, one micro-batch, groups of one parameter.
fn opts(zero: u8) -> PipelineOptions {
    PipelineOptions {
        optimizer: adam(0.02),
        zero,
        micro_batches: 1,
        group_bytes: 1,
        ..super::tests::options(Schedule::OneFOneB, 2, 2)
    }
}

/// What one rank ends with: its stage, replica, its stage's parameters' hash (under ZeRO-3
/// gathered one group at a time) and parameters by name, and its stage's whole optimizer
/// state (on replica 0).
struct Ended {
    rank: usize,
    at: (usize, usize),
    hash: u64,
    params: Vec<(String, Vec<f32>)>,
    whole: Option<Vec<u8>>,
    /// Bytes it received while it restored.
    restore_bytes: u64,
}

/// Batches `batches` on 2 stages (cut at `point`) × 2 replicas at `zero`, after restoring
/// `from` if given, then a checkpoint into `out` if given; the ranks in `blind` do not see
/// rank 0's directories (as on other hosts). What each rank ends with, and the checkpoint.
fn run(
    (zero, point): (u8, usize),
    from: Option<PathBuf>,
    batches: Range<usize>,
    (out, blind): (Option<PathBuf>, &[usize]),
) -> (Vec<Ended>, Option<PathBuf>) {
    let cut = StageCut::at(&super::tests::spec(), &[point]).expect("cut");
    // Where a ZeRO-3 replica that does not see the checkpoint spools its stage's weights file.
    let spooled = tempfile::tempdir().expect("spool");
    let handles: Vec<_> = world(4)
        .into_iter()
        .map(|group| {
            let (cut, batches, from, out) =
                (cut.clone(), batches.clone(), from.clone(), out.clone());
            let blind = blind.contains(&group.rank());
            let spool = spooled.path().to_path_buf();
            std::thread::spawn(move || {
                if blind {
                    crate::checkpoint_offer::BLIND.with(|b| b.set(true));
                }
                let spec = super::tests::spec();
                let mut pipe = Pipeline::new(&spec, cut, opts(zero), group).expect("pipeline");
                let before = pipe.world().stats().bytes_received;
                if let Some(dir) = &from {
                    let mine = (pipe.world().rank() == 0).then_some(dir.as_path());
                    restore::restore(&mut pipe, mine, &spool).expect("restore");
                }
                let restore_bytes = pipe.world().stats().bytes_received - before;
                batches.for_each(|b| {
                    train_batch(&mut pipe, b);
                });
                let saved = out.and_then(|o| {
                    let s = checkpoint_at(10, "pipeline-test");
                    state::save(&mut pipe, &o, &s).expect("save")
                });
                let hash = pipe.param_hash().expect("hash");
                pipe.gather_stage().expect("gather");
                let mut params: Vec<_> = super::tests::named(pipe.stage()).into_iter().collect();
                params.sort_by(|a, b| a.0.cmp(&b.0));
                let whole = pipe.stage_state().expect("stage state").map(|[_, o]| o);
                let ended = Ended {
                    rank: pipe.world().rank(),
                    at: (pipe.stage_index(), pipe.replica()),
                    hash,
                    params,
                    whole,
                    restore_bytes,
                };
                (ended, saved)
            })
        })
        .collect();
    let mut ended = Vec::new();
    let mut dir = None;
    for h in handles {
        let (e, d) = h.join().expect("rank thread");
        ended.push(e);
        dir = dir.or(d);
    }
    // Every spooled file was removed after its load.
    let left = std::fs::read_dir(spooled.path())
        .expect("spool dir")
        .count();
    assert_eq!(left, 0, "{left} spooled files left");
    ended.sort_by_key(|e| e.at);
    (ended, dir)
}

/// Each rank in `blind` of a resume under ZeRO received its stage's weights and its shard of
/// the optimizer state, not the stage's whole state: fewer bytes than the weights and 3/4 of
/// the whole state (a shard is half of it on 2 replicas; the checkpoint's `state.json` and
/// the framing are the rest). Checked where the stage's state is at least 4 KiB, so that
/// they do not drown it; the number of ranks checked.
fn assert_received_shards(ended: &[Ended], blind: &[usize], what: &str) -> usize {
    let mut checked = 0;
    for e in ended.iter().filter(|e| blind.contains(&e.rank)) {
        let replica_0 = ended.iter().find(|o| o.at == (e.at.0, 0));
        let whole = replica_0.and_then(|o| o.whole.as_ref()).map_or(0, Vec::len);
        if whole < 4096 {
            continue;
        }
        let weights: usize = e.params.iter().map(|(_, v)| 4 * v.len()).sum();
        assert!(
            e.restore_bytes > 0 && (e.restore_bytes as usize) < weights + whole * 3 / 4,
            "{what}: rank {} received {} bytes, weights {weights}, whole state {whole}",
            e.rank,
            e.restore_bytes
        );
        checked += 1;
    }
    checked
}

fn assert_same_params(got: &[Ended], want: &[Ended], what: &str) {
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.at, w.at);
        assert_eq!(g.hash, w.hash, "{what}: stage {:?}'s hash", g.at);
        for ((name, g), (_, w)) in g.params.iter().zip(&w.params) {
            assert_bitwise(g, w, &format!("{what}: {name}"));
        }
    }
}

/// The names of the files in `dir`.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Checkpoint `dir` holds each replica's shard file and no stage's whole state, and its
/// shards put together are the whole state `ended`'s replica 0 gathered, stage by stage.
fn assert_sharded(dir: &Path, ended: &[Ended], what: &str) {
    let names = names(dir);
    for k in 0..2 {
        for r in 0..2 {
            let shard = checkpoint::stage_zero_file(k, r);
            assert!(names.contains(&shard), "{what}: no {shard} in {names:?}");
        }
        let whole = &checkpoint::stage_files(k)[1];
        assert!(!names.contains(whole), "{what}: {whole} written");
    }
    let state = checkpoint::read_state(dir).expect("state");
    let cut = StageCut::at(&super::tests::spec(), &[5]).expect("cut");
    for e in ended.iter().filter(|e| e.at.1 == 0) {
        let k = e.at.0;
        let stage =
            Stage::new(&super::tests::spec(), &cut, k, &adam(0.02), "flex", 5).expect("stage");
        let layout = stage.layout();
        let read = checkpoint::read_stage_flat_state(dir, &state, k, layout).expect("read");
        let whole = e.whole.as_ref().expect("replica 0's whole state");
        let gathered =
            flotilla_engine::FlatOptimizerState::gather(layout, &[(None, whole)]).expect("flat");
        assert!(read == gathered, "{what}: stage {k}'s shards put together");
    }
}

/// Ranks 1, 2 and 3 blind: every part but rank 0's over the wire (stage 1's ZeRO-3 weights
/// gathered whole on its replicas and sent by the first); rank 1 blind: stage 1's ZeRO-3
/// weights written by its second replica alone, the first gathering with it.
#[test]
fn every_replica_writes_its_own_shard_and_any_zero_resumes_from_the_shards_bitwise() {
    let dir = tempfile::tempdir().expect("dir");
    let (plain, _) = run((0, 5), None, 0..20, (None, &[]));
    let (others, one): (&[usize], &[usize]) = (&[1, 2, 3], &[1]);
    let cases = [
        (3, 3, &[][..]),
        (3, 3, others),
        (3, 3, one),
        (1, 1, others),
        (3, 1, &[]),
        (3, 1, others),
        (0, 3, &[]),
        (0, 3, one),
    ];
    for (i, (first, then, blind)) in cases.into_iter().chain([(1, 0, others)]).enumerate() {
        let what = format!("zero {first}, then {then}, blind {blind:?}");
        let out = dir.path().join(format!("{i}"));
        let (at_10, saved) = run((first, 5), None, 0..10, (Some(out), blind));
        let saved = saved.expect("rank 0 wrote a checkpoint");
        if first > 0 {
            assert_sharded(&saved, &at_10, &what);
        }
        let (resumed, _) = run((then, 5), Some(saved), 10..20, (None, blind));
        assert_same_params(&resumed, &plain, &what);
    }
    // At another cut: each rank that sees the checkpoint (else rank 0 for it) puts the old
    // stages' shards together to cut them again, and reads its tensors from the merged
    // weights file, written by the replicas a share each.
    let (plain_9, _) = run((0, 9), None, 0..20, (None, &[]));
    let out = dir.path().join("recut");
    let (_, saved) = run((3, 5), None, 0..10, (Some(out), &[]));
    // ZeRO-3 again: a replica that sees the checkpoint reads its pieces of its new stage's
    // weights file, written into its scratch directory.
    for (blind, then) in [&[][..], others, one]
        .into_iter()
        .flat_map(|b| [(b, 1), (b, 3)])
    {
        let (resumed, _) = run((then, 9), saved.clone(), 10..20, (None, blind));
        let what = format!("zero 3 at cut 5, then zero {then} at cut 9, blind {blind:?}");
        assert_same_params(&resumed, &plain_9, &what);
        let checked = assert_received_shards(&resumed, blind, &what);
        assert!(
            checked > 0 || blind != others,
            "{what}: no blind rank checked"
        );
    }
    // A checkpoint from before checksums: nothing offered, every part over the wire.
    let saved = saved.expect("saved");
    std::fs::remove_file(saved.join(checkpoint::CHECKSUMS)).expect("remove");
    let (resumed, _) = run((1, 9), Some(saved.clone()), 10..20, (None, &[]));
    assert_same_params(&resumed, &plain_9, "re-cut without checksums");
    let (resumed, _) = run((3, 5), Some(saved), 10..20, (None, &[]));
    assert_same_params(&resumed, &plain, "the same cut without checksums");
}

/// Resume takes a checkpoint of shards as complete, and passes over one that lost a shard's
/// file (with or without its checksums), naming it.
#[test]
fn a_checkpoint_of_shards_is_complete_with_every_shard_only() {
    let dir = tempfile::tempdir().expect("dir");
    let out = dir.path().join("run");
    let (_, saved) = run((1, 5), None, 0..10, (Some(out.clone()), &[]));
    let saved = saved.expect("rank 0 wrote a checkpoint");
    let (found, warnings) = checkpoint::newest_complete(&out).expect("newest");
    assert_eq!(found.as_ref(), Some(&saved), "{warnings:?}");
    let lost = checkpoint::stage_zero_file(1, 1);
    std::fs::remove_file(saved.join(&lost)).expect("remove");
    for name in [lost.as_str(), checkpoint::CHECKSUMS] {
        let (found, warnings) = checkpoint::newest_complete(&out).expect("newest");
        assert_eq!(found, None, "without {name}");
        assert!(warnings.iter().any(|w| w.contains(&lost)), "{warnings:?}");
        let _ = std::fs::remove_file(saved.join(checkpoint::CHECKSUMS));
    }
}

/// A pipeline checkpoint exports as one file with its optimizer state put together from
/// the stages (each from its replicas' shards): a ZeRO-3 run's holds zero 0's tensors, the
/// optimizer's too, bit for bit, and each stage's 1-d tensors' state is what the stage's
/// replica 0 gathers.
#[test]
fn a_pipeline_checkpoint_of_shards_exports_zero_0s_tensors_with_the_optimizer_state() {
    let dir = tempfile::tempdir().expect("dir");
    let mut exports = Vec::new();
    let mut ended = Vec::new();
    for zero in [0, 3] {
        let out = dir.path().join(format!("{zero}"));
        let (e, saved) = run((zero, 5), None, 0..10, (Some(out), &[]));
        let file = dir.path().join(format!("{zero}.safetensors"));
        let done = crate::checkpoint_export::export(&saved.expect("saved"), &file).expect("export");
        assert_eq!(done.without_optimizer, None);
        exports.push(tensor_bytes(&file));
        ended = e;
    }
    assert!(
        exports[0] == exports[1],
        "zero 3's export differs from zero 0's"
    );
    let cut = StageCut::at(&super::tests::spec(), &[5]).expect("cut");
    let mut checked = 0;
    for e in ended.iter().filter(|e| e.at.1 == 0) {
        let stage =
            Stage::new(&super::tests::spec(), &cut, e.at.0, &adam(0.02), "flex", 5).expect("stage");
        let layout = stage.layout();
        let whole = e.whole.as_ref().expect("whole");
        let flat =
            flotilla_engine::FlatOptimizerState::gather(layout, &[(None, whole)]).expect("flat");
        for field in flat.field_names() {
            let values = flat.field_values(layout, &field).expect("values");
            for p in layout.params.iter().filter(|p| p.shape.len() == 1) {
                let want: Vec<u8> = (values[p.offset..p.offset + p.len].iter())
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                let name = format!("optimizer.{}.{field}", p.name);
                assert_eq!(exports[1].get(&name), Some(&want), "{name}");
                checked += 1;
            }
        }
    }
    assert!(checked >= 4, "{checked} tensors checked");
}
