#!/usr/bin/env python3
"""The PyTorch twin of `flotilla launch examples/gpt-char.yaml`: the same model, data, optimizer,
schedule and evaluation, trained with torch DDP on 2 ranks over gloo (1 thread per rank).

Usage:
  gpt_char_torch.py [--data data/text/kjv.txt] [--steps 1000] [--world 2] ...   (needs torch)
  gpt_char_torch.py --check DIR                                      (numpy only, no torch)

Training prints, from rank 0, `eval step S test_loss=L test_acc=A bpb=B` at every
`--eval-every` steps and at the last one (as Flotilla's run log does), then the training
throughput: `tokens/s=` over the steps alone, and `tokens/s_with_eval=` over the whole loop up
to the last step, evaluations within it included (Flotilla's epoch line measures the latter).
It also runs under torchrun (`torchrun --nproc-per-node 2 scripts/gpt_char_torch.py`).

`--model gpt-char-tied` trains models/gpt-char-tied.yaml (the head tied to the token embedding,
both embedding tables N(0, 0.02^2), as Flotilla draws them tied). `--model gpt-zero3` trains models/gpt-zero3.yaml's 57 M-parameter GPT (context 128) instead;
`--fsdp` shards it with FSDP2 (`fully_shard` on each transformer block, then on the whole model,
over gloo on the CPU: each block's parameters all-gathered before its forward and backward,
its gradients reduce-scattered, the next block's gather prefetched) instead of DDP, and
`--recompute` recomputes each block's forward in backward (`torch.utils.checkpoint`), as
Flotilla's ZeRO-3 does (scripts/gpt_vs_fsdp.py compares them).

--check DIR (what CI runs, see the engine's tests/torch_twin.rs): DIR holds `spec.json` (the
spec of models/gpt-char.yaml as the engine resolved it) and `model.safetensors` (a Flotilla
checkpoint's weights); checks that SPEC below is that spec layer by layer, and that the
model's parameter names and PyTorch shapes are the checkpoint's, so the model built here
(`check_layers_torch.torch_model`, whose outputs its --torch check compares with the engine's)
loads Flotilla's weights with load_state_dict(strict=True).

What is the same as Flotilla's run, and what is not:
- Model: models/gpt-char.yaml (SPEC), built by check_layers_torch.torch_model: token
  embedding, learned positional embedding, 4 pre-LN blocks as burn's TransformerEncoderLayer
  with norm_first (x + mha(norm_2(x)), then x + linear_outer(gelu(linear_inner(norm_1(x)))),
  causal attention scaled by 1/sqrt(d/heads), exact (erf) GELU, LayerNorm eps 1e-5), a final
  layer norm, an untied linear head, no dropout.
- Initialisation: the same distributions as burn's (embeddings N(0, 1); linear weights and
  biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)), PyTorch's nn.Linear default too; layer norms 1
  and 0), but not the same values: burn's and torch's random streams differ.
- Data: the file's first floor(0.9 n) bytes train, every window of 64 bytes starting at any
  offset (its targets the 64 bytes after each position); every non-overlapping window of the
  rest validates. Each epoch a permutation of the training windows seeded with seed + epoch,
  cut to a multiple of the world size, rank r taking every world-th window from r on, batches
  of 16 consecutive ones (Flotilla's DistributedSampler); the permutation itself differs
  (Flotilla shuffles with ChaCha8, this script with torch.randperm).
- Optimizer: AdamW, betas (0.9, 0.99), eps 1e-8, weight decay 0.1 on parameters of 2 or more
  dimensions (linear weights, both embeddings), none on biases and layer norms.
- Schedule: linear warm-up lr * (s + 1) / 100 over steps s < 100, then cosine from lr to
  0.1 lr over the remaining steps (Flotilla's LrSchedule::lr_at_floor, step s 0-based).
- Loss: mean cross-entropy over every position of the batch; DDP averages the ranks'
  gradients as Flotilla's sync all-reduce does. Evaluation: mean cross-entropy (nats) over
  every position of every validation window, split across ranks and summed; bpb = nats / ln 2.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np

from check_layers_torch import check_names, read_safetensors, walk

# models/gpt-char.yaml, as the engine resolves it (the linear head's bias spelled out).
SPEC = {
    "name": "gpt-char",
    "input": [64],
    "layers": [
        {"embedding": {"vocab": 256, "dim": 128}},
        {"pos_embedding": {"max_len": 64}},
        {"transformer_block": {"heads": 4, "mlp": 4}},
        {"transformer_block": {"heads": 4, "mlp": 4}},
        {"transformer_block": {"heads": 4, "mlp": 4}},
        {"transformer_block": {"heads": 4, "mlp": 4}},
        "layer_norm",
        {"linear": {"out": 256, "bias": True}},
    ],
}
CONTEXT = SPEC["input"][0]
VOCAB = 256

# models/gpt-zero3.yaml, as the engine resolves it.
SPEC_ZERO3 = {
    "name": "gpt-zero3",
    "input": [128],
    "layers": [{"embedding": {"vocab": 256, "dim": 768}}, {"pos_embedding": {"max_len": 128}}]
    + [{"transformer_block": {"heads": 12, "mlp": 4}}] * 8
    + ["layer_norm", {"linear": {"out": 256, "bias": True}}],
}
# models/gpt-char-tied.yaml: gpt-char with its head tied to its token embedding.
SPEC_TIED = dict(SPEC, name="gpt-char-tied", layers=SPEC["layers"][:-1] + [
    {"linear": {"out": 256, "bias": False, "tie_embedding": True}}])
SPECS = {"gpt-char": SPEC, "gpt-char-tied": SPEC_TIED, "gpt-zero3": SPEC_ZERO3}


def select(name):
    """Makes `name`'s spec the one every function here uses (each process calls it)."""
    global SPEC, CONTEXT
    SPEC = SPECS[name]
    CONTEXT = SPEC["input"][0]
VALIDATION_FRACTION = 0.1


def check(directory):
    """CI's check (numpy only): SPEC is the engine's spec, the names and shapes its weights'."""
    with open(f"{directory}/spec.json") as f:
        engine_spec = json.load(f)
    ours, want = walk(SPEC)
    theirs, _ = walk(engine_spec)
    problems = [f"layer {i}: script {a[:3]}, engine {b[:3]}"
                for i, (a, b) in enumerate(zip(ours, theirs)) if a[:3] != b[:3]]
    if len(ours) != len(theirs):
        problems.append(f"script has {len(ours)} layers, engine {len(theirs)}")
    problems += check_names(read_safetensors(f"{directory}/model.safetensors"), want)
    if problems:
        print("FAIL\n" + "\n".join(problems))
        sys.exit(1)
    print(f"OK {len(want)} tensors, {len(ours)} layers")


def lr_at(step, a):
    """Flotilla's LrSchedule::lr_at_floor: linear warm-up, then cosine to min_lr_ratio."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    span = max(a.steps - a.warmup, 1)
    t = min((step - a.warmup) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * t))
    return a.lr * (a.min_lr_ratio + (1.0 - a.min_lr_ratio) * cosine)


def splits(path):
    """The training bytes and their window starts, the validation bytes and theirs."""
    data = np.fromfile(path, dtype=np.uint8)
    cut = int(len(data) * (1.0 - VALIDATION_FRACTION))
    train, val = data[:cut], data[cut:]
    return (train, np.arange(0, len(train) - CONTEXT)), (val, np.arange(0, len(val) - CONTEXT, CONTEXT))


def windows(torch, tokens, starts):
    """Inputs [n, T] and targets [n, T] of the windows at `starts`."""
    idx = starts[:, None] + np.arange(CONTEXT)[None, :]
    x = torch.from_numpy(tokens[idx].astype(np.int64))
    y = torch.from_numpy(tokens[idx + 1].astype(np.int64))
    return x, y


def shard_batches(torch, n, rank, world, batch, seed, epoch):
    """Rank `rank`'s batches of epoch `epoch` (Flotilla's DistributedSampler, drop_last)."""
    g = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g).numpy()
    perm = perm[: (n // world) * world]
    shard = perm[rank::world]
    return [shard[k * batch:(k + 1) * batch] for k in range(len(shard) // batch)]


def evaluate(torch, model, val, rank, world, chunk=64, limit=0):
    """Mean loss (nats) and accuracy over every position of every validation window (the first
    `limit` of them when `limit`)."""
    import torch.nn.functional as F
    import torch.distributed as dist

    tokens, starts = val
    mine = (starts[:limit] if limit else starts)[rank::world]
    total = torch.zeros(3, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for i in range(0, len(mine), chunk):
            x, y = windows(torch, tokens, mine[i:i + chunk])
            logits = model(x).reshape(-1, VOCAB)
            y = y.reshape(-1)
            total[0] += F.cross_entropy(logits, y, reduction="sum").double()
            total[1] += (logits.argmax(dim=1) == y).sum().double()
            total[2] += y.numel()
    model.train()
    dist.all_reduce(total)
    return (total[0] / total[2]).item(), (total[1] / total[2]).item()


def build(torch, seed):
    """The model of SPEC, initialised as burn initialises it (see the module docs)."""
    from check_layers_torch import torch_model

    torch.manual_seed(seed)
    plan, _ = walk(SPEC)
    model = torch_model(plan)
    for layer, (kind, *_rest) in zip(model.layers, plan):
        if kind == "pos_embedding":
            torch.nn.init.normal_(layer.weight)
    head = SPEC["layers"][-1]
    if isinstance(head, dict) and head.get("linear", {}).get("tie_embedding"):
        # GPT-2's tie, and its N(0, 0.02^2) tables (Flotilla's TIED_TABLE_STD).
        for layer in model.layers[:2]:
            torch.nn.init.normal_(layer.weight, std=0.02)
        model.layers[-1].weight = model.layers[0].weight
    return model


def optimizer(torch, model, a):
    """AdamW with weight decay on the parameters of two or more dimensions only."""
    params = list(model.named_parameters())
    decay = [p for _, p in params if p.dim() >= 2]
    no_decay = [p for _, p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, a.beta2), eps=1e-8)


def distributed(torch, model, a):
    """`model` wrapped for data parallelism: DDP, or FSDP2 per block (`--fsdp`), each block's
    forward recomputed in backward with `--recompute`; and the module to evaluate."""
    from torch.nn.parallel import DistributedDataParallel

    blocks = [i for i, (kind, *_r) in enumerate(walk(SPEC)[0]) if kind == "transformer_block"]
    if a.recompute:
        from torch.utils.checkpoint import checkpoint

        class Recomputed(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return checkpoint(self.inner, x, use_reentrant=False)

        for i in blocks:
            model.layers[i] = Recomputed(model.layers[i])
    if not a.fsdp:
        ddp = DistributedDataParallel(model)
        return ddp, ddp.module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (a.world,))
    for i in blocks:
        fully_shard(model.layers[i], mesh=mesh, reshard_after_forward=not a.keep_gathered)
    fully_shard(model, mesh=mesh, reshard_after_forward=not a.keep_gathered)
    return model, model


def train(rank, world, a):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    select(a.model)
    if a.threads:
        torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    (train_part, val) = splits(a.data)
    model, plain = distributed(torch, build(torch, a.seed), a)
    opt = optimizer(torch, plain, a)
    tokens, starts = train_part
    batches, epoch = [], 0
    say = print if rank == 0 else (lambda *_, **__: None)
    say(f"{a.model}: {sum(p.numel() for p in model.parameters())} params, {len(starts)} training "
        f"windows, {len(val[1])} validation windows, {world} ranks x {a.batch} windows")
    step_s, started = 0.0, time.perf_counter()
    for step in range(a.steps):
        if not batches:
            batches = shard_batches(torch, len(starts), rank, world, a.batch, a.seed, epoch)
            epoch += 1
        x, y = windows(torch, tokens, starts[batches.pop(0)])
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_s += time.perf_counter() - t0
        done = step + 1
        if done % 50 == 0:
            say(f"step {done} train_loss={loss.item():.4f} lr={lr_at(step, a):.3e}", flush=True)
        if done == a.steps:
            loop_s = time.perf_counter() - started
        if (a.eval_every and done % a.eval_every == 0) or done == a.steps:
            nats, acc = evaluate(torch, plain, val, rank, world, limit=a.val_limit)
            say(f"eval step {done} test_loss={nats:.4f} test_acc={acc:.4f} "
                f"bpb={nats / math.log(2):.4f}", flush=True)
    trained = a.steps * a.batch * world * CONTEXT
    say(f"tokens/s={trained / step_s:.0f} tokens/s_with_eval={trained / loop_s:.0f} "
        f"({a.steps} steps of {a.batch * world} windows of {CONTEXT} tokens: steps "
        f"{step_s:.1f} s, loop {loop_s:.1f} s)")
    dist.destroy_process_group()


def spawned(rank, world, port, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    train(rank, world, a)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", metavar="DIR", help="only check names and shapes (numpy only)")
    p.add_argument("--data", default=os.path.join(here, "..", "data", "text", "kjv.txt"))
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=16, help="windows per rank")
    p.add_argument("--world", type=int, default=2, help="ranks (without torchrun)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: torch's default)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=250, help="0: only at the end")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--model", choices=sorted(SPECS), default="gpt-char")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 per block instead of DDP")
    p.add_argument("--recompute", action="store_true", help="each block recomputed in backward")
    p.add_argument("--keep-gathered", action="store_true",
                   help="FSDP2 with reshard_after_forward=False: each block's parameters "
                        "kept gathered from its forward to its backward")
    p.add_argument("--val-limit", type=int, default=0, help="validation windows (0: all)")
    a = p.parse_args()
    if a.check:
        check(a.check)
        return
    if "RANK" in os.environ:
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(spawned, args=(a.world, port, a), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
