#!/usr/bin/env python3
"""Tokens/s of the 57 M-parameter GPT on 2 ranks: Flotilla's ZeRO-3 against PyTorch FSDP2, in one run.

Usage: scripts/gpt_vs_fsdp.py [--runs 2] [--steps 12] [--flotilla $CARGO_TARGET_DIR/release/flotilla]
                              [--python PY] [--sides flotilla,fsdp,...]

Every side trains models/gpt-zero3.yaml (57,196,288 parameters: 8 pre-LN blocks of d 768,
context 128) on the vendored text (data/text/kjv.txt), 2 local ranks of 1 thread, 4 windows of
128 bytes per rank, AdamW lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on matrices only, 5
warm-up steps then cosine to 10 % (examples/gpt-zero3.yaml's recipe), no evaluation during the
run, no checkpoint:
- flotilla: `flotilla launch` with `zero: 3` (each block's parameters all-gathered before its
  forward and again before its recomputed forward in backward, the next block's gather
  prefetched, gradients reduce-scattered);
- fsdp: scripts/gpt_char_torch.py --model gpt-zero3 --fsdp (FSDP2's `fully_shard` per block
  and on the whole model, over gloo; no recomputation: each block's activations kept);
- fsdp+recompute: the same with each block recomputed in backward (torch.utils.checkpoint),
  the work Flotilla's ZeRO-3 does;
- flotilla-kept and fsdp-kept: each block's gathered parameters kept from its forward to its
  backward (`reshard_after_forward: false`; FSDP2's `reshard_after_forward=False`): one
  all-gather a block a step, nothing recomputed.
The runs alternate (flotilla, fsdp, fsdp+recompute, flotilla, ...) so that a change of load
hits every side.

Tokens/s = steps x 2 ranks x 4 windows x 128 tokens over the training loop's time (process
start, data load and the final evaluation excluded: Flotilla's rank 0 `epoch_s`, PyTorch's
`tokens/s_with_eval=` with --eval-every 0). Then the GEMM rate of this machine on all cores
(`flotilla bench gemm --sizes 2048`) and each side's model FLOP rate, 6 x parameters x
tokens/s, as a fraction of it (recomputation's extra forward is not counted: it is not the
model's work). Wall-clock figures: take them on a quiet machine.
"""
import os
import re
import statistics
import subprocess
import sys
import time

import vs_ddp  # scripts/vs_ddp.py: this folder is on the path when a script runs

ROOT = vs_ddp.ROOT
WORLD, BATCH, CONTEXT, WARMUP, PARAMS = 2, 4, 128, 5, 57_196_288

CONFIG = """model: models/gpt-zero3.yaml
data: text:{data}
batch_size: {batch}
max_steps: {steps}
optimizer: {{name: adamw, lr: 0.0003, beta1: 0.9, beta2: 0.95, weight_decay: 0.1, decay_params: matrices}}
lr_schedule: cosine
warmup_steps: {warmup}
min_lr_ratio: 0.1
test_limit: 64
zero: 3
seed: 42
world_size: {world}
checkpoint_every: 0
"""


def tokens(steps):
    return steps * WORLD * BATCH * CONTEXT


def flotilla_side(name, extra):
    def run(args, work, i):
        config = CONFIG.format(data=os.path.join(ROOT, "data/text/kjv.txt"), batch=BATCH,
                               steps=args.steps, warmup=WARMUP, world=WORLD) + extra
        # An output directory of each side's own (a second run's metrics would be appended).
        rows, total = vs_ddp.launch_flotilla(args, work, f"{name}-{i}", config)
        loop = sum(r["epoch_s"] for r in rows)
        return tokens(args.steps) / loop, total, rows[-1]["train_loss"]
    return run


def torch_side(flags):
    def run(args, work, i):
        del work
        script = os.path.join(ROOT, "scripts/gpt_char_torch.py")
        cmd = [args.python, script, "--model", "gpt-zero3", "--steps", str(args.steps),
               "--batch", str(BATCH), "--world", str(WORLD), "--warmup", str(WARMUP),
               "--lr", "3e-4", "--beta2", "0.95", "--eval-every", "0", "--val-limit", "64",
               *flags]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        started = time.perf_counter()
        out = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env, cwd=ROOT, timeout=3600)
        total = time.perf_counter() - started
        rate = re.search(r"tokens/s_with_eval=(\d+)", out.stdout)
        loss = re.findall(r"train_loss=([0-9.]+)", out.stdout)
        if out.returncode != 0 or rate is None:
            raise SystemExit(f"PyTorch run {i} {flags} failed ({out.returncode}):\n{out.stdout}")
        return float(rate.group(1)), total, float(loss[-1]) if loss else float("nan")
    return run


def gemm_rate(args):
    """GFLOP/s of `flotilla bench gemm` on 2048 x 2048 with every core (its last line)."""
    out = subprocess.run([args.flotilla, "bench", "gemm", "--sizes", "2048"], check=True,
                         stdout=subprocess.PIPE, text=True, cwd=ROOT, timeout=600).stdout
    return float(out.strip().splitlines()[-1].split()[2])


def main():
    p = vs_ddp.parser(__doc__)
    p.set_defaults(runs=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sides", default="flotilla,fsdp,fsdp+recompute,flotilla-kept,fsdp-kept")
    args = p.parse_args()
    every = {"flotilla": flotilla_side("flotilla", ""),
             "flotilla-kept": flotilla_side("kept", "reshard_after_forward: false\n"),
             "fsdp": torch_side(["--fsdp"]),
             "fsdp+recompute": torch_side(["--fsdp", "--recompute"]),
             "fsdp-kept": torch_side(["--fsdp", "--keep-gathered"])}
    sides = tuple((name, every[name]) for name in args.sides.split(","))
    runs = vs_ddp.alternate(
        args, "gpt-vs-fsdp-", sides,
        lambda i, side, r: (f"run {i + 1} {side:15} tokens/s {r[0]:7.1f}  total {r[1]:6.1f} s"))
    peak = gemm_rate(args)
    print(f"GEMM rate (bench gemm, 2048, all cores): {peak:.1f} GFLOP/s")
    medians = {side: statistics.median(r[0] for r in rows) for side, rows in runs.items()}
    for side, rate in medians.items():
        flops = 6 * PARAMS * rate / 1e9
        print(f"{side:15} tokens/s median {rate:7.1f}  model FLOP rate {flops:5.1f} GFLOP/s "
              f"= {100 * flops / peak:4.1f} % of the GEMM rate")
    for ours, theirs in (("flotilla", "fsdp"), ("flotilla", "fsdp+recompute"),
                         ("flotilla-kept", "fsdp"), ("flotilla-kept", "fsdp-kept")):
        if ours in medians and theirs in medians:
            print(f"ratio {ours}/{theirs} tokens/s: {medians[ours] / medians[theirs]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
