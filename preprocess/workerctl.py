"""How many preprocessing workers (MinatoLoader §4.3, Formula 1-2).

    workers' = min(max_workers, max(1, workers + clip(round(delta), -2, 2)))
    delta    = ALPHA * (1 - 2 * fill) + BETA * (TARGET_CPU - cpu)

fill: how full the queue of ready batches is (0 empty: training waits for data;
1 full: workers are ahead); cpu: the machine's CPU use in [0, 1]. An empty queue
asks for more workers, a full one for fewer. The paper adds BETA * (cpu - 0.7),
which grows the pool as the CPU saturates; we subtract, so the pool grows only
while CPU use is below about 70% and shrinks above it (the target the issue
names: workers stop being added once they would only contend for cores)."""
from __future__ import annotations

import os

ALPHA = 1.5
BETA = 4.0
TARGET_CPU = 0.7
MAX_STEP = 2


def next_workers(workers: int, fill: float, cpu: float, max_workers: int) -> int:
    delta = ALPHA * (1 - 2 * min(1.0, max(0.0, fill))) + BETA * (TARGET_CPU - cpu)
    step = max(-MAX_STEP, min(MAX_STEP, int(round(delta))))
    return min(max_workers, max(1, workers + step))


def max_workers() -> int:
    """One worker per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class CpuMeter:
    """Machine CPU use between calls, from /proc/stat (Linux); None elsewhere."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    def sample(self) -> float | None:
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        total, idle = now[0] - last[0], now[1] - last[1]
        return 1.0 - idle / total
