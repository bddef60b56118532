"""Synthetic steps with known costs, for benchmarks and tests: importable by
spawned workers (a benchmark script's own functions are not)."""
from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


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


class Inflate:
    """The item's bytes as a uint8 array ``factor`` times as large (Cachew's Figure 8
    pipeline grows each element 2.5x); deterministic, so its output can be cached."""

    def __init__(self, factor: float) -> None:
        if not factor > 0:
            raise ValueError(f"factor must be > 0, got {factor!r}")
        self.factor = factor

    def __call__(self, data: bytes) -> "np.ndarray":
        import numpy as np

        src = np.frombuffer(bytes(data), np.uint8)
        return np.resize(src, max(1, int(round(len(src) * self.factor))))


class Spin:
    """``seconds`` of CPU per item (a busy loop on this thread's CPU clock); returns its input."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, x):
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass
        return x
