//! Asynchronous parameter servers against their update formula: a fixed sequence of pushes
//! of fixed gradients, delivered one at a time (so the arrival order is the script's), and
//! the server's parameters after each push compared bit for bit with the formula of
//! [`RootRef`]: an SGD step (the server's momentum: `topology.async_momentum` if set, else
//! the optimizer's) with the sample-weighted mean push, at the learning rate of the round
//! divided by `1 + staleness` (unless `topology.staleness_lr: false`), where the staleness
//! is the versions the push is behind plus what an async local server carried from below.

use flotilla_cluster::Aggregation;

use super::formula_kit::{
    MOMENTUM, RootRef, Server, answer, flat, grad, hierarchical, ps_config, push, weighted_mean,
};
use super::local::LocalServer;
use super::shard_server::ShardServer;
use crate::testkit::{assert_bitwise, world};

/// Flat script: (worker, version computed on, samples, gradient).
const FLAT: [(usize, u64, u32, usize); 6] = [
    (0, 0, 4, 0),
    (1, 0, 4, 1), // 1 stale
    (0, 1, 2, 2), // 1 stale
    (0, 3, 4, 3),
    (1, 2, 3, 4), // 2 stale
    (1, 5, 4, 5),
];

/// Runs [`FLAT`] on `shards` async flat servers under `config`'s policy; the formula scales
/// the rate when `scaled` and steps with `momentum`.
fn flat_script(shards: usize, config: &crate::TrainConfig, scaled: bool, momentum: f64) {
    let topology = config.topology().expect("topology");
    let mut comms = world(shards + 2);
    let workers = comms.split_off(shards);
    let mut servers: Vec<Server<ShardServer>> = comms
        .into_iter()
        .map(|c| Server::updating(c, config, &topology))
        .collect();
    let ranges = topology.shard_ranges(super::formula_kit::N);
    let mut reference = RootRef::new(servers[0].params(), momentum, 2, scaled);
    for (i, &(worker, version, samples, g)) in FLAT.iter().enumerate() {
        let values = grad(g);
        let staleness = reference.updates - version;
        reference.apply(&weighted_mean(&[(samples, &values)]), staleness);
        for (s, server) in servers.iter_mut().enumerate() {
            let slice = &values[ranges[s].clone()];
            workers[worker]
                .send(s, flotilla_ps::TAG, &push(version, samples, slice))
                .expect("send");
            server.step();
            let what = format!("push {} ({staleness} stale), shard {s}", i + 1);
            let want = &reference.w[ranges[s].clone()];
            assert_bitwise(&server.params()[ranges[s].clone()], want, &what);
            let (v, sent) = answer(&*workers[worker], s);
            assert_eq!(v, reference.updates, "{what}: version answered");
            assert_bitwise(&sent, want, &format!("{what}: answered"));
        }
    }
}

#[test]
fn an_async_server_scales_each_push_by_its_staleness() {
    // Unset staleness_lr: on at an async server; the optimizer's momentum.
    let c = ps_config(|t| flat(t, Aggregation::Async, 1));
    flat_script(1, &c, true, MOMENTUM);
}

#[test]
fn staleness_lr_false_and_async_momentum_change_the_formula_as_configured() {
    let c = ps_config(|t| {
        flat(t, Aggregation::Async, 1);
        t.staleness_lr = Some(false);
        t.async_momentum = Some(0.5);
    });
    flat_script(1, &c, false, 0.5);
}

#[test]
fn sharded_async_servers_each_follow_the_formula_on_their_range() {
    let c = ps_config(|t| flat(t, Aggregation::Async, 2));
    flat_script(2, &c, true, MOMENTUM);
}

/// A hierarchical world: the root, local servers A (rank 1) and B (rank 4), and their
/// workers' links (ranks 2, 3 and 5, 6).
struct Tree {
    root: Server<ShardServer>,
    a: Server<LocalServer>,
    b: Server<LocalServer>,
    workers: Vec<std::sync::Arc<dyn flotilla_tcp::ProcessGroup>>,
}

impl Tree {
    fn new(config: &crate::TrainConfig) -> Self {
        let topology = config.topology().expect("topology");
        let mut comms = world(7).into_iter();
        let mut next = || comms.next().expect("rank");
        let root = Server::updating(next(), config, &topology);
        let a = Server::local(next(), config, &topology);
        let (w2, w3) = (next(), next());
        let b = Server::local(next(), config, &topology);
        let (w5, w6) = (next(), next());
        Self {
            root,
            a,
            b,
            workers: vec![w2, w3, w5, w6],
        }
    }

    /// Worker `w` (rank 2, 3, 5 or 6) pushes gradient `g` computed on `version` to its
    /// local server, which takes it.
    fn push(&mut self, w: usize, version: u64, samples: u32, g: usize) {
        let (link, local) = match w {
            2 => (&self.workers[0], &mut self.a),
            3 => (&self.workers[1], &mut self.a),
            5 => (&self.workers[2], &mut self.b),
            _ => (&self.workers[3], &mut self.b),
        };
        let parent = if w < 5 { 1 } else { 4 };
        link.send(parent, flotilla_ps::TAG, &push(version, samples, &grad(g)))
            .expect("send");
        local.step();
    }
}

#[test]
fn async_local_servers_carry_their_staleness_to_an_async_root() {
    let c = ps_config(|t| hierarchical(t, Aggregation::Async, Aggregation::Async));
    let mut t = Tree::new(&c);
    let mut reference = RootRef::new(t.root.params(), MOMENTUM, 2, true);
    // The root weighs a local server's mean by its samples, as any push.
    let mut root_takes = |t: &mut Tree, (samples, mean): (u32, Vec<f32>), s: u64, what: &str| {
        t.root.step();
        reference.apply(&weighted_mean(&[(samples, &mean)]), s);
        assert_bitwise(&t.root.params(), &reference.w, what);
    };
    // Both local servers pull version 0.
    for _ in 0..2 {
        t.root.step();
    }
    t.a.step();
    t.b.step();
    // A pushes rank 2's gradient up at once; rank 3's waits for the answer.
    t.push(2, 0, 2, 0);
    t.push(3, 0, 3, 1);
    root_takes(
        &mut t,
        (2, weighted_mean(&[(2, grad(0))])),
        0,
        "A's first push, on v0 at v0",
    );
    // A gets v1 and pushes rank 3's gradient (computed on v0): 1 stale from below.
    t.a.step();
    root_takes(
        &mut t,
        (3, weighted_mean(&[(3, grad(1))])),
        1,
        "A's push at v1 from v0, root at v1",
    );
    t.a.step(); // v2: nothing gathered, nothing pushed
    t.push(5, 0, 4, 2);
    root_takes(
        &mut t,
        (4, weighted_mean(&[(4, grad(2))])),
        2,
        "B's push on v0, root at v2",
    );
    t.b.step(); // v3
    // A pushes rank 2's gradient of v1 at v2 (1 from below) and gathers two more.
    t.push(2, 1, 2, 3);
    t.push(3, 2, 2, 4);
    t.push(2, 1, 3, 6);
    // B, at v3, pushes rank 6's gradient of v0: 3 from below.
    t.push(6, 0, 1, 5);
    root_takes(
        &mut t,
        (2, weighted_mean(&[(2, grad(3))])),
        2,
        "A's push at v2 (1 below), root at v3",
    );
    root_takes(
        &mut t,
        (1, weighted_mean(&[(1, grad(5))])),
        4,
        "B's push at v3 (3 below), root at v4",
    );
    // A gets v4 and pushes the mean of v2 (2 samples) and v1 (3 samples): its mean version
    // is 1.4, so 3 (rounded 2.6) from below; the root is at v5.
    t.a.step();
    root_takes(
        &mut t,
        (5, weighted_mean(&[(2, grad(4)), (3, grad(6))])),
        4,
        "A's mean, root at v5",
    );
    assert_eq!(reference.updates, 6);
}

/// A sync root over the async local servers: each round sums one push of each local
/// server in child order and takes one step at the round's rate, divided by
/// `1 + staleness` only when `staleness_lr: true` (`scaled`).
fn sync_root_over_async_locals(staleness_lr: Option<bool>, scaled: bool) {
    let c = ps_config(|t| {
        hierarchical(t, Aggregation::Sync, Aggregation::Async);
        t.staleness_lr = staleness_lr;
    });
    let mut t = Tree::new(&c);
    let mut reference = RootRef::new(t.root.params(), MOMENTUM, 1, scaled);
    for _ in 0..2 {
        t.root.step();
    }
    t.a.step();
    t.b.step();
    // Round 1: A pushes rank 2's gradient (rank 3's waits), B rank 5's; both on v0.
    t.push(2, 0, 2, 0);
    t.push(3, 0, 3, 1);
    t.root.step();
    assert_eq!(t.root.params(), reference.w, "half a round changes nothing");
    t.push(5, 0, 4, 2);
    t.root.step();
    let a = weighted_mean(&[(2, grad(0))]);
    let b = weighted_mean(&[(4, grad(2))]);
    reference.apply(&weighted_mean(&[(2, a), (4, b)]), 0);
    assert_bitwise(&t.root.params(), &reference.w, "round 1");
    // Round 2: A pushes rank 3's gradient of v0 at v1; B, at v1, rank 6's of v0: both
    // carry 1 from below.
    t.a.step();
    t.b.step();
    t.push(6, 0, 1, 5);
    t.root.step();
    t.root.step();
    let a = weighted_mean(&[(3, grad(1))]);
    let b = weighted_mean(&[(1, grad(5))]);
    reference.apply(&weighted_mean(&[(3, a), (1, b)]), 1);
    assert_bitwise(&t.root.params(), &reference.w, "round 2 (1 stale)");
}

#[test]
fn a_sync_root_over_async_local_servers_does_not_scale_unless_asked() {
    sync_root_over_async_locals(None, false);
    sync_root_over_async_locals(Some(true), true);
}
