//! `flotilla checkpoint`: what a checkpoint holds, and its export as one safetensors file
//! that PyTorch loads — a ZeRO-2 run's sharded optimizer state put together to the bits of
//! the unsharded run's, each optimizer field laid out as its weight.

mod common;

use common::*;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);

/// 2 ranks of LeNet-5, 6 Adam steps, ZeRO stage `zero`; the run's output directory.
fn train(dir: &Path, zero: u8) -> std::path::PathBuf {
    let yaml = format!(
        "world_size: 2\nbatch_size: 16\ntrain_limit: 640\nmax_steps: 6\ncheckpoint_every: 6\n\
         optimizer: {{name: adam, lr: 0.001}}\nzero: {zero}\nsmall_all_reduce_kb: 0\n\
         mid_all_reduce_kb: 0\n"
    );
    let cfg = config_file(dir, &format!("zero{zero}.yaml"), &yaml);
    let out = dir.join(format!("zero{zero}"));
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output", out.to_str().expect("utf8")]);
    let o = run_with_deadline(c, LIMIT);
    assert!(o.status.success(), "zero {zero}: {}", text(&o));
    out
}

/// `flotilla checkpoint OUT --export FILE`: what it printed, and the file's tensors.
fn export(out: &Path, file: &Path) -> (String, BTreeMap<String, Vec<f32>>) {
    let mut c = flotilla();
    c.args(["checkpoint", out.to_str().expect("utf8"), "--export"])
        .arg(file);
    let o = run_with_deadline(c, LIMIT);
    assert!(o.status.success(), "{}", text(&o));
    (text(&o), safetensors_file(file))
}

#[test]
fn a_zero_2_checkpoint_exports_the_bits_of_the_unsharded_one_laid_out_as_its_weights() {
    let dir = tmp();
    let (whole, sharded) = (train(dir.path(), 0), train(dir.path(), 2));
    let (listed, a) = export(&whole, &dir.path().join("whole.safetensors"));
    let (listed2, b) = export(&sharded, &dir.path().join("sharded.safetensors"));
    assert!(listed.contains("step 6"), "{listed}");
    assert!(
        listed.contains("optimizer state: momentum.moment_1, momentum.moment_2"),
        "{listed}"
    );
    assert!(
        listed2.contains("ZeRO stage 2: optimizer state in 2 shards"),
        "{listed2}"
    );
    assert!(
        listed2.contains("10 model tensors, 20 optimizer tensors"),
        "{listed2}"
    );
    assert_bitwise("the ZeRO-2 export vs the unsharded one", &b, &a);
    // The model's tensors are the checkpoint's; every weight has its two moments.
    assert_bitwise("the exported model", &checkpoint_tensors(&whole), &{
        let mut m = a.clone();
        m.retain(|k, _| !k.starts_with("optimizer."));
        m
    });
    let python = std::env::var("FLOTILLA_TORCH_PYTHON").ok();
    let Some(python) = python.filter(|p| python_has(p, "torch")) else {
        assert!(
            std::env::var("CI").is_err(),
            "CI loads the export in torch: FLOTILLA_TORCH_PYTHON names no Python with torch"
        );
        eprintln!("SKIPPED the torch load: FLOTILLA_TORCH_PYTHON names no Python with torch");
        return;
    };
    let mut c = Command::new(python);
    c.args(["-c", TORCH_CHECK])
        .arg(dir.path().join("sharded.safetensors"));
    let o = run_with_deadline(c, LIMIT);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("OK 10 weights, 20 moments, step 6"),
        "{}",
        text(&o)
    );
}

/// torch loads the file; each weight's moments have its shape, Adam's second moment is not
/// negative and not all zero.
const TORCH_CHECK: &str = r#"
import sys
from safetensors import safe_open
from safetensors.torch import load_file
t = load_file(sys.argv[1])
with safe_open(sys.argv[1], "pt") as f:
    meta = f.metadata()
weights = [k for k in t if not k.startswith("optimizer.")]
moments = [k for k in t if k.startswith("optimizer.")]
for k in weights:
    for field in ("momentum.moment_1", "momentum.moment_2"):
        m = t[f"optimizer.{k}.{field}"]
        assert m.shape == t[k].shape, (k, field, m.shape, t[k].shape)
    v = t[f"optimizer.{k}.momentum.moment_2"]
    assert (v >= 0).all() and (v > 0).any(), k
print(f"OK {len(weights)} weights, {len(moments)} moments, step {meta['flotilla.step']}")
"#;
