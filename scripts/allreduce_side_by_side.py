#!/usr/bin/env python3
"""All-reduce busbw of Flotilla against Open MPI (defaults and TCP) and Gloo, in one run.

Extends ../shared/bench/side_by_side_allreduce.sh to every size and to several rounds: each
round runs, for each rank count, Flotilla's `bench allreduce` (once per transport, its ranks
bound to cores when they outnumber them: its default), Open MPI at its defaults (shared memory
between local ranks) unbound and bound to cores, Open MPI forced onto TCP, and Gloo
(torch.distributed), one thread per rank. Each tool's figure in a round is the median
iteration of that round; the table prints the median over the rounds with the min-max, and
Flotilla's ratio to Open MPI's defaults and to the best peer (medians).

Usage (from the project root, after `cargo build --release`, on a quiet machine):
    python3 scripts/allreduce_side_by_side.py --runs 3
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch_python

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "bench"))
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s):
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    return int(s[:-1]) * UNITS[s[-1]] if s[-1] in UNITS else int(s)


def label(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def run(cmd, env=None, timeout=1800):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        sys.stderr.write(f"warning: {' '.join(cmd)} exited {out.returncode}\n{out.stderr[-2000:]}")
    return out.stdout


def flotilla(binary, n, sizes, transport):
    cmd = [binary, "bench", "allreduce", "-n", str(n), "--iters", "20",
           "--sizes", ",".join(str(b) for b in sizes)]
    if transport:
        cmd += ["--transport", transport]
    res = {}
    for line in run(cmd).splitlines():
        f = line.split()
        if len(f) >= 7 and f[0] == str(n):
            b = parse_size(f[1] + f[2])
            res[b] = float(f[6])
    return res


def peer_lines(text, prefix):
    res = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            b = int(re.search(r"bytes=(\d+)", line).group(1))
            res[b] = float(re.search(r"busbw_median_GBs=([\d.]+)", line).group(1))
    return res


def mpi(binary, n, sizes, tcp, bound=False):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n)]
    if bound:
        # Rank r on core r mod cores, as `flotilla bench allreduce` binds when the ranks
        # outnumber the cores (and as Open MPI itself binds up to 2 ranks by default).
        cmd += ["--map-by", "core:OVERSUBSCRIBE", "--bind-to", "core:overload-allowed"]
    else:
        cmd += ["--bind-to", "none"]
    if tcp:
        cmd += ["--mca", "btl", "tcp,self", "--mca", "pml", "ob1", "--mca", "btl_tcp_if_include", "lo"]
    return peer_lines(run(cmd + [binary] + [str(b) for b in sizes]), "openmpi")


def gloo(python, n, sizes):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [python, os.path.join(SHARED, "gloo_allreduce.py"), str(n)] + [str(b) for b in sizes]
    return peer_lines(run(cmd, env=env), "gloo")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=torch_python.default(), help=torch_python.HELP)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sizes", default="1M,16M,64M,256M")
    ap.add_argument("--transports", default="tcp,shm",
                    help="Flotilla transports to measure (`bench allreduce --transport`); '' = the default")
    ap.add_argument("--flotilla", default="target/release/flotilla")
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    ranks = [int(n) for n in a.ranks.split(",")]
    transports = [t for t in a.transports.split(",") if t] or [""]
    if not shutil.which("mpicc"):
        sys.exit("mpicc not found: apt-get install -y libopenmpi-dev openmpi-bin")
    mpi_bin = os.path.join(tempfile.mkdtemp(), "mpi_allreduce")
    subprocess.run(["mpicc", "-O2", "-o", mpi_bin, os.path.join(SHARED, "mpi_allreduce.c")], check=True)
    tools = [f"flotilla-{t or 'default'}" for t in transports] + PEERS
    got = {}  # (tool, n, bytes) -> [busbw per round]
    for r in range(a.runs):
        for n in ranks:
            round_ = {f"flotilla-{t or 'default'}": flotilla(a.flotilla, n, sizes, t) for t in transports}
            round_["openmpi-shm"] = mpi(mpi_bin, n, sizes, tcp=False)
            round_["openmpi-shm-bound"] = mpi(mpi_bin, n, sizes, tcp=False, bound=True)
            round_["openmpi-tcp"] = mpi(mpi_bin, n, sizes, tcp=True)
            round_["gloo"] = gloo(a.python, n, sizes)
            for tool, res in round_.items():
                for b, v in res.items():
                    got.setdefault((tool, n, b), []).append(v)
        print(f"# round {r + 1} of {a.runs} done", file=sys.stderr, flush=True)
    report(got, tools, ranks, sizes, transports, a.runs)


# Open MPI unbound (`--bind-to none`, the shared script's) and bound to cores, over TCP, Gloo.
PEERS = ["openmpi-shm", "openmpi-shm-bound", "openmpi-tcp", "gloo"]


def cell(vals):
    if not vals:
        return "n/a"
    return f"{statistics.median(vals):.2f} ({min(vals):.2f}–{max(vals):.2f})"


def report(got, tools, ranks, sizes, transports, runs):
    print(f"busbw GB/s: median of {runs} rounds (min–max); each round's figure is its median iteration\n")
    ours = [t for t in tools if t.startswith("flotilla")]
    peers = PEERS
    head = ["ranks", "size"] + tools + [f"{o} / openmpi-shm" for o in ours] + [f"{o} / best peer" for o in ours]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    med = lambda t, n, b: statistics.median(got[(t, n, b)]) if got.get((t, n, b)) else None
    for n in ranks:
        for b in sizes:
            row = [str(n), label(b)] + [cell(got.get((t, n, b), [])) for t in tools]
            best = max((m for p in peers if (m := med(p, n, b)) is not None), default=None)
            mshm = med("openmpi-shm", n, b)
            for o in ours:
                m = med(o, n, b)
                row.append(f"{m / mshm:.2f}" if m and mshm else "n/a")
            for o in ours:
                m = med(o, n, b)
                row.append(f"{m / best:.2f}" if m and best else "n/a")
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
