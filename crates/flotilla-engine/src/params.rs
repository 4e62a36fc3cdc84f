//! Flat views of a model's parameters and gradients.
//!
//! **Parameter order** (the contract every rank and every strategy relies on): parameters in
//! the module's visit order, that is layer order and, within a layer, weight before bias; each
//! tensor row-major in burn's layout (a linear weight is `[in, out]`, a convolution weight
//! `[out, in, kh, kw]`). [`ParamLayout`] records each tensor's name, shape and offset.
//!
//! Buffers (batch norm's running statistics) are not parameters: every view here skips them,
//! except the buffer view that [`ParamLayout::of_tensors`], [`read_values`] and
//! [`write_values`] give with [`Tensors::Buffers`] (see [`crate::buffers`]), in the same
//! order and layout rules.

use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::{Gradients, TensorData};

use crate::buffers::{Only, Tensors};
use crate::device::copies;
use crate::error::{EngineError, Result};
use crate::kernels;

/// One parameter tensor's place in the flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// PyTorch-style dotted name, e.g. `layers.0.weight`: the name the tensor is saved under
    /// (a normalization's `gamma` and `beta` are its `weight` and `bias`).
    pub name: String,
    /// Shape in burn's layout.
    pub shape: Vec<usize>,
    /// First index in the flat buffer.
    pub offset: usize,
    /// Number of values.
    pub len: usize,
}

/// Where every parameter tensor lives in the flat buffer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParamLayout {
    /// The tensors, in flat order.
    pub params: Vec<ParamInfo>,
    /// Total number of values.
    pub total: usize,
}

impl ParamLayout {
    /// The parameters writer `k` of `writers` writes of one weights file that several ranks
    /// write at once: the tensors in flat order cut into `writers` runs of about equal
    /// bytes, the `k`-th.
    pub fn writer_share(&self, writers: usize, k: usize) -> std::ops::Range<usize> {
        let total = self.total.max(1);
        let bound = |k: usize| {
            (self.params.iter())
                .position(|p| p.offset * writers >= total * k)
                .unwrap_or(self.params.len())
        };
        bound(k)..bound(k + 1)
    }

    /// A layout of 1-d tensors `p0`, `p1`, ... of lengths `lens`, one after the other (for
    /// code that plans over a layout, and its tests, without a model).
    pub fn of_lengths(lens: &[usize]) -> Self {
        let mut l = Self::default();
        for (i, &len) in lens.iter().enumerate() {
            l.params.push(ParamInfo {
                name: format!("p{i}"),
                shape: vec![len],
                offset: l.total,
                len,
            });
            l.total += len;
        }
        l
    }

    /// Reads the layout of `model`'s parameters.
    pub fn of<M: Module>(model: &M) -> Self {
        Self::of_tensors(model, Tensors::Params)
    }

    /// Reads the layout of `model`'s parameters or of its buffers.
    pub(crate) fn of_tensors<M: Module>(model: &M, which: Tensors) -> Self {
        let mut v = LayoutVisitor {
            path: Vec::new(),
            layout: ParamLayout::default(),
        };
        model.visit(&mut Only::new(&mut v, which));
        v.layout
    }

    /// Consecutive parameters for each of `world` ranks, by whole parameter (for an optimizer
    /// that steps whole tensors, as burn's do): parameter `i` to the rank whose equal share of
    /// the values holds its middle, so every rank's parameters are consecutive and about `1/N`
    /// of the values as whole tensors allow (some ranges may be empty).
    pub fn whole_param_cut(&self, world: usize) -> Vec<std::ops::Range<usize>> {
        let world = world.max(1);
        let total = self.total.max(1) as f64;
        let rank_of = |i: usize| {
            let p = &self.params[i];
            let middle = (p.offset as f64 + p.len as f64 / 2.0) / total;
            ((middle * world as f64) as usize).min(world - 1)
        };
        let mut ranges = Vec::with_capacity(world);
        let mut start = 0;
        for rank in 0..world {
            let mut end = start;
            while end < self.params.len() && rank_of(end) == rank {
                end += 1;
            }
            ranges.push(start..end);
            start = end;
        }
        ranges
    }

    /// A stable 64-bit fingerprint of names and shapes (XXH3), for cluster-wide checks.
    pub fn fingerprint(&self) -> u64 {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for p in &self.params {
            h.update(p.name.as_bytes());
            for d in &p.shape {
                h.update(&(*d as u64).to_le_bytes());
            }
        }
        h.digest()
    }
}

struct LayoutVisitor {
    path: Vec<String>,
    layout: ParamLayout,
}

impl ModuleVisitor for LayoutVisitor {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        // Enum variant names are not part of the PyTorch-style name (see SafetensorsStore's
        // `skip_enum_variants`), and the root struct's fields are entered with their own name.
        // A normalization's `gamma` and `beta` are PyTorch's `weight` and `bias`, as burn's
        // PyTorch adapter saves them.
        let norm = matches!(
            container_type,
            "Struct:BatchNorm" | "Struct:LayerNorm" | "Struct:RmsNorm"
        );
        let part = match (norm, name) {
            (_, _) if container_type.starts_with("Enum:") => "",
            (true, "gamma") => "weight",
            (true, "beta") => "bias",
            _ => name,
        };
        self.path.push(part.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let shape = param.lazy_shape().dims::<D>().to_vec();
        let len = shape.iter().product();
        let name = self
            .path
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect::<Vec<_>>()
            .join(".");
        self.layout.params.push(ParamInfo {
            name,
            shape,
            offset: self.layout.total,
            len,
        });
        self.layout.total += len;
    }
}

/// Gives every parameter the id of its position in flat order, so that ids (and so optimizer
/// state keyed by id) agree across ranks and across runs.
pub fn renumber<M: Module>(model: M) -> M {
    struct Renumber(u64);
    impl ModuleMapper for Renumber {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (_, value, mapper) = param.consume();
            let id = ParamId::from(self.0);
            self.0 += 1;
            Param::from_mapped_value(id, value, mapper)
        }
    }
    model.map(&mut Only::new(&mut Renumber(0), Tensors::Params))
}

/// The ids of `model`'s parameters in flat order (its buffers skipped): what optimizer state
/// keyed by id is keyed by in this process.
pub fn param_ids<M: Module>(model: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    model.visit(&mut Only::new(&mut ids, Tensors::Params));
    ids.0
}

/// Copies `tensor`'s values into `out` (whose length must be the tensor's).
pub(crate) fn copy_tensor<const D: usize>(tensor: Tensor<D>, out: &mut [f32]) -> Result<()> {
    let data = tensor.into_data().convert::<f32>();
    let values = data
        .as_slice::<f32>()
        .map_err(|e| EngineError::Batch(format!("reading a tensor: {e:?}")))?;
    if values.len() != out.len() {
        return Err(EngineError::FlatLength {
            expected: out.len(),
            got: values.len(),
        });
    }
    out.copy_from_slice(values);
    Ok(())
}

/// Copies every parameter (or every buffer) of `model` into `out` (flat order of `layout`,
/// the layout of the same kind of tensors).
pub fn read_values<M: Module>(
    model: &M,
    layout: &ParamLayout,
    out: &mut [f32],
    which: Tensors,
) -> Result<()> {
    if out.len() != layout.total {
        return Err(EngineError::FlatLength {
            expected: layout.total,
            got: out.len(),
        });
    }
    struct Reader<'a> {
        out: &'a mut [f32],
        offset: usize,
        error: Option<EngineError>,
    }
    impl ModuleVisitor for Reader<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            let len = tensor.shape().num_elements();
            let Some(dst) = self.out.get_mut(self.offset..self.offset + len) else {
                self.error.get_or_insert(EngineError::FlatLength {
                    expected: self.offset + len,
                    got: self.out.len(),
                });
                return;
            };
            if let Err(e) = copy_tensor(tensor, dst) {
                self.error.get_or_insert(e);
            }
            self.offset += len;
        }
    }
    let _copy = copies::to_host(which.name(), layout.total);
    let mut reader = Reader {
        out,
        offset: 0,
        error: None,
    };
    model.visit(&mut Only::new(&mut reader, which));
    reader.error.map_or(Ok(()), Err)
}

/// Copies the parameters whose index is in `params` into `out` (their values one after the
/// other in flat order; its length is theirs).
pub(crate) fn read_range<M: Module>(
    model: &M,
    layout: &ParamLayout,
    params: Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    struct Reader<'a> {
        params: Range<usize>,
        index: usize,
        out: &'a mut [f32],
        offset: usize,
        error: Option<EngineError>,
    }
    impl ModuleVisitor for Reader<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let index = self.index;
            self.index += 1;
            if !self.params.contains(&index) || self.error.is_some() {
                return;
            }
            let tensor = param.val();
            let len = tensor.shape().num_elements();
            let Some(dst) = self.out.get_mut(self.offset..self.offset + len) else {
                self.error = Some(EngineError::FlatLength {
                    expected: self.offset + len,
                    got: self.out.len(),
                });
                return;
            };
            self.error = copy_tensor(tensor, dst).err();
            self.offset += len;
        }
    }
    let len: usize = layout
        .params
        .get(params.clone())
        .map_or(0, |infos| infos.iter().map(|p| p.len).sum());
    if out.len() != len {
        return Err(EngineError::FlatLength {
            expected: len,
            got: out.len(),
        });
    }
    let _copy = copies::to_host(Tensors::Params.name(), len);
    let mut reader = Reader {
        params,
        index: 0,
        out,
        offset: 0,
        error: None,
    };
    model.visit(&mut Only::new(&mut reader, Tensors::Params));
    reader.error.map_or(Ok(()), Err)
}

/// Replaces every parameter (or every buffer) of `model` with values from `src` (flat order of
/// `layout`), keeping parameter ids (so optimizer state stays attached) and gradient
/// requirements.
pub fn write_values<M: Module>(
    model: M,
    layout: &ParamLayout,
    src: &[f32],
    which: Tensors,
) -> Result<M> {
    if src.len() != layout.total {
        return Err(EngineError::FlatLength {
            expected: layout.total,
            got: src.len(),
        });
    }
    let _copy = copies::to_device(which.name(), layout.total);
    let mut writer = RangeWriter {
        layout,
        params: 0..layout.params.len(),
        src: Some(src),
        require_grad: None,
        index: 0,
    };
    Ok(model.map(&mut Only::new(&mut writer, which)))
}

/// Replaces the parameters whose index is in `params` (consecutive, flat order) with the
/// values of `src` (theirs one after the other), each a leaf that requires its gradient when
/// `require_grad`; with `src` `None`, releases them: each becomes an empty tensor of its rank
/// (ZeRO-3 between the uses of a group's parameters; [`ParamLayout`] keeps their shapes).
/// Parameter ids are kept, the other parameters left as they are.
pub(crate) fn write_range<M: Module>(
    model: M,
    layout: &ParamLayout,
    params: Range<usize>,
    src: Option<&[f32]>,
    require_grad: bool,
) -> Result<M> {
    let infos = layout
        .params
        .get(params.clone())
        .ok_or(EngineError::FlatLength {
            expected: layout.params.len(),
            got: params.end,
        })?;
    let len: usize = infos.iter().map(|p| p.len).sum();
    if let Some(src) = src
        && src.len() != len
    {
        return Err(EngineError::FlatLength {
            expected: len,
            got: src.len(),
        });
    }
    let _copy = src.map(|_| copies::to_device("parameters", len));
    let mut writer = RangeWriter {
        layout,
        params,
        src,
        require_grad: Some(require_grad),
        index: 0,
    };
    Ok(model.map(&mut Only::new(&mut writer, Tensors::Params)))
}

/// Writes the tensors whose index is in `params` from `src` (which starts at the first of
/// them), in the layout's shapes, or releases them (`src` `None`).
struct RangeWriter<'a> {
    layout: &'a ParamLayout,
    params: Range<usize>,
    src: Option<&'a [f32]>,
    /// Whether the written tensors require their gradient (`None`: as the old ones did).
    require_grad: Option<bool>,
    index: usize,
}

impl ModuleMapper for RangeWriter<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let index = self.index;
        self.index += 1;
        if !self.params.contains(&index) {
            return param;
        }
        if self.src.is_none() && !param.is_initialized() {
            // Released without drawing it: a lazily initialised parameter never used yet (a
            // ZeRO-3 block built only to run gathered values) keeps no values and draws none.
            let empty = Tensor::<D>::empty([0; D], &param.lazy_device());
            return Param::initialized(param.id, empty);
        }
        let (id, value, mapper) = param.consume();
        let device = value.device();
        let require_grad = self.require_grad.unwrap_or_else(|| value.is_require_grad());
        drop(value);
        // Both lengths were checked against the layout by the callers, so the slices are in
        // range.
        let info = &self.layout.params[index];
        let first = self.layout.params[self.params.start].offset;
        let tensor = match self.src {
            Some(src) => {
                let at = info.offset - first;
                let values = src[at..at + info.len].to_vec();
                let shape = burn::tensor::Shape::from(info.shape.clone());
                Tensor::<D>::from_data(TensorData::new(values, shape), &device)
            }
            None => Tensor::<D>::empty([0; D], &device),
        };
        let tensor = if require_grad && self.src.is_some() {
            tensor.require_grad()
        } else {
            tensor
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// `model` with each parameter drawn now (a lazily initialised one: in flat order, as
/// [`read_values`] draws them), its values handed to `each` with its index and released at
/// once: no more than one tensor's values exist at a time (ZeRO-3's start of a user's module).
pub(crate) fn draw_released<M: Module>(
    model: M,
    each: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
) -> Result<M> {
    struct Drawer<'a> {
        each: &'a mut dyn FnMut(usize, &[f32]) -> Result<()>,
        index: usize,
        error: Option<EngineError>,
    }
    impl ModuleMapper for Drawer<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let index = self.index;
            self.index += 1;
            let (id, value, mapper) = param.consume();
            let device = value.device();
            if self.error.is_none() {
                let data = value.into_data().convert::<f32>();
                self.error = match data.as_slice::<f32>() {
                    Ok(values) => (self.each)(index, values).err(),
                    Err(e) => Some(EngineError::Batch(format!("reading a parameter: {e:?}"))),
                };
            }
            Param::from_mapped_value(id, Tensor::<D>::empty([0; D], &device), mapper)
        }
    }
    let mut drawer = Drawer {
        each,
        index: 0,
        error: None,
    };
    let model = model.map(&mut Only::new(&mut drawer, Tensors::Params));
    drawer.error.map_or(Ok(model), Err)
}

/// Calls `f(index, values)` with each parameter's gradient, in flat order. A parameter with
/// no gradient (unused in the forward pass) gives zeros.
pub fn for_each_grad<M: Module>(
    model: &M,
    grads: &Gradients,
    layout: &ParamLayout,
    f: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    for_each_grad_in(model, Some(grads), layout, 0..layout.params.len(), f)
}

/// Calls `f(index, values)` with the gradient of each parameter whose index is in `params`,
/// in flat order. A parameter with no gradient in `grads` (or with no `grads` at all) gives
/// zeros. The gradients are read back from the device first, all of them in one
/// `device_to_host` span, then handed to `f` (whose work, such as starting a bucket's
/// all-reduce, is not part of the copy).
pub fn for_each_grad_in<M: Module>(
    model: &M,
    grads: Option<&Gradients>,
    layout: &ParamLayout,
    params: Range<usize>,
    f: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    let read = read_grads(model, grads, layout, params)?;
    let mut zeros = Vec::new();
    for (index, data) in read {
        let len = layout.params[index].len;
        match data {
            // The gradient's own buffer is handed over as it is (no intermediate copy).
            Some(data) => match data.values() {
                Ok(values) if values.len() == len => f(index, values)?,
                Ok(values) => {
                    return Err(EngineError::FlatLength {
                        expected: len,
                        got: values.len(),
                    });
                }
                Err(e) => return Err(EngineError::Batch(format!("reading a gradient: {e:?}"))),
            },
            None => {
                zeros.resize(len, 0.0);
                f(index, &zeros[..len])?;
            }
        }
    }
    Ok(())
}

/// The gradient of parameter `param` in `grads` (`None`: it has none there).
pub(crate) fn grad_of<M: Module>(
    model: &M,
    grads: &Gradients,
    layout: &ParamLayout,
    param: usize,
) -> Result<Option<Vec<f32>>> {
    let read = read_grads(model, Some(grads), layout, param..param + 1)?;
    match read.into_iter().next().and_then(|(_, data)| data) {
        Some(data) => data
            .values()
            .map(|v| Some(v.to_vec()))
            .map_err(|e| EngineError::Batch(format!("reading a gradient: {e:?}"))),
        None => Ok(None),
    }
}

/// A gradient read back: on Flex its own buffer (shared with the gradients, not copied: the
/// two copies of burn's `into_data` were 5 % of the MLP's step), else its values as data.
enum GradValues {
    /// A contiguous `f32` Flex tensor.
    Flex(burn::backend::flex::FlexTensor),
    /// Another backend's (or dtype's) gradient, read as `f32` data.
    Data(TensorData),
}

impl GradValues {
    /// The gradient of `param` in `grads`, if it has one.
    fn of<const D: usize>(param: &Param<Tensor<D>>, grads: &Gradients) -> Option<Self> {
        let grad = param.val().grad(grads)?;
        let grad = grad.into_dispatch();
        Some(match kernels::host::flex_f32(&grad) {
            Some(flex) => Self::Flex(flex),
            None => Self::Data(
                Tensor::<D>::from_dispatch(grad)
                    .into_data()
                    .convert::<f32>(),
            ),
        })
    }

    /// Its values.
    fn values(&self) -> std::result::Result<&[f32], String> {
        match self {
            Self::Flex(t) => kernels::host::values(t).ok_or_else(|| "not contiguous".to_string()),
            Self::Data(d) => d.as_slice::<f32>().map_err(|e| format!("{e:?}")),
        }
    }
}

/// The gradients of the parameters whose index is in `params` (`None`: no gradient), read
/// from the device in flat order inside one `device_to_host` span.
fn read_grads<M: Module>(
    model: &M,
    grads: Option<&Gradients>,
    layout: &ParamLayout,
    params: Range<usize>,
) -> Result<Vec<(usize, Option<GradValues>)>> {
    struct GradReader<'a> {
        grads: Option<&'a Gradients>,
        layout: &'a ParamLayout,
        params: Range<usize>,
        index: usize,
        read: Vec<(usize, Option<GradValues>)>,
        error: Option<EngineError>,
    }
    impl ModuleVisitor for GradReader<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let index = self.index;
            self.index += 1;
            if self.error.is_some() || !self.params.contains(&index) {
                return;
            }
            if index >= self.layout.params.len() {
                self.error = Some(EngineError::FlatLength {
                    expected: self.layout.params.len(),
                    got: index + 1,
                });
                return;
            }
            let data = self.grads.and_then(|grads| GradValues::of(param, grads));
            self.read.push((index, data));
        }
    }
    let values: usize = layout
        .params
        .get(params.clone())
        .map_or(0, |infos| infos.iter().map(|info| info.len).sum());
    let _copy = copies::to_host("gradients", values);
    let mut reader = GradReader {
        grads,
        layout,
        params,
        index: 0,
        read: Vec::new(),
        error: None,
    };
    model.visit(&mut Only::new(&mut reader, Tensors::Params));
    reader.error.map_or(Ok(reader.read), Err)
}

/// Builds burn's [`GradientsParams`] from a flat gradient buffer, keyed by `model`'s ids.
pub fn grads_from_flat<M: Module>(
    model: &M,
    layout: &ParamLayout,
    flat: &[f32],
    device: &Device,
) -> Result<GradientsParams> {
    if flat.len() != layout.total {
        return Err(EngineError::FlatLength {
            expected: layout.total,
            got: flat.len(),
        });
    }
    struct Builder<'a> {
        flat: &'a [f32],
        offset: usize,
        device: &'a Device,
        grads: GradientsParams,
    }
    impl ModuleVisitor for Builder<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let shape = param.lazy_shape();
            let len = shape.num_elements();
            let values = self.flat[self.offset..self.offset + len].to_vec();
            self.offset += len;
            let tensor = Tensor::<D>::from_data(TensorData::new(values, shape), self.device);
            self.grads.register(param.id, tensor);
        }
    }
    let _copy = copies::to_device("gradients", layout.total);
    let mut b = Builder {
        flat,
        offset: 0,
        device,
        grads: GradientsParams::new(),
    };
    model.visit(&mut Only::new(&mut b, Tensors::Params));
    Ok(b.grads)
}

#[cfg(test)]
mod writer_share_tests {
    use super::ParamLayout;

    /// Every parameter is written by exactly one writer, in runs of about equal bytes.
    #[test]
    fn the_writers_shares_cover_every_tensor_once_by_bytes() {
        let layout = ParamLayout::of_lengths(&[100, 5, 5, 90, 100, 10, 90]);
        for writers in 1..=4 {
            let shares: Vec<_> = (0..writers)
                .map(|k| layout.writer_share(writers, k))
                .collect();
            assert_eq!(shares[0].start, 0);
            assert_eq!(shares[writers - 1].end, layout.params.len());
            for pair in shares.windows(2) {
                assert_eq!(pair[0].end, pair[1].start, "{shares:?}");
            }
            let bytes = |r: &std::ops::Range<usize>| -> usize {
                layout.params[r.clone()].iter().map(|p| p.len).sum()
            };
            let most = shares.iter().map(bytes).max().unwrap_or(0);
            assert!(most <= 400 / writers + 100, "{writers} writers: {shares:?}");
        }
        assert_eq!(layout.writer_share(2, 1), 4..7);
    }
}

#[cfg(test)]
mod grad_read_tests {
    use burn::nn::LinearConfig;
    use burn::prelude::*;

    use super::{ParamLayout, for_each_grad, grad_of};
    use crate::kernels::host;

    /// On Flex the step's callback gets each gradient's own buffer (no copy): the slices it is
    /// handed start where the gradients' tensors' values do, and hold their values.
    #[test]
    fn gradients_are_handed_over_in_their_own_buffers() {
        let device = Device::flex().autodiff();
        let model = LinearConfig::new(5, 3).init(&device);
        let layout = ParamLayout::of(&model);
        let x = Tensor::<2>::ones([4, 5], &device);
        let grads = model.forward(x).sum().backward();
        let owners = [
            model.weight.val().grad(&grads).map(|g| g.into_dispatch()),
            model
                .bias
                .as_ref()
                .and_then(|b| b.val().grad(&grads))
                .map(|g| g.into_dispatch()),
        ];
        let mut seen = Vec::new();
        for_each_grad(&model, &grads, &layout, &mut |index, values| {
            seen.push((index, values.as_ptr(), values.to_vec()));
            Ok(())
        })
        .expect("the gradients");
        assert_eq!(seen.len(), 2);
        for ((index, ptr, values), owner) in seen.into_iter().zip(owners) {
            let owner = owner.expect("a gradient");
            let flex = host::flex_f32(&owner).expect("a Flex f32 gradient");
            assert_eq!(
                host::values(&flex).map(<[f32]>::as_ptr),
                Some(ptr),
                "parameter {index}"
            );
            let want = grad_of(&model, &grads, &layout, index)
                .expect("read")
                .expect("some");
            assert_eq!(values, want, "parameter {index}");
        }
    }
}
