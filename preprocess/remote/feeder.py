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

An epoch's batches come from `batches()`, a FeedRun: its waits run in a thread of its own
("remote-feeder"), so the loader's dispatcher thread, which takes the batches, goes on reading
its local workers' results meanwhile (`next_ready` answers at once, or within a bound; a
batch the local workers can make never waits on a later batch's slow remote work). The thread
works on one batch at a time, once the taker asks for it, exactly as when it ran in the taker's
thread: the window, `wait_limit` (counted from the ask) and the measurements mean what they
did, and `on_batch` runs in the taker's thread as it takes a batch, before the feeder sends
another task. `stop()`, from any thread, says the epoch was left: a wait under way ends
within the pool's WAIT_SLICE_S, the thread ends, and the run hands on no further batch, task
or Ray call (the next epoch, or close(), is then the pool's only user)."""
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
    waited: float = 0.0         # seconds the feeder waited on asked batches' remote work (in its
                                # thread: the dispatcher reads its local workers' results meanwhile)
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
        self.on_batch = on_batch  # after each batch handed on (the controller), in the taker's thread
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
            yield item.batch  # the FeedRun's taker runs on_batch before it asks for the next

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


STOP_JOIN_S = 5.0  # stop() waits this long for the feeder's thread (a Ray call of its that stalls)
IDLE_S = 0.5       # the thread's longest wait for an ask before it looks at stop and the pool again
_EMPTY, _END = object(), object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Handoff:
    """What a FeedRun's thread and its taker share: one slot and one ask. The thread holds
    no reference to the FeedRun, so that a run dropped unfinished is collected (and stops)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.stopped = threading.Event()
        self.asked = False   # the taker wants the next batch; the thread has not begun on it
        self.slot: Any = _EMPTY  # a batch, _END or _Failed, until taken

    def put(self, item: Any) -> None:
        with self.cond:
            self.slot = item
            self.cond.notify_all()

    def wait_ask(self, pool: Any, epoch: int) -> bool:
        """Until the taker asks (True), or the run is stopped or its pool closed (False)."""
        with self.cond:
            while True:
                if self.stopped.is_set():
                    return False
                if getattr(pool, "closed", False):  # the loader closed: no batch may be handed on silently
                    self.slot = _Failed(RuntimeError(
                        f"the remote workers were closed while epoch {epoch} was fed: its other batches "
                        f"cannot be handed on"))
                    self.cond.notify_all()
                    return False
                if self.asked:
                    self.asked = False
                    return True
                self.cond.wait(IDLE_S)  # stop() and asks notify; a drop (no notify) is seen this soon


def _feed(h: _Handoff, batches: Iterator[list[int]], pool: Any, epoch: int) -> None:
    """The feeder's thread: the next batch of `batches` (its remote work awaited) per ask."""
    try:
        while h.wait_ask(pool, epoch):
            item = next(batches, _END)
            h.put(item)
            if item is _END:
                return
    except BaseException as e:  # the taker raises it
        h.put(_Failed(e))


class FeedRun(Iterator[list[int]]):
    """One epoch's batches through the feeder (Feeder.batches). Its waits run in a thread of
    its own, started at the first ask: `next_ready` takes a batch without waiting longer than
    it is told, iteration waits for it. A thread other than the taker's may stop it (the epoch
    was left: preprocess.engine)."""

    def __init__(self, feeder: Feeder, source: Iterable[list[int]], epoch: int) -> None:
        self.feeder, self.epoch = feeder, epoch
        self._h = _Handoff()
        self.stopped = self._h.stopped
        self._batches = feeder._batches(source, epoch, self.stopped)
        self._thread: threading.Thread | None = None
        self._asked = False  # an ask not answered yet (the thread works on it, or its batch waits)
        self._ended: BaseException | None = None  # what every later call raises

    def __next__(self) -> list[int]:
        while True:
            batch = self.next_ready(IDLE_S)
            if batch is not None:
                return batch

    def next_ready(self, timeout: float = 0.0) -> list[int] | None:
        """The next batch, in order, if it is ready within `timeout` seconds, else None (asked
        for: the feeder works on it meanwhile); StopIteration once the epoch's batches are
        all handed on, or the run was stopped."""
        if self._ended is not None:
            raise self._ended
        if self.stopped.is_set():
            raise StopIteration
        h = self._h
        if self._thread is None:
            self._thread = threading.Thread(target=_feed, args=(h, self._batches, self.feeder.pool, self.epoch),
                                            name="remote-feeder", daemon=True)
            self._thread.start()
        with h.cond:
            if not self._asked:
                h.asked = self._asked = True
                h.cond.notify_all()
            h.cond.wait_for(lambda: h.slot is not _EMPTY or h.stopped.is_set(), max(0.0, timeout))
            item, h.slot = h.slot, _EMPTY
        if self.stopped.is_set():  # left meanwhile: no batch after a stop
            raise StopIteration
        if item is _EMPTY:
            if not self._thread.is_alive() and h.slot is _EMPTY:
                self._ended = RuntimeError("internal error: the remote feeder's thread ended without a batch")
                raise self._ended
            return None
        self._asked = False
        return self._took(item)

    def _took(self, item: Any) -> list[int]:
        if item is _END:
            self._ended = StopIteration()
            if self._thread is not None:
                self._thread.join(STOP_JOIN_S)  # it ends as it hands on _END: none outlives the epoch
            raise StopIteration
        if isinstance(item, _Failed):
            self._ended = item.error
            raise item.error
        if self.feeder.on_batch is not None:  # in the taker's thread: it may resize its workers
            self.feeder.on_batch(self.feeder)
        return item

    def stop(self) -> None:
        """The epoch was left: its wait ends soon, its thread ends (waited for STOP_JOIN_S at
        most), and no batch comes after it."""
        self.stopped.set()
        with self._h.cond:
            self._h.cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(STOP_JOIN_S)

    def __del__(self) -> None:
        h = getattr(self, "_h", None)
        if h is not None:  # dropped unfinished: its thread ends within IDLE_S (or its pool's wait slice)
            h.stopped.set()
