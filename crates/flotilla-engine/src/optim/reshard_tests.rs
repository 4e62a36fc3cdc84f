//! [`crate::FlatOptimizerState`]: the states of 3 shards (cut mid-tensor) put together equal
//! the whole model's state after the same steps, for every optimizer; cut again for 2 shards
//! and for the whole model, they continue bitwise as the whole model stepped throughout.

use crate::optim::shard_optim_tests::{engine, gradient, optimizers, owned, shard_of};
use crate::{Engine, FlatOptimizerState, ModelState, ShardOptimizer};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One step of every shard from `params` by `g`: the parameters each shard's owner gives.
fn step_shards(shards: &mut [ShardOptimizer], params: &[f32], g: &[f32]) -> Vec<f32> {
    let mut next = params.to_vec();
    for s in shards {
        let mut mine = params.to_vec();
        let g = shard_of(s, g);
        s.step(&mut mine, &g, 0.3).expect("shard step");
        for p in s.pieces() {
            next[p.range.clone()].copy_from_slice(&mine[p.range.clone()]);
        }
    }
    next
}

#[test]
fn shard_states_put_together_and_cut_anew_continue_bitwise() {
    for spec in optimizers() {
        let mut whole = engine(&spec);
        let layout = whole.layout().clone();
        let total = layout.total;
        let mut params = vec![0.0; total];
        whole.read_params(&mut params).expect("read");
        let mut three: Vec<ShardOptimizer> = (0..3)
            .map(|r| {
                ShardOptimizer::new(&spec, &layout, &owned(total, 3, r), "flex").expect("shard")
            })
            .collect();
        for step in 0..4 {
            let g = gradient(total, step);
            whole.apply_grads(&g, 0.3).expect("whole step");
            params = step_shards(&mut three, &params, &g);
        }
        let states: Vec<Vec<u8>> = three.iter().map(|s| s.state().expect("state")).collect();
        let ranges: Vec<_> = (0..3).map(|r| owned(total, 3, r)).collect();
        let parts: Vec<_> = ranges
            .iter()
            .zip(&states)
            .map(|(r, s)| (Some(r.as_slice()), s.as_slice()))
            .collect();
        let gathered = FlatOptimizerState::gather(&layout, &parts).expect("gather shards");
        let reference = whole.optimizer_state().expect("state");
        let want = FlatOptimizerState::gather(&layout, &[(None, &reference)]).expect("gather");
        assert_eq!(gathered, want, "{spec:?}: 3 shards put together");
        // Cut anew: the whole model and 2 shards, each continuing from `params`.
        let mut resumed = engine(&spec);
        resumed.write_params(&params).expect("write");
        resumed
            .load_optimizer_state(&gathered.whole(&layout).expect("whole"))
            .expect("load");
        let mut two: Vec<ShardOptimizer> = (0..2)
            .map(|r| {
                let mine = owned(total, 2, r);
                let mut s = ShardOptimizer::new(&spec, &layout, &mine, "flex").expect("shard");
                s.load_state(gathered.shard(&layout, &mine).expect("cut"))
                    .expect("load");
                s
            })
            .collect();
        let mut sharded = params.clone();
        for step in 4..6 {
            let g = gradient(total, step);
            whole.apply_grads(&g, 0.3).expect("whole step");
            resumed.apply_grads(&g, 0.3).expect("resumed step");
            sharded = step_shards(&mut two, &sharded, &g);
        }
        let (mut want, mut got) = (vec![0.0; total], vec![0.0; total]);
        whole.read_params(&mut want).expect("read");
        resumed.read_params(&mut got).expect("read");
        assert_ne!(bits(&want), bits(&params), "{spec:?}: the parameters moved");
        assert_eq!(
            bits(&got),
            bits(&want),
            "{spec:?}: whole, from 3 shards' state"
        );
        assert_eq!(
            bits(&sharded),
            bits(&want),
            "{spec:?}: 2 shards, from 3 shards' state"
        );
    }
}
