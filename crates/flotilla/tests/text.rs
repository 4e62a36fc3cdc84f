//! Text through `flotilla train` (issue 21): a small GPT on the vendored `data/text/kjv.txt`
//! as byte tokens. Two ranks equal one rank with the same global batch (AdamW decaying matrices
//! only), the epoch line gives tokens/s, training lowers the validation loss, `target_loss`
//! stops a run early, and bad inputs are refused naming their numbers.

mod common;

use common::*;

use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(240);

/// A one-block GPT of width 32 over windows of `context` bytes, positional table `max_len`.
fn spec(dir: &Path, context: usize, max_len: usize) -> String {
    config_file(
        dir,
        &format!("gpt-tiny-{context}-{max_len}.yaml"),
        &format!(
            "name: gpt-tiny\ninput: [{context}]\nlayers:\n  - embedding: {{vocab: 256, dim: 32}}\n  \
             - pos_embedding: {{max_len: {max_len}}}\n  - transformer_block: {{heads: 2, mlp: 2}}\n  \
             - layer_norm\n  - linear: {{out: 256}}\n"
        ),
    )
}

/// A config of the tiny GPT on kjv.txt; `extra` appends keys.
fn config(dir: &Path, name: &str, extra: &str) -> String {
    let model = spec(dir, 32, 32);
    config_file(
        dir,
        &format!("{name}.yaml"),
        &format!(
            "model: {model}\ndata: text:data/text/kjv.txt\n\
             optimizer: {{name: adamw, lr: 0.003, beta1: 0.9, beta2: 0.99, weight_decay: 0.1, \
             decay_params: matrices}}\n\
             lr_schedule: cosine\nwarmup_steps: 10\nmin_lr_ratio: 0.1\nseed: 5\n{extra}"
        ),
    )
}

fn run_figures(out: &Path) -> serde_json::Value {
    let bytes = std::fs::read(out.join("summary.json")).expect("summary.json");
    let v: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
    v["run"].clone()
}

#[test]
fn two_ranks_equal_one_with_the_global_batch_and_the_validation_loss_falls() {
    let dir = tmp();
    let cfg = config(dir.path(), "gpt", "max_steps: 30\n");
    let path = |name: &str| dir.path().join(name);
    let s = |p: &Path| p.to_str().expect("utf8").to_string();
    let (one, two, init) = (path("one"), path("two"), path("init"));
    let o1 = launch(
        &[&cfg, "-n", "1", "--batch-size", "16", "--output", &s(&one)],
        LIMIT,
    );
    let o2 = launch(
        &[&cfg, "-n", "2", "--batch-size", "8", "--output", &s(&two)],
        LIMIT,
    );
    launch(
        &[&cfg, "-n", "1", "--max-steps", "0", "--output", &s(&init)],
        LIMIT,
    );
    let (f1, f2) = (final_fields(&o1), final_fields(&o2));
    assert_eq!((f1["steps"], f2["steps"]), (30.0, 30.0), "{}", text(&o2));
    let e = relative_error(&checkpoint_tensors(&one), &checkpoint_tensors(&two));
    assert!(e <= 1e-5, "2 ranks x 8 windows differ from 1 x 16: {e}");
    let moved = relative_error(&checkpoint_tensors(&one), &checkpoint_tensors(&init));
    assert!(moved > 1e-2, "parameters barely moved: {moved}");
    // The final line gives the validation loss in nats and bits per byte.
    let (loss, bpb) = (f1["val_loss"], f1["bpb"]);
    assert!((bpb - loss / std::f64::consts::LN_2).abs() < 1e-3, "{f1:?}");
    let (before, after) = (run_figures(&init), run_figures(&one));
    let (l0, l1) = (
        before["final_loss"].as_f64().expect("initial loss"),
        after["final_loss"].as_f64().expect("final loss"),
    );
    // An untrained model is near ln 256 = 5.55 nats; 30 steps must take it well below.
    assert!(l0 > 5.0 && l1 < l0 - 1.0, "validation loss {l0} -> {l1}");
    let b1 = after["bpb"].as_f64().expect("bpb");
    assert!((b1 - l1 / std::f64::consts::LN_2).abs() < 1e-9, "{after}");
    // The epoch line gives the throughput in tokens too: 32 per window.
    let (samples, tokens) = throughput(&text(&o1));
    assert!(
        (tokens - 32.0 * samples).abs() <= 16.0,
        "{samples} samples/s, {tokens} tokens/s"
    );
}

/// The samples/s and tokens/s of the first epoch line in a run's output.
fn throughput(out: &str) -> (f64, f64) {
    let line = out
        .lines()
        .find(|l| l.contains(" epoch ") && l.contains("samples/s="))
        .unwrap_or_else(|| panic!("no epoch line in {out}"));
    let field = |key: &str| -> f64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key)?.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {line}"))
    };
    (field("samples/s="), field("tokens/s="))
}

#[test]
fn target_loss_stops_the_run_early() {
    let dir = tmp();
    let extra = "max_steps: 300\neval_every_steps: 10\ntarget_loss: 3.0\nbatch_size: 16\n";
    let cfg = config(dir.path(), "target", extra);
    let out = dir.path().join("out");
    let o = launch(
        &[&cfg, "-n", "1", "--output", out.to_str().expect("utf8")],
        LIMIT,
    );
    let f = final_fields(&o);
    assert!(f["steps"] < 300.0, "no early stop: {f:?}");
    assert!(f["steps"].rem_euclid(10.0) == 0.0, "{f:?}");
    assert!(f["val_loss"] <= 3.0, "{f:?}");
    let log = run_log(&out, 0);
    assert!(log.contains("reached target 3"), "{log}");
}

/// `flotilla launch -n 1 CONFIG`, expected to fail; its stdout and stderr.
fn refused(cfg: &str, out: &Path) -> String {
    let mut c = flotilla();
    c.args(["launch", cfg, "-n", "1", "--output"]).arg(out);
    let o = run_with_deadline(c, LIMIT);
    assert!(!o.status.success(), "accepted:\n{}", text(&o));
    text(&o)
}

#[test]
fn bad_text_inputs_are_refused_naming_their_numbers() {
    let dir = tmp();
    let d = dir.path();
    let out = d.join("out");
    let model = spec(d, 32, 32);
    let text_file = |name: &str, bytes: usize| {
        let p = d.join(name);
        std::fs::write(&p, "a".repeat(bytes)).expect("write");
        p.to_str().expect("utf8").to_string()
    };
    let cases = [
        (
            format!("model: {model}\ndata: text:{}\n", text_file("empty.txt", 0)),
            vec!["empty.txt: the file is empty"],
        ),
        (
            format!(
                "model: {model}\ndata: text:{}\n",
                text_file("short.txt", 100)
            ),
            vec![
                "100 bytes are too few",
                "(10 bytes)",
                "context 32",
                "(33 bytes)",
            ],
        ),
        (
            format!("model: {model}\ndata: data/mnist\n"),
            vec!["takes input [32]", "samples of [1, 28, 28]"],
        ),
        (
            "model: mlp\ndata: text:data/text/kjv.txt\n".to_string(),
            vec!["input [T]", "takes input [1, 28, 28]"],
        ),
        (
            format!("model: {}\ndata: text:data/text/kjv.txt\n", spec(d, 48, 32)),
            vec!["context 48 is larger than the positional table (max_len 32)"],
        ),
    ];
    for (i, (yaml, wants)) in cases.iter().enumerate() {
        let cfg = config_file(d, &format!("bad{i}.yaml"), &format!("{yaml}max_steps: 1\n"));
        let said = refused(&cfg, &out);
        for want in wants {
            assert!(said.contains(want), "case {i}: no {want:?} in\n{said}");
        }
    }
}
