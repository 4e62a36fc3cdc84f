//! Activation recomputation (`Engine::set_recompute`) against the same engine without it:
//! the same losses and gradients bit for bit over steps, whether the gradients are streamed
//! or read after the pass, with one backward group or many; models whose forward changes
//! state or draws are refused, and so is an engine that runs a user's module.

use crate::sharded_tests::{batch, bits, engine};
use crate::{BatchRef, BurnEngine, Engine, EngineError, ModelSpec, ModelState};

/// Three steps of `e` on fixed batches: each step's loss and streamed gradient, then the
/// gradient [`Engine::for_each_grad`] reads after a plain `forward_backward`.
fn steps(e: &mut BurnEngine, spec: &ModelSpec) -> Vec<(u32, Vec<u32>)> {
    let total = e.layout().total;
    let n = if spec.token_vocab().is_some() { 2 } else { 8 };
    let mut seen = Vec::new();
    for step in 0..3u32 {
        let (images, labels) = batch(spec, n, step);
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
    for name in ["mlp", "lenet5", "resmlp", "gpt-char"] {
        let spec = ModelSpec::builtin(name).expect("shipped spec");
        for max_bytes in [0, 1 << 20] {
            let mut plain = engine(&spec, max_bytes);
            let mut recomputed = engine(&spec, max_bytes);
            recomputed.set_recompute(true).expect("recompute");
            let (want, got) = (steps(&mut plain, &spec), steps(&mut recomputed, &spec));
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
        }
    }
}

#[test]
fn recomputation_is_refused_for_a_model_whose_forward_changes_state_or_draws() {
    let dropout = ModelSpec::from_yaml(
        "input: [8]\nlayers:\n  - linear: {out: 8}\n  - dropout: {p: 0.1}\n  - linear: {out: 3}\n",
        "dropout",
    )
    .expect("spec");
    for (name, spec) in [
        ("resnet-bn", ModelSpec::builtin("resnet-bn").expect("spec")),
        ("dropout", dropout),
    ] {
        let mut e = engine(&spec, 0);
        let err = e.set_recompute(true).expect_err(name);
        assert!(
            matches!(err, EngineError::Recompute(_)) && err.to_string().contains("recomputes"),
            "{name}: {err}"
        );
        e.set_recompute(false).expect("off is always possible");
    }
}
