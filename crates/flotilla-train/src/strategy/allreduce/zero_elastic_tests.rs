//! ZeRO in an elastic job (`zero/elastic.rs`): in-memory ranks of the production
//! [`SyncAllReduce`] train 3 ranks sharded, lose one (its shard's state is on the rank
//! before it), train on 2, take a fresh process in (which holds nothing) and train on 3. The
//! optimizer state re-cut among the members at each change must be the state itself: every
//! member ends bit for bit as zero 0 run through the same worlds from checkpoints (ZeRO on
//! the ring is bitwise zero 0). Also the choice of holders: a shard whose owner left comes
//! from its spare, a step that finished nowhere is taken back, one that finished somewhere
//! is kept, and two neighbours lost together name the shard that is gone. Every member holds
//! its own shard and a spare: the job's ranks hold each value's state twice (their
//! `optimizer_state_bytes` sum to twice a fixed-size run's). A rank lost in a
//! step after its optimizer update and before its all-gather (every member's update of that
//! step done, none finished): the members take it back and redo it among themselves.

use std::sync::Arc;
use std::thread;

use flotilla_engine::OptimizerSpec;
use flotilla_tcp::ProcessGroup;

use super::SyncAllReduce;
use super::zero::elastic::{Cut, Header, Holding, choose};
use super::zero_tests::{STEPS, optimizers, rank, ring_config, run};
use crate::strategy::{Resume, Strategy};
use crate::testkit::{Rank, assert_bitwise, batches, params, world_with};

/// Steps on 3 ranks, then on 2 up to `K2`, then on 3 again.
const K1: u64 = 4;
const K2: u64 = 8;

/// Trains `peer` steps `span` on its group's shard of the data.
fn train(peer: &mut SyncAllReduce, rank: &mut Rank, span: (u64, u64)) {
    let data = crate::testkit::dataset(96);
    let mut shard = batches(&data, rank.comm.size(), rank.comm.rank());
    for _ in 0..span.0 {
        shard.next_batch().expect("skip a batch");
    }
    for done in span.0..span.1 {
        peer.step(&mut rank.cx(), &mut shard, done).expect("step");
    }
}

/// Moves a member to the group `comm` (the run's regroup) and starts it there.
fn regroup(peer: &mut SyncAllReduce, rank: &mut Rank, comm: Arc<dyn ProcessGroup>) {
    rank.config.topology.world_size = comm.size();
    rank.comm = comm;
    peer.regroup(&mut rank.cx()).expect("regroup");
    peer.start(&mut rank.cx()).expect("start");
}

/// The groups one process is in, generation by generation (`None`: not a member).
type Groups = [Option<Arc<dyn ProcessGroup>>; 3];

/// The processes' groups: the generations are worlds of their own (as the launcher's are):
/// processes 0, 1, 2; then 0, 2; then 0, 2 and a new process 3.
fn generations() -> Vec<Groups> {
    let ring = |n| world_with(n, ring_config(n));
    let (mut a, mut b, mut c) = (
        ring(3).into_iter(),
        ring(2).into_iter(),
        ring(3).into_iter(),
    );
    vec![
        [a.next(), b.next(), c.next()],
        [a.next(), None, None],
        [a.next(), b.next(), c.next()],
        [None, None, c.next()],
    ]
}

/// What a process ends with: its parameters and the optimizer state it holds in bytes.
type Ended = (Vec<f32>, f64);

/// `peer`'s parameters and `optimizer_state_bytes`.
fn ended(peer: &mut SyncAllReduce, r: &mut Rank) -> Ended {
    let bytes = peer
        .figures(&r.cx())
        .into_iter()
        .find(|f| f.0 == "optimizer_state_bytes");
    (params(peer), bytes.expect("optimizer_state_bytes").1)
}

/// Process `p` through the script: processes 0, 1, 2 train to `K1`; 1 is lost (with
/// `mid_step`: in step `K1`, after its optimizer update and before its all-gather, so that
/// the others' step fails after their updates too); 0 and 2 train (again) from `K1` to `K2`;
/// process 3 joins; 0, 2, 3 train to [`STEPS`]. Its parameters at the end.
fn member(p: usize, groups: Groups, opt: OptimizerSpec, (zero, mid_step): (u8, bool)) -> Ended {
    let [first, second, third] = groups;
    let elastic = |comm: Arc<dyn ProcessGroup>| {
        let mut r = rank(comm, &opt, zero);
        r.config.topology.min_world_size = Some(2);
        r
    };
    let build = |r: &mut Rank| {
        let topology = r.config.topology().expect("topology");
        r.build(&topology, SyncAllReduce::build)
    };
    let third = || third.expect("every process but the lost one trains in the third");
    if p == 3 {
        let mut r = elastic(third());
        let mut peer = build(&mut r);
        peer.start(&mut r.cx()).expect("a joiner's start");
        train(&mut peer, &mut r, (K2, STEPS));
        return ended(&mut peer, &mut r);
    }
    let mut r = elastic(first.expect("a first generation's member"));
    let mut peer = build(&mut r);
    let resume = Resume::find(&mut r.cx(), 7, false).expect("find");
    assert!(
        peer.restore(&mut r.cx(), &resume)
            .expect("restore")
            .is_none()
    );
    peer.start(&mut r.cx()).expect("start");
    train(&mut peer, &mut r, (0, K1));
    if mid_step {
        if p == 1 {
            peer.zero_mut().expect("zero").fail_before_gather = true;
        }
        let data = crate::testkit::dataset(96);
        let mut shard = batches(&data, 3, p);
        for _ in 0..K1 {
            shard.next_batch().expect("skip a batch");
        }
        let failed = peer.step(&mut r.cx(), &mut shard, K1);
        assert!(
            failed.is_err(),
            "step {K1} of process {p} lost with process 1"
        );
    }
    let Some(second) = second else {
        return (Vec::new(), 0.0);
    };
    regroup(&mut peer, &mut r, second);
    train(&mut peer, &mut r, (K1, K2));
    regroup(&mut peer, &mut r, third());
    train(&mut peer, &mut r, (K2, STEPS));
    ended(&mut peer, &mut r)
}

#[test]
fn a_zero_run_that_loses_a_rank_and_takes_one_in_trains_as_zero_0_through_checkpoints() {
    for opt in optimizers().iter().take(2) {
        let tmp = tempfile::tempdir().expect("tmp");
        run(3, opt, 0, (0, K1), tmp.path(), true);
        run(2, opt, 0, (K1, K2), tmp.path(), true);
        let want = run(3, opt, 0, (K2, STEPS), tmp.path(), false).remove(0).0;
        // A fixed-size ZeRO run's shards hold each value's state once.
        let once: f64 = run(3, opt, 1, (K2, STEPS), tmp.path(), false)
            .iter()
            .map(|o| o.2["optimizer_state_bytes"])
            .sum();
        for (zero, mid_step) in [(1, false), (2, false), (1, true), (2, true)] {
            let handles: Vec<_> = generations()
                .into_iter()
                .enumerate()
                .map(|(p, groups)| {
                    let opt = opt.clone();
                    thread::spawn(move || member(p, groups, opt, (zero, mid_step)))
                })
                .collect();
            let mut held = 0.0;
            for (p, h) in handles.into_iter().enumerate() {
                let (got, bytes) = h.join().expect("process thread");
                held += bytes;
                if p != 1 {
                    let what =
                        format!("{opt:?}, zero {zero}, lost mid-step {mid_step}, process {p}");
                    assert_bitwise(&got, &want, &what);
                }
            }
            // Own shard and spare: every value's state twice, 2/N of it per rank.
            assert_eq!(held, 2.0 * once, "{opt:?}, zero {zero}: state held");
        }
    }
}

fn holding(world: usize, index: usize, steps: u64, undoable: bool) -> Holding {
    Holding {
        cut: Cut { world, index },
        steps,
        undoable,
    }
}

/// Members of a 3-rank cut at `steps`, each holding its shard and its successor's; the
/// step not finished where `!finished`.
fn members(steps: u64, finished: [bool; 3], alive: &[usize]) -> Vec<Header> {
    alive
        .iter()
        .map(|&r| Header {
            finished: steps - u64::from(!finished[r]),
            holdings: vec![
                holding(3, r, steps, !finished[r]),
                holding(3, (r + 1) % 3, steps, !finished[r]),
            ],
        })
        .collect()
}

#[test]
fn each_shard_comes_from_a_member_holding_it_at_the_generations_step() {
    // Rank 1 lost: shard 1 from its spare on rank 0 (member 0), the rest from their owners.
    let c = choose(&members(5, [true; 3], &[0, 2])).expect("a cover");
    assert_eq!((c.step, c.world), (5, 3));
    assert_eq!(c.holders, vec![(0, 0), (0, 1), (1, 0)]);
    // Step 6 finished on rank 2 only: rank 0's unfinished shards hold it too, and are taken.
    let c = choose(&members(6, [false, true, true], &[0, 2])).expect("a cover");
    assert_eq!(c.step, 6);
    assert_eq!(c.holders, vec![(0, 0), (0, 1), (1, 0)]);
    // Step 6 finished nowhere: every shard taken back to step 5.
    let c = choose(&members(6, [false; 3], &[0, 2])).expect("a cover");
    assert_eq!(c.step, 5);
    // A joiner's fresh shard of the new cut at step 0 covers nothing at step 5.
    let mut with_joiner = members(5, [true; 3], &[0, 2]);
    with_joiner.push(Header {
        finished: 0,
        holdings: vec![holding(3, 2, 0, false)],
    });
    assert_eq!(choose(&with_joiner).expect("a cover").world, 3);
}

#[test]
fn two_neighbours_lost_together_name_the_shard_that_is_gone() {
    let e = choose(&members(5, [true; 3], &[2])).expect_err("shard 1 is gone");
    let text = e.to_string();
    assert!(
        text.contains("shard(s) 1 of the 3-rank cut at step 5"),
        "{text}"
    );
    assert!(text.contains("restart from its checkpoint"), "{text}");
}

#[test]
fn a_header_goes_over_the_wire_and_a_malformed_one_is_refused() {
    let h = members(9, [false, true, true], &[0]).remove(0);
    assert_eq!(Header::decode(&h.encode()), Some(h.clone()));
    let bytes = h.encode();
    assert_eq!(Header::decode(&bytes[..bytes.len() - 8]), None);
    assert_eq!(Header::decode(&bytes[..5]), None);
    let mut bad = bytes.clone();
    bad[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_eq!(
        Header::decode(&bad),
        None,
        "a holding count beyond the bytes"
    );
    let mut bad = bytes;
    bad[24..32].copy_from_slice(&7u64.to_le_bytes());
    assert_eq!(Header::decode(&bad), None, "an index beyond its cut");
}
