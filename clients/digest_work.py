"""What the digest tool's hashing and verifying share: a progress bar in bytes, and a
pool fed a bounded number of jobs at a time."""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from tqdm import tqdm


def progress(total: int | None, quiet: bool, desc: str, unit: str = "B") -> tqdm:
    """A bar counting bytes (unit "B") or things (unit " files", say)."""
    # disable=None: tqdm hides itself when stderr is not a terminal.
    # Bytes scaled (KiB, MiB); a count as it is (scaled, 30 files would show as "30.0").
    return tqdm(total=total, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                desc=desc, disable=True if quiet else None, file=sys.stderr)


def waiting(bar: tqdm, fn: Callable[[], Any], every: float = 0.5) -> Any:
    """fn(), the bar redrawn meanwhile: its clock moves through a long call that tells
    nothing of its own progress (a remote listing), so it does not look hung."""
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every):
            bar.refresh()
    t = threading.Thread(target=tick, name="digest-waiting", daemon=True)
    t.start()
    try:
        return fn()
    finally:
        stop.set()
        t.join()


class ThreadCounter:
    """itemscan.add_to's counter for threads: a multiprocessing.Value without the shared memory
    and semaphore (which some sandboxes lack)."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def get_lock(self) -> threading.Lock:
        return self._lock


Job = tuple[Any, Callable[..., Any], tuple[Any, ...]]  # (key, function, arguments)


TICK = 0.1  # seconds between calls of submit_bounded's tick: a progress bar's refresh


def submit_bounded(ex: cf.Executor, jobs: Iterator[Job], window: int,
                   tick: Callable[[], None] | None = None) -> Iterator[tuple[Any, cf.Future[Any]]]:
    """Submit jobs keeping at most `window` unfinished; yield (key, future) as each is done,
    calling `tick` every TICK seconds meanwhile (progress within long jobs).
    The first jobs are submitted before this returns. Submitting one future per object
    of a bucket up front held about 2 KiB each: gigabytes for millions of objects."""
    pending: dict[cf.Future[Any], Any] = {}

    def fill() -> None:
        for key, fn, args in itertools.islice(jobs, max(window - len(pending), 0)):
            pending[ex.submit(fn, *args)] = key

    def finished() -> Iterator[tuple[Any, cf.Future[Any]]]:
        while pending:
            done, _ = cf.wait(pending, None if tick is None else TICK, cf.FIRST_COMPLETED)
            if tick is not None:
                tick()
            for fut in done:
                yield pending.pop(fut), fut
            fill()
    fill()
    return finished()
