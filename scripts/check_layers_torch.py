#!/usr/bin/env python3
"""Check Flotilla's layers against PyTorch modules of the same architecture.

Usage: check_layers_torch.py DIR [--torch]

DIR holds what the engine's `tests/torch_twin.rs` writes: `spec.json` (a model spec),
`model.safetensors` (its weights, as checkpoints write them) and `batch.safetensors` (`input`,
`output_eval`, and optionally `output_train`: the engine's outputs on that input in evaluation
and in training mode). For a model without dropout also `labels` and `loss` in the batch (the
engine's mean cross-entropy of the training-mode logits against them) and `grads.safetensors`:
the gradient of that loss with respect to every parameter, under the parameter's name and in
its PyTorch layout (written the way the weights are).

Always (numpy only): every tensor's name and shape in the weights is the PyTorch module's
(a linear weight is [out, in]; batch norm's running statistics are there too), computed from
the spec independently of the engine. With --torch (needs torch): builds the PyTorch module
of the spec, loads the weights with load_state_dict(strict=True), and compares its outputs on
the batch with the engine's within 1e-4 (evaluation; training mode too when given); with
`grads.safetensors`, runs one backward of the same loss and compares the loss and every
parameter's gradient with the engine's (see GRAD_TOLERANCE).
Prints "OK <n> tensors" (and "torch: outputs agree ...", "torch: gradients agree ...") on
success; exits 1 with the reason otherwise.

The layers, as PyTorch computes them (names of the tensors in brackets):
  conv2d, linear [weight, bias]; maxpool, avgpool; relu, tanh, sigmoid, gelu (exact), silu;
  flatten; dropout; identity; layer_norm, rms_norm [weight(, bias)], eps 1e-5;
  batch_norm [weight, bias, running_mean, running_var] (BatchNorm1d/2d; burn keeps no
  num_batches_tracked: PyTorch fills it in when it loads a state dict without it, as it does
  for its own old checkpoints, and with a fixed momentum does not use it);
  embedding [weight: vocab x dim]; pos_embedding [weight: max_len x d] (rows 0..T added);
  attention [query, key, value, output: Linear d x d] causal, scaled by 1/sqrt(d/heads);
  transformer_block [norm_2, mha.{query,key,value,output}, norm_1, pwff.linear_inner,
  pwff.linear_outer]: x + mha(norm_2(x)), then x + linear_outer(gelu(linear_inner(norm_1(x))))
  (burn's TransformerEncoderLayer with norm_first: it names the norms for the post-LN order).
Links: a layer's `dependencies` are merged into its input (add, or concat on channels /
features), `out_variables` keep its output.
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np

LINKS = ("out_variables", "dependencies", "merge")
TOLERANCE = 1e-4
# A parameter's gradient agrees when its largest difference from the float64 gradient
# (PyTorch's, in double precision on the same weights and batch) is at most this share of
# the tensor's largest float64 gradient. Both float32 computations (the engine's and
# PyTorch's own, printed beside it) land within 2e-7 to 5e-6 of it on these models (the
# most in resnet-bn, whose batch norm backward subtracts nearly equal sums): sums of a few
# hundred to a few thousand products rounded at 2^-24 each, and softmax, normalization and
# erf rounded likewise. A backward that is wrong anywhere is off by far more: with the
# second term of GELU's derivative 1 % too small, gpt-char's gradients are off by 3.6e-3.
# 1e-4 sits between: 20 times the rounding, 36 times below that error.
GRAD_TOLERANCE = 1e-4
# A gradient that is zero in exact arithmetic (an attention key's bias: it adds the same
# amount to every score of a query, which softmax takes out) is float32 noise in both
# libraries, of no scale of its own: there the engine may differ from float64 by up to this
# many times PyTorch's own float32 difference.
NOISE_FACTOR = 10


def read_safetensors(path):
    """The tensors of a safetensors file as numpy arrays (F32 and I64 only)."""
    with open(path, "rb") as f:
        data = f.read()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    body = data[8 + size:]
    dtypes = {"F32": np.float32, "I64": np.int64}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        array = np.frombuffer(body[start:end], dtype=dtypes[info["dtype"]])
        out[name] = array.reshape(info["shape"])
    return out


def layers_of(spec):
    """Each layer as (kind, args, out_variables, dependencies, merge)."""
    for node in spec["layers"]:
        if isinstance(node, str):
            yield node, {}, [], [], "add"
            continue
        kinds = [k for k in node if k not in LINKS]
        assert len(kinds) == 1, f"a layer needs one kind: {node}"
        kind = kinds[0]
        yield (kind, node[kind] or {}, node.get("out_variables") or [],
               node.get("dependencies") or [], node.get("merge") or "add")


def merge_shape(a, b, how):
    if how == "add":
        assert a == b, f"add of {a} and {b}"
        return a
    if a[0] == "image":
        return ("image", a[1] + b[1], a[2], a[3])
    if a[0] == "seq":
        return ("seq", a[1], a[2] + b[2])
    return ("flat", a[1] + b[1])


def last_dim(shape):
    return {"image": shape[1], "flat": shape[1], "seq": shape[-1]}[shape[0]]


def layer_io(kind, args, shape):
    """A layer's output shape and its tensors {name: PyTorch shape}."""
    last = last_dim(shape)
    if kind == "conv2d":
        k, s, p, out = args["k"], args.get("stride", 1), args.get("padding", 0), args["out"]
        _, c, h, w = shape
        tensors = {"weight": (out, c, k, k)}
        if args.get("bias", True):
            tensors["bias"] = (out,)
        return ("image", out, (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1), tensors
    if kind in ("maxpool", "avgpool"):
        k = args["k"]
        s = args.get("stride") or k
        _, c, h, w = shape
        return ("image", c, (h - k) // s + 1, (w - k) // s + 1), {}
    if kind == "linear":
        out = args["out"]
        inputs = last if shape[0] == "seq" else int(np.prod(shape[1:]))
        tensors = {"weight": (out, inputs)}
        if args.get("bias", True):
            tensors["bias"] = (out,)
        new = ("seq", shape[1], out) if shape[0] == "seq" else ("flat", out)
        return new, tensors
    if kind == "flatten":
        return ("flat", int(np.prod(shape[1:]))), {}
    if kind == "layer_norm":
        return shape, {"weight": (last,), "bias": (last,)}
    if kind == "rms_norm":
        return shape, {"weight": (last,)}
    if kind == "batch_norm":
        return shape, {n: (last,) for n in ("weight", "bias", "running_mean", "running_var")}
    if kind == "embedding":
        return ("seq", shape[1], args["dim"]), {"weight": (args["vocab"], args["dim"])}
    if kind == "pos_embedding":
        return shape, {"weight": (args["max_len"], last)}
    if kind == "attention":
        return shape, attention_tensors("", last)
    if kind == "transformer_block":
        hidden = args.get("mlp", 4) * last
        tensors = attention_tensors("mha.", last)
        for norm in ("norm_1", "norm_2"):
            tensors[f"{norm}.weight"] = (last,)
            tensors[f"{norm}.bias"] = (last,)
        tensors.update({
            "pwff.linear_inner.weight": (hidden, last), "pwff.linear_inner.bias": (hidden,),
            "pwff.linear_outer.weight": (last, hidden), "pwff.linear_outer.bias": (last,),
        })
        return shape, tensors
    assert kind in ("relu", "tanh", "sigmoid", "gelu", "silu", "dropout", "identity"), kind
    return shape, {}


def attention_tensors(prefix, d):
    out = {}
    for proj in ("query", "key", "value", "output"):
        out[f"{prefix}{proj}.weight"] = (d, d)
        out[f"{prefix}{proj}.bias"] = (d,)
    return out


def walk(spec):
    """Per layer: (kind, args, input shape, links), and every tensor {name: shape}."""
    inp = spec["input"]
    if len(inp) == 3:
        shape = ("image", *inp)
    else:
        shape = ("flat", inp[0])
    named, plan, tensors = {}, [], {}
    for i, (kind, args, keep, take, how) in enumerate(layers_of(spec)):
        for name in take:
            shape = merge_shape(shape, named[name], how)
        out, own = layer_io(kind, args, shape)
        plan.append((kind, args, shape, keep, take, how))
        tensors.update({f"layers.{i}.{n}": s for n, s in own.items()})
        shape = out
        for name in keep:
            named[name] = shape
    return plan, tensors


def check_names(tensors, want):
    problems = []
    if set(tensors) != set(want):
        problems.append(f"names differ: missing {sorted(set(want) - set(tensors))}, "
                        f"unexpected {sorted(set(tensors) - set(want))}")
    for name, shape in want.items():
        t = tensors.get(name)
        if t is None:
            continue
        if t.dtype != np.float32:
            problems.append(f"{name}: dtype {t.dtype}, want float32")
        if tuple(t.shape) != tuple(shape):
            problems.append(f"{name}: shape {tuple(t.shape)}, want {tuple(shape)}")
        if not np.all(np.isfinite(t)):
            problems.append(f"{name}: non-finite values")
    return problems


def torch_model(plan):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class CausalAttention(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.query, self.key, self.value, self.output = (nn.Linear(d, d) for _ in range(4))

        def forward(self, x):
            n, t, d = x.shape
            split = lambda y: y.view(n, t, self.heads, d // self.heads).transpose(1, 2)
            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.output(y.transpose(1, 2).reshape(n, t, d))

    class Mlp(nn.Module):
        def __init__(self, d, hidden):
            super().__init__()
            self.linear_inner = nn.Linear(d, hidden)
            self.linear_outer = nn.Linear(hidden, d)

        def forward(self, x):
            return self.linear_outer(F.gelu(self.linear_inner(x)))

    class Block(nn.Module):
        def __init__(self, d, heads, mlp):
            super().__init__()
            self.norm_2 = nn.LayerNorm(d, eps=1e-5)
            self.mha = CausalAttention(d, heads)
            self.norm_1 = nn.LayerNorm(d, eps=1e-5)
            self.pwff = Mlp(d, mlp * d)

        def forward(self, x):
            x = x + self.mha(self.norm_2(x))
            return x + self.pwff(self.norm_1(x))

    class PosEmbedding(nn.Module):
        def __init__(self, max_len, d):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(max_len, d))

        def forward(self, x):
            return x + self.weight[: x.shape[1]]

    class Tokens(nn.Embedding):
        def forward(self, x):
            return super().forward(x.long())

    def batch_norm(shape):
        bn = nn.BatchNorm2d if shape[0] == "image" else nn.BatchNorm1d
        return bn(last_dim(shape), eps=1e-5, momentum=0.1)

    def module(kind, args, shape):
        last = last_dim(shape)
        simple = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "gelu": nn.GELU,
                  "silu": nn.SiLU, "flatten": nn.Flatten, "identity": nn.Identity}
        if kind in simple:
            return simple[kind]()
        if kind == "conv2d":
            return nn.Conv2d(shape[1], args["out"], args["k"], stride=args.get("stride", 1),
                             padding=args.get("padding", 0), bias=args.get("bias", True))
        if kind in ("maxpool", "avgpool"):
            pool = nn.MaxPool2d if kind == "maxpool" else nn.AvgPool2d
            return pool(args["k"], stride=args.get("stride") or args["k"])
        if kind == "linear":
            inputs = last if shape[0] == "seq" else int(np.prod(shape[1:]))
            return nn.Linear(inputs, args["out"], bias=args.get("bias", True))
        if kind == "dropout":
            return nn.Dropout(args["p"])
        if kind == "layer_norm":
            return nn.LayerNorm(last, eps=1e-5)
        if kind == "rms_norm":
            return nn.RMSNorm(last, eps=1e-5)
        if kind == "batch_norm":
            return batch_norm(shape)
        if kind == "embedding":
            return Tokens(args["vocab"], args["dim"])
        if kind == "pos_embedding":
            return PosEmbedding(args["max_len"], last)
        if kind == "attention":
            return CausalAttention(last, args["heads"])
        if kind == "transformer_block":
            return Block(last, args["heads"], args.get("mlp", 4))
        raise ValueError(f"unknown layer {kind}")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(module(k, a, s) for k, a, s, *_ in plan)

        def forward(self, x):
            kept = {}
            for layer, (_, _, shape, keep, take, how) in zip(self.layers, plan):
                for name in take:
                    other = kept[name]
                    x = x + other if how == "add" else torch.cat(
                        [x, other], dim=2 if shape[0] == "seq" else 1)
                x = layer(x)
                for name in keep:
                    kept[name] = x
            return x

    return Net()


def compare_torch(plan, weights_path, batch):
    import torch

    torch.manual_seed(0)
    model = torch_model(plan)
    state = {k: torch.from_numpy(v.copy()) for k, v in read_safetensors(weights_path).items()}
    model.load_state_dict(state, strict=True)
    x = torch.from_numpy(batch["input"].copy())
    results = []
    for mode in ("eval", "train"):
        want = batch.get(f"output_{mode}")
        if want is None:
            continue
        model.train(mode == "train")
        with torch.no_grad():
            got = model(x).numpy()
        diff = float(np.max(np.abs(got.reshape(want.shape) - want)))
        results.append((mode, diff))
    return results


def grad_outputs(model, x, labels):
    """The mean cross-entropy of `model`'s training-mode logits on `x` against `labels` (one
    label per row of logits: per sample, or per position of a sequence), after one backward;
    returns the loss and every parameter's gradient by name."""
    import torch.nn.functional as F

    model.train(True)
    model.zero_grad()
    logits = model(x)
    logits = logits.reshape(-1, logits.shape[-1])
    loss = F.cross_entropy(logits, labels.reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().double().numpy() for n, p in model.named_parameters()}
    return loss.item(), grads


def compare_grads(plan, weights_path, batch, grads_path):
    """The engine's loss and gradients (`grads_path`) against PyTorch's on the same weights and
    batch: per parameter, the largest difference from PyTorch's float64 gradient, within
    GRAD_TOLERANCE of the tensor's largest value (or NOISE_FACTOR times PyTorch's own float32
    difference, for a gradient that is zero but for rounding). Returns (problems, summary)."""
    import torch

    state = {k: torch.from_numpy(v.copy()) for k, v in read_safetensors(weights_path).items()}
    labels = torch.from_numpy(batch["labels"].copy()).long()
    x = torch.from_numpy(batch["input"].copy())
    outcome = {}
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        model = torch_model(plan)
        model.load_state_dict(state, strict=True)
        model = model.to(dtype)
        outcome[dtype] = grad_outputs(model, x.to(dtype), labels)
    (loss32, torch32), (loss64, exact) = outcome[torch.float32], outcome[torch.float64]
    engine = read_safetensors(grads_path)
    problems = []
    missing = sorted(set(exact) - set(engine))
    if missing:
        problems.append(f"the engine gave no gradient for {missing}")
    want_loss = float(batch["loss"].reshape(-1)[0])
    if not abs(want_loss - loss64) <= 1e-5 * max(1.0, abs(loss64)):
        problems.append(f"loss: engine {want_loss:.7f}, PyTorch {loss64:.7f}")
    worst, worst_torch, noise = (0.0, ""), 0.0, []
    for name, g in exact.items():
        if name not in engine:
            continue
        got = engine[name].astype(np.float64).reshape(g.shape)
        scale = float(np.max(np.abs(g)))
        mine = float(np.max(np.abs(got - g)))
        theirs = float(np.max(np.abs(torch32[name] - g)))
        if NOISE_FACTOR * theirs > GRAD_TOLERANCE * scale:
            noise.append(name)
            allowed = NOISE_FACTOR * theirs
        else:
            allowed = GRAD_TOLERANCE * scale
            worst_torch = max(worst_torch, theirs / scale)
            if not mine / scale <= worst[0]:
                worst = (mine / scale, name)
        if not mine <= allowed:
            problems.append(f"{name}: gradient off by {mine:.2e} where its largest value is "
                            f"{scale:.2e} (PyTorch float32: off by {theirs:.2e}; allowed "
                            f"{allowed:.2e})")
    summary = (f"{len(exact)} parameters, worst {worst[0]:.2e} of the largest value "
               f"({worst[1]}), PyTorch float32's worst {worst_torch:.2e}; "
               f"{len(noise)} gradients zero but for float32 noise "
               f"({', '.join(noise) or 'none'}); loss {want_loss:.6f} vs {loss64:.6f}")
    return problems, summary


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--torch", action="store_true", help="also run the PyTorch twin")
    a = p.parse_args()

    with open(f"{a.dir}/spec.json") as f:
        spec = json.load(f)
    plan, want = walk(spec)
    tensors = read_safetensors(f"{a.dir}/model.safetensors")
    problems = check_names(tensors, want)
    if problems:
        print("FAIL\n" + "\n".join(problems))
        sys.exit(1)
    if a.torch:
        batch = read_safetensors(f"{a.dir}/batch.safetensors")
        results = compare_torch(plan, f"{a.dir}/model.safetensors", batch)
        worst = max(d for _, d in results)
        summary = ", ".join(f"{m} max |diff| {d:.2e}" for m, d in results)
        if not worst <= TOLERANCE or math.isnan(worst):
            print(f"FAIL {spec.get('name')}: {summary} (tolerance {TOLERANCE})")
            sys.exit(1)
        print(f"torch: outputs agree for {spec.get('name')}: {summary}")
        grads_path = f"{a.dir}/grads.safetensors"
        if os.path.exists(grads_path):
            problems, summary = compare_grads(plan, f"{a.dir}/model.safetensors", batch,
                                              grads_path)
            if problems:
                print(f"FAIL {spec.get('name')} gradients: {summary}\n" + "\n".join(problems))
                sys.exit(1)
            print(f"torch: gradients agree for {spec.get('name')}: {summary}")
    print(f"OK {len(tensors)} tensors")


if __name__ == "__main__":
    main()
