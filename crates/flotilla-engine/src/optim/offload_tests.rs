//! [`crate::ShardOptimizer::offload_to`]: a shard whose state is in files steps bit for bit as
//! one whose state is in memory (every optimizer, offloaded before its first step or after
//! some, in chunks smaller than a piece and larger), holds none of it in memory, writes and
//! reads the same state, and leaves no file behind.

use std::path::Path;

use crate::optim::offload::chunks;
use crate::optim::shard_optim_tests::{engine, gradient, optimizers, owned, shard_of};
use crate::{ModelState, OptimizerSpec, ShardOptimizer, optimizer_state_bytes};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Steps `s` from `params` with the gradients of steps `steps`.
fn run(s: &mut ShardOptimizer, params: &mut [f32], steps: std::ops::Range<usize>) {
    for step in steps {
        let g = shard_of(s, &gradient(params.len(), step));
        s.step(params, &g, 0.3 + step as f64 * 0.1).expect("step");
    }
}

/// Rank 1 of 2's shard of the tiny LM under `spec`, and the model's initial parameters.
fn shard(spec: &OptimizerSpec) -> (ShardOptimizer, Vec<f32>) {
    let whole = engine(spec);
    let mut params = vec![0.0; whole.num_params()];
    whole.read_params(&mut params).expect("read");
    let owned = owned(params.len(), 2, 1);
    let s = ShardOptimizer::new(spec, whole.layout(), &owned, "flex").expect("shard");
    (s, params)
}

/// A state's tensors (name and bytes, by name) and scalars (name and value).
type Canonical = (Vec<(String, Vec<u8>)>, Vec<(String, String)>);

/// A state's tensors and scalars in a fixed order: burn writes a state's tensors in the order
/// of its hash map, so two writes of one state need not be the same bytes.
fn canonical(state: &[u8]) -> Canonical {
    let bytes = burn::store::burn_pack::Bytes::from_bytes_vec(state.to_vec());
    let reader = burn::store::burn_pack::Reader::from_bytes(bytes).expect("reader");
    let scalars = reader.scalars().iter();
    let scalars = scalars
        .map(|(k, v)| (k.clone(), format!("{v:?}")))
        .collect();
    let mut tensors: Vec<(String, Vec<u8>)> = reader
        .into_tensors()
        .expect("tensors")
        .into_iter()
        .map(|t| {
            let (name, _, _, _, bytes) = t.into_parts().expect("parts");
            (name, bytes.to_vec())
        })
        .collect();
    tensors.sort();
    (tensors, scalars)
}

fn files(dir: &Path) -> usize {
    std::fs::read_dir(dir).expect("dir").count()
}

#[test]
fn pieces_are_cut_into_chunks_of_about_the_size() {
    assert_eq!(chunks(&[3, 3, 3, 10, 1], 6), vec![0..2, 2..3, 3..4, 4..5]);
    assert_eq!(chunks(&[3, 3, 3], 100), vec![0..3]);
    assert_eq!(chunks(&[], 4), Vec::<std::ops::Range<usize>>::new());
}

#[test]
fn an_offloaded_shard_steps_bitwise_like_one_in_memory() {
    let base = tempfile::tempdir().expect("tmp");
    for spec in optimizers() {
        for (chunk, offload_after) in [(4, 0), (4, 2), (10_000, 0), (1, 3)] {
            let (mut memory, start) = shard(&spec);
            let (mut files_, _) = shard(&spec);
            let (mut a, mut b) = (start.clone(), start.clone());
            run(&mut memory, &mut a, 0..offload_after);
            run(&mut files_, &mut b, 0..offload_after);
            files_
                .offload_in_chunks(base.path(), chunk)
                .expect("offload");
            let dir = files_.offloaded_to().expect("offloaded").to_path_buf();
            assert!(dir.starts_with(base.path()), "{}", dir.display());
            run(&mut memory, &mut a, offload_after..6);
            run(&mut files_, &mut b, offload_after..6);
            let case = format!("{spec:?}, chunks of {chunk}, offloaded after {offload_after}");
            assert_ne!(bits(&a), bits(&start), "{case}: nothing moved");
            assert_eq!(bits(&b), bits(&a), "{case}");
            let state = memory.state().expect("state");
            let got = canonical(&files_.state().expect("state"));
            assert_eq!(got, canonical(&state), "{case}");
            let held = optimizer_state_bytes(&state).expect("bytes");
            assert_eq!(held, spec.state_slots() * 4 * memory.len() as u64, "{case}");
            assert_eq!(files_.state_bytes().expect("bytes"), held, "{case}");
            assert_eq!(files_.resident_bytes().expect("bytes"), 0, "{case}");
            let lens: Vec<usize> = memory.pieces().iter().map(|p| p.range.len()).collect();
            assert_eq!(
                files(&dir),
                chunks(&lens, chunk).len(),
                "{case}: a file a chunk"
            );
            drop(files_);
            assert!(!dir.exists(), "{case}: {} left behind", dir.display());
        }
    }
}

#[test]
fn an_offloaded_state_saved_loaded_and_moved_continues_bitwise() {
    let spec = &optimizers()[3];
    let base = tempfile::tempdir().expect("tmp");
    let (mut a, mut pa) = shard(spec);
    a.offload_in_chunks(base.path(), 5).expect("offload");
    run(&mut a, &mut pa, 0..3);
    // Saved from the files, loaded in memory.
    let saved = base.path().join("state.bpk");
    a.save_state(&saved).expect("save");
    let (mut b, _) = shard(spec);
    b.load_state(std::fs::read(&saved).expect("read"))
        .expect("load");
    // Loaded from memory into another offloaded shard.
    let (mut c, _) = shard(spec);
    c.offload_in_chunks(base.path(), 3).expect("offload");
    c.load_state(b.state().expect("state")).expect("load");
    let (mut pb, mut pc) = (pa.clone(), pa.clone());
    run(&mut a, &mut pa, 3..5);
    run(&mut b, &mut pb, 3..5);
    run(&mut c, &mut pc, 3..5);
    assert_eq!(bits(&pb), bits(&pa));
    assert_eq!(bits(&pc), bits(&pa));
    // A state of another cut is refused, and the files still hold the shard's own.
    let before = canonical(&c.state().expect("state"));
    let other = crate::optim::shard_optim_tests::stepped_shard_state(3, 1);
    assert!(c.load_state(other.clone()).is_err(), "another cut's state");
    assert_eq!(canonical(&c.state().expect("state")), before);
}

#[test]
fn an_optimizer_that_keeps_its_undo_is_not_offloaded() {
    let (mut s, _) = shard(&optimizers()[2]);
    s.keep_undo(true);
    let base = tempfile::tempdir().expect("tmp");
    let err = s.offload_to(base.path()).expect_err("undo in memory");
    assert!(err.to_string().contains("elastic"), "{err}");
    assert_eq!(files(base.path()), 0);
}
