//! What a checkpoint holds ([`Contents`]), and the whole of it as one safetensors file that
//! PyTorch loads ([`export`]): the model's tensors under their PyTorch names and layout (as
//! every strategy's `model.safetensors` has them, a ZeRO run's and a pipeline's merged), the
//! optimizer state of a spec model put together from its shards (a pipeline's from its
//! stages, each from its file or its replicas' shards) and laid out as the weights
//! (`optimizer.<tensor>.<field>`, burn's field names, e.g. Adam's
//! `momentum.moment_1`), and the run's position
//! (`flotilla.step`, `flotilla.epoch`, ...) in the file's metadata.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use flotilla_engine::{BurnEngine, ModelSpec, ModelState, OptimizerSpec};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

use crate::checkpoint::{self, CheckpointState};
use crate::error::{Result, TrainError};

/// A tensor of the export: name, shape, little-endian `f32` bytes.
type OwnedTensor = (String, Vec<usize>, Vec<u8>);

/// Buffers' names (batch norm's running statistics), which an optimizer has no state for.
const BUFFERS: [&str; 3] = ["running_mean", "running_var", "num_batches_tracked"];

/// What a checkpoint holds.
#[derive(Debug, Clone)]
pub struct Contents {
    /// Its directory.
    pub dir: PathBuf,
    /// Its `state.json`: step, position in the data, model, ZeRO shards, pipeline stages.
    pub state: CheckpointState,
    /// The model's tensors: name, dtype, shape.
    pub tensors: Vec<(String, String, Vec<usize>)>,
    /// Its files and their sizes in bytes.
    pub files: Vec<(String, u64)>,
    /// The optimizer state's fields (e.g. `moment_1`), when they can be read (a spec
    /// model's), or why not.
    pub optimizer: std::result::Result<Vec<String>, String>,
}

fn error(path: &Path, message: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// The checkpoint `path` names: a checkpoint's directory, or a run's output directory (its
/// newest complete checkpoint).
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join("state.json").is_file() {
        return Ok(path.to_path_buf());
    }
    let (newest, warnings) = checkpoint::newest_complete(path)?;
    newest.ok_or_else(|| {
        let why = match warnings.is_empty() {
            true => "no state.json and no complete checkpoint under it".to_string(),
            false => format!("no complete checkpoint under it: {}", warnings.join("; ")),
        };
        error(path, why)
    })
}

/// The checkpoint `path` names (see [`resolve`]): its directory, state and
/// `model.safetensors` bytes.
fn open(path: &Path) -> Result<(PathBuf, CheckpointState, Vec<u8>)> {
    let dir = resolve(path)?;
    let state = checkpoint::read_state(&dir)?;
    let weights = read(&dir.join("model.safetensors"))?;
    Ok((dir, state, weights))
}

/// The tensors of `weights`, the `model.safetensors` of `dir`.
fn parse<'a>(dir: &Path, weights: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(weights)
        .map_err(|e| error(&dir.join("model.safetensors"), e.to_string()))
}

/// Reads what the checkpoint `path` names holds (see [`resolve`]).
pub fn contents(path: &Path) -> Result<Contents> {
    let (dir, state, weights) = open(path)?;
    let st = parse(&dir, &weights)?;
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| (name, format!("{:?}", v.dtype()), v.shape().to_vec()))
        .collect();
    tensors.sort();
    let mut files = Vec::new();
    for entry in fs::read_dir(&dir).map_err(|e| TrainError::io(&dir, e))? {
        let entry = entry.map_err(|e| TrainError::io(&dir, e))?;
        let size = entry
            .metadata()
            .map_err(|e| TrainError::io(entry.path(), e))?;
        files.push((entry.file_name().to_string_lossy().into_owned(), size.len()));
    }
    files.sort();
    let optimizer = Optimizer::read(&dir, &state, &weights).map(|o| o.fields);
    Ok(Contents {
        dir,
        state,
        tensors,
        files,
        optimizer,
    })
}

fn read(path: &Path) -> Result<Vec<u8>> {
    fs::read(path).map_err(|e| TrainError::io(path, e))
}

/// A spec model's optimizer state, put together (a ZeRO run's shards, a pipeline's stages), over an engine of
/// the spec that lays each field out as the weights.
struct Optimizer {
    engine: BurnEngine,
    state: flotilla_engine::FlatOptimizerState,
    fields: Vec<String>,
}

/// A pipeline checkpoint's optimizer state over the whole model's `layout`: its stages'
/// joined in the model's order (`strategy/pipeline/recut.rs`), checked to hold the model's
/// tensors in that order.
fn pipeline_state(
    dir: &Path,
    state: &CheckpointState,
    spec: &ModelSpec,
    layout: &flotilla_engine::ParamLayout,
) -> Result<flotilla_engine::FlatOptimizerState> {
    let (flat, names) = crate::strategy::pipeline::model_flat_state(dir, state, spec)?;
    if layout.params.iter().map(|p| &p.name).ne(names.iter()) {
        return Err(error(
            dir,
            "its stages do not hold the model's tensors in order",
        ));
    }
    Ok(flat)
}

impl Optimizer {
    /// The optimizer state of the checkpoint in `dir`; why not when it cannot be read here.
    fn read(
        dir: &Path,
        state: &CheckpointState,
        weights: &[u8],
    ) -> std::result::Result<Self, String> {
        let (_, header) = SafeTensors::read_metadata(weights).map_err(|e| e.to_string())?;
        let spec = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get("flotilla.model"))
            .ok_or(
                "the model is a program's own module: its program knows its optimizer's layout",
            )?;
        let spec =
            ModelSpec::from_yaml(spec, "the checkpoint's model").map_err(|e| e.to_string())?;
        let engine = BurnEngine::new(&spec, &OptimizerSpec::default(), "flex", 0)
            .map_err(|e| e.to_string())?;
        let flat = match state.stages {
            None => checkpoint::read_flat_state(dir, state, engine.layout()),
            Some(_) => pipeline_state(dir, state, &spec, engine.layout()),
        }
        .map_err(|e| e.to_string())?;
        let fields = flat.field_names();
        Ok(Self {
            engine,
            state: flat,
            fields,
        })
    }

    /// Field `name` laid out as the weights: each parameter's tensor under its PyTorch name.
    fn field(&mut self, name: &str) -> std::result::Result<Vec<OwnedTensor>, String> {
        let layout = self.engine.layout().clone();
        let values = self
            .state
            .field_values(&layout, name)
            .ok_or_else(|| format!("field {name} is not f32 on every parameter"))?;
        self.engine
            .write_params(&values)
            .map_err(|e| e.to_string())?;
        let bytes = self.engine.weights_bytes().map_err(|e| e.to_string())?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
        Ok(st
            .tensors()
            .into_iter()
            .filter(|(n, _)| !BUFFERS.iter().any(|b| n.ends_with(b)))
            .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
            .collect())
    }
}

/// What [`export`] wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// Tensors written: the model's, and the optimizer's.
    pub tensors: (usize, usize),
    /// Why the optimizer state is not in the file, when it is not.
    pub without_optimizer: Option<String>,
}

/// Writes the checkpoint `path` names (see [`resolve`]) as one safetensors file `out` (see
/// the module docs), atomically.
pub fn export(path: &Path, out: &Path) -> Result<Exported> {
    let (dir, state, weights) = open(path)?;
    let st = parse(&dir, &weights)?;
    let (_, header) = SafeTensors::read_metadata(&weights)
        .map_err(|e| error(&dir.join("model.safetensors"), e.to_string()))?;
    let mut metadata: HashMap<String, String> = header.metadata().clone().unwrap_or_default();
    metadata.extend(position(&state));
    let mut owned: Vec<OwnedTensor> = Vec::new();
    let without_optimizer = match Optimizer::read(&dir, &state, &weights) {
        Ok(mut optimizer) => {
            for field in optimizer.fields.clone() {
                let tensors = optimizer.field(&field).map_err(|e| error(&dir, e))?;
                for (name, shape, data) in tensors {
                    owned.push((format!("optimizer.{name}.{field}"), shape, data));
                }
            }
            None
        }
        Err(why) => Some(why),
    };
    let mut views: Vec<(String, TensorView<'_>)> = st.tensors();
    let model_tensors = views.len();
    for (name, shape, data) in &owned {
        let view = TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
            .map_err(|e| error(out, e.to_string()))?;
        views.push((name.clone(), view));
    }
    let bytes =
        safetensors::serialize(views, Some(metadata)).map_err(|e| error(out, e.to_string()))?;
    let tmp = out.with_extension("safetensors.tmp");
    fs::write(&tmp, &bytes).map_err(|e| TrainError::io(&tmp, e))?;
    fs::rename(&tmp, out).map_err(|e| TrainError::io(out, e))?;
    Ok(Exported {
        dir,
        tensors: (model_tensors, owned.len()),
        without_optimizer,
    })
}

/// The run's position and origin as metadata.
fn position(state: &CheckpointState) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    m.insert("flotilla.step".into(), state.step.to_string());
    m.insert("flotilla.epoch".into(), state.epoch.to_string());
    m.insert(
        "flotilla.step_in_epoch".into(),
        state.step_in_epoch.to_string(),
    );
    m.insert("flotilla.model_name".into(), state.model.clone());
    m.insert(
        "flotilla.config_hash".into(),
        format!("{:016x}", state.config_hash),
    );
    if let Some(acc) = state.test_acc {
        m.insert("flotilla.test_acc".into(), acc.to_string());
    }
    m
}

impl fmt::Display for Contents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.state;
        writeln!(f, "checkpoint {}", self.dir.display())?;
        writeln!(
            f,
            "  model {}, {} parameters; step {} (epoch {}, batch {} of it){}",
            s.model,
            s.num_params,
            s.step,
            s.epoch,
            s.step_in_epoch,
            s.test_acc
                .map_or(String::new(), |a| format!("; test accuracy {a:.4}"))
        )?;
        if let Some(z) = &s.zero {
            writeln!(
                f,
                "  ZeRO stage {}: optimizer state in {} shards (one per rank)",
                z.stage, z.world
            )?;
        }
        if let Some(z) = s.stage_zero.as_ref().and_then(|z| z.first()) {
            writeln!(
                f,
                "  ZeRO stage {} among each stage's {} replicas: optimizer state in shards",
                z.stage, z.world
            )?;
        }
        if let Some(stages) = &s.stages {
            let cut: Vec<String> = stages.iter().map(|[a, b]| format!("{a}..{b}")).collect();
            writeln!(
                f,
                "  pipeline of {} stages (layers {})",
                stages.len(),
                cut.join(", ")
            )?;
        }
        match &self.optimizer {
            Ok(fields) => writeln!(f, "  optimizer state: {}", fields.join(", "))?,
            Err(why) => writeln!(f, "  optimizer state: not read here ({why})")?,
        }
        writeln!(f, "  tensors ({}):", self.tensors.len())?;
        for (name, dtype, shape) in &self.tensors {
            writeln!(f, "    {name} {dtype} {shape:?}")?;
        }
        writeln!(f, "  files:")?;
        for (name, size) in &self.files {
            writeln!(f, "    {name} {size} bytes")?;
        }
        Ok(())
    }
}
