//! [`crate::recut_shard`]: a shard's state read from the files of 3 shards, or from the bytes
//! of the whole model's, is the bytes [`crate::FlatOptimizerState`] cuts for it after putting those files
//! together, for every optimizer, before and after the first step; it needs only the files
//! that meet the shard; a file that leaves part of the shard uncovered is refused.

use std::ops::Range;
use std::path::Path;

use crate::optim::shard_optim_tests::{engine, gradient, optimizers, owned};
use crate::{
    Engine, FlatOptimizerState, ModelState, ShardOptimizer, ShardRecut, StateFile, recut_shard,
};

/// The files of `n` shards of `spec`'s model after `steps` steps, and the whole model's.
fn written(dir: &Path, spec: &crate::OptimizerSpec, steps: usize) -> (Vec<StateFile>, StateFile) {
    let mut whole = engine(spec);
    let layout = whole.layout().clone();
    let total = layout.total;
    let mut params = vec![0.0; total];
    whole.read_params(&mut params).expect("read");
    let mut files = Vec::new();
    for r in 0..3 {
        let mine = owned(total, 3, r);
        let mut shard = ShardOptimizer::new(spec, &layout, &mine, "flex").expect("shard");
        for step in 0..steps {
            let g = gradient(total, step);
            let g: Vec<f32> = shard
                .pieces()
                .iter()
                .flat_map(|p| g[p.range.clone()].to_vec())
                .collect();
            shard.step(&mut params.clone(), &g, 0.3).expect("step");
        }
        let path = dir.join(format!("shard-{r}.bpk"));
        std::fs::write(&path, shard.state().expect("state")).expect("write");
        files.push((Some(mine), path));
    }
    for step in 0..steps {
        whole
            .apply_grads(&gradient(total, step), 0.3)
            .expect("whole step");
    }
    let path = dir.join("whole.bpk");
    std::fs::write(&path, whole.optimizer_state().expect("state")).expect("write");
    (files, (None, path))
}

/// The state FlatOptimizerState cuts for `owned` from `files`, put together whole first.
fn cut_whole(layout: &crate::ParamLayout, files: &[StateFile], owned: &[Range<usize>]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = files
        .iter()
        .map(|(_, p)| std::fs::read(p).expect("read"))
        .collect();
    let parts: Vec<_> = (files.iter().zip(&bytes))
        .map(|((r, _), b)| (r.as_deref(), b.as_slice()))
        .collect();
    let flat = FlatOptimizerState::gather(layout, &parts).expect("gather");
    flat.shard(layout, owned).expect("cut")
}

#[test]
fn a_shard_recut_from_files_is_the_state_cut_from_the_whole() {
    let dir = tempfile::tempdir().expect("dir");
    for spec in optimizers() {
        let layout = engine(&spec).layout().clone();
        let total = layout.total;
        for steps in [0, 4] {
            let (shards, whole) = written(dir.path(), &spec, steps);
            for n in [1, 2, 4, 5] {
                for r in 0..n {
                    let mine = owned(total, n, r);
                    let what = format!("{spec:?} after {steps} steps, shard {r} of {n}");
                    let want = cut_whole(&layout, &shards, &mine);
                    let got = recut_shard(&layout, &shards, &mine).expect("from shards");
                    assert!(
                        got == want,
                        "{what}, from 3 shards: {} bytes, want {}",
                        got.len(),
                        want.len()
                    );
                    let whole = std::slice::from_ref(&whole);
                    let want = cut_whole(&layout, whole, &mine);
                    let mut recut = ShardRecut::new(&layout, &mine).expect("recut");
                    let bytes = std::fs::read(&whole[0].1).expect("read");
                    recut.read_bytes(None, bytes).expect("the whole's bytes");
                    let got = recut.finish().expect("from the whole");
                    assert!(
                        got == want,
                        "{what}, from the whole: {} bytes, want {}",
                        got.len(),
                        want.len()
                    );
                }
            }
        }
    }
}

#[test]
fn a_shard_needs_only_the_files_that_meet_it_and_refuses_a_gap() {
    let dir = tempfile::tempdir().expect("dir");
    let spec = &optimizers()[2];
    let layout = engine(spec).layout().clone();
    let (shards, _) = written(dir.path(), spec, 2);
    // Shard 0 of 3 itself, from file 0 alone, and then from every file but 0.
    let first = shards[0].0.clone().expect("ranges");
    let alone = recut_shard(&layout, &shards[..1], &first).expect("file 0 alone");
    assert!(alone == cut_whole(&layout, &shards, &first), "file 0 alone");
    let e = recut_shard(&layout, &shards[1..], &first).expect_err("file 0 missing");
    assert!(e.to_string().contains("the files cover 0 of"), "{e}");
}
