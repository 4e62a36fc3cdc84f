#!/usr/bin/env python3
"""Open MPI reference for `flotilla bench allreduce`: MPI_Allreduce(SUM) of f32 buffers, TCP
over loopback, 1 thread per rank. Run it under mpirun, e.g.

  mpirun --oversubscribe --allow-run-as-root --mca btl tcp,self --mca btl_tcp_if_include lo \
         --mca pml ob1 -n 2 python3 scripts/bench_mpi_allreduce.py [--sizes ...] [--iters 20]

(`--mca btl tcp,self` with `pml ob1` keeps shared memory out: every byte goes through TCP on
127.0.0.1, as Flotilla's ring does.) Or let the script start mpirun itself, once per rank count:

  python3 scripts/bench_mpi_allreduce.py -n 2,4

Timing as Flotilla's bench (crates/flotilla/src/bench/measure.rs): buffers filled with rank+1,
a barrier, one timed Allreduce; 2 warm-up iterations; iterations capped so that
iters * bytes <= 4 GiB (at least 3); each rank's median, then the max over ranks;
algbw = bytes / time, busbw = algbw * 2(N-1)/N (GB = 1e9 bytes). Needs numpy and mpi4py.
"""
import argparse
import os
import subprocess
import sys
import time

MPIRUN = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
          "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo", "--mca", "pml", "ob1"]


def parse_size(s):
    s = s.strip()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1].lower(), 1)
    return int(s[:-1] if mult != 1 else s) * mult


def fmt_bytes(n):
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def header(iters, warmup):
    print(f"# Open MPI MPI_Allreduce(SUM) of f32 over 127.0.0.1 (btl tcp,self; pml ob1), "
          f"{os.cpu_count()} cores, 1 thread per rank; median of up to {iters} iters "
          f"after {warmup} warm-up")
    print(f"{'ranks':>6} {'size':>10} {'iters':>6} {'time_us':>12} {'algbw_GB/s':>12} {'busbw_GB/s':>12}",
          flush=True)


def run_ranks(args):
    """Inside mpirun: every rank measures, rank 0 prints rows."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    if rank == 0 and not args.no_header:
        header(args.iters, args.warmup)
    for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
        iters = max(3, min(args.iters, (4 << 30) // max(1, nbytes)))
        buf = np.empty(nbytes // 4, dtype=np.float32)
        out = np.empty_like(buf)
        expected = np.float32(n * (n + 1) // 2)
        times = []
        for i in range(args.warmup + iters):
            buf.fill(rank + 1)
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(buf, out, op=MPI.SUM)
            dt = time.perf_counter() - t0
            if i == args.warmup and not (out == expected).all():
                raise SystemExit(f"Allreduce result check failed at {nbytes} bytes")
            if i >= args.warmup:
                times.append(dt)
        local = sorted(times)[len(times) // 2]
        secs = comm.allreduce(local, op=MPI.MAX)
        if rank == 0:
            algbw = nbytes / secs / 1e9
            busbw = algbw * 2 * (n - 1) / n
            print(f"{n:>6} {fmt_bytes(nbytes):>10} {iters:>6} {secs * 1e6:>12.1f} "
                  f"{algbw:>12.3f} {busbw:>12.3f}", flush=True)
        del buf, out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--ranks", default=None,
                   help="start mpirun for these rank counts (e.g. 2,4); without it, run as a rank")
    p.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M,256M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-header", action="store_true")
    args = p.parse_args()
    if args.ranks is None:
        run_ranks(args)
        return
    header(args.iters, args.warmup)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for n in [int(r) for r in args.ranks.split(",")]:
        cmd = MPIRUN + ["-n", str(n), sys.executable, os.path.abspath(__file__),
                        "--sizes", args.sizes, "--iters", str(args.iters),
                        "--warmup", str(args.warmup), "--no-header"]
        r = subprocess.run(cmd, env=env)
        if r.returncode != 0:
            print(f"mpirun -n {n} failed with exit code {r.returncode}", file=sys.stderr)
            sys.exit(r.returncode)


if __name__ == "__main__":
    main()
