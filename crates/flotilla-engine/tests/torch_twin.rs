//! The files of the PyTorch twin check (`scripts/check_layers_torch.py`). For gpt-char,
//! resnet-bn and three small models that hold the other layers (attention, RMS norm, SiLU,
//! GELU, dropout, 1-d batch norm, links between sequences; tanh, sigmoid, identity, biased and
//! strided convolutions, overlapping pools, a concatenation of images), which together hold
//! every layer kind the engine has (asserted), each trained a few steps so that no norm keeps
//! its initial weight and no running statistic its initial value, a directory gets the spec
//! (`spec.json`), the weights (`model.safetensors`, as checkpoints write them) and a batch with
//! the engine's outputs on it (`batch.safetensors`: `input`, `output_eval`, and `output_train`
//! for a batch norm model without dropout, whose training outputs use the batch's statistics).
//! For every model without dropout (whose masks PyTorch cannot draw alike), one backward too:
//! `labels` and the engine's `loss` in the batch, and the gradient of every parameter in
//! `grads.safetensors` (written as the weights are: names and PyTorch layouts).
//!
//! With python3 and numpy (as CI has) the script checks every tensor's name and PyTorch
//! shape against the spec. With `FLOTILLA_TORCH_PYTHON` naming a Python that has torch (CI
//! installs one: `.ci/run`), it also builds the PyTorch module of the same architecture, loads
//! the weights with `load_state_dict(strict=True)`, compares its outputs with the engine's
//! within 1e-4, and its loss and gradients with the engine's (the script's `GRAD_TOLERANCE`).
//! Under `CI` a missing torch fails the test. `FLOTILLA_TWIN_DIR` keeps the files in that
//! directory. The PyTorch twin of the GPT example, `scripts/gpt_char_torch.py --check`, checks
//! its model's spec, names and shapes against gpt-char's files (numpy only).

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{batch, token_batch};
use flotilla_engine::StageEngine;
use flotilla_engine::{
    BatchRef, BurnEngine, Engine, LayerSpec, ModelSpec, ModelState, Shape, Stage, StageCut,
};
use safetensors::tensor::{Dtype, TensorView};

/// Every sequence layer but the block, with a residual add and a concatenation of sequences.
const SEQ_MIX: &str = "name: seq-mix
input: [12]
layers:
  - embedding: {vocab: 40, dim: 16}
  - pos_embedding: {max_len: 16}
    out_variables: [x0]
  - attention: {heads: 4}
  - rms_norm:
    dependencies: [x0]
    out_variables: [x1]
  - linear: {out: 32}
  - gelu
  - dropout: {p: 0.2}
  - linear: {out: 16}
  - silu:
    dependencies: [x1]
    merge: concat
  - layer_norm
  - linear: {out: 40}
";

/// A 1-d batch norm after a linear layer without bias, and the norms on flat features.
const FLAT_BN: &str = "name: flat-bn
input: [10]
layers:
  - linear: {out: 12, bias: false}
  - batch_norm
  - silu
  - linear: {out: 12}
  - gelu
  - layer_norm
  - rms_norm
  - linear: {out: 5}
";

/// Tanh, sigmoid and identity; convolutions with a bias, padding and a stride; pools whose
/// windows overlap; a concatenation of images on channels.
const IMG_MIX: &str = "name: img-mix
input: [2, 9, 9]
layers:
  - conv2d: {out: 4, k: 3, padding: 1}
    out_variables: [c0]
  - tanh
  - conv2d: {out: 4, k: 3, padding: 1}
  - sigmoid
  - identity:
    dependencies: [c0]
    merge: concat
  - maxpool: {k: 2, stride: 1}
  - conv2d: {out: 6, k: 3, stride: 2}
  - relu
  - avgpool: {k: 2, stride: 1}
  - flatten
  - linear: {out: 7}
  - tanh
  - identity
  - linear: {out: 3}
";

/// Every layer kind of [`LayerSpec`]: the match has no catch-all, so a new kind does not
/// compile until it is listed here (and the test then fails until a model above holds it).
const KINDS: [&str; 19] = [
    "conv2d",
    "maxpool",
    "avgpool",
    "linear",
    "relu",
    "tanh",
    "sigmoid",
    "flatten",
    "dropout",
    "identity",
    "gelu",
    "silu",
    "layer_norm",
    "rms_norm",
    "batch_norm",
    "embedding",
    "pos_embedding",
    "attention",
    "transformer_block",
];

/// Where `layer`'s kind is in [`KINDS`].
fn kind_index(layer: &LayerSpec) -> usize {
    match layer {
        LayerSpec::Conv2d { .. } => 0,
        LayerSpec::Maxpool { .. } => 1,
        LayerSpec::Avgpool { .. } => 2,
        LayerSpec::Linear { .. } => 3,
        LayerSpec::Relu => 4,
        LayerSpec::Tanh => 5,
        LayerSpec::Sigmoid => 6,
        LayerSpec::Flatten => 7,
        LayerSpec::Dropout { .. } => 8,
        LayerSpec::Identity => 9,
        LayerSpec::Gelu => 10,
        LayerSpec::Silu => 11,
        LayerSpec::LayerNorm => 12,
        LayerSpec::RmsNorm => 13,
        LayerSpec::BatchNorm => 14,
        LayerSpec::Embedding { .. } => 15,
        LayerSpec::PosEmbedding { .. } => 16,
        LayerSpec::Attention { .. } => 17,
        LayerSpec::TransformerBlock { .. } => 18,
    }
}

/// A batch of `n` samples for `spec`: token ids, or values in `[-1, 1)`.
fn sample_batch(spec: &ModelSpec, n: usize, salt: u32) -> (Vec<f32>, Vec<i64>) {
    let per = spec.input_shape().expect("input").numel();
    let classes = spec.classes().expect("classes");
    match spec.token_vocab() {
        Some(vocab) => token_batch(n, per, vocab, salt),
        None => batch(n, per, classes, salt),
    }
}

/// A few SGD steps, then the weights written to `dir`.
fn train_and_save(spec: &ModelSpec, dir: &Path) {
    let sgd = common::plain_sgd(0.05);
    let mut e = BurnEngine::new(spec, &sgd, "flex", 61).expect("engine");
    let mut g = vec![0.0; e.num_params()];
    for step in 0..3 {
        e.set_dropout_seed(step);
        let (x, y) = sample_batch(spec, 4, 100 + step as u32);
        e.forward_backward(BatchRef {
            images: &x,
            labels: &y,
        })
        .expect("step");
        e.read_grads(&mut g).expect("grads");
        e.apply_grads(&g, 0.05).expect("apply");
    }
    e.save_weights(&dir.join("model.safetensors"))
        .expect("save");
}

fn has(spec: &ModelSpec, kind: &str) -> bool {
    spec.layers.iter().any(|n| n.layer.kind() == kind)
}

/// Whether `spec` draws dropout masks (a dropout layer with `p > 0`).
fn has_dropout(spec: &ModelSpec) -> bool {
    spec.layers
        .iter()
        .any(|l| matches!(l.layer, LayerSpec::Dropout { p } if p > 0.0))
}

/// A named tensor of the batch file: shape and little-endian bytes.
type Named = (&'static str, Vec<usize>, Dtype, Vec<u8>);

fn f32s(name: &'static str, shape: Vec<usize>, values: &[f32]) -> Named {
    let bytes = values.iter().flat_map(|x| x.to_le_bytes()).collect();
    (name, shape, Dtype::F32, bytes)
}

/// The saved weights in a one-stage pipeline (which loads them), run on a batch: the input
/// and the outputs in evaluation and (for batch norm without dropout) training.
fn outputs(spec: &ModelSpec, dir: &Path, n: usize) -> Vec<Named> {
    let cut = StageCut::at(spec, &[]).expect("cut");
    let sgd = common::plain_sgd(0.05);
    let mut stage = Stage::new(spec, &cut, 0, &sgd, "flex", 99).expect("stage");
    stage
        .load_weights(&dir.join("model.safetensors"))
        .expect("load");
    let (x, _) = sample_batch(spec, n, 7);
    let shape = |s: Shape| -> Vec<usize> {
        let dims = match s {
            Shape::Image { c, h, w } => vec![c, h, w],
            Shape::Flat(f) => vec![f],
            Shape::Seq { t, d } => vec![t, d],
        };
        std::iter::once(n).chain(dims).collect()
    };
    let input = shape(spec.input_shape().expect("input"));
    let output = shape(spec.output_shape().expect("output"));
    let eval = stage.forward_eval(n, &[&x]).expect("eval").remove(0);
    let mut files = vec![
        f32s("input", input, &x),
        f32s("output_eval", output.clone(), &eval),
    ];
    if has(spec, "batch_norm") && !has_dropout(spec) {
        let train = stage.forward(0, n, &[&x]).expect("train").remove(0);
        files.push(f32s("output_train", output, &train));
    }
    files
}

/// One backward of the engine on the batch of [`outputs`] with the saved weights: the
/// labels and the loss for the batch file; the gradient of every parameter goes to
/// `grads.safetensors`, written as the weights are (the gradient put in an engine's
/// parameters and saved), so that its names and layouts are PyTorch's.
fn backward(spec: &ModelSpec, dir: &Path, n: usize) -> Vec<Named> {
    let sgd = common::plain_sgd(0.05);
    let mut e = BurnEngine::new(spec, &sgd, "flex", 99).expect("engine");
    e.load_weights(&dir.join("model.safetensors"))
        .expect("load");
    let (x, y) = sample_batch(spec, n, 7);
    let loss = e
        .forward_backward(BatchRef {
            images: &x,
            labels: &y,
        })
        .expect("backward");
    let mut g = vec![0.0; e.num_params()];
    e.read_grads(&mut g).expect("grads");
    e.write_params(&g).expect("gradient as parameters");
    e.save_weights(&dir.join("grads.safetensors"))
        .expect("save grads");
    let labels = y.iter().flat_map(|v| v.to_le_bytes()).collect();
    vec![
        ("labels", vec![y.len()], Dtype::I64, labels),
        f32s("loss", vec![1], &[loss]),
    ]
}

fn write_batch(path: &Path, tensors: &[Named]) {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, dtype, b)| {
            let view = TensorView::new(*dtype, shape.clone(), b).expect("view");
            (*name, view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("write batch");
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs the script on `dir` with `python` (`--torch` with torch); returns its output.
fn check(python: &str, dir: &Path, torch: bool) -> String {
    let mut args = vec![dir.as_os_str()];
    if torch {
        args.push("--torch".as_ref());
    }
    run_script(python, "check_layers_torch.py", &args)
}

/// Runs `scripts/<script>` with `args` under `python`, asserting it succeeds; returns its
/// output.
fn run_script(python: &str, script: &str, args: &[&OsStr]) -> String {
    let o = Command::new(python)
        .arg(repo().join("scripts").join(script))
        .args(args)
        .output()
        .expect("python runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{script} {args:?}: {text}");
    text
}

fn python_has(python: &str, modules: &str) -> bool {
    Command::new(python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn pytorch_modules_of_the_same_architecture_load_the_weights_and_agree() {
    let tmp = tempfile::tempdir().expect("tmp");
    let root =
        std::env::var_os("FLOTILLA_TWIN_DIR").map_or(tmp.path().to_path_buf(), PathBuf::from);
    let specs = [
        ModelSpec::builtin("gpt-char").expect("gpt-char"),
        ModelSpec::builtin("resnet-bn").expect("resnet-bn"),
        ModelSpec::from_yaml(SEQ_MIX, "seq-mix").expect("seq-mix"),
        ModelSpec::from_yaml(FLAT_BN, "flat-bn").expect("flat-bn"),
        ModelSpec::from_yaml(IMG_MIX, "img-mix").expect("img-mix"),
    ];
    let mut covered = [false; KINDS.len()];
    for node in specs.iter().flat_map(|s| &s.layers) {
        covered[kind_index(&node.layer)] = true;
        assert_eq!(KINDS[kind_index(&node.layer)], node.layer.kind());
    }
    let missing: Vec<&str> = (0..KINDS.len())
        .filter(|&k| !covered[k])
        .map(|k| KINDS[k])
        .collect();
    assert!(missing.is_empty(), "no model here holds {missing:?}");
    let mut dirs = Vec::new();
    let mut backwards = 0;
    for spec in &specs {
        let dir = root.join(&spec.name);
        std::fs::create_dir_all(&dir).expect("dir");
        let json = serde_json::to_string_pretty(spec).expect("json");
        std::fs::write(dir.join("spec.json"), json).expect("spec.json");
        train_and_save(spec, &dir);
        let mut tensors = outputs(spec, &dir, 3);
        if !has_dropout(spec) {
            tensors.extend(backward(spec, &dir, 3));
            backwards += 1;
        }
        write_batch(&dir.join("batch.safetensors"), &tensors);
        dirs.push(dir);
    }
    assert_eq!(
        backwards, 4,
        "every model but seq-mix (dropout) has its backward checked"
    );
    if !python_has("python3", "numpy") {
        assert!(
            std::env::var("CI").is_err(),
            "CI must have python3 with numpy (see .ci/run)"
        );
        eprintln!("SKIPPED: python3 with numpy is not installed");
        return;
    }
    // The PyTorch twin of the GPT example (scripts/gpt_char_torch.py) has this spec and
    // these names and shapes: it loads a checkpoint of models/gpt-char.yaml.
    let out = run_script(
        "python3",
        "gpt_char_torch.py",
        &["--check".as_ref(), dirs[0].as_os_str()],
    );
    assert!(out.contains("OK 70 tensors, 8 layers"), "{out}");
    let torch = torch_python();
    for (dir, spec) in dirs.iter().zip(&specs) {
        let out = check("python3", dir, false);
        assert!(out.contains("OK"), "{out}");
        if let Some(python) = &torch {
            let out = check(python, dir, true);
            assert!(out.contains("torch: outputs agree"), "{out}");
            assert_eq!(
                out.contains("torch: gradients agree"),
                !has_dropout(spec),
                "{out}"
            );
            println!("{}: {out}", dir.display());
        }
    }
}

/// The Python with torch that `FLOTILLA_TORCH_PYTHON` names; `None` (the PyTorch comparison
/// skipped, said on stderr) without one, except under `CI`, where that fails.
fn torch_python() -> Option<String> {
    let python = std::env::var("FLOTILLA_TORCH_PYTHON").ok();
    let usable = python.as_deref().is_some_and(|p| python_has(p, "torch"));
    if usable {
        return python;
    }
    let why = match &python {
        Some(p) => format!("FLOTILLA_TORCH_PYTHON={p} cannot import torch"),
        None => "FLOTILLA_TORCH_PYTHON is not set".to_string(),
    };
    assert!(
        std::env::var("CI").is_err(),
        "CI compares the engine with PyTorch, but {why} (.ci/run installs torch)"
    );
    eprintln!("SKIPPED the PyTorch comparison: {why}");
    None
}
