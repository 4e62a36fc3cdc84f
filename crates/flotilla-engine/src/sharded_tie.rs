//! A head tied to the token embedding under ZeRO-3 ([`crate::sharded`]): the table (layer 0's
//! parameter, in the first group) is used again by the head's group, after the first group's
//! parameters are released. As FSDP2 keeps its root module's parameters (where a tied
//! embedding lives) from forward to the end of backward, the table's values are kept from
//! the first group's gather to the end of the pass and written into the model for the head's
//! group; the head's gradient of the table waits there for the first group's backward, which
//! hands the table's gradient on as the sum of both uses (as one backward pass sums it).

use crate::backward_groups::BackwardGroup;
use crate::error::Result;
use crate::params::{self, ParamLayout};
use crate::spec::model::{Layer, SequentialModel};

/// The tied table's place and what a pass holds of it.
pub(crate) struct Tie {
    /// The table's parameter index.
    param: usize,
    /// The group holding it, and the table's offset in that group's gathered values.
    owner: (usize, usize),
    /// The group whose layers use it as well (the head's).
    user: usize,
    /// Its values, from the owner's first gather in this pass.
    values: Option<Vec<f32>>,
    /// The user's gradient of it, waiting for the owner's backward.
    grad: Option<Vec<f32>>,
}

impl Tie {
    /// The tie of `model` cut into `groups`, if a head in a later group uses layer 0's table.
    pub(crate) fn of(
        model: &SequentialModel,
        layout: &ParamLayout,
        groups: &[BackwardGroup],
    ) -> Option<Self> {
        let param = crate::grouped::tied_param(model, layout)?;
        let owner = groups.iter().position(|g| g.params.contains(&param))?;
        let head = model
            .layers
            .iter()
            .position(|l| matches!(l, Layer::TiedLinear(_)))?;
        let user = groups.iter().position(|g| g.layers.contains(&head))?;
        let first = layout.params[groups[owner].params.start].offset;
        let at = layout.params[param].offset - first;
        (user != owner).then_some(Self {
            param,
            owner: (owner, at),
            user,
            values: None,
            grad: None,
        })
    }

    /// Group `g` was gathered into `values`: the owner's first gather keeps the table's.
    pub(crate) fn gathered(&mut self, g: usize, values: &[f32], layout: &ParamLayout) {
        if g == self.owner.0 && self.values.is_none() {
            let len = layout.params[self.param].len;
            self.values = Some(values[self.owner.1..self.owner.1 + len].to_vec());
        }
    }

    /// `model` for group `g`: the user's gets the kept table (requiring its gradient when
    /// `tape`) unless the model holds it already (`held`: the owner kept gathered).
    pub(crate) fn lend(
        &self,
        g: usize,
        model: SequentialModel,
        layout: &ParamLayout,
        (tape, held): (bool, bool),
    ) -> Result<SequentialModel> {
        match (&self.values, g == self.user && !held) {
            (Some(v), true) => {
                params::write_range(model, layout, self.param..self.param + 1, Some(v), tape)
            }
            _ => Ok(model),
        }
    }

    /// `model` after group `g` ran: the user's lent table released (unless `held`).
    pub(crate) fn take_back(
        &self,
        g: usize,
        model: SequentialModel,
        layout: &ParamLayout,
        held: bool,
    ) -> Result<SequentialModel> {
        match g == self.user && !held {
            true => params::write_range(model, layout, self.param..self.param + 1, None, false),
            false => Ok(model),
        }
    }

    /// Group `g`'s backward gave `grads`: the user's gradient of the table is kept.
    pub(crate) fn user_done(
        &mut self,
        g: usize,
        model: &SequentialModel,
        grads: Option<&burn::tensor::Gradients>,
        layout: &ParamLayout,
    ) -> Result<()> {
        if let (true, Some(grads)) = (g == self.user, grads) {
            self.grad = params::grad_of(model, grads, layout, self.param)?;
        }
        Ok(())
    }

    /// `ready` with the table's gradient, in the owner's backward (`g`), summed with the
    /// user's.
    pub(crate) fn summed<'a>(
        &'a mut self,
        g: usize,
        ready: &'a mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> impl FnMut(usize, &[f32]) -> Result<()> + 'a {
        let extra = match g == self.owner.0 {
            true => self.grad.take(),
            false => None,
        };
        let param = self.param;
        move |i, g| match (&extra, i == param) {
            (Some(e), true) => ready(i, &g.iter().zip(e).map(|(a, b)| a + b).collect::<Vec<_>>()),
            _ => ready(i, g),
        }
    }
}
