#!/usr/bin/env python3
"""Epoch time of 2-rank sync data parallel: Flotilla against PyTorch DDP (gloo), in one run.

Usage: scripts/epoch_vs_ddp.py [--runs 3] [--epochs 1] [--flotilla $CARGO_TARGET_DIR/release/flotilla]
                               [--python PY]

Both sides train LeNet-5 (models/lenet5.yaml) on the vendored MNIST (data/mnist), 2 local
ranks, batch 64 per rank, SGD lr 0.01 momentum 0.9 (no weight decay, constant rate, no
warm-up), 1 thread per rank, then evaluate once on the test set split across the ranks. The
runs alternate (Flotilla, DDP, Flotilla, DDP, ...) so that a change of load hits both.

Two times per run:
- loop: the training epochs alone, process start, data load and the final evaluation
  excluded on both sides. Flotilla: the sum of `epoch_s` of rank 0's metrics.jsonl (the
  run loop's time from its start, the initial parameter broadcast included, to the end of
  each epoch's last step). DDP (scripts/ddp_mnist_epoch.py): from the first step to the end
  of the last (the DDP constructor's broadcast before it).
- total: the wall time of the whole job as a user sees it, from starting the ranks to their
  exit (process start, data load, training, the final evaluation; Flotilla also writes its
  final checkpoint and report).

Prints each run, then per side the median and min-max of both times, and the ratios
Flotilla / DDP of the medians (below 1: Flotilla is faster). Wall-clock figures: take them on
a quiet machine.
"""
import os
import statistics
import subprocess
import sys
import time

import vs_ddp  # scripts/vs_ddp.py: this folder is on the path when a script runs

ROOT = vs_ddp.ROOT

CONFIG = """model: lenet5
data: {data}
epochs: {epochs}
batch_size: 64
optimizer: {{name: sgd, lr: 0.01, momentum: 0.9, weight_decay: 0.0}}
lr_schedule: constant
warmup_steps: 0
seed: 42
world_size: 2
checkpoint_every: 0
eval_every: 0
"""



def flotilla(args, work, i):
    config = CONFIG.format(data=os.path.join(ROOT, "data/mnist"), epochs=args.epochs)
    epochs, total = vs_ddp.launch_flotilla(args, work, i, config)
    return sum(e["epoch_s"] for e in epochs), total, epochs[-1].get("test_acc")


def ddp(args, work, i):
    del work, i
    port = str(vs_ddp.free_port())
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    script = os.path.join(ROOT, "scripts/ddp_mnist_epoch.py")
    cmd = [args.python, script, "--epochs", str(args.epochs), "--data",
           os.path.join(ROOT, "data/mnist")]
    started = time.perf_counter()
    ranks = [subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for r in range(2)]
    outs = [p.communicate(timeout=3600)[0] for p in ranks]
    total = time.perf_counter() - started
    if any(p.returncode != 0 for p in ranks):
        raise SystemExit(f"DDP run {i} failed: {[p.returncode for p in ranks]}")
    fields = dict(kv.split("=") for kv in outs[0].split())
    print(f"  ddp rank 0: setup {float(fields['setup_s']):.2f} s (imports, data, process group), "
          f"evaluation {float(fields['eval_s']):.2f} s", flush=True)
    return float(fields["loop_s"]), total, float(fields["test_acc"])


def spread(xs):
    return f"median {statistics.median(xs):7.2f} s (min-max {min(xs):.2f}-{max(xs):.2f})"


def main():
    p = vs_ddp.parser(__doc__)
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args()
    runs = vs_ddp.alternate(
        args, "epoch-vs-ddp-", (("flotilla", flotilla), ("ddp", ddp)),
        lambda i, side, r: (f"run {i + 1} {side:8} loop {r[0]:7.2f} s  total {r[1]:7.2f} s  "
                            f"test_acc {r[2]}"))
    results = {side: [r[:2] for r in rows] for side, rows in runs.items()}
    for side, rows in results.items():
        print(f"{side:8} loop  {spread([r[0] for r in rows])}")
        print(f"{side:8} total {spread([r[1] for r in rows])}")
    for k, what in ((0, "loop"), (1, "total")):
        ratio = (statistics.median(r[k] for r in results["flotilla"])
                 / statistics.median(r[k] for r in results["ddp"]))
        print(f"ratio flotilla/ddp {what}: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
