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
