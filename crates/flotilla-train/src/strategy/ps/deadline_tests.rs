//! Who a hierarchical tree names when a rank goes silent (SIGSTOP): the servers' own steps
//! (the ones the run loop calls) on an in-memory group, with a short `comm.timeout_s`.
//!
//! A sync root over two sync local servers A (rank 1, workers 2 and 3) and B (rank 4,
//! workers 5 and 6). B pushes up its round; then either A or the root is silent.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use flotilla_cluster::Aggregation;
use flotilla_tcp::{CommError, ProcessGroup};

use super::formula_kit::{Server, grad, hierarchical, ps_config, push};
use super::local::LocalServer;
use super::shard_server::ShardServer;
use crate::TrainError;
use crate::strategy::Strategy;
use crate::testkit::{batches, dataset, world};
use flotilla_ps::{PsMessage, TAG};

/// The deadline of every wait (`comm.timeout_s`).
const T: Duration = Duration::from_millis(800);

/// The root and B after B pushed its first round up and the root took that push; A took
/// the root's first parameters and then stopped.
struct Stalled {
    root: Server<ShardServer>,
    b: Server<LocalServer>,
    /// When B pushed up.
    pushed: Instant,
    /// The root's link (to read what B sent it).
    root_link: Arc<dyn ProcessGroup>,
    /// A and the workers: alive (their links open), silent.
    _silent: (Server<LocalServer>, Vec<Arc<dyn ProcessGroup>>),
}

/// The tree with a deadline of `t`, after B pushed its first round up (the root has not
/// taken that push yet): the root, A, B and the workers 2, 3, 5 and 6, and the root's link.
struct Tree {
    root: Server<ShardServer>,
    a: Server<LocalServer>,
    b: Server<LocalServer>,
    workers: [Arc<dyn ProcessGroup>; 4],
    root_link: Arc<dyn ProcessGroup>,
}

fn tree(t: Duration) -> Tree {
    let mut c = ps_config(|t| hierarchical(t, Aggregation::Sync, Aggregation::Sync));
    c.comm.timeout_s = t.as_secs_f64();
    let topology = c.topology().expect("topology");
    let mut comms = world(7).into_iter();
    let mut next = || comms.next().expect("rank");
    let root_link = next();
    let mut root = Server::updating(root_link.clone(), &c, &topology);
    let mut a = Server::local(next(), &c, &topology);
    let (w2, w3) = (next(), next());
    let mut b = Server::local(next(), &c, &topology);
    let (w5, w6) = (next(), next());
    // Both local servers pull; the root answers both.
    root.step();
    root.step();
    a.step();
    b.step();
    for (i, w) in [&w5, &w6].into_iter().enumerate() {
        w.send(4, TAG, &push(0, 2, &grad(i))).expect("send");
        b.step();
    }
    Tree {
        root,
        a,
        b,
        workers: [w2, w3, w5, w6],
        root_link,
    }
}

fn stalled(root_steps: bool) -> Stalled {
    let mut tree = tree(T);
    let pushed = Instant::now();
    if root_steps {
        tree.root.step();
    }
    Stalled {
        root: tree.root,
        b: tree.b,
        pushed,
        root_link: tree.root_link,
        _silent: (tree.a, tree.workers.into()),
    }
}

/// Runs `server`'s own step (the run loop's) until it fails.
fn fail<S: Strategy>(server: &mut Server<S>) -> TrainError {
    let mut data = batches(&dataset(16), 2, 0);
    loop {
        if let Err(e) = server.machine.step(&mut server.rank.cx(), &mut data, 0) {
            return e;
        }
    }
}

#[test]
fn a_silent_local_server_is_named_by_the_root_to_its_sibling() {
    let Stalled {
        mut root,
        mut b,
        pushed,
        _silent: _keep,
        ..
    } = stalled(true);
    // The root's engine stays on this thread; B fails on another.
    let (root_error, (b_error, b_failed)) = thread::scope(|s| {
        let b = s.spawn(|| {
            let e = fail(&mut b);
            (e, pushed.elapsed())
        });
        let r = fail(&mut root);
        (r, b.join().expect("B"))
    });
    assert_eq!(root_error.blamed_rank(), Some(1), "root: {root_error}");
    // B hears the root's verdict: the root failed, naming A.
    assert_eq!(b_error.blamed_rank(), Some(0), "B: {b_error}");
    assert!(
        b_error.to_string().contains("no message from rank(s) 1"),
        "B must pass on the root's reason, naming rank 1: {b_error}"
    );
    assert!(
        b_failed >= T && b_failed < T.mul_f64(1.25),
        "B failed {b_failed:?} after its push: after the root's deadline, before its own"
    );
}

#[test]
fn a_local_server_names_a_silent_parent_after_its_longer_deadline_and_tells_only_its_children() {
    let Stalled {
        mut b,
        pushed,
        root_link,
        _silent: _keep,
        ..
    } = stalled(false);
    let e = fail(&mut b);
    let waited = pushed.elapsed();
    assert!(
        matches!(e, TrainError::ParentSilent { peer: 0, .. }),
        "B names its silent parent: {e}"
    );
    assert!(
        waited >= T.mul_f64(1.25),
        "B gave up on its parent after {waited:?}, before 1.25 × {T:?}"
    );
    // What B sent the root: its push, and no abort (a deadline is told down, not up).
    let mut sent = Vec::new();
    loop {
        match root_link.recv(4, TAG, Instant::now() + Duration::from_millis(150)) {
            Ok(bytes) => sent.push(PsMessage::decode(&bytes, 4).expect("decodes")),
            Err(CommError::Deadline { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        matches!(sent.as_slice(), [PsMessage::Push { .. }]),
        "B sent its parent {sent:?}"
    );
}

/// A silent worker (2, under A) is named by A, not A by the root, even when the root heard
/// its last message (B's push) a little before A heard its own (worker 3's push): the root
/// waits on local servers 1.1 times the deadline, so A gives up on worker 2 first and the
/// root fails with A's verdict. (With one deadline for both, the root gave up first and
/// blamed A: the launcher then named a local server for its worker's fault.)
#[test]
fn a_silent_worker_is_named_by_its_local_server_not_the_local_server_by_the_root() {
    let t = Duration::from_secs(2);
    // B, the root's link and the other workers stay alive (their links open), silent.
    let Tree {
        mut root,
        mut a,
        b: _b,
        workers,
        root_link: _link,
    } = tree(t);
    // B's push up: the root's last message; worker 3's push, 50 ms later: A's.
    root.step();
    thread::sleep(t / 40);
    workers[1]
        .send(1, TAG, &push(0, 2, &grad(2)))
        .expect("send");
    a.step();
    let (root_error, a_error) = thread::scope(|s| {
        let a = s.spawn(|| fail(&mut a));
        let r = fail(&mut root);
        (r, a.join().expect("A"))
    });
    assert_eq!(a_error.blamed_rank(), Some(2), "A: {a_error}");
    assert!(
        root_error.to_string().contains("no message from rank(s) 2"),
        "the root passes on A's reason, naming worker 2: {root_error}"
    );
}
