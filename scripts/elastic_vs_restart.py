#!/usr/bin/env python3
"""What a lost rank costs: an elastic job (`-n 3:4 --max-restarts K`) against a whole-job
restart from the checkpoint (`-n 4 --max-restarts K --checkpoint-every C`), one rank
SIGKILLed every `--every` seconds for `--for` seconds, in the same run, and an undisturbed
run of the same length as the baseline. Not a CI test: a benchmark (BENCHMARKS.md).

Usage: scripts/elastic_vs_restart.py [--every 20] [--for 120] [--epochs 40]
                                     [--flotilla $CARGO_TARGET_DIR/release/flotilla]

Each job: LeNet-5 on the vendored MNIST, 4 ranks x batch 64 (global batch 256), 1 thread
per rank, `--timeout-s 10`. The victims cycle through the ranks, rank 0 included (an
elastic job's rank 0 of the newest generation; a restarted job's rank 0 is its child 0).

Prints, per job: its wall time, the faults it took, the time each fault cost (the wall time
over the undisturbed run's, per fault), and for the elastic job, per change of generation,
the survivors' pause (from leaving a generation to training in the next, from their
run.logs) and the steps the change cost (the step left minus the step resumed from:
0 when the lost step went through elsewhere, 1 when it was redone). It checks what the CI
test checks: exit 0, every generation's members logged the same parameters' hash, no
survivor changed its process id.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GEN = re.compile(
    r"\[\s*([\d.]+)s\] generation (\d+): \d+ ranks \(slots \[([\d, ]+)\]\), this process "
    r"\(pid (\d+)\) rank (\d+), from step (\d+); .*\(xxh3 ([0-9a-f]+)\)"
)
LEFT = re.compile(r"\[\s*([\d.]+)s\] left generation (\d+) after step (\d+)")
EPOCH = re.compile(r"\[\s*([\d.]+)s\] epoch \d+/\d+ .* time=([\d.]+)s")


def generations(log):
    return [
        dict(at=float(m[1]), gen=int(m[2]), slots=[int(s) for s in m[3].split(", ")],
             pid=int(m[4]), rank=int(m[5]), step=int(m[6]), hash=m[7])
        for m in GEN.finditer(log)
    ]


def slot_logs(out):
    return {int(d.name[5:]): (d / "run.log").read_text()
            for d in out.glob("slot-*") if (d / "run.log").exists()}


def elastic_victim(out, k):
    """A pid of the newest generation: its rank 0 every third fault, else another rank."""
    newest = None
    for log in slot_logs(out).values():
        for g in generations(log):
            if newest is None or g["gen"] > newest["gen"]:
                newest = g
    if newest is None:
        return None
    slot = newest["slots"][0 if k % 3 == 2 else 1 + k % (len(newest["slots"]) - 1)]
    gens = generations(slot_logs(out).get(slot, ""))
    return gens[-1]["pid"] if gens else None


def restart_victim(out, k):
    """A rank of the current start of a whole-job restart (its rank 0 every third fault)."""
    needle = str(out / "launch-config.yaml")
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"train" in cmd and needle.encode() in cmd:
                pids.append(int(p.name))
    pids.sort()
    if len(pids) < 4:
        return None
    return pids[0] if k % 3 == 2 else pids[1 + k % 3]


def run(flotilla, args, out, every, duration, victim):
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    started = time.monotonic()
    proc = subprocess.Popen([flotilla, "launch", *args, "--output", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kills = []

    def killer():
        k = 0
        while victim and time.monotonic() - started < duration and proc.poll() is None:
            time.sleep(every)
            pid = None
            until = time.monotonic() + 10
            while pid is None and time.monotonic() < until and proc.poll() is None:
                pid = victim(out, k)
                time.sleep(0.1)
            if pid is None or proc.poll() is not None:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                kills.append(time.monotonic() - started)
                k += 1
            except ProcessLookupError:
                pass

    t = threading.Thread(target=killer)
    t.start()
    output, _ = proc.communicate()
    wall = time.monotonic() - started
    t.join()
    return proc.returncode, wall, kills, output


def check_elastic(out):
    logs = slot_logs(out)
    hashes, pauses, steps_lost = {}, [], []
    for slot, log in logs.items():
        gens = generations(log)
        for g in gens:
            hashes.setdefault(g["gen"], set()).add(g["hash"])
        if "final test_acc=" in log and len({g["pid"] for g in gens}) != 1:
            sys.exit(f"slot {slot} changed its process id")
        for m in LEFT.finditer(log):
            t, left, step = float(m[1]), int(m[2]), int(m[3])
            nxt = next((g for g in gens if g["at"] >= t), None)
            if nxt:
                pauses.append(nxt["at"] - t)
                steps_lost.append(step - nxt["step"])
    bad = {g: h for g, h in hashes.items() if len(h) != 1}
    if bad:
        sys.exit(f"generations whose members hold different parameters: {bad}")
    # The epochs of the process that trained longest, those with a change starred.
    longest = max(logs.values(), key=lambda log: len(EPOCH.findall(log)))
    changes = [float(m[1]) for m in LEFT.finditer(longest)]
    epochs, start = [], 0.0
    for m in EPOCH.finditer(longest):
        end, took = float(m[1]), float(m[2])
        star = "*" if any(start <= c <= end for c in changes) else ""
        epochs.append(f"{took:.1f}{star}")
        start = end
    return len(hashes), pauses, steps_lost, epochs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--every", type=float, default=20.0)
    p.add_argument("--for", dest="duration", type=float, default=120.0)
    p.add_argument("--epochs", default="40")
    target = os.environ.get("CARGO_TARGET_DIR", str(ROOT / "target"))
    p.add_argument("--flotilla", default=f"{target}/release/flotilla")
    a = p.parse_args()
    common = ["--epochs", a.epochs, "--timeout-s", "10", "--batch-size", "64"]
    faults = int(a.duration // a.every)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rc, base, _, out = run(a.flotilla, ["-n", "4", *common], tmp / "plain", 0, 0, None)
        if rc:
            sys.exit(f"the undisturbed run failed:\n{out[-3000:]}")
        final = [l for l in out.splitlines() if l.startswith("final ")]
        print(f"undisturbed: {base:.1f} s  {final[-1] if final else ''}")
        jobs = [
            ("elastic", ["-n", "3:4", "--max-restarts", str(faults + 2), *common], elastic_victim),
            ("restart", ["-n", "4", "--max-restarts", str(faults + 2), "--checkpoint-every", "50",
                         *common], restart_victim),
        ]
        for name, args, victim in jobs:
            out_dir = tmp / name
            rc, wall, kills, out = run(a.flotilla, args, out_dir, a.every, a.duration, victim)
            if rc:
                sys.exit(f"{name}: exit {rc}\n{out[-3000:]}")
            final = [l for l in out.splitlines() if l.startswith("final ")]
            cost = (wall - base) / max(len(kills), 1)
            print(f"{name}: {wall:.1f} s, {len(kills)} ranks killed (at "
                  f"{', '.join(f'{k:.0f}' for k in kills)} s), {cost:.1f} s per fault over "
                  f"the undisturbed run  {final[-1] if final else ''}")
            if name == "elastic":
                gens, pauses, lost, epochs = check_elastic(out_dir)
                print(f"  {gens} generations, parameters equal on every member of each; "
                      f"survivors' pause per change: "
                      f"{', '.join(f'{x:.2f}' for x in sorted(pauses))} s; steps lost per "
                      f"change: {sorted(set(lost))}")
                print(f"  epoch times of the longest-lived process (s; * a change in it): "
                      f"{' '.join(epochs)}")


if __name__ == "__main__":
    main()
