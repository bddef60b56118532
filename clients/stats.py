"""Loader statistics that DataLoader worker processes add to and the main process reads.

Counters live in shared memory, one row per process, so processes never contend
and the main process sums rows at epoch end. With spawn/forkserver the array
travels to workers by pickling (multiprocessing shares the memory).

An add is a read and a write, so two processes must never share a row: each process claims a
row of its own at its first add (under a lock shared by all of them, once per process), a free
one or one whose process has ended (workers restarted every epoch reuse their predecessors'
rows). Rows were once worker id + 1, and the workers of two loaders of one dataset (train and
eval, both with workers), each with a worker 0, added to one row and lost counts. MAX_ROWS
processes may hold rows at once; one more is refused with a clear error rather than counted wrong.

A job may read one dataset through several loaders (train and eval): each loader has counters
of its own (LoaderCounters) that its reads add to as well as to the dataset's, so that an
epoch's statistics leave out what another loader read meanwhile (clients/epochs.py). A read
counts for the loader its process serves (a DataLoader worker: serve_loader) or, in the main
process, the loader whose batch this thread is fetching (counting_for).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .ownedlock import OwnedLock, alive

# vouched: hits taken without the hash check, the in-process server vouching for them
# (cacheserver/trust.py); they are in `hits` too.
FIELDS = ("hits", "misses", "store_bytes", "cache_bytes", "poisoned", "inserted",
          "coalesced", "cache_errors", "prefetched", "vouched")
# transformed items (autocache): found, not found, stored, poisoned, outputs the format cannot store
T_FIELDS = ("t_hits", "t_misses", "t_puts", "t_poisoned", "t_uncacheable")
FIELDS += T_FIELDS
MAX_WORKERS = 1024
MAX_ROWS = 1 + MAX_WORKERS  # the main process and 1024 workers at once (164 KB of counters)
PAIR_WAIT_S = 5.0  # at most, for the lock a loader's read is counted twice under
CLAIM_WAIT_S = 30.0  # at most, for the lock a row is claimed under (held for microseconds)

_pid = os.getpid()  # this process's id, kept true in a forked child (which claims a row of its own)
_all_rows: weakref.WeakSet[SharedRows] = weakref.WeakSet()  # this process's, for _forked


def _forked() -> None:
    global _pid
    _pid = os.getpid()
    for rows in list(_all_rows):  # a parent's thread mid-add held its lock at the fork: never released here
        rows._lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def worker_row() -> int:
    """Which process this is: 0 the main process, a DataLoader (or preprocessing) worker's id + 1.
    No longer a row of SharedRows (a process claims its own: the module's docstring)."""
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover
        return 0
    info = get_worker_info()
    return 0 if info is None else info.id + 1


class SharedRows:
    """`width` counters per process in shared memory, a row each (the module's docstring)."""

    def __init__(self, width: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.width = width
        self._arr = ctx.RawArray("q", MAX_ROWS * width)
        self._owners = ctx.RawArray("q", MAX_ROWS)  # each row's process id; 0: free
        self._claiming = OwnedLock()  # a process killed claiming a row leaves it to the next one
        # a process's row is added to from several threads at once (tf_dataset's parallel reads)
        self._lock = threading.Lock()
        self._row, self._row_pid = -1, 0  # this process's row, and which process claimed it
        _all_rows.add(self)

    def __getstate__(self) -> dict:
        # to a process as it starts, as RawArrays go; the row stays: the process claims its own
        return {"width": self.width, "_arr": self._arr, "_owners": self._owners, "_claiming": self._claiming}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._row, self._row_pid = -1, 0
        _all_rows.add(self)

    def add(self, counts: Mapping[int, int]) -> None:
        """Add counts (column: n) to this process's row (claimed at its first add)."""
        with self._lock:
            if self._row_pid != _pid:
                self._claim()
            base = self._row * self.width
            for col, n in counts.items():
                self._arr[base + col] += n

    def _claim(self) -> None:
        """This process's row: a free one, else one whose process has ended (its counts stay
        in the sums; nobody else adds to it any more)."""
        if not self._claiming.acquire(timeout=CLAIM_WAIT_S):
            raise RuntimeError(f"loader statistics: no row claimed in {CLAIM_WAIT_S:.0f} s (a live process "
                               f"holds the lock rows are claimed under: stopped, or its pid taken again?)")
        try:
            owners = self._owners[:]
            row = owners.index(0) if 0 in owners else next(
                (r for r, pid in enumerate(owners) if not alive(pid)), -1)
            if row < 0:
                raise ValueError(f"loader statistics have rows for {MAX_ROWS} processes at once (the main one "
                                 f"and {MAX_WORKERS} DataLoader or preprocessing workers), and live processes "
                                 f"hold them all: use fewer workers")
            self._owners[row] = _pid
        finally:
            self._claiming.release()
        self._row, self._row_pid = row, _pid

    def sums(self) -> list[int]:
        """Each column summed over all rows."""
        a, w = self._arr, self.width
        return [sum(a[col::w]) for col in range(w)]


class SharedCounters:
    """The loader statistics (FIELDS) in SharedRows. ``key`` names them across processes (a
    pickled copy keeps it); ``loaders``: this process's LoaderCounters of them."""

    def __init__(self, pairs: Any = None) -> None:
        self._rows = SharedRows(len(FIELDS))
        self.key = os.urandom(8)
        self.loaders: weakref.WeakSet[LoaderCounters] = weakref.WeakSet()
        # held across a loader's read counted twice (here and in its LoaderCounters) and across
        # reading both: else an epoch read another loader's worker between its two adds
        self._pairs = pairs if pairs is not None else OwnedLock()

    def __getstate__(self) -> dict:
        return {"_rows": self._rows, "key": self.key, "_pairs": self._pairs}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.loaders = weakref.WeakSet()

    def add(self, **counts: int) -> None:
        """Add counts (FIELDS: n) to this process's row."""
        cols = {FIELDS.index(name): n for name, n in counts.items()}
        mine = getattr(_local, "counters", None) or _serving
        if mine is None or mine.base != self.key:  # no loader's (or other counters: reads made to measure)
            self._rows.add(cols)
            return
        with _held(self._pairs):
            self._rows.add(cols)
            mine._rows.add(cols)

    def totals(self) -> dict[str, int]:
        return dict(zip(FIELDS, self._rows.sums()))

    def totals_with(self, loaders: list[LoaderCounters]) -> tuple[dict[str, int], dict[Any, dict[str, int]]]:
        """These totals and those loaders' (of these counters), read at one instant: no read of
        theirs counted here and not there yet."""
        with _held(self._pairs):
            return self.totals(), {c: c.totals() for c in loaders}


class LoaderCounters(SharedCounters):
    """One loader's share of a dataset's counters (``base``): what its reads added there."""

    def __init__(self, base: SharedCounters) -> None:
        super().__init__(base._pairs)
        self.base = base.key
        base.loaders.add(self)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "base": self.base}


@contextlib.contextmanager
def _held(lock: Any) -> Iterator[None]:
    """The pair lock, for microseconds. A process killed holding it leaves it to the next waiter
    (OwnedLock); one that holds it longer than PAIR_WAIT_S (stopped) is waited for no longer:
    the counts go on without it (each total stays right; only an epoch's split could be off)."""
    got = lock.acquire(timeout=PAIR_WAIT_S)
    try:
        yield
    finally:
        if got:
            lock.release()


_local = threading.local()  # .counters: the loader whose batch this thread fetches (main process)
_serving: LoaderCounters | None = None  # the loader a DataLoader worker process serves


def serve_loader(counters: LoaderCounters | None) -> None:
    """In a DataLoader worker, as it starts: its reads count for this loader."""
    global _serving
    _serving = counters


@contextlib.contextmanager
def counting_for(counters: LoaderCounters | None) -> Iterator[None]:
    """Reads this thread makes meanwhile count for this loader (one fetch, not across yields:
    the training loop may read another loader's batches between two of this one's)."""
    before, _local.counters = getattr(_local, "counters", None), counters
    try:
        yield
    finally:
        _local.counters = before


@dataclass
class EpochStats:
    """One epoch of one loader. `substituted`: cached items yielded while a miss the
    sampler had already met waited for a later batch (a hit taking a miss's place;
    at most the hits). `coalesced`: misses taken from another reader's insert."""
    epoch: int
    batches: int
    items: int
    seconds: float
    hits: int
    misses: int
    substituted: int
    store_bytes: int
    cache_bytes: int
    poisoned: int
    inserted: int
    coalesced: int
    planned_hit_rate: float
    batch_time_median: float
    batch_time_p95: float
    complete: bool = True  # False: the loop stopped (break, exception) before the epoch's end
    preprocess: Any = None  # preprocess.stats.PreprocessStats when the loader ran a transform
    transformed: dict[str, int] | None = None  # autocache: T_FIELDS' counts without "t_"
    autocache: str = ""  # autocache: the mode the epoch ended in and why

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0

    def line(self) -> str:
        # MiB, as tools/digest and cachectl print sizes
        return (f"epoch {self.epoch}{'' if self.complete else ' (stopped early)'}: {self.items} items in "
                f"{self.seconds:.2f}s, hit rate {self.hit_rate:.0%}, "
                f"substituted {self.substituted}, store {self.store_bytes / 2**20:.1f} MiB, "
                f"cache {self.cache_bytes / 2**20:.1f} MiB, poisoned {self.poisoned}, "
                f"batch median {self.batch_time_median * 1e3:.1f} ms"
                + (f"\n  {self.preprocess.line()}" if self.preprocess is not None else "")
                + (f"\n  {self.autocache_line()}" if self.autocache else ""))

    def autocache_line(self) -> str:
        t = self.transformed or {}
        counts = ", ".join(f"{t.get(k, 0)} {k}" for k in ("hits", "misses", "puts", "poisoned"))
        bad = f", {t['uncacheable']} not storable" if t.get("uncacheable") else ""
        return f"autocache {self.autocache}; transformed items: {counts}{bad}"
