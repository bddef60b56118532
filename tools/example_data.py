#!/usr/bin/env python3
"""Write a small ImageFolder-style dataset: DIR/<class>/<n>.png (README's example).

    python tools/example_data.py DIR [--classes 3] [--per-class 40] [--size 32]

Each class's images share a tint, so the class is learnable; the same arguments
always write the same bytes (seeded)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image

NAMES = ["airplane", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck", "zebra"]


def write(root: Path, classes: int, per_class: int, size: int) -> int:
    rng = np.random.default_rng(0)
    for k in range(classes):
        d = root / NAMES[k % len(NAMES)] if classes <= len(NAMES) else root / f"class{k:03d}"
        d.mkdir(parents=True, exist_ok=True)
        tint = rng.integers(0, 255, 3)
        for j in range(per_class):
            noise = rng.integers(0, 96, (size, size, 3))
            img = np.clip(tint * 0.6 + noise, 0, 255).astype(np.uint8)
            Image.fromarray(img).save(d / f"{j:04d}.png")
    return classes * per_class


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", help="directory to write (created)")
    p.add_argument("--classes", type=int, default=3)
    p.add_argument("--per-class", type=int, default=40)
    p.add_argument("--size", type=int, default=32, help="image side in pixels")
    a = p.parse_args(argv)
    for flag, value in (("--classes", a.classes), ("--per-class", a.per_class), ("--size", a.size)):
        if value < 1:  # else a traceback (--size 0) or "wrote -9 images" (--per-class -3)
            p.error(f"{flag} must be at least 1, not {value}")
    try:
        n = write(Path(a.dir), a.classes, a.per_class, a.size)
    except OSError as e:  # DIR under a file, read-only, a full disk: say so, not a traceback
        print(f"example_data: error: cannot write {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"example_data: wrote {n} images in {a.classes} classes under {a.dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
