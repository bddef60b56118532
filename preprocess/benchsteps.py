"""Synthetic steps with known costs, for benchmarks and tests: importable by
spawned workers (a benchmark script's own functions are not)."""
from __future__ import annotations

import struct
import time


def item_index(data: bytes) -> int:
    """The item's index, written in its first 8 bytes."""
    return struct.unpack_from("<q", data)[0]


class Work:
    """`base` seconds of work per item and `extra` more on every fifth (index % 5 == 0),
    as CPU (a busy loop on this thread's CPU clock) or waiting (a sleep)."""

    def __init__(self, kind: str, base: float, extra: float) -> None:
        if kind not in ("cpu", "wait"):
            raise ValueError(f"kind must be 'cpu' or 'wait', got {kind!r}")
        self.kind, self.base, self.extra = kind, base, extra

    def __call__(self, i: int) -> int:
        secs = self.base + (self.extra if i % 5 == 0 else 0.0)
        if self.kind == "wait":
            time.sleep(secs)
        else:
            end = time.thread_time() + secs
            while time.thread_time() < end:
                pass
        return i
