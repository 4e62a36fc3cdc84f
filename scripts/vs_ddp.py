"""What the side-by-side scripts against PyTorch share (`epoch_vs_ddp.py`, `gpt_vs_ddp.py`,
`gpt_vs_fsdp.py`): their common options, the alternating rounds and Flotilla's runs.

Each round runs Flotilla, then DDP, so that a change of load hits both sides.
"""
import argparse
import json
import os
import socket
import subprocess
import tempfile
import time

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


def free_port():
    """A free TCP port on 127.0.0.1 (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_flotilla(args, work, i, config, threads="1"):
    """Runs `flotilla launch` of the YAML text `config` (`threads` threads per rank, or the
    launcher's default for `default`) into `work`'s `flotilla-{i}`; returns its rows of
    metrics.jsonl (one per epoch) and the run's wall time in seconds."""
    cfg = os.path.join(work, "flotilla.yaml")
    with open(cfg, "w") as f:
        f.write(config)
    out = os.path.join(work, f"flotilla-{i}")
    cmd = [args.flotilla, "launch", cfg, "--output", out, "--master-port", str(free_port())]
    if threads != "default":
        cmd += ["--threads", str(threads)]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   cwd=ROOT, timeout=3600)
    total = time.perf_counter() - started
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()], total
