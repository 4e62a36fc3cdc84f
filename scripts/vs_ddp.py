"""What the side-by-side scripts against PyTorch DDP share (`epoch_vs_ddp.py`,
`gpt_vs_ddp.py`): their common options and the alternating rounds.

Each round runs Flotilla, then DDP, so that a change of load hits both sides.
"""
import argparse
import os
import tempfile

import torch_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parser(doc):
    """An argument parser with --runs, --flotilla and --python (the script adds its own)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    p.add_argument("--flotilla", default=os.path.join(target, "release/flotilla"))
    p.add_argument("--python", default=torch_python.default(), help=torch_python.HELP)
    return p


def alternate(args, prefix, sides, show):
    """Runs `sides` ((name, run) pairs; `run(args, work, i)` returns a tuple) `args.runs` times
    in turn in one temporary directory, printing each result with `show(i, name, result)`;
    returns every side's results in run order."""
    results = {name: [] for name, _ in sides}
    with tempfile.TemporaryDirectory(prefix=prefix) as work:
        for i in range(args.runs):
            for name, run in sides:
                result = run(args, work, i)
                results[name].append(result)
                print(show(i, name, result), flush=True)
    return results
