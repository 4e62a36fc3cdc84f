#!/usr/bin/env python3
"""PyTorch CPU reference for `flotilla bench step`: samples/s of one full training step.

Usage: bench_torch_step.py --model mlp|lenet5 --batch B --threads T --steps S [--warmup 5]

The step is the same work Flotilla's `bench step` times (crates/flotilla/src/bench/mod.rs):
  1. a batch of B synthetic MNIST-shaped samples ([B,1,28,28] f32, labels i64), copied from
     a host buffer into a fresh tensor (Flotilla builds its input tensor from a Vec each step);
  2. forward, CrossEntropyLoss (mean), backward;
  3. every gradient copied out into one flat f32 buffer, in parameter order (what the sync
     strategy all-reduces), and the optimizer fed from that buffer;
  4. SGD(lr=0.04, momentum=0.9, dampening=0, weight_decay=5e-4) step.
Architectures match models/mlp.yaml and models/lenet5.yaml (PyTorch default init; the init does
not change the work). `torch.set_num_threads(T)` and `torch.set_num_interop_threads(1)`.
5 warm-up steps, then S timed steps. The last two stdout lines are `cpu_ms_per_step=<float>`
(process CPU time, every thread, per timed step) and `samples_per_s=<float>`, which
`flotilla bench step` parses. Exits 2 with a message on stderr if torch is not installed.
"""
import argparse
import sys
import time


def build_model(nn, name):
    if name == "lenet5":
        layers = [
            nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
        ]
    elif name == "mlp":
        layers = [
            nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
            nn.Linear(128, 10),
        ]
    else:
        raise SystemExit(f"unknown model {name!r} (expected mlp or lenet5)")
    return nn.Sequential(*layers)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet5", choices=["mlp", "lenet5"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-flat", action="store_true",
                   help="skip the flat-buffer gradient copy (plain PyTorch loop)")
    args = p.parse_args()

    try:
        import torch
        import torch.nn as nn
    except ImportError as e:
        print(f"bench_torch_step.py: PyTorch is not installed ({e}); "
              "install it with `pip install torch`", file=sys.stderr)
        sys.exit(2)

    torch.set_num_threads(max(1, args.threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set; harmless
    torch.manual_seed(1)

    model = build_model(nn, args.model)
    params = [q for q in model.parameters()]
    opt = torch.optim.SGD(params, lr=0.04, momentum=0.9, dampening=0.0, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()

    # The same deterministic synthetic batch as bench/mod.rs: ((i*7919) % 255)/255 - 0.5,
    # label i%10.
    b = args.batch
    idx = torch.arange(b * 784, dtype=torch.int64)
    host_images = (((idx * 7919) % 255).to(torch.float32) / 255.0 - 0.5).reshape(b, 1, 28, 28)
    host_labels = torch.arange(b, dtype=torch.int64) % 10

    total = sum(q.numel() for q in params)
    flat = torch.zeros(total, dtype=torch.float32)
    views = []
    off = 0
    for q in params:
        views.append(flat[off:off + q.numel()].view_as(q))
        off += q.numel()

    def step():
        x = host_images.clone()
        y = host_labels.clone()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        if not args.no_flat:
            for q, v in zip(params, views):
                v.copy_(q.grad)      # gradients out, into the flat buffer
            for q, v in zip(params, views):
                q.grad.copy_(v)      # optimizer fed from the flat buffer
        opt.step()
        return loss

    for _ in range(args.warmup):
        step()
    t0 = time.perf_counter()
    c0 = time.process_time()
    for _ in range(args.steps):
        loss = step()
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    print(f"# torch {torch.__version__} model={args.model} batch={b} threads={torch.get_num_threads()} "
          f"steps={args.steps} secs={dt:.4f} last_loss={loss.item():.4f} params={total}")
    print(f"cpu_ms_per_step={cpu * 1e3 / args.steps:.4f}")
    print(f"samples_per_s={b * args.steps / dt:.1f}")


if __name__ == "__main__":
    main()
