#!/usr/bin/env python3
"""Production lines of Rust per crate at a git revision: what `crates/*/src` holds, less
tests (files named `*_tests.rs`, `testkit.rs`, and a file's trailing `#[cfg(test)] mod`),
blank lines and comment lines (`//`, `///`, `//!`).

    python3 scripts/code_lines.py [REV ...]     # default: HEAD; one column per revision

Read from git (`git ls-tree`, `git show`), so any two revisions compare without a checkout.
"""

import subprocess
import sys
from collections import defaultdict


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def production(text: str) -> int:
    """Lines of code up to the file's `#[cfg(test)]` module, without blanks and comments."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if line.strip() == "#[cfg(test)]" and nxt.startswith("mod ") and nxt.endswith("{"):
            lines = lines[:i]
            break
    return sum(1 for l in lines if l.strip() and not l.strip().startswith("//"))


def counts(rev: str) -> dict:
    per_crate = defaultdict(int)
    for path in git("ls-tree", "-r", "--name-only", rev, "crates").splitlines():
        parts = path.split("/")
        if len(parts) < 4 or parts[2] != "src" or not path.endswith(".rs"):
            continue
        name = parts[-1]
        if name.endswith("_tests.rs") or name == "testkit.rs" or "tests" in parts[3:-1]:
            continue
        per_crate[parts[1]] += production(git("show", f"{rev}:{path}"))
    return per_crate


def main() -> None:
    revs = sys.argv[1:] or ["HEAD"]
    tables = [counts(r) for r in revs]
    crates = sorted(set().union(*tables))
    print("| crate | " + " | ".join(revs) + " |")
    print("|---|" + "---:|" * len(revs))
    for c in crates:
        print(f"| {c} | " + " | ".join(str(t.get(c, 0)) for t in tables) + " |")
    print("| **total** | " + " | ".join(str(sum(t.values())) for t in tables) + " |")


if __name__ == "__main__":
    main()
