//! Activation recomputation (`Engine::set_recompute`) against the same engine without it:
//! the same losses and gradients bit for bit over steps, whether the gradients are streamed
//! or read after the pass, with one backward group or many, dropout masks included (drawn
//! again in the recomputed forward), and batch norm's running statistics, which the
//! recomputed forward updates too (undone); a recomputed pass with dropout but no dropout
//! seed is refused.

use crate::sharded_tests::{batch, bits, engine, specs};
use crate::{BatchRef, BurnEngine, Engine, ModelSpec, ModelState};

/// Three steps of `e` on fixed batches, each with its dropout seed (`salt` plus the step):
/// each step's loss and streamed gradient, then the gradient [`Engine::for_each_grad`] reads
/// after a plain `forward_backward`.
fn steps(e: &mut BurnEngine, spec: &ModelSpec, salt: u64) -> Vec<(u32, Vec<u32>)> {
    let total = e.layout().total;
    let n = if spec.token_vocab().is_some() { 2 } else { 8 };
    let mut seen = Vec::new();
    for step in 0..3u32 {
        let (images, labels) = batch(spec, n, step);
        e.set_dropout_seed(salt + u64::from(step));
        let b = BatchRef {
            images: &images,
            labels: &labels,
        };
        let mut grads = vec![f32::NAN; total];
        let layout = e.layout().clone();
        let mut into = |i: usize, g: &[f32]| {
            let p = &layout.params[i];
            grads[p.offset..p.offset + p.len].copy_from_slice(g);
            Ok(())
        };
        let loss = if step == 1 {
            let loss = e.forward_backward(b).expect("forward_backward");
            e.for_each_grad(&mut into).expect("gradients");
            loss
        } else {
            e.forward_backward_streaming(b, &mut into)
                .expect("streaming")
        };
        e.apply_grads(&grads, 0.05).expect("step");
        seen.push((loss.to_bits(), bits(&grads)));
    }
    seen
}

#[test]
fn recomputation_gives_the_same_losses_and_gradients_bit_for_bit() {
    for (name, spec) in specs() {
        for max_bytes in [0, 1 << 20] {
            let mut plain = engine(&spec, max_bytes);
            let mut recomputed = engine(&spec, max_bytes);
            recomputed.set_recompute(true).expect("recompute");
            let want = steps(&mut plain, &spec, 100);
            let got = steps(&mut recomputed, &spec, 100);
            for (step, (w, g)) in want.iter().zip(&got).enumerate() {
                assert_eq!(
                    w.0, g.0,
                    "{name} ({max_bytes} B groups): step {step}'s loss"
                );
                assert!(
                    w.1 == g.1,
                    "{name} ({max_bytes} B groups): step {step}'s gradients differ first at {:?}",
                    w.1.iter().zip(&g.1).position(|(a, b)| a != b)
                );
            }
            if name.contains("dropout") {
                // The masks are drawn: another seed, other gradients.
                let mut other = engine(&spec, max_bytes);
                other.set_recompute(true).expect("recompute");
                assert_ne!(steps(&mut other, &spec, 200)[0].1, got[0].1, "{name}");
            }
        }
    }
}

/// A residual CNN, and an MLP whose last layer is a batch norm (the last group's forward
/// runs once, in backward: its update is the step's one, not undone).
#[test]
fn recomputation_updates_batch_norms_running_statistics_once() {
    let (_, mlp_bn) = specs()
        .into_iter()
        .find(|(name, _)| name == "mlp-bn")
        .expect("mlp-bn");
    for spec in [ModelSpec::builtin("resnet-bn").expect("spec"), mlp_bn] {
        statistics_of_one_forward(spec);
    }
}

/// [`recomputation_updates_batch_norms_running_statistics_once`] for `spec`.
fn statistics_of_one_forward(spec: ModelSpec) {
    let buffers = |e: &BurnEngine| {
        let mut b = vec![0.0; e.buffer_layout().total];
        e.read_buffers(&mut b).expect("buffers");
        bits(&b)
    };
    let initial = buffers(&engine(&spec, 0));
    for max_bytes in [0, 1 << 20] {
        let mut plain = engine(&spec, max_bytes);
        let mut recomputed = engine(&spec, max_bytes);
        recomputed.set_recompute(true).expect("recompute");
        let want = steps(&mut plain, &spec, 100);
        assert!(
            want == steps(&mut recomputed, &spec, 100),
            "{max_bytes} B groups"
        );
        let stats = buffers(&plain);
        assert_ne!(stats, initial, "three steps moved the running statistics");
        assert!(
            stats == buffers(&recomputed),
            "{max_bytes} B groups: running statistics differ first at {:?}",
            stats
                .iter()
                .zip(buffers(&recomputed))
                .position(|(a, b)| *a != b)
        );
    }
}

#[test]
fn a_recomputed_pass_with_dropout_and_no_seed_is_refused() {
    let (_, spec) = specs()
        .into_iter()
        .find(|(name, _)| name == "gpt-dropout")
        .expect("gpt-dropout");
    let mut e = engine(&spec, 0);
    e.set_recompute(true).expect("recompute");
    let (images, labels) = batch(&spec, 2, 0);
    let b = BatchRef {
        images: &images,
        labels: &labels,
    };
    let err = e.forward_backward(b).expect_err("no dropout seed");
    assert!(err.to_string().contains("dropout seed"), "{err}");
}
