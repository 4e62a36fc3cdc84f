#!/usr/bin/env python3
"""Per-rank resident memory of a `flotilla launch` job, measured from /proc (not counted by
the strategy): every 0.2 s the RSS of each `flotilla train` process is read; printed per rank
are the largest before the end-of-run checkpoint (training and evaluation: samples taken
before rank 0's run.log says the parameters were hashed) and over the whole run, with the
kernel's own peak (VmHWM) at the end of the last step and at the end of the run
(`steps_peak_resident_bytes` and `peak_resident_bytes` of summary.json).

    python3 scripts/rss_peaks.py OUTPUT -- flotilla launch examples/gpt-zero3.yaml -n 4 ...

OUTPUT must be the job's `--output` directory."""
import json
import os
import subprocess
import sys
import time


def ranks():
    """pid -> rank of the running `flotilla train` processes (RANK from their environment)."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            if len(cmd) < 2 or not cmd[0].endswith(b"flotilla") or cmd[1] != b"train":
                continue
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[int(pid)] = int(rank)
        except OSError:
            pass
    return found


def rss_mib(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def hashed(output):
    try:
        log = open(os.path.join(output, "rank-0", "run.log")).read()
    except OSError:
        return False
    return "(xxh3 " in log


def main():
    output, cmd = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    before, whole = {}, {}
    while job.poll() is None:
        late = hashed(output)
        for pid, rank in ranks().items():
            mib = rss_mib(pid)
            if mib is None:
                continue
            whole[rank] = max(whole.get(rank, 0), mib)
            if not late:
                before[rank] = max(before.get(rank, 0), mib)
        time.sleep(0.2)
    if job.returncode != 0:
        sys.exit(f"the job failed: {job.stderr.read().decode()[-2000:]}")
    summary = json.load(open(os.path.join(output, "summary.json")))
    figures = {r["rank"]: r.get("figures", {}) for r in summary.get("ranks", [])}
    mib = lambda rank, name: figures.get(rank, {}).get(name, 0) / 2**20
    for rank in sorted(whole):
        print(f"rank {rank}: training+evaluation {before.get(rank, 0):.0f} MiB, "
              f"whole run {whole[rank]:.0f} MiB (sampled); VmHWM at the last step "
              f"{mib(rank, 'steps_peak_resident_bytes'):.0f} MiB, at the end "
              f"{mib(rank, 'peak_resident_bytes'):.0f} MiB")


main()
