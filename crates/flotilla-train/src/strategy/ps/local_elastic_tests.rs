//! An elastic hierarchical job's workers (`members.rs`), on the production [`LocalServer`]
//! and [`ShardServer`] over an in-memory group: a sync local server leaves a silent or lost
//! worker out, tells its parent who is out and pushes the round up with the others' pushes
//! (their sample-weighted mean, a serial formula here); it refuses the left-out worker's
//! pushes and pulls for good, takes a replacement into the round under way (or, after the
//! round went up, into the next one, whose parameters answer its pull); a local server whose
//! every worker is out ends the run naming them; and the root stops the job, naming the
//! workers left out across groups, below the job's minimum.

use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_cluster::Aggregation;
use flotilla_tcp::{CommError, ProcessGroup};

use super::formula_kit::{N, Server, hierarchical, push, weighted_mean};
use super::local::LocalServer;
use super::serve::ServerMachine;
use crate::config::TrainConfig;
use crate::testkit::{config, sgd, world};
use flotilla_ps::{PsMessage, TAG};

const WAIT: Duration = Duration::from_millis(500);

/// A sync global server over two sync local servers of two workers each (7 ranks), elastic
/// down to `min` ranks.
fn job(min: usize) -> TrainConfig {
    let mut c = config(sgd(0.5, 0.0));
    c.topology.staleness_lr = Some(false);
    hierarchical(&mut c.topology, Aggregation::Sync, Aggregation::Sync);
    c.topology.world_size = 7;
    c.topology.min_world_size = Some(min);
    c
}

/// The next message from `from` at `me`, or `None` within a short wait.
fn next(me: &Arc<dyn ProcessGroup>, from: usize) -> Option<PsMessage> {
    match me.recv(from, TAG, Instant::now() + Duration::from_millis(150)) {
        Ok(b) => Some(PsMessage::decode(&b, from).expect("decodes")),
        Err(CommError::Deadline { .. }) => None,
        Err(e) => panic!("{e}"),
    }
}

/// `N` copies of `value`.
fn all(value: f32) -> Vec<f32> {
    vec![value; N]
}

/// The parent's end, local server 1 (of workers 2 and 3, whose ends follow) in `job(6)`,
/// after the parent sent it version 4.
fn started() -> (Link, Server<LocalServer>, Link, Link) {
    let mut w = world(4);
    let (w3, w2) = (w.pop().expect("w3"), w.pop().expect("w2"));
    let c = job(6);
    let topology = c.topology().expect("topology");
    assert_eq!(topology.role(1).expect("local").children, vec![2, 3]);
    let mut s = Server::local(w.pop().expect("local"), &c, &topology);
    let parent = w.pop().expect("parent");
    assert_eq!(next(&parent, 1), Some(PsMessage::Pull));
    parent
        .send(1, TAG, &flotilla_ps::encode_params(4, &all(0.5)))
        .expect("send");
    s.step();
    (parent, s, w2, w3)
}

/// A rank's end of the in-memory group.
type Link = Arc<dyn ProcessGroup>;

/// The push up the parent received next: its version, samples and values.
fn pushed_up(parent: &Link) -> (u64, u32, Vec<f32>) {
    match next(parent, 1) {
        Some(PsMessage::Push {
            version,
            samples,
            values,
            ..
        }) => (version, samples, values),
        other => panic!("expected a push up, got {other:?}"),
    }
}

/// Whether `me`'s next message from the local server is a refusal for good.
fn refused_for_good(me: &Link) -> bool {
    matches!(next(me, 1), Some(PsMessage::Reject { reason, retry: false }) if reason.contains("left out"))
}

#[test]
fn a_silent_worker_is_left_out_refused_for_good_and_its_replacement_taken_back() {
    let (parent, mut s, w2, w3) = started();
    w2.send(1, TAG, &push(4, 2, &all(1.0))).expect("send");
    s.step();
    assert!(next(&parent, 1).is_none(), "the round waits for rank 3");
    // Rank 3 is silent past the deadline: left out, the parent told, the round pushed up
    // with rank 2's push alone.
    s.try_step(WAIT).expect("a silent worker is left out");
    assert_eq!(
        next(&parent, 1),
        Some(PsMessage::Members { left_out: vec![3] })
    );
    assert_eq!(pushed_up(&parent), (4, 2, all(1.0)));
    // It wakes up: its push and its pull are refused for good.
    w3.send(1, TAG, &push(4, 1, &all(5.0))).expect("send");
    s.step();
    assert!(refused_for_good(&w3));
    w3.send(1, TAG, &PsMessage::Pull.encode()).expect("send");
    s.step();
    assert!(refused_for_good(&w3));
    // The parent's reply starts the next round, for rank 2 only.
    parent
        .send(1, TAG, &flotilla_ps::encode_params(5, &all(0.25)))
        .expect("send");
    s.step();
    assert!(matches!(
        next(&w2, 1),
        Some(PsMessage::Params { version: 5, .. })
    ));
    assert!(next(&w3, 1).is_none(), "a worker left out is not answered");
    // Rank 3's replacement: taken into the round under way, the parent told.
    ServerMachine::on_back(&mut s.machine, &mut s.rank.cx(), 3).expect("back");
    assert_eq!(
        next(&parent, 1),
        Some(PsMessage::Members { left_out: vec![] })
    );
    w2.send(1, TAG, &push(5, 1, &all(3.0))).expect("send");
    s.step();
    assert!(
        next(&parent, 1).is_none(),
        "the round waits for the replacement"
    );
    w3.send(1, TAG, &PsMessage::Pull.encode()).expect("send");
    s.step();
    assert!(matches!(
        next(&w3, 1),
        Some(PsMessage::Params { version: 5, .. })
    ));
    w3.send(1, TAG, &push(5, 3, &all(-1.0))).expect("send");
    s.step();
    let (version, samples, values) = pushed_up(&parent);
    assert_eq!((version, samples), (5, 4));
    assert_eq!(values, weighted_mean(&[(1, all(3.0)), (3, all(-1.0))]));
}

#[test]
fn a_replacement_after_the_round_went_up_is_answered_by_the_next_rounds_parameters() {
    let (parent, mut s, w2, w3) = started();
    w2.send(1, TAG, &push(4, 2, &all(1.0))).expect("send");
    s.step();
    s.try_step(WAIT).expect("a silent worker is left out");
    assert!(matches!(next(&parent, 1), Some(PsMessage::Members { .. })));
    assert_eq!(pushed_up(&parent).0, 4);
    // Its replacement comes while the round is up: its pull waits for the next round's
    // parameters (an answer now would be version 4, which the round just replaced).
    ServerMachine::on_back(&mut s.machine, &mut s.rank.cx(), 3).expect("back");
    assert_eq!(
        next(&parent, 1),
        Some(PsMessage::Members { left_out: vec![] })
    );
    w3.send(1, TAG, &PsMessage::Pull.encode()).expect("send");
    s.step();
    assert!(next(&w3, 1).is_none(), "no answer while the round is up");
    parent
        .send(1, TAG, &flotilla_ps::encode_params(5, &all(0.25)))
        .expect("send");
    s.step();
    for w in [&w2, &w3] {
        assert!(matches!(
            next(w, 1),
            Some(PsMessage::Params { version: 5, .. })
        ));
        assert!(next(w, 1).is_none(), "one answer each");
    }
    // Round 5 waits for both.
    w2.send(1, TAG, &push(5, 1, &all(3.0))).expect("send");
    s.step();
    assert!(next(&parent, 1).is_none(), "round 5 waits for rank 3");
    w3.send(1, TAG, &push(5, 1, &all(1.0))).expect("send");
    s.step();
    assert_eq!(pushed_up(&parent), (5, 2, all(2.0)));
}

#[test]
fn a_lost_worker_closes_the_round_and_a_local_server_with_none_left_ends_the_run() {
    let (parent, mut s, w2, w3) = started();
    w3.send(1, TAG, &push(4, 3, &all(2.0))).expect("send");
    s.step();
    // Rank 3 pushed, then was lost: its push counts, and the round waits for rank 2 alone.
    drop(w3);
    s.try_step(WAIT).expect("a lost worker is left out");
    assert_eq!(
        next(&parent, 1),
        Some(PsMessage::Members { left_out: vec![3] })
    );
    assert!(next(&parent, 1).is_none(), "the round waits for rank 2");
    w2.send(1, TAG, &push(4, 1, &all(-2.0))).expect("send");
    s.step();
    let (version, samples, values) = pushed_up(&parent);
    assert_eq!((version, samples), (4, 4));
    assert_eq!(values, weighted_mean(&[(3, all(2.0)), (1, all(-2.0))]));
    drop(w2);
    let e = s.try_step(WAIT).expect_err("none left").to_string();
    assert!(
        e.contains(
            "every worker of this local server is left out (rank(s) 2, 3): it trains with one \
             at least"
        ),
        "{e}"
    );
}

#[test]
fn the_root_stops_the_job_below_its_minimum_across_groups_naming_the_workers_out() {
    let c = job(6);
    let topology = c.topology().expect("topology");
    let locals = topology.role(0).expect("root").children.clone();
    let groups: Vec<Vec<usize>> = locals
        .iter()
        .map(|&l| topology.role(l).expect("local").children.clone())
        .collect();
    let mut w = world(7);
    let mut s = Server::updating(w.remove(0), &c, &topology);
    let link = |rank: usize| w[rank - 1].clone();
    // One worker out of 4 (minimum 3: 6 ranks less 3 servers): the job goes on, and a
    // replacement's report brings it back.
    let first = |l: usize, out: Vec<u32>| {
        link(l)
            .send(0, TAG, &PsMessage::Members { left_out: out }.encode())
            .expect("send")
    };
    first(locals[0], vec![groups[0][0] as u32]);
    s.step();
    first(locals[0], vec![]);
    s.step();
    first(locals[1], vec![groups[1][1] as u32]);
    s.step();
    // A second worker out, in the other group: 2 of 4 left.
    first(locals[0], vec![groups[0][1] as u32]);
    let e = s.try_step(WAIT).expect_err("below the minimum").to_string();
    assert!(
        e.contains("down to 2 worker(s), fewer than its minimum of 3")
            && e.contains(&format!("rank(s) {}, {}", groups[0][1], groups[1][1])),
        "{e}"
    );
}
