"""Steps stuck on an item: a warning that names the step and the item, repeated at
a growing interval while it stays stuck, and an optional timeout after which the
item fails (docs/preprocess.md, "Stuck steps").

Whoever runs steps binds a slot to its thread (`bind`); Pipeline.call_step writes
into it which step runs and since when (two writes per step, no lock: the slot is
a few integers, in shared memory for a worker process). One watcher reads the
slots: the scheduler's dispatcher thread between results for worker processes, or
one Watchdog thread where steps run in this process. Nothing is made per item.

A thread cannot be stopped in Python: a timeout ends a step where its process can be
ended with it (a worker process, a Ray actor); in the loader's own process the step
runs in a helper thread that is abandoned (inline.py). An item's read is watched too
(READ in place of the step)."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from numbers import Real
from typing import Any

log = logging.getLogger("preprocess")

STEP_WARNING_S = 60.0  # default: seconds in one step on one item before the first warning
NOT_RUNNING = -1
READ = -2  # in a slot's step field: the item's read (the cache, the store), not a step of the pipeline
READING = "reading it (the cache, the store)"
# per thread: item, step (written position), when that step started (time.monotonic_ns), and the
# run the item was sent in (engine.EpochPlan.run; NOT_RUNNING where none is kept: steps run in this
# process): an item an earlier epoch left behind is told from this epoch's copy by that number,
# never by when its step began
FIELDS = 4

_bound = threading.local()

ADVICE = "a step that never returns holds up the epoch; step_timeout= fails its item instead"

# (who: a worker's thread or the loader's process, item, step, started at (monotonic ns))
Running = tuple[Any, Any, int, int]


def check_limits(step_warning: float | None, step_timeout: float | None) -> None:
    for name, v in (("step_warning", step_warning), ("step_timeout", step_timeout)):
        check_seconds(name, v)


def check_seconds(name: str, v: Any) -> None:
    """A limit in seconds: a number > 0, or None (off); else a ValueError naming it."""
    if v is not None and (not isinstance(v, Real) or isinstance(v, bool) or not v > 0):
        raise ValueError(f"{name} must be a number of seconds > 0, or None (off), got {v!r}")


def due(next_at: dict[Any, float], key: Any, secs: float, warn_s: float) -> bool:
    """Whether `key`, stuck for `secs`, is due a warning: first at `warn_s`, then at twice
    the time of its last one (kept in next_at: a key there has been warned about)."""
    if secs < next_at.get(key, warn_s):
        return False
    next_at[key] = 2 * secs
    return True


class Slot:
    """One thread's running item, step and the item's run, in `array` (a list, or shared
    memory read by the scheduler) at fields k*FIELDS..: what the watcher reads. `by_context`:
    the item is named by the ItemContext its step runs with (sample items before the first
    epoch, whose indices the steps' callers do not pass on), not by item()."""

    def __init__(self, array: Any, k: int = 0, by_context: bool = False) -> None:
        self.a, self.base, self.by_context = array, k * FIELDS, by_context

    def item(self, i: int, run: int = NOT_RUNNING) -> None:
        """Item i (sent in `run`) is this thread's from now on."""
        b = self.base
        self.a[b + 1] = NOT_RUNNING  # first: no reader pairs the step running with the new item
        self.a[b + 3] = run
        self.a[b] = i

    def at(self, j: int, ctx: Any = None) -> None:
        b = self.base
        if self.by_context:
            self.a[b] = ctx
        self.a[b + 2] = time.monotonic_ns()  # the time first: a reader never pairs a step with an older start
        self.a[b + 1] = j

    def out(self) -> None:
        self.a[self.base + 1] = NOT_RUNNING

    def idle(self) -> None:
        self.out()
        self.a[self.base] = NOT_RUNNING

    def current(self) -> tuple[int, int]:
        """(item, its run): NOT_RUNNING for the item between items (the run is then stale)."""
        return self.a[self.base], self.a[self.base + 3]

    def step(self) -> int:
        """The step running now (written position), or NOT_RUNNING (or READ)."""
        return self.a[self.base + 1]

    def read(self) -> tuple[int, int, int, int] | None:
        """(item, step, started, run) while a step runs; None between steps. Read twice, so a
        value torn by a write in between is never returned (None then: the next look sees it)."""
        b, a = self.base, self.a
        first: Any = tuple(a[b:b + FIELDS])
        if first != tuple(a[b:b + FIELDS]) or NOT_RUNNING in first[:2]:
            return None
        return first


def local_slot(by_context: bool = False) -> Slot:
    return Slot([NOT_RUNNING] * FIELDS, by_context=by_context)


def bind(slot: Slot | None) -> None:
    """The slot the steps this thread runs are marked in (None: unmarked)."""
    _bound.slot = slot


def bound() -> Slot | None:
    return getattr(_bound, "slot", None)


class StallWatch:
    """Reads running steps; logs a warning once one has run on its item `warn_s`, again
    at twice the time, four times, ...; returns those over `timeout_s` (the caller ends
    them) and says when a warned one went on."""

    def __init__(self, warn_s: float | None, timeout_s: float | None, step_name: Callable[[int], str],
                 item_name: Callable[[Any], str], where: Callable[[Any], str], advice: str = ADVICE) -> None:
        self.warn_s, self.timeout_s, self.advice = warn_s, timeout_s, advice
        self.step_name, self.item_name, self.where = step_name, item_name, where
        self.next: dict[Running, float] = {}  # warned stalls: seconds of their next warning
        self.ended: set[Running] = set()      # returned as over the timeout (once each)
        self.warned = 0  # stalls warned about

    @property
    def active(self) -> bool:
        return bool(self.warn_s or self.timeout_s)

    def what(self, item: Any, j: int) -> str:
        # j < 0: not a step of the pipeline (inline.READ: the item's read), named by step_name
        doing = f"step {j} ({self.step_name(j)})" if j >= 0 else self.step_name(j)
        return f"item {self.item_name(item)}: {doing}"

    def check(self, running: Iterable[Running], now_ns: int | None = None) -> list[tuple[Running, float]]:
        """The steps over the timeout, with their seconds; warns about the others due.
        `now_ns` is best taken before `running` was read: a watcher held up after reading
        (preempted, the GIL held elsewhere) would count the delay as time in a step that
        may have ended meanwhile, and end it although it ran within the timeout."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        seen, over = set(), []
        for r in running:
            secs = (now - r[3]) / 1e9
            seen.add(r)
            if self.timeout_s and secs >= self.timeout_s:
                if r not in self.ended:  # its caller ends it: no "went on" for it
                    self.ended.add(r)
                    self.next.pop(r, None)
                    over.append((r, secs))
            elif self.warn_s:
                first = r not in self.next
                if due(self.next, r, secs, self.warn_s):
                    self.warned += first
                    end = f"it fails at step_timeout={self.timeout_s:g} s" if self.timeout_s else self.advice
                    log.warning("preprocessing: %s has run for %s (%s); %s", self.what(r[1], r[2]),
                                seconds(secs), self.where(r[0]), end)
        self.ended &= seen
        for r in [r for r in self.next if r not in seen]:
            del self.next[r]
            log.warning("preprocessing: %s went on after %s or more", self.what(r[1], r[2]),
                        seconds((now - r[3]) / 1e9))
        return over

    def forget(self, gone: Callable[[Any], bool]) -> None:
        """Threads that are gone (`gone(who)`: their worker died or was ended): their steps
        did not go on, whatever the caller says of their items."""
        for r in [r for r in self.next if gone(r[0])]:
            del self.next[r]


def seconds(secs: float) -> str:
    return f"{secs:.1f} s" if secs < 10 else f"{secs:.0f} s"


def every(watch: StallWatch) -> float:
    """How often to look: a fraction of the shortest limit (bounded)."""
    limits = [s for s in (watch.warn_s, watch.timeout_s) if s]
    return look_every(min(limits)) if limits else 1.0


def look_every(shortest: float) -> float:
    """A watcher's period for its shortest limit: a tenth of it, within 0.02-1 s."""
    return min(1.0, max(0.02, shortest / 10))


class Watchdog:
    """One thread watching slots of this process (steps run in the loader's process, or
    in a Ray actor); `on_timeout(running, seconds)` for a step over the timeout (none: the
    step cannot be ended, it is warned about only). A context manager: started and
    stopped around the work (the thread is made then, not per item)."""

    def __init__(self, watch: StallWatch, slots: dict[Any, Slot],
                 on_timeout: Callable[[Running, float], None] | None = None) -> None:
        self.watch, self.slots, self.on_timeout = watch, slots, on_timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def running(self) -> list[Running]:
        out = []
        for who, slot in self.slots.items():
            r = slot.read()
            if r is not None:
                out.append((who, *r[:3]))
        return out

    def _run(self) -> None:
        period = every(self.watch)
        while not self._stop.wait(period):
            try:
                now = time.monotonic_ns()  # before the slots are read (StallWatch.check)
                for r, secs in self.watch.check(self.running(), now):
                    if self.on_timeout is not None:
                        self.on_timeout(r, secs)
            except Exception:  # a watcher must never end the work it watches
                log.exception("preprocessing: the stuck-step watchdog failed")

    def __enter__(self) -> Watchdog:
        if self.watch.active and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="preprocess-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        if self.watch.active:
            self.watch.check([])  # the work is over: a step warned about went on

    def stop(self) -> None:
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(5)
