//! The parameter-server state machines on an in-memory process group: each test is one
//! process whose threads-free "ranks" are in-memory communicators; pushes and replies go
//! through the group, and the machine under test is driven one event at a time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_comm::{CommConfig, CommError, Communicator, ProcessGroup};
use flotilla_data::ImageDataset;
use flotilla_engine::{BurnEngine, ModelSpec, ModelState, OptimizerSpec};

use super::PsContext;
use super::inbox::Inbox;
use super::local::LocalServer;
use super::protocol::{PsMessage, TAG};
use super::serve::{ServerMachine, serve_one};
use super::server::ShardPlan;
use super::shard_server::ShardServer;
use crate::config::{LrSchedule, TrainConfig};
use crate::observe::Quiet;
use crate::runlog::RunLog;

const TINY: &str = "name: tiny\ninput: [1, 2, 2]\nlayers:\n  - flatten\n  - linear: {out: 3}\n";
/// Parameters of [`TINY`]: a 4x3 weight and 3 biases.
const N: usize = 15;
const LR: f64 = 0.5;

/// What a server's [`PsContext`] borrows.
struct Fixture {
    comm: Arc<dyn ProcessGroup>,
    config: TrainConfig,
    engine: BurnEngine,
    data: ImageDataset,
    log: RunLog,
    observer: Quiet,
    _dir: tempfile::TempDir,
}

impl Fixture {
    fn new(comm: Communicator, max_staleness: Option<u64>) -> Self {
        let mut config = TrainConfig {
            optimizer: OptimizerSpec::Sgd {
                lr: LR,
                momentum: 0.0,
                dampening: 0.0,
                nesterov: false,
                weight_decay: 0.0,
            },
            ..TrainConfig::default()
        };
        config.schedule.lr_schedule = LrSchedule::Constant;
        config.schedule.warmup_steps = 0;
        config.topology.max_staleness = max_staleness;
        config.comm.timeout_s = 2.0;
        let spec = ModelSpec::from_yaml(TINY, "tiny").expect("spec");
        let engine = BurnEngine::new(&spec, &config.optimizer, "flex", 7).expect("engine");
        let data = ImageDataset::new(vec![0.0; 8], vec![0, 1], 2, 2).expect("data");
        let dir = tempfile::tempdir().expect("tmp");
        let log = RunLog::open(dir.path(), comm.rank()).expect("log");
        Self {
            comm: Arc::new(comm),
            config,
            engine,
            data,
            log,
            observer: Quiet,
            _dir: dir,
        }
    }

    fn cx(&mut self) -> PsContext<'_> {
        PsContext {
            comm: &self.comm,
            config: &self.config,
            engine: Some(&mut self.engine),
            train: &self.data,
            test: &self.data,
            rank: self.comm.rank(),
            num_workers: 2,
            rounds: 1000,
            eval_every: 0,
            log: &mut self.log,
            observer: &mut self.observer,
            fault: None,
            last_eval: None,
            async_momentum: None,
        }
    }

    fn params(&self) -> Vec<f32> {
        let mut p = vec![0.0; N];
        self.engine.read_params(&mut p).expect("params");
        p
    }
}

fn world(n: usize) -> Vec<Communicator> {
    Communicator::in_memory(
        n,
        CommConfig::new(Some(0), n).with_timeout(Duration::from_secs(2)),
    )
    .expect("world")
}

/// A worker's push of `len` copies of `value` (see [`super::formula_kit::push`]).
fn push(version: u64, samples: u32, value: f32, len: usize) -> Vec<u8> {
    super::formula_kit::push(version, samples, &vec![value; len])
}

/// Receives the next message from `from` at `me`, or `None` within a short wait.
fn next(me: &Communicator, from: usize) -> Option<PsMessage> {
    match me.recv(from, TAG, Instant::now() + Duration::from_millis(150)) {
        Ok(b) => Some(PsMessage::decode(&b, from).expect("decodes")),
        Err(CommError::Deadline { .. }) => None,
        Err(e) => panic!("{e}"),
    }
}

/// Takes one event off `inbox` and hands it to the machine, then lets it send what it held
/// back for the run loop (which goes on), as a role's step does.
fn step(m: &mut dyn ServerMachine, f: &mut Fixture, inbox: &Inbox) -> crate::Result<()> {
    let mut cx = f.cx();
    serve_one(m, &mut cx, inbox, Duration::from_millis(500))?;
    m.flush(&mut cx)
}

fn root(f: &mut Fixture, sync: bool) -> (ShardServer, Inbox) {
    let m = ShardServer::new(&mut f.cx(), &[1, 2], sync, ShardPlan::whole(N)).expect("server");
    let inbox = Inbox::listen(&f.comm, &m.peers());
    (m, inbox)
}

#[test]
fn a_sync_round_waits_for_every_child_and_applies_the_sample_weighted_mean() {
    let mut w = world(3);
    let (w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
    let mut f = Fixture::new(w.pop().expect("server"), None);
    let (mut m, inbox) = root(&mut f, true);
    let p0 = f.params();

    w1.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("first push");
    assert_eq!(m.version(), 0, "one push of two is not a round");
    assert!(
        next(&w1, 0).is_none(),
        "nobody is answered before the round is complete"
    );

    w2.send(0, TAG, &push(0, 3, -1.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("second push");
    assert_eq!(m.version(), 1);
    // Mean (1*1 + 3*(-1)) / 4 = -0.5; SGD: p - lr * mean = p + 0.25.
    let want: Vec<f32> = p0.iter().map(|p| p + 0.25).collect();
    assert_eq!(f.params(), want);
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
    let mut f = Fixture::new(w.pop().expect("server"), None);
    let (mut m, inbox) = root(&mut f, true);
    let p0 = f.params();
    let rejected = |w: &Communicator, what: &str| match next(w, 0) {
        Some(PsMessage::Reject { reason }) => assert!(reason.contains(what), "{reason}"),
        other => panic!("expected a reject about {what:?}, got {other:?}"),
    };

    w1.send(0, TAG, &push(5, 1, 1.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("future version");
    rejected(&w1, "version 5");
    w1.send(0, TAG, &push(0, 1, 1.0, N - 1)).expect("send");
    step(&mut m, &mut f, &inbox).expect("wrong length");
    rejected(&w1, "14 values");
    w1.send(0, TAG, &[PsMessage::Pull.encode(), vec![1, 2, 3]].concat())
        .expect("send");
    step(&mut m, &mut f, &inbox).expect("malformed");
    assert!(matches!(next(&w1, 0), Some(PsMessage::Reject { .. })));
    w1.send(0, TAG, &push(0, 1, f32::NAN, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("nan");
    rejected(&w1, "non-finite");
    assert_eq!(
        (m.version(), f.params()),
        (0, p0.clone()),
        "nothing changed"
    );

    // An admitted push, then the same child again in the same round.
    w1.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("push");
    w1.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("second push");
    rejected(&w1, "second push");
    // The round completes with w2, on w1's first push only: mean (1 + 3) / 2 = 2.
    w2.send(0, TAG, &push(0, 1, 3.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("round");
    let want: Vec<f32> = p0.iter().map(|p| p - 1.0).collect();
    assert_eq!((m.version(), f.params()), (1, want));
    // A push computed on version 0 is now stale in sync mode.
    let _ = (next(&w1, 0), next(&w2, 0));
    w2.send(0, TAG, &push(0, 1, 3.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("stale");
    rejected(&w2, "version 0");
    assert_eq!(m.version(), 1);
}

#[test]
fn a_sync_server_names_a_lost_child_and_the_silent_ones_at_its_deadline() {
    let mut w = world(3);
    let (w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
    let mut f = Fixture::new(w.pop().expect("server"), None);
    let (mut m, inbox) = root(&mut f, true);
    w1.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("push");
    // Rank 2 is silent: the deadline names it (and not rank 1, which pushed).
    let e = step(&mut m, &mut f, &inbox)
        .expect_err("deadline")
        .to_string();
    assert!(e.contains("rank(s) 2") && !e.contains("1, 2"), "{e}");
    drop(w2);
    let e = step(&mut m, &mut f, &inbox).expect_err("lost").to_string();
    assert!(e.contains("rank 2 lost during sync round 0"), "{e}");
    drop(w1);
}

#[test]
fn an_async_server_applies_each_push_answers_its_sender_and_survives_a_lost_child() {
    let mut w = world(3);
    let (w2, w1) = (w.pop().expect("w2"), w.pop().expect("w1"));
    let mut f = Fixture::new(w.pop().expect("server"), Some(1));
    let (mut m, inbox) = root(&mut f, false);
    let p0 = f.params();

    w1.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("push");
    assert_eq!(m.version(), 1, "applied on arrival");
    assert!(matches!(
        next(&w1, 0),
        Some(PsMessage::Params { version: 1, .. })
    ));
    assert!(next(&w2, 0).is_none(), "only the sender is answered");
    // One version stale is within max_staleness 1.
    w2.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("stale by one");
    assert_eq!(m.version(), 2);
    let _ = next(&w2, 0);
    let want: Vec<f32> = p0.iter().map(|p| p - 0.5 - 0.5).collect();
    assert_eq!(f.params(), want);
    // Two versions stale is not.
    w2.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("too stale");
    match next(&w2, 0) {
        Some(PsMessage::Reject { reason }) => {
            assert!(reason.contains("max_staleness 1"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(m.version(), 2);

    drop(w1);
    step(&mut m, &mut f, &inbox).expect("a lost child is not an error when async");
    assert_eq!(m.active().iter().copied().collect::<Vec<_>>(), vec![2]);
    w2.send(0, TAG, &push(2, 1, 1.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("the other child goes on");
    assert_eq!(m.version(), 3);
    drop(w2);
    let e = step(&mut m, &mut f, &inbox)
        .expect_err("all lost")
        .to_string();
    assert!(e.contains("every child"), "{e}");
}

#[test]
fn a_sync_local_server_pushes_the_mean_up_and_forwards_the_reply() {
    // Rank 0 plays the parent, 1 is the local server, 2 and 3 its workers.
    let mut w = world(4);
    let (w3, w2) = (w.pop().expect("w3"), w.pop().expect("w2"));
    let mut f = Fixture::new(w.pop().expect("local"), None);
    let parent = w.pop().expect("parent");
    let mut m = LocalServer::new(&f.cx(), 0, &[2, 3], true).expect("local server");
    let inbox = Inbox::listen(&f.comm, &m.peers());
    m.on_start(&mut f.cx()).expect("start");
    assert_eq!(next(&parent, 1), Some(PsMessage::Pull));
    // The workers pull before there is anything to give: answered when the parent replies.
    for w in [&w2, &w3] {
        w.send(1, TAG, &PsMessage::Pull.encode()).expect("send");
        step(&mut m, &mut f, &inbox).expect("early pull");
        assert!(next(w, 1).is_none());
    }
    let v0 = vec![0.5f32; N];
    parent
        .send(1, TAG, &super::protocol::encode_params(4, &v0))
        .expect("send");
    step(&mut m, &mut f, &inbox).expect("params");
    for w in [&w2, &w3] {
        assert!(matches!(
            next(w, 1),
            Some(PsMessage::Params { version: 4, .. })
        ));
    }
    w2.send(1, TAG, &push(4, 2, 1.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("push");
    assert!(next(&parent, 1).is_none(), "the round is not complete");
    w3.send(1, TAG, &push(4, 2, 2.0, N)).expect("send");
    step(&mut m, &mut f, &inbox).expect("push");
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
    step(&mut m, &mut f, &inbox).expect("stop");
    assert!(m.done());
    for w in [&w2, &w3] {
        assert!(matches!(next(w, 1), Some(PsMessage::Stop { .. })));
    }
    assert_eq!(m.pushes_up(), 1);
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
        let mut f = Fixture::new(w.pop().expect("server"), None);
        let (mut m, inbox) = root(&mut f, sync);
        let abort = PsMessage::Abort {
            reason: reason.into(),
        };
        w2.send(0, TAG, &abort.encode()).expect("send");
        let r = step(&mut m, &mut f, &inbox);
        if sync {
            let e = r.expect_err("a sync root cannot go on without a child");
            assert_eq!(e.to_string(), format!("rank 2 failed: {reason}"));
            assert_eq!(e.blamed_rank(), Some(2));
            let e = super::abort_peers(&f.comm, &m.peers(), &[], e);
            match next(&w1, 0) {
                Some(PsMessage::Abort { reason: told }) => assert_eq!(told, e.to_string()),
                other => panic!("rank 1 must be told why: {other:?}"),
            }
        } else {
            r.expect("an async root goes on");
            assert!(!m.done());
            w1.send(0, TAG, &push(0, 1, 1.0, N)).expect("send");
            step(&mut m, &mut f, &inbox).expect("the other child's push");
            assert_eq!(m.version(), 1, "rank 1's push is applied");
        }
    }
}
