"""step_timeout in the loader's own process (num_workers=0, and the sample profiled
when the loader is made): the work runs in one helper thread and the loader's thread
waits for it, at most step_timeout per step or read (docs/preprocess.md, "Stuck steps").

A Python thread cannot be killed, so a stuck one is abandoned, not stopped: it keeps
its item's memory and any lock of its own step's for as long as it hangs (a later step
that needs that lock then times out too, named, rather than waiting for ever); the next
work goes to a fresh helper thread. The seeding lock (seeding.SEEDING) is taken from it
(fenced): a step stuck in one item's random step holds up no other item's seeding, and
the abandoned thread runs no further step once (if ever) its stuck one returns. The
waiting thread is the watcher: it warns as the Watchdog does (stall.StallWatch), so no
other thread is made."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .seeding import SEEDING
from .stall import READ, Running, Slot, StallWatch, bind, bound, every, local_slot

__all__ = ["READ", "InlineRunner", "Overdue", "marked_read"]


class Overdue(Exception):
    """The helper thread ran one step (or read) for longer than the timeout; it was abandoned."""

    def __init__(self, running: Running, seconds: float) -> None:
        super().__init__(f"step {running[2]} on {running[1]!r} ran for {seconds:.1f} s")
        self.running, self.seconds = running, seconds

    @property
    def item(self) -> Any:
        return self.running[1]

    @property
    def step(self) -> int:
        return self.running[2]


class InlineRunner:
    """Runs calls in one helper thread (its slot bound, so Pipeline.call_step marks each
    step in it) and waits, watching: `call` returns the call's result, raises its error,
    or raises Overdue once a step has run longer than watch.timeout_s (the thread is then
    abandoned and the next call starts a fresh one). `abandoned`: threads left stuck."""

    def __init__(self, watch: StallWatch, by_context: bool = False) -> None:
        self.watch, self.by_context = watch, by_context
        self.abandoned = 0
        self._jobs: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self.slot: Slot = local_slot(by_context)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._jobs is None:
            self._start()
        box: queue.Queue = queue.Queue(maxsize=1)
        self._jobs.put((fn, args, box))
        period = every(self.watch)
        while True:
            try:
                ok, value = box.get(timeout=period)
            except queue.Empty:
                now = time.monotonic_ns()  # before the slot is read (StallWatch.check)
                r = self.slot.read()
                over = self.watch.check([] if r is None else [("inline", *r[:3])], now)
                if over:
                    self._abandon()
                    raise Overdue(*over[0]) from None
                continue
            if ok:
                return value
            raise value

    def _start(self) -> None:
        self.slot = local_slot(self.by_context)
        self._jobs = jobs = queue.Queue()
        self._thread = threading.Thread(target=_serve, args=(jobs, self.slot), name="preprocess-inline", daemon=True)
        self._thread.start()

    def _abandon(self, stuck: bool = True) -> None:
        """Leave the thread: it stops once (if ever) its call returns. A stuck one is fenced:
        it loses the seeding lock if it holds it, and runs no further step."""
        jobs, self._jobs = self._jobs, None
        if jobs is not None:
            jobs.put(None)
            if stuck:
                SEEDING.fence(self._thread)
        self.abandoned += stuck

    def close(self) -> None:
        """Stop the helper thread once its current call (if any) returns; the watch's
        warned steps are over."""
        self._abandon(stuck=False)
        self.watch.check([])


def _serve(jobs: queue.Queue, slot: Slot) -> None:
    bind(slot)
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, args, box = job
        try:
            box.put((True, fn(*args)))
        except BaseException as e:  # the caller raises it, in its own thread
            box.put((False, e))
        finally:
            slot.idle()


def marked_read(fetch: Callable[[list[int]], Any], indices: list[int]) -> Any:
    """fetch(indices), marked in this thread's slot as a read of its first item (READ), so
    that a hung read is watched as a stuck step is."""
    slot = bound()
    if slot is None:
        return fetch(indices)
    slot.item(indices[0])
    slot.at(READ)
    try:
        return fetch(indices)
    finally:
        slot.idle()
