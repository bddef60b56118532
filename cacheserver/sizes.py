"""Human byte sizes ("200GB", "1.5GiB", "64MB") for flags and reports."""
from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
}
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a size; decimal units (KB, MB, GB) are powers of 10, binary ones
    (KiB, MiB, GiB, or a bare K/M/G) powers of 2. Raises ValueError naming the input."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    m = _RE.match(text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (expected e.g. 200GB, 512MiB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def size_flag(text: str) -> int:
    """parse_size as an argparse ``type=``: argparse replaces a ValueError's message by
    "invalid parse_size value: ...", naming a function; this keeps parse_size's own
    ("not a size: ... (expected e.g. 200GB, ...)") after the flag's name."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
