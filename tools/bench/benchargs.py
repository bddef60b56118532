"""Argument checks the benchmarks share (a bench script's own directory is on its sys.path)."""
from __future__ import annotations

import argparse
import subprocess


def check_commit(ap: argparse.ArgumentParser, root: str, commit: str) -> None:
    """--against must name a commit of the repo at `root`: else git's failure came as a
    traceback, without git's reason, after the set-up."""
    r = subprocess.run(["git", "-C", root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                       capture_output=True)
    if r.returncode != 0:
        ap.error(f"--against: {commit!r} is not a commit of {root}")


def at_least_one(ap: argparse.ArgumentParser, args: argparse.Namespace, *flags: str) -> None:
    """Counts of 0 (no item, no round: no median) refused before any set-up, naming the flag."""
    for flag in flags:
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
