#!/usr/bin/env python3
"""PyTorch gloo reference for `flotilla bench allreduce`: all_reduce(SUM) of f32 tensors over
127.0.0.1 with N local processes, 1 compute thread per rank.

Usage: bench_torch_allreduce.py [-n 2,4] [--sizes 4K,16K,...,256M] [--iters 20] [--warmup 2]

For each rank count N it spawns N processes (torch.multiprocessing, start method "spawn"), each
joining a gloo process group with a TCP store on 127.0.0.1 (GLOO_SOCKET_IFNAME=lo), and for
each size runs `--warmup` untimed then `--iters` timed all_reduce calls, each preceded by a
barrier so every rank starts together. The timing is the one of Flotilla's bench
(crates/flotilla/src/bench/measure.rs): each rank's median over iterations, then the max over ranks; iterations are capped so that
iters * bytes <= 4 GiB (at least 3); the result is checked against the expected sum.
algbw = bytes / time, busbw = algbw * 2(N-1)/N (GB = 1e9 bytes).
"""
import argparse
import os
import socket
import sys
import time


def parse_size(s):
    s = s.strip()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1].lower(), 1)
    return int(s[:-1] if mult != 1 else s) * mult


def fmt_bytes(n):
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, port, sizes, iters, warmup, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Gloo's C++ side prints connection chatter on stdout; keep stdout for the table (rows
    # travel back through the queue), send the chatter to stderr.
    sys.stdout.flush()
    os.dup2(2, 1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    rows = []
    for nbytes in sizes:
        # Same iteration cap as Flotilla's bench: iters * bytes <= 4 GiB, at least 3.
        n_iters = max(3, min(iters, (4 << 30) // max(1, nbytes)))
        t = torch.empty(nbytes // 4, dtype=torch.float32)
        expected = float(world * (world + 1) // 2)
        times = []
        for i in range(warmup + n_iters):
            t.fill_(float(rank + 1))
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            dt = time.perf_counter() - t0
            if i == warmup and not bool((t == expected).all()):
                raise RuntimeError(f"all_reduce result check failed at {nbytes} bytes")
            if i >= warmup:
                times.append(dt)
        # As Flotilla: each rank's median, then the max over ranks.
        local = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        rows.append((nbytes, n_iters, local.item()))
        del t
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--ranks", default="2,4")
    p.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M,256M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as e:
        print(f"bench_torch_allreduce.py: PyTorch is not installed ({e})", file=sys.stderr)
        sys.exit(2)

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    print(f"# torch {torch.__version__} gloo all_reduce(SUM) of f32 over 127.0.0.1 "
          f"(GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']}), {os.cpu_count()} cores, "
          f"1 thread per rank; median of {args.iters} iters after {args.warmup} warm-up")
    print(f"{'ranks':>6} {'size':>10} {'iters':>6} {'time_us':>12} {'algbw_GB/s':>12} {'busbw_GB/s':>12}")
    ctx = mp.get_context("spawn")
    for n in ranks:
        queue = ctx.SimpleQueue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, n, port, sizes, args.iters, args.warmup, queue))
                 for r in range(n)]
        for pr in procs:
            pr.start()
        rows = queue.get()
        for pr in procs:
            pr.join()
            if pr.exitcode != 0:
                print(f"rank process exited with {pr.exitcode}", file=sys.stderr)
                sys.exit(1)
        for nbytes, iters, secs in rows:
            algbw = nbytes / secs / 1e9
            busbw = algbw * 2 * (n - 1) / n
            print(f"{n:>6} {fmt_bytes(nbytes):>10} {iters:>6} {secs * 1e6:>12.1f} "
                  f"{algbw:>12.3f} {busbw:>12.3f}", flush=True)


if __name__ == "__main__":
    main()
