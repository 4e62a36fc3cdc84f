//! A checkpoint's optimizer shards (two in-memory ranks): a rank that sees rank 0's
//! checkpoint directory writes its shard there itself (no scratch file of its own, nothing
//! over the wire), one that does not sends it to rank 0; the files are the same bytes both
//! ways, each the shard's own state, and the offer's marker is gone afterwards.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::thread;

use flotilla_engine::{ParamLayout, ShardOptimizer};

use super::{collect, send_shard};
use crate::checkpoint;
use crate::checkpoint_offer::{ASK_TAG, Offer, Offered, offer};
use crate::testkit::{sgd, world};

/// Rank `rank`'s optimizer of its half of two 6-value tensors, stepped once (its momentum
/// is state that differs by rank).
fn stepped(rank: usize) -> ShardOptimizer {
    let layout = ParamLayout::of_lengths(&[6, 6]);
    let owned: Vec<Range<usize>> = std::iter::once(rank * 6..rank * 6 + 6).collect();
    let mut o = ShardOptimizer::new(&sgd(0.1, 0.9), &layout, &owned, "flex").expect("optimizer");
    let mut shard = vec![1.0f32; 6];
    let grads: Vec<f32> = (0..6).map(|i| (i + 3 * rank) as f32 * 0.5).collect();
    o.step_shard(&mut shard, &grads, 0.1).expect("step");
    o
}

/// The bytes of `optimizer`'s state as [`ShardOptimizer::save_state`] writes it.
fn state_file(optimizer: &ShardOptimizer, dir: &Path, name: &str) -> Vec<u8> {
    let path = dir.join(name);
    optimizer.save_state(&path).expect("save");
    std::fs::read(&path).expect("read")
}

/// A checkpoint of two ranks into `tmp`; rank 1's output directory is `output`. With
/// `shared: false` rank 0 offers a directory rank 1 cannot see (as on another host).
fn save(tmp: &Path, output: &Path, shared: bool) {
    let comms = world(2);
    let (c0, c1) = (comms[0].clone(), comms[1].clone());
    let output = output.to_path_buf();
    let rank1 = thread::spawn(move || send_shard(&*c1, &stepped(1), &output));
    let offered = if shared {
        offer(&*c0, tmp).expect("offer")
    } else {
        let marker = tempfile::Builder::new()
            .prefix(".shared-")
            .tempfile_in(tmp)
            .expect("marker");
        c0.send(1, ASK_TAG, b"/nonexistent/checkpoint\n.shared-x")
            .expect("offer");
        Offer {
            marker,
            tmp: tmp.to_path_buf(),
            peers: vec![1],
        }
    };
    collect(offered, &*c0, &stepped(0)).expect("collect");
    rank1.join().expect("rank 1").expect("rank 1's shard");
}

/// The names of the files in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_rank_that_sees_the_checkpoint_writes_its_shard_there_else_sends_it_the_same_bytes() {
    let dir = tempfile::tempdir().expect("tmp");
    let (shared, wire) = (dir.path().join("shared"), dir.path().join("wire"));
    let outputs: Vec<PathBuf> = ["out-shared", "out-wire"]
        .iter()
        .map(|o| dir.path().join(o))
        .collect();
    for d in [&shared, &wire] {
        std::fs::create_dir(d).expect("mkdir");
    }
    save(&shared, &outputs[0], true);
    save(&wire, &outputs[1], false);
    let files = vec![checkpoint::zero_file(0), checkpoint::zero_file(1)];
    assert_eq!(
        names(&shared),
        files,
        "the marker is gone, both shards are there"
    );
    assert_eq!(names(&wire), files);
    // Rank 1 wrote into rank 0's directory: it never made a scratch file of its own.
    assert!(!outputs[0].exists(), "rank 1 made {:?}", outputs[0]);
    assert!(
        outputs[1].is_dir(),
        "over the wire, rank 1 writes a scratch file first"
    );
    let own = dir.path().join("own");
    std::fs::create_dir(&own).expect("mkdir");
    for (rank, file) in files.iter().enumerate() {
        let want = state_file(&stepped(rank), &own, file);
        let got = std::fs::read(shared.join(file)).expect("shared");
        assert!(
            got == want,
            "rank {rank}'s shard written in place is not its state"
        );
        let got = std::fs::read(wire.join(file)).expect("wire");
        assert!(
            got == want,
            "rank {rank}'s shard over the wire is not its state"
        );
    }
    assert!(
        std::fs::read(shared.join(&files[0])).ok() != std::fs::read(shared.join(&files[1])).ok(),
        "the two ranks' states must differ for the check to tell them apart"
    );
}

/// Before the parameters are gathered for a weights file the ranks write together, every
/// rank learns the writers: rank 0 and the ranks that see the offered directory (rank 1 does
/// when it is there, not when the offer names a directory it cannot see), and a writer learns
/// where it is.
#[test]
fn the_writers_of_the_weights_file_are_rank_0_and_the_ranks_that_see_it() {
    for shared in [true, false] {
        let dir = tempfile::tempdir().expect("tmp");
        let comms = world(2);
        let (c0, c1) = (comms[0].clone(), comms[1].clone());
        let rank1 = thread::spawn(move || Offered::receive(&*c1));
        let offered = if shared {
            offer(&*c0, dir.path()).expect("offer")
        } else {
            // A directory rank 1 cannot see: another host's.
            let marker = tempfile::Builder::new()
                .prefix(".shared-")
                .tempfile_in(dir.path())
                .expect("marker");
            c0.send(1, ASK_TAG, b"/nonexistent/checkpoint\n.shared-x")
                .expect("offer");
            Offer {
                marker,
                tmp: dir.path().to_path_buf(),
                peers: vec![1],
            }
        };
        let writers = offered.writers(&*c0).expect("writers");
        let seen = rank1.join().expect("rank 1").expect("the offer");
        let want = if shared { vec![0, 1] } else { vec![0] };
        assert_eq!(writers, want, "shared: {shared}");
        assert_eq!(seen.writers, want, "rank 1's view, shared: {shared}");
        assert_eq!(seen.dir.as_deref(), shared.then_some(dir.path()));
    }
}
