//! Parameters and buffers: which tensors of a module a flat view covers.
//!
//! burn visits a batch norm's running statistics (`RunningState`) as float tensors, like its
//! parameters; but they are **buffers**: never differentiated, never an optimizer's, and
//! updated by the forward pass itself. The parameter views ([`crate::params`]: layout, read,
//! write, gradients, ids) wrap their visitor in [`Only`] with [`Tensors::Params`], which
//! hides the buffers; the buffer view ([`crate::ModelState::buffer_layout`]) takes only them
//! with [`Tensors::Buffers`]. A buffer is told apart by where burn visits it: the
//! `running_mean` or `running_var` field of a `BatchNorm`.

use burn::module::{ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;

use crate::error::Result;
use crate::params::{self, ParamLayout};

/// Which tensors a flat view covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tensors {
    /// The parameters (what is trained).
    Params,
    /// The buffers (batch norm's running statistics).
    Buffers,
}

impl Tensors {
    /// `parameters` or `buffers` (the copy spans' `what`).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Tensors::Params => "parameters",
            Tensors::Buffers => "buffers",
        }
    }
}

/// Whether the field `name` of a module of `container_type` (as burn's visitors name them)
/// holds a buffer.
fn is_buffer(name: &str, container_type: &str) -> bool {
    container_type == "Struct:BatchNorm" && matches!(name, "running_mean" | "running_var")
}

/// A visitor or mapper that hands `inner` only the float tensors of one kind ([`Tensors`]);
/// module entries and exits go through, so paths stay whole.
pub(crate) struct Only<'a, V> {
    inner: &'a mut V,
    want: Tensors,
    /// For each module entered, whether it is a buffer field.
    stack: Vec<bool>,
}

impl<'a, V> Only<'a, V> {
    /// Wraps `inner` to see only the tensors of kind `want`.
    pub(crate) fn new(inner: &'a mut V, want: Tensors) -> Self {
        Self {
            inner,
            want,
            stack: Vec::new(),
        }
    }

    /// Enters the module field `name` of `container_type`: `inner`, to pass the entry on.
    fn enter(&mut self, name: &str, container_type: &str) -> &mut V {
        self.stack.push(is_buffer(name, container_type));
        self.inner
    }

    /// Leaves the module entered last: `inner`, to pass the exit on.
    fn exit(&mut self) -> &mut V {
        self.stack.pop();
        self.inner
    }

    /// Whether the tensor visited now is of the wanted kind.
    fn wanted(&self) -> bool {
        let buffer = self.stack.last().copied().unwrap_or(false);
        buffer == (self.want == Tensors::Buffers)
    }
}

impl<V: ModuleVisitor> ModuleVisitor for Only<'_, V> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.enter(name, container_type)
            .enter_module(name, container_type);
    }

    fn exit_module(&mut self, name: &str, container_type: &str) {
        self.exit().exit_module(name, container_type);
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.wanted() {
            self.inner.visit_float(param);
        }
    }
}

impl<M: ModuleMapper> ModuleMapper for Only<'_, M> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.enter(name, container_type)
            .enter_module(name, container_type);
    }

    fn exit_module(&mut self, name: &str, container_type: &str) {
        self.exit().exit_module(name, container_type);
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        match self.wanted() {
            true => self.inner.map_float(param),
            false => param,
        }
    }
}

/// Runs `run`, a forward recomputed for its backward, and undoes what it did to `model`'s
/// buffers: a batch norm's forward updates its running statistics, which the first forward
/// of the same batch already did. The buffers are read before (settled: burn keeps an
/// update pending until the next read) and written back after; every copy of `model` shares
/// them (burn keeps them behind a shared cell), so the copy the forward ran on is restored.
/// Free for a module without buffers. The recomputed output is the first forward's either
/// way: in training a batch norm normalizes by the batch's statistics, not the running ones.
pub(crate) fn updates_undone<M: Module, T>(model: &M, run: impl FnOnce() -> T) -> Result<T> {
    let layout = ParamLayout::of_tensors(model, Tensors::Buffers);
    if layout.total == 0 {
        return Ok(run());
    }
    let mut kept = vec![0.0; layout.total];
    params::read_values(&model.valid(), &layout, &mut kept, Tensors::Buffers)?;
    let out = run();
    // Settle the recomputation's update first: left pending, it would overwrite `kept`.
    drop(model.valid());
    drop(params::write_values(
        model.clone(),
        &layout,
        &kept,
        Tensors::Buffers,
    )?);
    Ok(out)
}
