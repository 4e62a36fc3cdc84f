#!/usr/bin/env python3
"""Tokens/s of the byte-level GPT on 2 ranks: Flotilla against its PyTorch DDP twin, in one run.

Usage: scripts/gpt_vs_ddp.py [--runs 3] [--steps 150] [--flotilla $CARGO_TARGET_DIR/release/flotilla]
                             [--python PY] [--threads 1|N|default]

Both sides train gpt-char (models/gpt-char.yaml, 867,328 parameters) on the vendored text
(data/text/kjv.txt), 2 local ranks of 1 thread (`--threads`: N, or `default` for each side's
own default), 16 windows of 64 bytes per rank, AdamW lr 1e-3,
betas (0.9, 0.99), weight decay 0.1 on matrices only, 10 warm-up steps then cosine to 10 %
(examples/gpt-char.yaml's recipe, shortened), no evaluation during the run. Flotilla is
`flotilla launch` of that config; PyTorch is scripts/gpt_char_torch.py (the same model, data,
optimizer and schedule, DDP over gloo). The runs alternate (Flotilla, DDP, Flotilla, DDP, ...)
so that a change of load hits both.

Tokens/s = steps x 2 ranks x 16 windows x 64 tokens over the training loop's time, process
start, data load and the final evaluation excluded on both sides:
- Flotilla: rank 0's `epoch_s` in metrics.jsonl (the run loop from its start, the initial
  parameter broadcast included, to the end of the last step).
- PyTorch: the script's `tokens/s_with_eval=` (its loop from the first step to the end of the
  last, batch gathering included; with --eval-every 0 no evaluation falls inside it).

Prints each run (with the training loss of its last step: Flotilla's mean over the ranks,
PyTorch's of rank 0's batch; a sanity check, not a comparison), then per side the median and min-max of tokens/s and the ratio Flotilla /
PyTorch of the medians (above 1: Flotilla is faster). Wall-clock figures: take them on a quiet
machine.
"""
import os
import re
import statistics
import subprocess
import sys
import time

import vs_ddp  # scripts/vs_ddp.py: this folder is on the path when a script runs

ROOT = vs_ddp.ROOT
WORLD, BATCH, CONTEXT, WARMUP = 2, 16, 64, 10

CONFIG = """model: gpt-char
data: text:{data}
batch_size: {batch}
max_steps: {steps}
optimizer: {{name: adamw, lr: 0.001, beta1: 0.9, beta2: 0.99, weight_decay: 0.1, decay_params: matrices}}
lr_schedule: cosine
warmup_steps: {warmup}
min_lr_ratio: 0.1
seed: 42
world_size: {world}
checkpoint_every: 0
"""



def tokens(steps):
    return steps * WORLD * BATCH * CONTEXT


def flotilla(args, work, i):
    config = CONFIG.format(data=os.path.join(ROOT, "data/text/kjv.txt"), batch=BATCH,
                           steps=args.steps, warmup=WARMUP, world=WORLD)
    rows, total = vs_ddp.launch_flotilla(args, work, i, config, args.threads)
    loop = sum(r["epoch_s"] for r in rows)
    return tokens(args.steps) / loop, total, rows[-1]["train_loss"]


def ddp(args, work, i):
    del work
    script = os.path.join(ROOT, "scripts/gpt_char_torch.py")
    cmd = [args.python, script, "--steps", str(args.steps), "--batch", str(BATCH),
           "--world", str(WORLD), "--warmup", str(WARMUP), "--eval-every", "0"]
    env = dict(os.environ)
    if args.threads == "default":
        cmd += ["--threads", "0"]
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.pop(name, None)
    else:
        cmd += ["--threads", args.threads]
        env.update(OMP_NUM_THREADS=args.threads, MKL_NUM_THREADS=args.threads)
    started = time.perf_counter()
    out = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, env=env, cwd=ROOT, timeout=3600)
    total = time.perf_counter() - started
    rate = re.search(r"tokens/s_with_eval=(\d+)", out.stdout)
    loss = re.findall(r"train_loss=([0-9.]+)", out.stdout)
    if out.returncode != 0 or rate is None:
        raise SystemExit(f"DDP run {i} failed ({out.returncode}):\n{out.stdout}")
    return float(rate.group(1)), total, float(loss[-1]) if loss else float("nan")


def spread(xs):
    return f"median {statistics.median(xs):8.0f} (min-max {min(xs):.0f}-{max(xs):.0f})"


def main():
    p = vs_ddp.parser(__doc__)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--threads", default="1",
                   help="threads per rank on both sides: a number, or `default` for each side's "
                        "own (Flotilla's launcher: 1 per rank; torch: every core in each rank)")
    args = p.parse_args()
    if args.threads != "default" and not args.threads.isdigit():
        p.error("--threads takes a number or `default`")
    runs = vs_ddp.alternate(
        args, "gpt-vs-ddp-", (("flotilla", flotilla), ("ddp", ddp)),
        lambda i, side, r: (f"run {i + 1} {side:8} tokens/s {r[0]:8.0f}  total {r[1]:6.1f} s  "
                            f"last-step train_loss {r[2]:.4f}"))
    results = {side: [r[0] for r in rows] for side, rows in runs.items()}
    for side, rates in results.items():
        print(f"{side:8} tokens/s {spread(rates)}")
    ratio = statistics.median(results["flotilla"]) / statistics.median(results["ddp"])
    print(f"ratio flotilla/ddp tokens/s: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
