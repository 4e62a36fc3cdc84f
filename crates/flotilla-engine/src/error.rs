//! The engine's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the engine adapter.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A model spec could not be parsed.
    #[error("model spec {source_name}: {message}")]
    SpecParse {
        /// Where the spec came from (a file path or `<inline>`).
        source_name: String,
        /// What the parser said.
        message: String,
    },
    /// A layer's input shape does not fit the layer.
    #[error("model spec: layer {index} ({kind}): {message}")]
    LayerShape {
        /// The layer's 0-based position in the spec.
        index: usize,
        /// The layer kind, e.g. `linear`.
        kind: String,
        /// What does not fit.
        message: String,
    },
    /// A spec that is structurally wrong (no layers, bad input shape, wrong number of outputs).
    #[error("model spec: {0}")]
    InvalidSpec(String),
    /// A spec (or its file) asks for more than a limit allows (see [`crate::SpecLimits`]).
    #[error("model spec: {what} is {value}, more than the limit {limit} = {max}")]
    LimitExceeded {
        /// What is too large.
        what: String,
        /// Its size.
        value: u128,
        /// The limit's name.
        limit: &'static str,
        /// The limit.
        max: u64,
    },
    /// A flat buffer's length does not match the model's parameter count.
    #[error("flat buffer has {got} values but the model has {expected} parameters")]
    FlatLength {
        /// Number of parameters the model has.
        expected: usize,
        /// Number of values given.
        got: usize,
    },
    /// A batch whose buffers do not fit its declared size.
    #[error("batch: {0}")]
    Batch(String),
    /// The model is not available (a previous engine call failed while holding it).
    #[error("the model is unavailable after an earlier failure")]
    ModelUnavailable,
    /// No gradients are available (no backward pass since the last step).
    #[error("no gradients: call forward_backward before reading or applying gradients")]
    NoGradients,
    /// The requested device is not compiled into this build.
    #[error(
        "device `{0}` is not available in this build (known: flex, auto; ndarray, libtorch, cuda and wgpu with the features of those names)"
    )]
    UnknownDevice(String),
    /// A GPU device named in a build without the feature that brings its backend.
    #[error(
        "device `{device}` needs a binary built with the `{feature}` feature (cargo build --release --features {feature})"
    )]
    FeatureMissing {
        /// The device as named (`cuda`, `cuda:1`).
        device: String,
        /// The cargo feature that builds its backend.
        feature: &'static str,
    },
    /// A GPU backend whose driver cannot be used on this machine (not installed, no device).
    #[error("device `{device}`: {detail}")]
    GpuDriver {
        /// The device as named.
        device: String,
        /// What is missing (names the driver's library).
        detail: String,
    },
    /// A device index beyond the GPUs the driver reports.
    #[error("device `{device}`: GPU index {index} but the driver reports {count} GPU(s)")]
    NoSuchGpu {
        /// The device as named.
        device: String,
        /// The index asked for.
        index: usize,
        /// The GPUs the driver sees.
        count: usize,
    },
    /// No Vulkan adapter answers at the requested index (no driver, or fewer adapters).
    #[error(
        "device `wgpu:{index}`: no Vulkan adapter at index {index} ({found} found); install a Vulkan driver (a GPU's, or Mesa's lavapipe on the CPU: Debian's `mesa-vulkan-drivers` and `libvulkan1`) and check `vulkaninfo --summary`"
    )]
    NoVulkanAdapter {
        /// The adapter index asked for.
        index: usize,
        /// How many Vulkan adapters this machine offers.
        found: usize,
    },
    /// The Vulkan adapter was found but its device could not be opened.
    #[error("device `wgpu:{index}`: the Vulkan device could not be opened: {message}")]
    VulkanInit {
        /// The adapter index.
        index: usize,
        /// What wgpu said.
        message: String,
    },
    /// A model's parameter tensors are not all on one device (as the tensors report it; see
    /// [`crate::ModelState::param_placement`]): a tensor was created or written back on
    /// another backend than the rest.
    #[error(
        "parameter tensors on two devices: {first_tensor} is on {first} but {tensor} is on {device}"
    )]
    MixedDevices {
        /// The first parameter tensor (flat order).
        first_tensor: String,
        /// Where it is.
        first: String,
        /// The first tensor that is elsewhere.
        tensor: String,
        /// Where that one is.
        device: String,
    },
    /// A synchronized batch norm's sum over the ranks failed (the pass is void).
    #[error("synchronized batch norm: {0}")]
    BatchNormSync(String),
    /// An optimizer setting that is out of range.
    #[error("optimizer: {0}")]
    Optimizer(String),
    /// Optimizer state (from a checkpoint, or sent by another rank) holds a tensor that does
    /// not fit the parameter it is keyed to: the state of another model, or of a shard cut
    /// otherwise and not re-sharded. Checked before burn sees the state.
    #[error(
        "optimizer state: tensor {tensor} has shape {got:?} but {param} has shape {expected:?} \
         (the state of another model, or of another shard cut)"
    )]
    StateShape {
        /// The state tensor's name (`{id}.{field}`, e.g. `3.moment_1`).
        tensor: String,
        /// What the state tensor belongs to in this optimizer (a parameter, or a shard's
        /// piece of one), or that it belongs to nothing.
        param: String,
        /// The shape this optimizer expects (empty when the tensor belongs to nothing).
        expected: Vec<usize>,
        /// The tensor's shape in the state.
        got: Vec<usize>,
    },
    /// The caller's gradient callback ([`crate::Engine::forward_backward_streaming`],
    /// [`crate::Engine::for_each_grad`]) stopped the pass; the caller knows why.
    #[error("the gradient callback stopped the pass: {0}")]
    Callback(String),
    /// Activation recomputation (`recompute: true`) refused for this model or engine.
    #[error("activation recomputation: {0}")]
    Recompute(String),
    /// A whole-model operation on a model whose parameters are sharded (ZeRO-3: each rank
    /// holds its shard; the run gathers them first), or a model that cannot be sharded so.
    #[error("parameters sharded over the ranks (ZeRO-3): {0}")]
    ParamsSharded(String),
    /// Saving or loading a checkpoint failed.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file or directory concerned.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// An I/O error with the path it concerned.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl EngineError {
    /// Wraps an I/O error with the path it concerned.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            source,
        }
    }
}

/// The engine's result type.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
