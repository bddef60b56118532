"""The feeder: keeps remote workers a bounded window ahead of the trainer.

It sits between the batch sampler and whatever runs the rest of the pipeline on
the trainer's host. It takes the sampler's batches up to `window` batches
before the trainer needs them (the sampler's order is then known), sends the
items of each (less the local workers' share) to the remote workers in tasks of
`task_items`, and hands a batch on, unchanged and in order, once its tasks have
finished or `wait_limit` seconds have passed since the trainer asked for it.
The trainer side then finds the remote workers' outputs as hits and computes
what is missing (a failed task, a dead worker, a slow one past the limit, the
local share). Which items an epoch yields, and that each comes exactly once, is
the sampler's: the feeder neither adds nor drops an index.

It also measures what the scaling policies are fed: the time between batches
handed on (the trainer's batch time once the pipeline is full) and the ready
queue (batches taken ahead whose remote work is done; Cachew's result queue).

An epoch's batches come from `batches()`, an iterator the loader's dispatcher thread runs;
`stop()` on it, from another thread, says the epoch was left: a wait under way ends within
the pool's WAIT_SLICE_S, and the iterator ends without a further batch, task or Ray call (the
next epoch, or close(), is then the pool's only user)."""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Ahead:
    batch: list[int]
    refs: list[Any]
    local: int                  # items of the batch left to the local workers


@dataclass
class FeedStats:
    batches: int = 0
    remote_items: int = 0       # items sent to remote workers
    local_items: int = 0        # items left to local workers (their share, or no remote worker)
    waited: float = 0.0         # seconds the trainer side waited on remote work
    timed_out: int = 0          # batches handed on with remote work unfinished
    batch_times: list[float] = field(default_factory=list)
    queues: list[float] = field(default_factory=list)


class Feeder:
    def __init__(self, pool: Any, *, window: int = 4, task_items: int = 8, wait_limit: float = 10.0,
                 on_batch: Callable[["Feeder"], None] | None = None) -> None:
        if window < 1 or task_items < 1 or wait_limit < 0:
            raise ValueError(f"need window >= 1, task_items >= 1, wait_limit >= 0; "
                             f"got {window}, {task_items}, {wait_limit}")
        self.pool, self.window, self.task_items, self.wait_limit = pool, window, task_items, wait_limit
        self.on_batch = on_batch  # after each batch handed on (the controller)
        self.local_share = 0.0    # fraction of each batch's items the local workers make
        self.stats = FeedStats()
        self._last: float | None = None

    def batches(self, source: Iterable[list[int]], epoch: int) -> "FeedRun":
        """The source's batches, unchanged and in order, each once its remote work is done."""
        return FeedRun(self, source, epoch)

    def _batches(self, source: Iterable[list[int]], epoch: int, stopped: threading.Event) -> Iterator[list[int]]:
        it = iter(source)
        ahead: deque[Ahead] = deque()
        exhausted = False
        self._last = None
        while not stopped.is_set():
            while not exhausted and len(ahead) < self.window:
                batch = next(it, None)
                if batch is None:
                    exhausted = True
                else:
                    ahead.append(self._send(batch, epoch))
            if not ahead:
                return
            item = ahead.popleft()
            self._await(item, stopped)
            if stopped.is_set():  # left meanwhile: the batch goes nowhere, and nothing follows
                return
            self._measure(ahead)
            yield item.batch
            if self.on_batch is not None and not stopped.is_set():
                self.on_batch(self)

    def _send(self, batch: list[int], epoch: int) -> Ahead:
        n_local = round(len(batch) * min(1.0, max(0.0, self.local_share)))
        refs = []
        rest = batch[n_local:]
        for k in range(0, len(rest), self.task_items):
            ref = self.pool.submit(epoch, rest[k:k + self.task_items])
            if ref is None:  # no remote worker (none yet, or the cluster is gone)
                n_local += len(rest) - k
                break
            refs.append(ref)
        self.stats.local_items += n_local
        self.stats.remote_items += len(batch) - n_local
        return Ahead(batch, refs, n_local)

    def _await(self, item: Ahead, stopped: threading.Event) -> None:
        t0 = time.monotonic()
        rest = self.pool.wait(item.refs, self.wait_limit, stopped)
        self.stats.waited += time.monotonic() - t0
        if rest and not stopped.is_set():  # a wait cut short by a stop is no batch handed on unfinished
            self.stats.timed_out += 1

    def _measure(self, ahead: deque[Ahead]) -> None:
        now = time.monotonic()
        if self._last is not None:
            self.stats.batch_times.append(now - self._last)
        self._last = now
        self.pool.poll()
        ready = sum(all(r not in self.pool.tasks for r in a.refs) for a in ahead)
        self.stats.queues.append(float(ready))
        self.stats.batches += 1


class FeedRun(Iterator[list[int]]):
    """One epoch's batches through the feeder (Feeder.batches), which a thread other than
    the one iterating may stop (the epoch was left: preprocess.engine)."""

    def __init__(self, feeder: Feeder, source: Iterable[list[int]], epoch: int) -> None:
        self.stopped = threading.Event()
        self._batches = feeder._batches(source, epoch, self.stopped)

    def __next__(self) -> list[int]:
        return next(self._batches)

    def stop(self) -> None:
        """The epoch was left: its wait ends soon, and no batch comes after it."""
        self.stopped.set()
