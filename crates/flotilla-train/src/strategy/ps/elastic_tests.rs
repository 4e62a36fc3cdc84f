//! An elastic flat server's workers (`shard_server/elastic.rs`), on the production
//! [`ShardServer`] over an in-memory group: a sync round whose worker is lost closes with the
//! others' pushes (their sample-weighted mean, a serial formula here), the rounds after wait
//! for the remaining workers only, a silent worker is left out at the deadline and its pushes
//! refused for good, a replacement is taken into the round under way, and below the minimum
//! the server stops naming the workers left out; a round nobody pushed waits once more.

use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_cluster::Aggregation;
use flotilla_tcp::{CommError, ProcessGroup};

use super::formula_kit::{N, Server, answer, flat, push};
use super::serve::ServerMachine;
use super::shard_server::ShardServer;
use crate::testkit::{config, sgd, world};
use flotilla_ps::{PsMessage, TAG};

const LR: f64 = 0.5;
const WAIT: Duration = Duration::from_millis(500);

/// The sync server (rank 0) of an elastic flat job of two workers, ranks 1 and 2, that
/// trains on with `min` ranks (itself included).
fn server(comm: Arc<dyn ProcessGroup>, min: usize) -> Server<ShardServer> {
    let mut c = config(sgd(LR, 0.0));
    c.topology.staleness_lr = Some(false);
    flat(&mut c.topology, Aggregation::Sync, 1);
    c.topology.world_size = 3;
    c.topology.min_world_size = Some(min);
    let topology = c.topology().expect("topology");
    Server::updating(comm, &c, &topology)
}

/// `len` copies of `value`.
fn all(value: f32) -> Vec<f32> {
    vec![value; N]
}

/// `p - LR * g` for a push of `g` everywhere.
fn stepped(p: &[f32], g: f32) -> Vec<f32> {
    p.iter().map(|v| v - (LR as f32) * g).collect()
}

/// The next message from the server, or `None` within a short wait.
fn next(me: &Arc<dyn ProcessGroup>) -> Option<PsMessage> {
    match me.recv(0, TAG, Instant::now() + Duration::from_millis(150)) {
        Ok(b) => Some(PsMessage::decode(&b, 0).expect("decodes")),
        Err(CommError::Deadline { .. }) => None,
        Err(e) => panic!("{e}"),
    }
}

/// Round 1 of [`server`] (at least 2 ranks): rank 1 pushes 1.0 of 2 samples, rank 2 is
/// silent past the deadline and left out. Ranks 1 and 2, the server, its first parameters.
fn rank_2_left_out_in_round_1() -> (Link, Link, Server<ShardServer>, Vec<f32>) {
    let mut w = world(3);
    let (w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
    let mut s = server(w.pop().expect("server"), 2);
    let p0 = s.params();
    w1.send(0, TAG, &push(0, 2, &all(1.0))).expect("send");
    s.step();
    s.try_step(WAIT)
        .expect("a silent worker is left out, not an error");
    (w1, w2, s, p0)
}

/// A worker's end of the in-memory group.
type Link = Arc<dyn ProcessGroup>;

#[test]
fn a_sync_round_closes_without_a_lost_worker_and_takes_its_replacement_back() {
    // Round 1 closes on rank 1's push alone.
    let (w1, w2, mut s, p0) = rank_2_left_out_in_round_1();
    let p1 = stepped(&p0, 1.0);
    assert_eq!((s.machine.version(), s.params()), (1, p1.clone()));
    assert_eq!(answer(&*w1, 0), (1, p1.clone()));
    assert!(next(&w2).is_none(), "a worker left out is not answered");

    // It wakes up and pushes: refused for good.
    w2.send(0, TAG, &push(0, 1, &all(5.0))).expect("send");
    s.step();
    match next(&w2) {
        Some(PsMessage::Reject { reason, retry }) => {
            assert!(reason.contains("left out") && !retry, "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // Round 2: rank 1 alone.
    w1.send(0, TAG, &push(1, 1, &all(-1.0))).expect("send");
    s.step();
    let p2 = stepped(&p1, -1.0);
    assert_eq!((s.machine.version(), s.params()), (2, p2.clone()));
    assert_eq!(answer(&*w1, 0).0, 2);

    // Rank 2's replacement: taken into round 3, which waits for it.
    ServerMachine::on_back(&mut s.machine, &mut s.rank.cx(), 2).expect("back");
    w1.send(0, TAG, &push(2, 1, &all(1.0))).expect("send");
    s.step();
    assert_eq!(s.machine.version(), 2, "round 3 waits for the replacement");
    w2.send(0, TAG, &push(2, 3, &all(-1.0))).expect("send");
    s.step();
    // (1 * 1 + 3 * -1) / 4 = -0.5.
    let p3 = stepped(&p2, -0.5);
    assert_eq!((s.machine.version(), s.params()), (3, p3.clone()));
    assert_eq!(answer(&*w1, 0), (3, p3.clone()));
    assert_eq!(answer(&*w2, 0), (3, p3));
}

#[test]
fn a_lost_worker_closes_the_round_and_below_the_minimum_the_server_stops() {
    let mut w = world(3);
    let (w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
    let mut s = server(w.pop().expect("server"), 2);
    let p0 = s.params();
    w1.send(0, TAG, &push(0, 1, &all(2.0))).expect("send");
    s.step();
    drop(w2);
    s.try_step(WAIT).expect("a lost worker is left out");
    let p1 = stepped(&p0, 2.0);
    assert_eq!((s.machine.version(), s.params()), (1, p1));
    assert_eq!(answer(&*w1, 0).0, 1);
    drop(w1);
    let e = s.try_step(WAIT).expect_err("below the minimum").to_string();
    assert!(
        e.contains("down to 0 worker(s), fewer than its minimum of 1")
            && e.contains("rank(s) 1, 2"),
        "{e}"
    );

    // Minimum 3 (every worker): the first loss stops it.
    let mut w = world(3);
    let (w2, _w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
    let mut s = server(w.pop().expect("server"), 3);
    drop(w2);
    let e = s.try_step(WAIT).expect_err("below the minimum").to_string();
    assert!(e.contains("fewer than its minimum of 2"), "{e}");
}

/// A deadline with no worker's push in the round blames nobody the first time (with shard
/// servers a worker may be waiting for another shard's answer: a worker frozen between its
/// pushes to two shards leaves their rounds one apart); the next deadline leaves out the
/// workers still silent, and the round closes with the others' pushes.
#[test]
fn a_round_nobody_pushed_waits_once_more_before_it_leaves_anyone_out() {
    let mut w = world(3);
    let (_w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
    let mut s = server(w.pop().expect("server"), 2);
    let p0 = s.params();
    s.try_step(WAIT)
        .expect("nobody pushed: the server waits once more");
    assert_eq!(s.machine.version(), 0);
    // Rank 1's push comes (it was waiting for another server); rank 2 stays silent.
    w1.send(0, TAG, &push(0, 2, &all(1.0))).expect("send");
    s.step();
    s.try_step(WAIT).expect("the silent worker is left out");
    assert_eq!((s.machine.version(), s.params()), (1, stepped(&p0, 1.0)));
    assert_eq!(answer(&*w1, 0).0, 1);
}

/// A replacement that a shard took back a round behind the others closes that round with a
/// push of no samples (`worker.rs::Worker::align`): the round closes at once, on the other
/// worker's gradient alone (a push of no samples weighs nothing in the mean), and both are
/// answered with the next version. Broken (the push counted as a worker's, or waited on
/// again): the parameters or the version differ.
#[test]
fn a_push_of_no_samples_closes_a_replacements_round_and_weighs_nothing() {
    let (w1, w2, mut s, p0) = rank_2_left_out_in_round_1();
    let p1 = stepped(&p0, 1.0);
    assert_eq!(answer(&*w1, 0), (1, p1.clone()));
    // Its replacement, taken into round 2, pushes nothing there.
    ServerMachine::on_back(&mut s.machine, &mut s.rank.cx(), 2).expect("back");
    w1.send(0, TAG, &push(1, 2, &all(3.0))).expect("send");
    s.step();
    assert_eq!(s.machine.version(), 1, "round 2 waits for the replacement");
    w2.send(0, TAG, &push(1, 0, &all(0.0))).expect("send");
    s.step();
    let p2 = stepped(&p1, 3.0);
    assert_eq!((s.machine.version(), s.params()), (2, p2.clone()));
    assert_eq!(answer(&*w1, 0), (2, p2.clone()));
    assert_eq!(answer(&*w2, 0), (2, p2));
}
