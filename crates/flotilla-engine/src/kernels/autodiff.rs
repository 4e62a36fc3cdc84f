//! The `Autodiff` side of the engine's backend extensions, written once: [`record`] runs an
//! op's forward on the backend under `Autodiff` and records it in the graph with the state its
//! backward keeps (only when an input tracks a gradient), and [`fused`] hands the gradients
//! that one backend call computes for all of an op's inputs to the inputs that track one (as
//! burn's `unary` and `binary` do for one and two inputs).

use std::cell::Cell;
use std::fmt::Debug;

use burn::backend::Backend;
use burn::backend::tensor::FloatTensor;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind, OpsPrep};

/// The output of the op `prep` prepares (its backward, on the nodes of its inputs) on
/// `inputs`, the backend's primitives of those inputs, recorded in the autodiff graph as
/// compute-bound: `tracked` gives the output and the state the backward keeps when an input
/// tracks a gradient, `untracked` the output alone otherwise.
pub(crate) fn record<B, C, O, I, S, const N: usize>(
    prep: OpsPrep<O, B, S, C, N>,
    inputs: I,
    tracked: impl FnOnce(I) -> (FloatTensor<B>, S),
    untracked: impl FnOnce(I) -> FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    O: Backward<B, N, State = S>,
    S: Clone + Send + Debug + 'static,
{
    match prep.compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let (output, state) = tracked(inputs);
            prep.finish(state, output)
        }
        OpsKind::UnTracked(prep) if AS_TRACKED.get() => prep.finish(tracked(inputs).0),
        OpsKind::UnTracked(prep) => prep.finish(untracked(inputs)),
    }
}

thread_local! {
    /// Whether an untracked op computes its output as its tracked twin does
    /// ([`as_tracked`]).
    static AS_TRACKED: Cell<bool> = const { Cell::new(false) };
}

/// `f`, with every op of [`record`] that tracks no gradient computing its output with the
/// tracked forward (its state dropped) instead of its own: the same bits as on the tape.
/// Some untracked forwards take a faster path with another summation order (attention
/// without its probabilities, layer norm without its statistics); a forward off the tape
/// that a taped recomputation must match bit for bit (ZeRO-3's, [`crate::sharded`]) runs
/// under this.
pub(crate) fn as_tracked<T>(f: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            AS_TRACKED.set(self.0);
        }
    }
    let _reset = Reset(AS_TRACKED.replace(true));
    f()
}

/// The backward of an op whose `N` input gradients one backend call computes together:
/// `backward` of the kept state and the output's gradient, each result registered for its
/// input when that input tracks a gradient.
pub(crate) fn fused<B: Backend, S, const N: usize>(
    ops: Ops<S, N>,
    grads: &mut Gradients,
    backward: impl FnOnce(S, FloatTensor<B>) -> [FloatTensor<B>; N],
) {
    let grad = grads.consume::<B>(&ops.node);
    for (parent, g) in ops.parents.into_iter().zip(backward(ops.state, grad)) {
        if let Some(node) = parent {
            grads.register::<B>(node.id, g);
        }
    }
}
