//! Model averaging (`local_steps: 2`) against its formula: real workers (the production
//! [`Worker`] role, its engine and optimizer) on known batches, a flat server, driven one
//! event at a time. Each worker takes the parameters it pulled, runs two local SGD steps
//! with its own optimizer (its momentum carries over from round to round) at the
//! configured rate, and pushes `local − pulled`; the server adds the sample-weighted mean
//! delta of a round (sync) or each delta on arrival (async), whatever version it came from.

use flotilla_cluster::Aggregation;

use super::formula_kit::{LR, MOMENTUM, Server, flat, ps_config, weighted_mean};
use super::worker::Worker;
use crate::batches::Batches;
use crate::strategy::Strategy;
use crate::testkit::{Oracle, Rank, SgdRef, assert_bitwise, batches, dataset, world};

/// Samples of the training set: 4 batches per worker and epoch, so 3 rounds of 2 local steps
/// cross an epoch.
const SAMPLES: usize = 32;
const ROUNDS: usize = 3;
const LOCAL_STEPS: usize = 2;

/// One worker's serial reference: its optimizer and its batches.
struct WorkerRef {
    opt: SgdRef,
    shard: Batches,
    /// The parameters it pulled last.
    pulled: Vec<f32>,
}

impl WorkerRef {
    /// Two local steps from the pulled parameters; the weight delta.
    fn delta(&mut self, oracle: &mut Oracle) -> Vec<f32> {
        let mut local = self.pulled.clone();
        for _ in 0..LOCAL_STEPS {
            let (g, _) = oracle.grad(&local, self.shard.next_batch().expect("batch").1);
            self.opt.step(&mut local, &g, LR);
        }
        local.iter().zip(&self.pulled).map(|(l, p)| l - p).collect()
    }
}

fn averaging(aggr: Aggregation) {
    let config = ps_config(|t| {
        flat(t, aggr, 1);
        t.local_steps = LOCAL_STEPS;
    });
    let topology = config.topology().expect("topology");
    let mut comms = world(3);
    let links = comms.split_off(1);
    let mut root = Server::updating(comms.remove(0), &config, &topology);
    let data = dataset(SAMPLES);
    let mut workers: Vec<(Rank, Worker, Batches)> = links
        .into_iter()
        .enumerate()
        .map(|(i, comm)| {
            let mut rank = Rank::new(comm, config.clone(), 16);
            let mut w = rank.build(&topology, Worker::build);
            w.start(&mut rank.cx()).expect("start");
            (rank, w, batches(&data, 2, i))
        })
        .collect();
    root.step();
    root.step();
    let (mut oracle, _) = Oracle::new();
    let mut w = root.params();
    let mut refs: Vec<WorkerRef> = (0..2)
        .map(|i| WorkerRef {
            opt: SgdRef::new(MOMENTUM),
            shard: batches(&data, 2, i),
            pulled: w.clone(),
        })
        .collect();
    let samples = (crate::testkit::BATCH * LOCAL_STEPS) as u32;
    for round in 0..ROUNDS {
        let mut deltas = Vec::new();
        for (i, (rank, worker, shard)) in workers.iter_mut().enumerate() {
            worker
                .step(&mut rank.cx(), shard, round as u64)
                .expect("worker round");
            root.step();
            let d = refs[i].delta(&mut oracle);
            if aggr == Aggregation::Async {
                // Added on arrival; the worker is answered with the result.
                let mean = weighted_mean(&[(samples, &d)]);
                w.iter_mut().zip(&mean).for_each(|(p, d)| *p += d);
                refs[i].pulled = w.clone();
                let what = format!("round {} worker {i}", round + 1);
                assert_bitwise(&root.params(), &w, &what);
            }
            deltas.push(d);
        }
        if aggr == Aggregation::Sync {
            let mean = weighted_mean(&[(samples, &deltas[0]), (samples, &deltas[1])]);
            w.iter_mut().zip(&mean).for_each(|(p, d)| *p += d);
            refs.iter_mut().for_each(|r| r.pulled = w.clone());
            assert_bitwise(&root.params(), &w, &format!("round {}", round + 1));
        }
    }
}

#[test]
fn a_sync_server_adds_the_mean_weight_delta_of_each_round() {
    averaging(Aggregation::Sync);
}

#[test]
fn an_async_server_adds_each_weight_delta_on_arrival() {
    averaging(Aggregation::Async);
}
