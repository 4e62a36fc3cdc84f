#!/usr/bin/env python3
"""One rank of the PyTorch DDP (gloo) twin of Flotilla's 2-rank sync data-parallel epoch:
LeNet-5 (models/lenet5.yaml), SGD lr 0.01 momentum 0.9 (no weight decay, constant rate),
batch 64 per rank, 1 thread per rank, on the vendored MNIST (data/mnist, gzipped IDX),
normalised as Flotilla does ((x/255 - 0.1307)/0.3081).

Started by scripts/epoch_vs_ddp.py (or by hand: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
set, as torchrun sets them). Data: each epoch a permutation seeded with seed + epoch (torch's
DistributedSampler, drop_last, rank r every world-th sample from r), batches of 64 gathered
by index from the normalised set held as one tensor (no DataLoader worker processes, as
Flotilla has none). After the epochs, every rank evaluates its strided shard of the test set
and the sums are all-reduced (as Flotilla's final evaluation).

Rank 0 prints one line `setup_s=<s> loop_s=<s> eval_s=<s> steps=<n> test_acc=<a>`: setup_s from
the interpreter's start to the loop (imports, data load, process group, model), loop_s from the first
step of epoch 1 to the end of the last step of the last epoch (the DDP model built and its
parameters broadcast before; process start and data load excluded), eval_s the evaluation.
"""
import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import gzip  # noqa: E402
import os  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402


def idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def split(data, name):
    x = idx(os.path.join(data, f"{name}-images-idx3-ubyte.gz"))
    y = idx(os.path.join(data, f"{name}-labels-idx1-ubyte.gz"))
    x = (torch.from_numpy(x.astype(np.float32)) / 255.0 - 0.1307) / 0.3081
    return x.unsqueeze(1).contiguous(), torch.from_numpy(y.astype(np.int64))


def lenet5():
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/mnist")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = split(args.data, "train")
    tx, ty = split(args.data, "t10k")
    torch.manual_seed(args.seed)
    model = nn.parallel.DistributedDataParallel(lenet5())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    sampler = torch.utils.data.distributed.DistributedSampler(
        range(len(y)), num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
        drop_last=True)
    steps = 0
    dist.barrier()
    started = time.perf_counter()
    setup_s = started - PROCESS_START
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), dtype=torch.int64)
        for k in range(len(order) // args.batch):
            batch = order[k * args.batch:(k + 1) * args.batch]
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x[batch]), y[batch]).backward()
            opt.step()
            steps += 1
    loop_s = time.perf_counter() - started
    started = time.perf_counter()
    with torch.no_grad():
        shard = torch.arange(rank, len(ty), world)
        logits = model.module(tx[shard])
        sums = torch.tensor([float((logits.argmax(1) == ty[shard]).sum()), float(len(shard))])
    dist.all_reduce(sums)
    eval_s = time.perf_counter() - started
    if rank == 0:
        print(f"setup_s={setup_s:.3f} loop_s={loop_s:.3f} eval_s={eval_s:.3f} steps={steps} "
              f"test_acc={float(sums[0] / sums[1]):.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
