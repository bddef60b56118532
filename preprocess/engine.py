"""Per-sample scheduling of one epoch (MinatoLoader §4.2, Algorithm 1, and beyond).

A dispatcher thread in the main process consumes the batch sampler's index
stream (so substitutable hits, exactly-once and any rank share come from the
sampler), hands items to the worker pool in small tasks, and builds batches
from items in the order they finish: a slow item never holds back a batch whose
other items are ready, and it joins a later one. Every item the sampler yields
is yielded exactly once (or skipped and counted, with on_error="skip"); the
epoch ends when all have finished, never after a fixed number of batches.
exactly_once=False is the papers' artifacts' behaviour, labelled as such: the
epoch ends once only slow items in the background remain, and those are dropped
(counted in `dropped`), under-sampling slow items.

Item states: upcoming (from the sampler) -> dispatched (in a task) -> [in the
background, after the timeout] -> finished (ready) -> yielded in a batch; or
failed. `yielded` marks the items handed to the training loop (for resuming).
Items the cost memory knows to be slow (over the timeout) are taken from the
upcoming window first and run in a worker's background thread from the start."""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .pool import CLOSED_MESSAGE, PoolClosed, WorkerDied, WorkerPool, is_whole
from .stall import READ, READING, STEP_WARNING_S, StallWatch, every, log
from .stats import PreprocessStats
from .timeout import SlowTimeout
from .worker import MAIN
from .workerctl import CpuMeter, next_workers

TICK = 0.05          # longest wait for a result before checking the workers
HELD_NAMED = 8       # of the items a dead worker held, those named in WorkerDied
RESTARTS = 3         # workers that may die in an epoch (replaced, their items re-run) before it fails
CONTROL_EVERY = 1.0  # seconds between worker-count decisions
LEFT_BEHIND = ("an item an earlier epoch left behind (dropped with exactly_once=False, or its epoch's "
               "iterator was left before its end), not this epoch's")


class PipelineError(RuntimeError):
    """A step raised on an item (with on_error="raise"); names the item and the step."""


class StepTimeout(PipelineError):
    """A step ran on an item for longer than step_timeout (with on_error="raise"); names
    the item and the step. Its worker process was stopped (docs/preprocess.md)."""


@dataclass
class EpochPlan:
    run: int
    epoch: int
    batch_size: int
    order: tuple[int, ...]
    on_error: str = "raise"
    task_items: int = 2
    prefetch_batches: int = 4
    adaptive: bool = False
    max_workers: int = 1
    exactly_once: bool = True  # False: the papers' bounded epochs (slow stragglers dropped)
    drop_last: bool = False    # a short last batch (items skipped or dropped) is not yielded
    step_warning: float | None = STEP_WARNING_S  # seconds in one step on one item before a warning
    step_timeout: float | None = None  # seconds after which the item fails, its worker stopped

    def __post_init__(self) -> None:
        # a count below 1 would send no task (or build no batch): the epoch would wait for ever
        for name in ("batch_size", "task_items", "prefetch_batches", "max_workers"):
            v = getattr(self, name)
            if not is_whole(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")


class EpochRun:
    def __init__(self, pool: WorkerPool, batches: Iterator[list[int]], plan: EpochPlan, stats: PreprocessStats,
                 timeout: SlowTimeout, known_cost: Callable[[int], float | None],
                 describe: Callable[[int], str],
                 resolve: Callable[[list[int], int], dict[int, Any]] | None = None) -> None:
        self.pool, self.sampler, self.plan, self.stats = pool, batches, plan, stats
        self.resolve = resolve  # items complete without a worker (feed.resolve), taken here
        self.timeout, self.known_cost, self.describe = timeout, known_cost, describe
        self.cond = threading.Condition()
        self.out: deque[list[tuple[int, Any]]] = deque()
        self.ready: list[tuple[int, Any]] = []
        self.upcoming: deque[int] = deque()
        self.exhausted = self.done = self.stop = False
        self.error: BaseException | None = None
        self.pending = self.in_background = 0
        self.held: dict[int, dict[int, bool]] = {}  # worker -> {item: in its background}
        self.deaths: list[str] = []  # how each worker that died this epoch died, and what it held
        self.pulled = 0  # items taken from the sampler
        self.measured: list[tuple[int, float]] = []  # (index, seconds of work)
        self.yielded: set[int] = set()
        self._meter = CpuMeter() if plan.adaptive else None
        self._thread: threading.Thread | None = None
        self._next_control = time.monotonic() + CONTROL_EVERY
        self.stalls = StallWatch(plan.step_warning, plan.step_timeout,
                                 lambda j: READING if j == READ else pool.pipeline.steps[j].name,
                                 lambda i: f"{i} ({describe(i)})", self._where)
        # worker stopped -> [(item, step, seconds, whether the item was sent in this run), ...]
        self.timed_out: dict[int, list[tuple[int, int, float, bool]]] = {}
        self.alone: set[int] = set()  # items sent in a task of their own (their read is theirs alone)
        self.solo: set[int] = set()   # items to send alone: a read of several, them among, hung
        self._next_watch = 0.0
        self._fed_wait = False  # this round of the dispatcher waited a tick on a source's next batch

    # ---- consumer side --------------------------------------------------------
    def __iter__(self) -> Iterator[list[tuple[int, Any]]]:
        self._take_pool()
        t = self._thread = threading.Thread(target=self._dispatch_guarded, name="preprocess-dispatch", daemon=True)
        t.start()
        finished = False
        try:
            while True:
                with self.cond:
                    while not self.out and not self.done and self.error is None:
                        self.cond.wait(0.5)
                    if self.error is None and not self.done and self.pool.closed:
                        # batches made before close() would come out, then the error: fail at once
                        self.error = PoolClosed(CLOSED_MESSAGE)
                    if self.error is not None:
                        raise self.error
                    if not self.out:
                        finished = True
                        return
                    batch = self.out.popleft()
                    self.yielded.update(i for i, _ in batch)
                    self.cond.notify_all()
                yield batch
        finally:
            if not finished:
                self._stop_dispatch()
            elif self.pool.epoch is self:
                self.pool.epoch = None

    def _take_pool(self) -> None:
        """One epoch at a time runs on the workers: an earlier one whose iterator was kept,
        neither run to its end nor closed, would take this one's messages and drop them."""
        prev = self.pool.epoch
        if prev is not None and prev is not self:
            prev.abandon()
        self.pool.epoch = self

    def abandon(self) -> None:
        """A later epoch started on the same workers: this one stops, and its iterator
        raises if it is resumed (its batches to come would be lost)."""
        with self.cond:
            if self.error is None and not self.done:
                self.error = RuntimeError(f"epoch {self.plan.epoch} was abandoned: a later epoch started on the "
                                          f"same preprocessing workers before this one's iterator was finished")
            self.cond.notify_all()
        self._stop_dispatch()

    def _stop_dispatch(self) -> None:
        """Stop the dispatcher; drop the tasks queued for this epoch, never for a later one.
        A source that waits on work elsewhere (the remote feeder, whose thread waits for a
        batch's remote work up to its wait_limit) is told to stop too, and ends that wait: a
        dispatcher or feeder left running would go on using the workers, the remote pool and
        the sampler beside the next epoch (or close())."""
        self.stop = True
        stop_source = getattr(self.sampler, "stop", None)
        if callable(stop_source):
            stop_source()
        if self._thread is not None:
            self._thread.join(10)
        if self.pool.epoch is self:
            self.pool.drain_tasks()
            self.pool.epoch = None

    # ---- dispatcher thread ----------------------------------------------------
    def _dispatch_guarded(self) -> None:
        try:
            self._dispatch()
        except BaseException as e:  # reaches the consumer, which raises it
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _dispatch(self) -> None:
        feeding = callable(getattr(self.sampler, "next_ready", None))
        while not self.stop and self.error is None:
            self._fed_wait = False
            if feeding:  # its batches come when ready: the window is kept full, not only as tasks go out
                self._fill()
            self._send_tasks()
            if self.stop:  # left while it took the sampler's batches: the workers' messages are the next epoch's
                return
            if self.exhausted and not self.upcoming and self._bounded_end():
                self._check_complete()
                with self.cond:
                    if self.ready and self.plan.drop_last:
                        self.stats.dropped += len(self.ready)
                    elif self.ready:
                        self.out.append(self.ready)
                    self.ready = []
                    self.done = True
                    self.cond.notify_all()
                return
            # a tick waited on the feeder (the workers held nothing) is not waited again on them
            for msg in self.pool.receive(0.0 if self._fed_wait else TICK):
                self._handle(msg)
            self._watch()    # after the messages: an item answered is not stuck
            self._recover()  # after the messages: what a dead worker finished before dying counts
            self._control()

    def _check_complete(self) -> None:
        """Every item taken from the sampler is accounted for (a loud failure, never a
        silently short epoch)."""
        with self.cond:
            batched = sum(map(len, self.out)) + len(self.ready)
            accounted = len(self.yielded) + batched + self.stats.skipped + self.stats.dropped
        if accounted != self.pulled:
            raise RuntimeError(f"internal error: {self.pulled} items taken from the sampler, {accounted} "
                               f"accounted for (yielded, batched, skipped, dropped)")

    def _bounded_end(self) -> bool:
        """Is the epoch over: every item finished, or (exactly_once=False) every item
        left is a slow one in the background, which is then dropped and counted."""
        if self.pending == 0:
            return True
        if not self.plan.exactly_once and self.pending == self.in_background:
            self.stats.dropped = self.pending
            return True
        return False

    def _send_tasks(self) -> None:
        """Tasks to the workers holding fewest items (background ones too, so known-slow
        items spread over the workers' background threads), each holding at most 2
        tasks' worth in its foreground; none while enough batches wait."""
        p = self.plan
        cap = p.task_items * 2
        while self.pending < 4 * cap * max(1, self.pool.size) and len(self.out) < p.prefetch_batches:
            if self.stop:
                return
            held = {w: self.held.get(w, {}) for w in self.pool.active()}
            free = [w for w, h in held.items() if sum(not bg for bg in h.values()) < cap]
            if not free:
                return
            wid = min(free, key=lambda w: len(held[w]))
            items = self._take(p.task_items)
            if not items or self.stop:  # stopped while it took them: the epoch was left
                return
            items = self._resolved(items)
            if not items:
                continue
            if len(items) == 1:
                self.alone.add(items[0][0])
            self.pool.send(wid, ("task", p.run, p.epoch, p.order, self.timeout.seconds, items))
            self.held.setdefault(wid, {}).update(items)
            self.pending += len(items)

    def _resolved(self, items: list[tuple[int, bool]]) -> list[tuple[int, bool]]:
        """Items the feed completes without any step (autocache: kept outputs with no
        step after the caching point) are ready at once; the rest go to a worker."""
        done = self.resolve([i for i, _ in items], self.plan.epoch) if self.resolve is not None else {}
        if not done:
            return items
        for i, to_bg in items:
            if i in done:
                self.in_background -= to_bg
                self.stats.items += 1
                self._ready(i, done[i])
        return [(i, bg) for i, bg in items if i not in done]

    def _ready(self, i: int, item: Any) -> None:
        self.ready.append((i, item))
        if len(self.ready) >= self.plan.batch_size:
            with self.cond:
                self.out.append(self.ready[:self.plan.batch_size])
                self.cond.notify_all()
            del self.ready[:self.plan.batch_size]

    def _recover(self) -> None:
        """A worker that died is replaced and the items it held go back to the front
        of the queue (they were not yielded: exactly once holds). One stopped for a step
        (or a read) over step_timeout is no death: its stuck items fail, the others run
        again; a hung read of several items fails none: each is read again alone."""
        for wid in self.pool.dead():
            self.stalls.forget(lambda who: who[0] == wid)  # its steps ended with it: none "went on"
            lost = self.held.pop(wid, {})
            stopped = wid in self.timed_out
            stuck = self._stuck(self.timed_out.pop(wid, []), lost)
            if not stopped:
                self.deaths.append(self._death(wid, lost))
                if len(self.deaths) > RESTARTS:
                    raise WorkerDied(f"{len(self.deaths)} preprocessing workers died this epoch; giving up. "
                                     + "; ".join(self.deaths))
            for (i, _, _, _), mine in stuck:
                if mine:  # fails below, after the others are queued again
                    self.pending -= 1
                    self.in_background -= lost.pop(i)
            self.pending -= len(lost)
            self.in_background -= sum(lost.values())
            self.upcoming.extendleft(reversed(list(lost)))
            self.stats.rerun += len(lost)
            self.pool.resize(self.pool.size + 1)
            for (i, j, secs, _), mine in stuck:
                self._timed_out(wid, i, j, secs, of_this_epoch=mine)

    def _stuck(self, over: list[tuple[int, int, float, bool]],
               lost: dict[int, bool]) -> list[tuple[tuple[int, int, float, bool], bool]]:
        """The steps (and reads) over step_timeout a stopped worker's threads ran, each with
        whether it fails its item (this epoch's, held): both threads may be stuck at once,
        and an item of this epoch left to run again would only hang again, for a second
        step_timeout. A hung read of several items of this epoch fails none: each is read
        alone from now on (which of them hung is unknown)."""
        out = []
        for s in over:
            i, j, _, this_run = s
            if j == READ and this_run and i not in self.alone:
                self.solo.update(lost)
                continue
            # the index alone does not tell this epoch's copy of an item from one an earlier
            # epoch left behind (exactly_once=False, or abandoned) whose step hangs while this
            # one's waits; nor does when the step began (such an item goes on to its next
            # steps during this epoch): the run it was sent in does
            out.append((s, this_run and i in lost))
        return out

    def _watch(self) -> None:
        """Steps stuck on an item (stall.py): warned about; one over step_timeout has its
        worker stopped (a thread cannot be), and _recover fails its item."""
        now = time.monotonic()
        if not self.stalls.active or now < self._next_watch:
            return
        self._next_watch = now + every(self.stalls)
        now_ns = time.monotonic_ns()  # before the slots are read (StallWatch.check)
        for ((wid, _, run), i, j, _), secs in self.stalls.check(self.pool.progress(), now_ns):
            # every thread of the worker over the limit (both may be): each item fails once
            self.timed_out.setdefault(wid, []).append((i, j, secs, run == self.plan.run))
            self.pool.kill(wid)
        self.stats.stalled = self.stalls.warned

    def _where(self, who: tuple[int, int, int]) -> str:
        wid, k, run = who
        where = f"worker {wid}, pid {self.pool.pid(wid)}, its {'main' if k == MAIN else 'background'} thread"
        return where if run == self.plan.run else where + f"; {LEFT_BEHIND}"

    def _timed_out(self, wid: int, i: int, j: int, secs: float, of_this_epoch: bool) -> None:
        """Item i's step j ran past step_timeout: the item fails as on_error says (one
        an earlier epoch left behind, exactly_once=False, is only reported)."""
        doing = READING if j == READ else f"step {j} ({self.pool.pipeline.steps[j].name})"
        what = (f"item {i} ({self.describe(i)}): {doing} ran for "
                f"{secs:.1f} s, over step_timeout={self.plan.step_timeout:g} s; its worker process ({wid}) was "
                f"stopped, the other items it held run again")
        if not of_this_epoch:
            log.warning("preprocessing: %s (%s; this epoch's copy of it runs again)", what, LEFT_BEHIND)
            return
        self.stats.timed_out += 1
        if self.plan.on_error == "skip":
            self.stats.skipped += 1
            if len(self.stats.errors) < 10:
                self.stats.errors.append(what)
            log.warning("preprocessing: %s; the item is skipped (on_error='skip')", what)
            return
        raise StepTimeout(what)

    def _death(self, wid: int, held: dict[int, bool]) -> str:
        """How worker wid died, naming the items of this epoch it was running (the likeliest
        cause: a decoder's segfault, an item too large for memory), an item an earlier epoch
        left behind that it ran as such, and the others of this epoch's it held."""
        how, running = self.pool.deaths.get(wid, ("died", []))
        text = f"worker {wid} {how}"
        mine = [i for i, run in running if run == self.plan.run]
        if mine:
            text += ", running " + self._named(mine)
        earlier = [i for i, run in running if run != self.plan.run]
        if earlier:
            text += ", and an item an earlier epoch left behind (not this epoch's): " + self._named(earlier)
        rest = sorted(set(held) - set(mine))
        if rest:
            text += ", holding " + self._named(rest[:HELD_NAMED]) + (
                f" and {len(rest) - HELD_NAMED} more" if len(rest) > HELD_NAMED else "")
        return text

    def _named(self, items: list[int]) -> str:
        return ", ".join(f"item {i} ({self.describe(i)})" for i in items)

    def _take(self, n: int) -> list[tuple[int, bool]]:
        """The next task: known-slow items of the upcoming window first (to the background)."""
        window = self.plan.batch_size * 4
        self._fill()
        limit = self.timeout.known_slow
        if limit is not None:
            slow = [i for i in list(self.upcoming)[:window] if (self.known_cost(i) or 0.0) > limit][:n]
            if self.solo.intersection(slow):
                slow = slow[:1]  # one read of its own
            if slow:
                for i in slow:
                    self.upcoming.remove(i)
                self.stats.known_slow_first += len(slow)
                self.in_background += len(slow)  # counted as sent
                return [(i, True) for i in slow]
        out: list[int] = []
        while self.upcoming and len(out) < n:
            if self.upcoming[0] in self.solo:  # alone in its task: its read is its own
                if not out:
                    out.append(self.upcoming.popleft())
                break
            out.append(self.upcoming.popleft())
        return [(i, False) for i in out]

    def _fill(self) -> None:
        """The upcoming window (batch_size * 4 items) from the sampler, as far as it has batches."""
        window = self.plan.batch_size * 4
        while len(self.upcoming) < window and not self.exhausted and not self.stop:
            batch = self._next_batch()
            if batch is None:
                break
            self.upcoming.extend(batch)
            self.pulled += len(batch)

    def _next_batch(self) -> list[int] | None:
        """The sampler's next batch; None at its end, or where a source that waits on work
        elsewhere (the remote feeder's next_ready) has none ready yet: the workers' results are
        read meanwhile, never held back by that wait. It is waited for (a tick) only when the
        workers hold nothing and nothing is left to send."""
        ready = getattr(self.sampler, "next_ready", None)
        try:
            if ready is None:
                return next(self.sampler)
            idle = not self.upcoming and self.pending == 0
            self._fed_wait |= idle
            return ready(TICK if idle else 0.0)
        except StopIteration:
            self.exhausted = True
            return None

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "exit":
            self.pool.exited(msg[1])
            return
        if msg[1] != self.plan.run:
            return  # left over from an epoch its consumer abandoned
        if kind == "fatal":
            raise RuntimeError(f"reading items {msg[3][:8]} in a preprocessing worker failed:\n{msg[4]}")
        held = self.held.get(msg[2], {})
        i = msg[3]
        if i not in held:
            return  # from a worker since declared dead: its items were sent again
        if kind == "moved":
            held[i] = True
            self.in_background += 1
        elif kind == "done":
            self._finished(i, msg[5], held.pop(i))
            self._ready(i, msg[4])
        elif kind == "error":
            _, _, _, _, j, name, text, records = msg
            self._finished(i, records, held.pop(i), measure=False)
            self._failed(i, j, name, text)

    def _finished(self, i: int, records: list, in_background: bool, measure: bool = True) -> None:
        self.pending -= 1
        if in_background:
            self.in_background -= 1
            self.stats.moved += 1
        self.stats.add(records)
        if measure:
            secs = sum(r[1] for r in records)
            self.measured.append((i, secs))
            self.timeout.add(secs)
            self.stats.items += 1

    def _failed(self, i: int, j: int, name: str, text: str) -> None:
        what = f"item {i} ({self.describe(i)}): step {j} ({name}) raised {text.strip().splitlines()[-1]}"
        if self.plan.on_error == "skip":
            self.stats.skipped += 1
            if len(self.stats.errors) < 10:
                self.stats.errors.append(what)
            return
        raise PipelineError(f"{what}\nin the worker:\n{text.rstrip()}")

    def _control(self) -> None:
        if self._meter is None or time.monotonic() < self._next_control:
            return
        self._next_control = time.monotonic() + CONTROL_EVERY
        cpu = self._meter.sample()
        if cpu is None:
            return
        fill = len(self.out) / max(1, self.plan.prefetch_batches)
        n = next_workers(self.pool.size, fill, cpu, self.plan.max_workers)
        if n != self.pool.size:
            self.pool.resize(n)
            self.stats.workers.append(n)
