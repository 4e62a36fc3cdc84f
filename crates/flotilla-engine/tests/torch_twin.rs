//! The files of the PyTorch twin check (`scripts/check_layers_torch.py`). For gpt-char,
//! resnet-bn and two small models that hold the other new layers (attention, RMS norm, SiLU,
//! GELU, dropout, 1-d batch norm, links between sequences), each trained a few steps so that
//! no norm keeps its initial weight and no running statistic its initial value, a directory
//! gets the spec (`spec.json`), the weights (`model.safetensors`, as checkpoints write them)
//! and a batch with the engine's outputs on it (`batch.safetensors`: `input`, `output_eval`,
//! and `output_train` for a batch norm model without dropout, whose training outputs use the
//! batch's statistics).
//!
//! With python3 and numpy (as CI has) the script checks every tensor's name and PyTorch
//! shape against the spec. With `FLOTILLA_TORCH_PYTHON` naming a Python that has torch, it also
//! builds the PyTorch module of the same architecture, loads the weights with
//! `load_state_dict(strict=True)` and compares its outputs with the engine's within 1e-4.
//! `FLOTILLA_TWIN_DIR` keeps the files in that directory. The PyTorch twin of the GPT example,
//! `scripts/gpt_char_torch.py --check`, checks its model's spec, names and shapes against
//! gpt-char's files (numpy only).

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{batch, token_batch};
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

/// The saved weights in a one-stage pipeline (which loads them), run on a batch: the input
/// and the outputs in evaluation and (for batch norm without dropout) training.
fn outputs(spec: &ModelSpec, dir: &Path, n: usize) -> Vec<(&'static str, Vec<usize>, Vec<f32>)> {
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
        ("input", input, x.clone()),
        ("output_eval", output.clone(), eval),
    ];
    let dropout = spec
        .layers
        .iter()
        .any(|l| matches!(l.layer, LayerSpec::Dropout { p } if p > 0.0));
    if has(spec, "batch_norm") && !dropout {
        let train = stage.forward(0, n, &[&x]).expect("train").remove(0);
        files.push(("output_train", output, train));
    }
    files
}

fn write_batch(path: &Path, tensors: &[(&'static str, Vec<usize>, Vec<f32>)]) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            let view = TensorView::new(Dtype::F32, shape.clone(), b).expect("view");
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
    ];
    let mut dirs = Vec::new();
    for spec in &specs {
        let dir = root.join(&spec.name);
        std::fs::create_dir_all(&dir).expect("dir");
        let json = serde_json::to_string_pretty(spec).expect("json");
        std::fs::write(dir.join("spec.json"), json).expect("spec.json");
        train_and_save(spec, &dir);
        write_batch(&dir.join("batch.safetensors"), &outputs(spec, &dir, 3));
        dirs.push(dir);
    }
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
    let torch = std::env::var("FLOTILLA_TORCH_PYTHON").ok();
    for dir in &dirs {
        let out = check("python3", dir, false);
        assert!(out.contains("OK"), "{out}");
        if let Some(python) = &torch {
            let out = check(python, dir, true);
            assert!(out.contains("torch: outputs agree"), "{out}");
            println!("{}: {out}", dir.display());
        }
    }
}
