//! A pipeline's checkpoint round trip: stages save after half the batches, fresh stages (built
//! from another seed) restore it and train the rest, and end where uninterrupted training
//! does, whether each stage writes and reads its own files in rank 0's checkpoint (the ranks
//! see one directory) or they travel over the wire (a rank made blind to it, as on another
//! host). The stage weights never pass through a file in the temporary directory: links
//! planted where they used to be written are not followed.

use std::path::{Path, PathBuf};

use flotilla_engine::StageCut;

use super::tests::train_batch;
use super::tests::{BATCHES, Ended, SEED, assert_matches, named, options, reference, spec};
use super::{Pipeline, Schedule, restore, state};
use crate::checkpoint::CheckpointState;
use crate::testkit::world;

/// Links at the names the stage weights once had in the temporary directory
/// (`flotilla-<pid>-stage-<k>.safetensors`, `flotilla-<pid>-resume-stage-<k>.safetensors`),
/// each to `target`; removed when dropped.
struct Planted(Vec<PathBuf>);

impl Planted {
    fn at(target: &Path, stages: usize) -> Self {
        let pid = std::process::id();
        let mut links = Vec::new();
        for k in 0..stages {
            for kind in ["stage", "resume-stage"] {
                let link =
                    std::env::temp_dir().join(format!("flotilla-{pid}-{kind}-{k}.safetensors"));
                let _ = std::fs::remove_file(&link);
                std::os::unix::fs::symlink(target, &link).expect("plant a link");
                links.push(link);
            }
        }
        Planted(links)
    }
}

impl Drop for Planted {
    fn drop(&mut self) {
        for l in &self.0 {
            let _ = std::fs::remove_file(l);
        }
    }
}

/// Runs `batches` on every rank of a 2-stage pipeline built from `seed`, after `restore` (the
/// checkpoint directory on rank 0) if given, and saves a checkpoint of step `save_at` into
/// `out` if given (where rank 1 does not see rank 0's checkpoint in progress, as on another
/// host, when `blind`): what each rank ends with, and the checkpoint's directory.
fn run(
    seed: u64,
    restore: Option<PathBuf>,
    batches: std::ops::Range<usize>,
    (out, blind): (Option<PathBuf>, bool),
) -> (Vec<Ended>, Option<PathBuf>) {
    let spec = spec();
    let cut = StageCut::at(&spec, &[4]).expect("cut");
    // Where a ZeRO-3 replica that does not see the checkpoint spools its stage's weights file.
    let spooled = tempfile::tempdir().expect("spool");
    let handles: Vec<_> = world(cut.stages())
        .into_iter()
        .map(|group| {
            let (spec, cut, restore, out) =
                (spec.clone(), cut.clone(), restore.clone(), out.clone());
            let batches = batches.clone();
            let spool = spooled.path().to_path_buf();
            std::thread::spawn(move || {
                if blind && group.rank() == 1 {
                    crate::checkpoint_offer::BLIND.with(|b| b.set(true));
                }
                let opts = super::PipelineOptions {
                    seed,
                    ..options(Schedule::OneFOneB, 2, 1)
                };
                let mut pipe = Pipeline::new(&spec, cut, opts, group).expect("pipeline");
                if let Some(dir) = &restore {
                    let mine = (pipe.world().rank() == 0).then_some(dir.as_path());
                    restore::restore(&mut pipe, mine, &spool).expect("restore");
                }
                let losses = batches.filter_map(|b| train_batch(&mut pipe, b)).collect();
                let saved = out.and_then(|o| {
                    let s = checkpoint_state(&pipe);
                    state::save(&mut pipe, &o, &s).expect("save")
                });
                let ended = Ended {
                    stage: pipe.stage_index(),
                    replica: pipe.replica(),
                    params: named(pipe.stage()),
                    peak: pipe.stage().peak_in_flight(),
                    losses,
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
    (ended, dir)
}

fn checkpoint_state(pipe: &Pipeline) -> CheckpointState {
    CheckpointState {
        step: (BATCHES / 2) as u64,
        epoch: 0,
        step_in_epoch: (BATCHES / 2) as u64,
        config_hash: 1,
        model: "pipeline-test".into(),
        num_params: pipe.stage().num_params(),
        test_acc: None,
        stages: None,
        zero: None,
        stage_zero: None,
    }
}

#[test]
fn a_resumed_pipeline_trains_on_and_never_follows_a_planted_link() {
    let dir = tempfile::tempdir().expect("dir");
    let target = dir.path().join("someone-elses-file");
    std::fs::write(&target, b"precious").expect("target");
    let _planted = Planted::at(&target, 2);
    let half = BATCHES / 2;
    let (_, saved) = run(SEED, None, 0..half, (Some(dir.path().join("run")), false));
    let saved = saved.expect("rank 0 wrote a checkpoint");
    // Another seed: only the checkpoint can bring the stages back to where they were.
    let (ended, _) = run(SEED + 1, Some(saved), half..BATCHES, (None, false));
    assert_matches(&ended, &reference().1, "saved, restored and trained on");
    let after = std::fs::read(&target).expect("target");
    assert!(
        after == b"precious",
        "a link planted at a stage's old temporary path was followed: its target now holds {} \
         bytes",
        after.len()
    );
}

/// The files of directory `dir` by name, with their bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("dir")
        .map(|e| {
            let e = e.expect("entry");
            let bytes = std::fs::read(e.path()).expect("read");
            (e.file_name().to_string_lossy().into_owned(), bytes)
        })
        .collect();
    files.sort();
    files
}

/// What a safetensors file holds: its metadata and every tensor's shape and bytes, by name.
type Held = (
    Option<std::collections::HashMap<String, String>>,
    std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)>,
);

fn held(file: &[u8]) -> Held {
    let (_, meta) = safetensors::SafeTensors::read_metadata(file).expect("metadata");
    let st = safetensors::SafeTensors::deserialize(file).expect("tensors");
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec())))
        .collect();
    (meta.metadata().clone(), tensors)
}

/// Stage 1 writes its files and its block of the merged weights into rank 0's checkpoint in
/// progress itself; when it does not see the directory (another host) it sends them to rank 0
/// instead: the checkpoint holds the same either way, the offer's marker gone, and a run
/// resumed from it over the wire (rank 1 reading its stage's files itself in the test above)
/// ends where uninterrupted training does.
#[test]
fn a_stage_writes_its_part_of_the_checkpoint_itself_or_sends_it_the_same_bytes() {
    let dir = tempfile::tempdir().expect("dir");
    let half = BATCHES / 2;
    let mut saved = Vec::new();
    for (name, blind) in [("seen", false), ("wire", true)] {
        let out = Some(dir.path().join(name));
        let (_, d) = run(SEED, None, 0..half, (out, blind));
        saved.push(d.expect("rank 0 wrote a checkpoint"));
    }
    let (seen, wire) = (files(&saved[0]), files(&saved[1]));
    let names: Vec<&str> = seen.iter().map(|f| f.0.as_str()).collect();
    assert!(
        names.contains(&"stage-1.optimizer.bpk") && names.contains(&"model.safetensors"),
        "{names:?}"
    );
    assert!(
        !names.iter().any(|n| n.starts_with(".shared-")),
        "{names:?}"
    );
    assert_eq!(names, wire.iter().map(|f| f.0.as_str()).collect::<Vec<_>>());
    // A stage's weights file lists its metadata in hash order, so safetensors files are
    // compared by what they hold (and the checksums of their bytes not at all).
    let differ: Vec<&str> = seen
        .iter()
        .zip(&wire)
        .filter(|((name, a), (_, b))| match name.as_str() {
            "checksums.json" => false,
            n if n.ends_with(".safetensors") => held(a) != held(b),
            _ => a != b,
        })
        .map(|((name, _), _)| name.as_str())
        .collect();
    assert!(differ.is_empty(), "{differ:?} differ between the two ways");
    // Restored over the wire too: rank 1 does not see the checkpoint either.
    let (ended, _) = run(
        SEED + 1,
        Some(saved[1].clone()),
        half..BATCHES,
        (None, true),
    );
    let why = "saved and restored over the wire, trained on";
    assert_matches(&ended, &reference().1, why);
}
