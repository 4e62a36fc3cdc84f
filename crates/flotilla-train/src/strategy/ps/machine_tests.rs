//! The parameter-server state machines on an in-memory process group: each test is one
//! process whose threads-free "ranks" are in-memory communicators; pushes and replies go
//! through the group, and the machine under test is driven one event at a time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_cluster::Aggregation;
use flotilla_tcp::{CommError, ProcessGroup};

use super::formula_kit::{N, Server, flat, hierarchical};
use super::serve::ServerMachine;
use super::shard_server::ShardServer;
use crate::config::{TopologySection, TrainConfig};
use crate::testkit::{config, sgd, world};
use flotilla_ps::{PsMessage, TAG};

const LR: f64 = 0.5;
/// How long a step waits for its event.
const WAIT: Duration = Duration::from_millis(500);

/// A job of the topology keys `set`, with SGD at the constant rate [`LR`], no momentum and
/// no staleness scaling.
fn job(set: impl FnOnce(&mut TopologySection)) -> TrainConfig {
    let mut c = config(sgd(LR, 0.0));
    c.topology.staleness_lr = Some(false);
    set(&mut c.topology);
    c
}

/// A worker's push of `len` copies of `value` (see [`super::formula_kit::push`]).
fn push(version: u64, samples: u32, value: f32, len: usize) -> Vec<u8> {
    super::formula_kit::push(version, samples, &vec![value; len])
}

/// Receives the next message from `from` at `me`, or `None` within a short wait.
fn next(me: &Arc<dyn ProcessGroup>, from: usize) -> Option<PsMessage> {
    match me.recv(from, TAG, Instant::now() + Duration::from_millis(150)) {
        Ok(b) => Some(PsMessage::decode(&b, from).expect("decodes")),
        Err(CommError::Deadline { .. }) => None,
        Err(e) => panic!("{e}"),
    }
}

/// The server of a flat job of two workers (ranks 1 and 2), sync or async (then with
/// `max_staleness`).
fn root(
    comm: Arc<dyn ProcessGroup>,
    sync: bool,
    max_staleness: Option<u64>,
) -> Server<ShardServer> {
    let aggr = if sync {
        Aggregation::Sync
    } else {
        Aggregation::Async
    };
    let config = job(|t| {
        flat(t, aggr, 1);
        t.max_staleness = max_staleness;
    });
    let topology = config.topology().expect("topology");
    Server::updating(comm, &config, &topology)
}

#[test]
fn a_sync_round_waits_for_every_child_and_applies_the_sample_weighted_mean() {
    let mut w = world(3);
    let (w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
    let mut s = root(w.pop().expect("server"), true, None);
    let p0 = s.params();

    w1.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    s.try_step(WAIT).expect("first push");
    assert_eq!(s.machine.version(), 0, "one push of two is not a round");
    assert!(
        next(&w1, 0).is_none(),
        "nobody is answered before the round is complete"
    );

    w2.send(0, TAG, &push(0, 3, -1.0, N)).expect("send");
    s.try_step(WAIT).expect("second push");
    assert_eq!(s.machine.version(), 1);
    // Mean (1*1 + 3*(-1)) / 4 = -0.5; SGD: p - lr * mean = p + 0.25.
    let want: Vec<f32> = p0.iter().map(|p| p + 0.25).collect();
    assert_eq!(s.params(), want);
    for w in [&w1, &w2] {
        match next(w, 0) {
            Some(PsMessage::Params { version: 1, values }) => assert_eq!(values, want),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn stale_duplicate_malformed_and_wrong_length_pushes_change_nothing() {
    let mut w = world(3);
    let (w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
    let mut s = root(w.pop().expect("server"), true, None);
    let p0 = s.params();
    // Whether the worker may retry: only when a later push can be taken.
    let rejected = |w: &Arc<dyn ProcessGroup>, what: &str, may: bool| match next(w, 0) {
        Some(PsMessage::Reject { reason, retry }) => {
            assert!(
                reason.contains(what) && retry == may,
                "{reason} (retry {retry})"
            )
        }
        other => panic!("expected a reject about {what:?}, got {other:?}"),
    };

    w1.send(0, TAG, &push(5, 1, 1.0, N)).expect("send");
    s.try_step(WAIT).expect("future version");
    rejected(&w1, "version 5", false);
    w1.send(0, TAG, &push(0, 1, 1.0, N - 1)).expect("send");
    s.try_step(WAIT).expect("wrong length");
    rejected(&w1, &format!("{} values", N - 1), false);
    w1.send(0, TAG, &[PsMessage::Pull.encode(), vec![1, 2, 3]].concat())
        .expect("send");
    s.try_step(WAIT).expect("malformed");
    rejected(&w1, "trailing bytes", false);
    w1.send(0, TAG, &push(0, 1, f32::NAN, N)).expect("send");
    s.try_step(WAIT).expect("nan");
    rejected(&w1, "non-finite", true);
    assert_eq!(
        (s.machine.version(), s.params()),
        (0, p0.clone()),
        "nothing changed"
    );

    // An admitted push, then the same child again in the same round.
    w1.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    s.try_step(WAIT).expect("push");
    w1.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    s.try_step(WAIT).expect("second push");
    rejected(&w1, "second push", true);
    // The round completes with w2, on w1's first push only: mean (1 + 3) / 2 = 2.
    w2.send(0, TAG, &push(0, 1, 3.0, N)).expect("send");
    s.try_step(WAIT).expect("round");
    let want: Vec<f32> = p0.iter().map(|p| p - 1.0).collect();
    assert_eq!((s.machine.version(), s.params()), (1, want));
    // A push computed on version 0 is now stale in sync mode.
    let _ = (next(&w1, 0), next(&w2, 0));
    w2.send(0, TAG, &push(0, 1, 3.0, N)).expect("send");
    s.try_step(WAIT).expect("stale");
    rejected(&w2, "version 0", true);
    assert_eq!(s.machine.version(), 1);
}

#[test]
fn a_sync_server_names_a_lost_child_and_the_silent_ones_at_its_deadline() {
    let mut w = world(3);
    let (w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
    let mut s = root(w.pop().expect("server"), true, None);
    w1.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    s.try_step(WAIT).expect("push");
    // Rank 2 is silent: the deadline names it (and not rank 1, which pushed).
    let e = s.try_step(WAIT).expect_err("deadline").to_string();
    assert!(e.contains("rank(s) 2") && !e.contains("1, 2"), "{e}");
    drop(w2);
    let e = s.try_step(WAIT).expect_err("lost").to_string();
    assert!(e.contains("rank 2 lost during sync round 0"), "{e}");
    drop(w1);
}

#[test]
fn an_async_server_applies_each_push_answers_its_sender_and_survives_a_lost_child() {
    let mut w = world(3);
    let (w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
    let mut s = root(w.pop().expect("server"), false, Some(1));
    let p0 = s.params();

    w1.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    s.try_step(WAIT).expect("push");
    assert_eq!(s.machine.version(), 1, "applied on arrival");
    assert!(matches!(
        next(&w1, 0),
        Some(PsMessage::Params { version: 1, .. })
    ));
    assert!(next(&w2, 0).is_none(), "only the sender is answered");
    // One version stale is within max_staleness 1.
    w2.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    s.try_step(WAIT).expect("stale by one");
    assert_eq!(s.machine.version(), 2);
    let _ = next(&w2, 0);
    let want: Vec<f32> = p0.iter().map(|p| p - 0.5 - 0.5).collect();
    assert_eq!(s.params(), want);
    // Two versions stale is not.
    w2.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    s.try_step(WAIT).expect("too stale");
    match next(&w2, 0) {
        Some(PsMessage::Reject { reason, retry }) => {
            assert!(reason.contains("max_staleness 1") && retry, "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.machine.version(), 2);

    drop(w1);
    s.try_step(WAIT)
        .expect("a lost child is not an error when async");
    assert_eq!(
        s.machine.active().iter().copied().collect::<Vec<_>>(),
        vec![2]
    );
    w2.send(0, TAG, &push(2, 1, 1.0, N)).expect("send");
    s.try_step(WAIT).expect("the other child goes on");
    assert_eq!(s.machine.version(), 3);
    drop(w2);
    let e = s.try_step(WAIT).expect_err("all lost").to_string();
    assert!(e.contains("every child"), "{e}");
}

#[test]
fn a_sync_local_server_pushes_the_mean_up_and_forwards_the_reply() {
    // Rank 0 plays the parent, 1 is the local server, 2 and 3 its workers.
    let mut w = world(4);
    let (w3, w2) = (w.pop().expect("w3"), w.pop().expect("w2"));
    let config = job(|t| hierarchical(t, Aggregation::Sync, Aggregation::Sync));
    let topology = config.topology().expect("topology");
    let mut s = Server::local(w.pop().expect("local"), &config, &topology);
    let parent = w.pop().expect("parent");
    assert_eq!(next(&parent, 1), Some(PsMessage::Pull));
    // The workers pull before there is anything to give: answered when the parent replies.
    for w in [&w2, &w3] {
        w.send(1, TAG, &PsMessage::Pull.encode()).expect("send");
        s.try_step(WAIT).expect("early pull");
        assert!(next(w, 1).is_none());
    }
    let v0 = vec![0.5f32; N];
    parent
        .send(1, TAG, &flotilla_ps::encode_params(4, &v0))
        .expect("send");
    s.try_step(WAIT).expect("params");
    for w in [&w2, &w3] {
        assert!(matches!(
            next(w, 1),
            Some(PsMessage::Params { version: 4, .. })
        ));
    }
    w2.send(1, TAG, &push(4, 2, 1.0, N)).expect("send");
    s.try_step(WAIT).expect("push");
    assert!(next(&parent, 1).is_none(), "the round is not complete");
    w3.send(1, TAG, &push(4, 2, 2.0, N)).expect("send");
    s.try_step(WAIT).expect("push");
    match next(&parent, 1) {
        Some(PsMessage::Push {
            version: 4,
            samples: 4,
            values,
            ..
        }) => assert_eq!(values, vec![1.5; N]),
        other => panic!("{other:?}"),
    }
    parent
        .send(
            1,
            TAG,
            &PsMessage::Stop {
                reason: "done".into(),
            }
            .encode(),
        )
        .expect("send");
    s.try_step(WAIT).expect("stop");
    assert!(s.machine.done());
    for w in [&w2, &w3] {
        assert!(matches!(next(w, 1), Some(PsMessage::Stop { .. })));
    }
    assert_eq!(s.machine.pushes_up(), 1);
}

/// A child that failed says why (`Abort`): a sync root fails with that reason, blaming the
/// child (so that every rank names the rank at fault), and tells its other children the
/// same; an async root goes on without the child, as without a lost one.
#[test]
fn an_abort_from_a_child_fails_a_sync_root_with_its_reason_and_an_async_root_goes_on() {
    let reason = "connection to rank 7 lost during point-to-point receive: reset";
    for sync in [true, false] {
        let mut w = world(3);
        let (w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
        let mut s = root(w.pop().expect("server"), sync, None);
        let abort = PsMessage::Abort {
            reason: reason.into(),
        };
        w2.send(0, TAG, &abort.encode()).expect("send");
        let r = s.try_step(WAIT);
        if sync {
            let e = r.expect_err("a sync root cannot go on without a child");
            assert_eq!(e.to_string(), format!("rank 2 failed: {reason}"));
            assert_eq!(e.blamed_rank(), Some(2));
            let e = super::abort_peers(&s.rank.comm, &s.machine.peers(), &[], e);
            match next(&w1, 0) {
                Some(PsMessage::Abort { reason: told }) => assert_eq!(told, e.to_string()),
                other => panic!("rank 1 must be told why: {other:?}"),
            }
        } else {
            r.expect("an async root goes on");
            assert!(!s.machine.done());
            w1.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
            s.try_step(WAIT).expect("the other child's push");
            assert_eq!(s.machine.version(), 1, "rank 1's push is applied");
        }
    }
}

/// A push that claims more samples than its worker can have trained on (its weight in the
/// mean), or whose finite values would overflow the round's sum to infinity, is refused to
/// that worker and changes nothing; so is an update whose new parameters would not be finite.
#[test]
fn an_overweight_or_overflowing_push_is_refused_to_its_worker_and_changes_nothing() {
    for sync in [true, false] {
        let mut w = world(3);
        let (w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
        let mut s = root(w.pop().expect("server"), sync, None);
        let p0 = s.params();
        let refused = |w: &Arc<dyn ProcessGroup>, what: &str, may: bool| match next(w, 0) {
            Some(PsMessage::Reject { reason, retry }) => {
                assert!(
                    reason.contains(what) && retry == may,
                    "{reason} (retry {retry})"
                )
            }
            other => panic!("expected a refusal about {what:?}, got {other:?}"),
        };
        // The configured batch is 64 samples, one local step: no retry claims fewer.
        w1.send(0, TAG, &push(0, u32::MAX, 1.0, N)).expect("send");
        s.try_step(WAIT).expect("overweight");
        refused(&w1, "claims 4294967295 samples, more than the 64", false);
        w2.send(0, TAG, &push(0, 2, 3e38, N)).expect("send");
        s.try_step(WAIT).expect("overflowing");
        refused(&w2, "overflow", true);
        assert_eq!((s.machine.version(), s.params()), (0, p0.clone()));
        // Each push alone is fine; together they would overflow the round's sum.
        w1.send(0, TAG, &push(0, 64, 2e36, N)).expect("send");
        s.try_step(WAIT).expect("a large push");
        if sync {
            w2.send(0, TAG, &push(0, 64, -2e36, N)).expect("send");
            s.try_step(WAIT).expect("a second large push");
            refused(&w2, "overflow", true);
            assert_eq!((s.machine.version(), s.params()), (0, p0.clone()));
        } else {
            // Alone it is applied: finite parameters.
            assert_eq!(s.machine.version(), 1);
            assert!(s.params().iter().all(|p| p.is_finite()));
        }
    }
    // A finite mean whose step makes the parameters infinite: refused, nothing applied.
    let mut w = world(3);
    let (_w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
    let mut config = job(|t| flat(t, Aggregation::Async, 1));
    config.optimizer = sgd(4.0, 0.0);
    let topology = config.topology().expect("topology");
    let mut s = Server::updating(w.pop().expect("server"), &config, &topology);
    let p0 = s.params();
    w1.send(0, TAG, &push(0, 1, 1e38, N)).expect("send");
    s.try_step(WAIT)
        .expect("a push that overflows the parameters");
    match next(&w1, 0) {
        Some(PsMessage::Reject { reason, retry }) => {
            assert!(reason.contains("non-finite") && retry, "{reason}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!((s.machine.version(), s.params()), (0, p0));
}

/// A worker told its push will never be taken (its claim, length or kind) stops at once,
/// naming its server and the reason; one whose pushes are refused [`MAX_REFUSED_IN_A_ROW`]
/// times in a row (stale, or not finite, each time) stops too. Before, it pulled and pushed
/// again without end.
#[test]
fn a_worker_stops_on_a_refusal_no_retry_changes_or_on_too_many_in_a_row() {
    use super::MAX_REFUSED_IN_A_ROW;
    use super::worker::Worker;
    use crate::strategy::Strategy;
    use crate::testkit::{Rank, batches, dataset};

    for (retry, refusals) in [(false, 1), (true, MAX_REFUSED_IN_A_ROW)] {
        let mut w = world(3);
        let _w2 = w.pop().expect("w2");
        let (w1, server) = (w.pop().expect("w1"), w.pop().expect("server"));
        let config = job(|t| flat(t, Aggregation::Sync, 1));
        let topology = config.topology().expect("topology");
        let worker = std::thread::spawn(move || {
            let mut rank = Rank::new(w1, config, 64);
            let mut worker = rank.build(&topology, Worker::build);
            let mut data = batches(&dataset(64), 2, 0);
            worker.start(&mut rank.cx()).expect("start");
            let mut done = 0;
            loop {
                match worker.step(&mut rank.cx(), &mut data, done) {
                    Ok(_) => done += 1,
                    Err(e) => return (e, done),
                }
            }
        });
        let mut answered = 0;
        let params = flotilla_ps::encode_params(0, &[0.0; N]);
        // Bounded: a worker that pushes past the refusals that must stop it ends the test.
        while answered <= refusals + 2
            && let Some(msg) = next_within(&server, 1, Duration::from_secs(5))
        {
            match msg {
                PsMessage::Pull => server.send(1, TAG, &params).expect("params"),
                PsMessage::Push { .. } => {
                    answered += 1;
                    let reject = PsMessage::Reject {
                        reason: format!("refusal {answered}"),
                        retry,
                    };
                    server.send(1, TAG, &reject.encode()).expect("reject");
                }
                // The worker's failure, told to its server.
                PsMessage::Abort { reason } => {
                    assert!(reason.contains(&format!("refusal {answered}")), "{reason}");
                    break;
                }
                other => panic!("a worker sent {other:?}"),
            }
        }
        drop(server);
        let (e, done) = worker.join().expect("worker thread");
        // A refusal is read at the next round's pull, after the step that pushed.
        assert_eq!((answered, done), (refusals, u64::from(refusals)), "{e}");
        let how = if retry {
            format!("{refusals} times in a row (the last)")
        } else {
            "for good".into()
        };
        assert_eq!(
            e.to_string(),
            format!("rank 0 refused this rank's push {how}: refusal {refusals}")
        );
    }
}

/// Receives the next message from `from` at `me`, or `None` within `wait`.
fn next_within(me: &Arc<dyn ProcessGroup>, from: usize, wait: Duration) -> Option<PsMessage> {
    let b = me.recv(from, TAG, Instant::now() + wait).ok()?;
    Some(PsMessage::decode(&b, from).expect("decodes"))
}
