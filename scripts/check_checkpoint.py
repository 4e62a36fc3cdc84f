#!/usr/bin/env python3
"""Check a Flotilla checkpoint with the real `safetensors` client (numpy only, no torch).

Usage: check_checkpoint.py CHECKPOINT/model.safetensors [--model lenet5|mlp] [--torch]

Verifies every tensor's name, dtype and PyTorch-layout shape (a linear weight is
[out, in]). With --torch (and torch installed) also loads the tensors into a PyTorch
model of the same architecture with load_state_dict(strict=True) and runs it.
Prints "OK <n> tensors" on success; exits 1 with the reason otherwise.
"""
import argparse
import sys

import numpy as np
from safetensors.numpy import load_file

# Names, dtypes, PyTorch-layout shapes and finite values: one check for both scripts.
from check_layers_torch import check_names

# PyTorch layout: nn.Sequential indices match Flotilla's `layers.<i>` (activations and pooling
# keep their index even though they have no parameters).
EXPECTED = {
    "lenet5": {
        "layers.0.weight": (6, 1, 5, 5), "layers.0.bias": (6,),
        "layers.3.weight": (16, 6, 5, 5), "layers.3.bias": (16,),
        "layers.7.weight": (120, 400), "layers.7.bias": (120,),
        "layers.9.weight": (84, 120), "layers.9.bias": (84,),
        "layers.11.weight": (10, 84), "layers.11.bias": (10,),
    },
    "mlp": {
        "layers.1.weight": (256, 784), "layers.1.bias": (256,),
        "layers.3.weight": (128, 256), "layers.3.bias": (128,),
        "layers.5.weight": (10, 128), "layers.5.bias": (10,),
    },
}


def torch_model(name):
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = nn.Sequential(*layers)

        def forward(self, x):
            return self.layers(x)

    if name == "lenet5":
        return Net([
            nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
        ])
    return Net([
        nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
        nn.Linear(128, 10),
    ])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--model", default="lenet5", choices=sorted(EXPECTED))
    p.add_argument("--torch", action="store_true", help="also load into a PyTorch model")
    a = p.parse_args()

    tensors = load_file(a.path)
    want = EXPECTED[a.model]
    problems = check_names(tensors, want)
    if problems:
        print("FAIL\n" + "\n".join(problems))
        sys.exit(1)

    if a.torch:
        import torch
        from safetensors.torch import load_file as load_torch

        model = torch_model(a.model)
        model.load_state_dict(load_torch(a.path), strict=True)
        out = model(torch.zeros(2, 1, 28, 28))
        assert tuple(out.shape) == (2, 10), out.shape
        print("torch: load_state_dict(strict=True) and forward OK")

    print(f"OK {len(tensors)} tensors")


if __name__ == "__main__":
    main()
