"""The engine a loader runs a pipeline with: prepares the pipeline on a sample of
items (determinism check, AutoOrder, fingerprint), owns the worker pool and the
item cost memory, and runs epochs (engine.EpochRun) over a batch sampler's index
stream. Duck-typed on the dataset: `read(indices)` (items before the transform),
`digest` (hashes, location) and `len()`; it never imports the client package."""
from __future__ import annotations

import contextlib
import random
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .autoorder import VERIFY_ITEMS, choose_order, first_disagreement, revise
from .costs import DIGEST_BYTES, CostMemory, default_dir, open_memory
from .determinism import check_declared
from .engine import EpochPlan, EpochRun, PipelineError, StepTimeout
from .feed import PlainFeed, run_item
from .fingerprint import Uncacheable
from .inline import READ, InlineRunner, Overdue, marked_read
from .items import describe, item_digest, pairs
from .pipeline import ItemContext, Pipeline, StepError
from .pool import MAX_IDS, WorkerPool, is_whole
from .profile import Trace, trace
from .reads import recording, unkeyed
from .stall import READING, STEP_WARNING_S, StallWatch, Watchdog, bind, bound, check_limits, local_slot, log
from .stats import PreprocessStats, StepStats
from .timeout import SlowTimeout
from .workerctl import max_workers

ON_ERROR = ("raise", "skip")
SAMPLE_ITEMS = 16


class Scheduler:
    def __init__(self, ds: Any, pipeline: Pipeline, *, num_workers: int | None, job_seed: int = 0,
                 on_error: str = "raise", auto_order: bool | None = None, cost_dir: str | None | bool = None,
                 task_items: int | None = None, prefetch_batches: int = 4, sample_items: int = SAMPLE_ITEMS,
                 exactly_once: bool = True, drop_last: bool = False, feed: Any = None,
                 step_warning: float | None = STEP_WARNING_S, step_timeout: float | None = None) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if num_workers is not None and (not is_whole(num_workers) or num_workers < 0):
            raise ValueError(f"num_workers must be an int >= 0 or None (adaptive), got {num_workers!r}")
        # here, when the loader is made, not when its first epoch starts
        if task_items is not None and (not is_whole(task_items) or task_items < 1):
            raise ValueError(f"task_items must be an int >= 1 or None, got {task_items!r}")
        if not is_whole(prefetch_batches) or prefetch_batches < 1:
            raise ValueError(f"prefetch_batches must be an int >= 1, got {prefetch_batches!r}")
        check_limits(step_warning, step_timeout)
        pipeline.check_picklable()  # before any worker starts
        self.ds, self.pipeline, self.job_seed, self.on_error = ds, pipeline, job_seed, on_error
        self.feed = PlainFeed(ds) if feed is None else feed  # where items come from (feed.py)
        self.sample_indices: list[int] = []
        self.auto_order = pipeline.auto_order if auto_order is None else auto_order
        self.adaptive = num_workers is None
        self.max_workers = min(max_workers(), MAX_IDS)  # adaptive: never past the pool's ids
        self.workers = min(2, self.max_workers) if num_workers is None else num_workers
        self.task_items, self.prefetch_batches, self.sample_items = task_items, prefetch_batches, sample_items
        self.exactly_once, self.drop_last = exactly_once, drop_last
        self.step_warning, self.step_timeout = step_warning, step_timeout
        self.cost_dir = default_dir() if cost_dir is None else (cost_dir or None)
        self.pool: WorkerPool | None = None
        self.memory: CostMemory | None = None
        self.known: dict[bytes, float] = {}
        self.sample: Trace | None = None
        self.fingerprint: str | None = None
        self.uncacheable: str | None = None
        self._opened: dict[int, set[str]] = {}  # files each step opened on the sample items (reads.py)
        self.unkeyed_reads: dict[int, list[str]] = {}  # of those, the ones its fingerprint does not cover
        self.epochs_run = 0
        self.last_run: EpochRun | None = None
        self.last_stats: PreprocessStats | None = None
        self._watchdogs: weakref.WeakSet[Watchdog] = weakref.WeakSet()  # of in-process epochs (_inline)
        self._sample_names: dict[bytes, int] = {}  # digest -> index of the items profiled in this process

    # ---- before the first epoch ---------------------------------------------------
    def prepare(self, start_workers: bool = True) -> None:
        """Profile the pipeline on sample items (determinism check, AutoOrder, first
        timeout), key it, open the cost memory and start the workers (start_workers=False:
        later, by start_workers(), e.g. after measuring on a machine they do not load yet).
        The loader calls it when it is made, so that the sample's reads count in no epoch."""
        if self.sample is None:
            self._profile()
        if start_workers:
            self.start_workers()

    def start_workers(self) -> None:
        if self.workers > 0 and self.pool is None:
            self.pool = WorkerPool(self.ds, self.pipeline, self.job_seed, self.feed)
            self.pool.resize(self.workers)

    def _profile(self) -> None:
        ds, n = self.ds, len(self.ds)
        idx = random.Random(f"{self.job_seed}/sample").sample(range(n), min(n, self.sample_items))
        ctxs = [ItemContext(self.job_seed, -1, item_digest(ds, i)) for i in idx]
        self.sample_indices = idx
        raw = self._sample_read(idx)
        if pairs(ds):
            raw = [x for x, _ in raw]
        tr = self._trace_sample(raw, ctxs, idx)
        self.sample = tr
        if self.auto_order:
            self._verify_order("before the first epoch")
        try:
            self.fingerprint = self.pipeline.fingerprint()
        except Uncacheable as e:
            self.uncacheable = str(e)
        if self.fingerprint is not None:
            self._warn_unkeyed()
        key = self.fingerprint or "unkeyed:" + repr(self.pipeline)
        self.memory = open_memory(self.cost_dir, key)
        self.known = self.memory.load() if self.memory else {}

    # ---- epochs ---------------------------------------------------------------
    def epoch(self, batches: Iterable[list[int]], epoch: int, batch_size: int
              ) -> Iterator[tuple[list[int], list[Any]]]:
        """(indices, items) batches of one epoch over the sampler's index stream."""
        self.prepare()
        stats = PreprocessStats({j: StepStats(s.name) for j, s in enumerate(self.pipeline.steps)},
                                order=self.pipeline.describe(),
                                workers=[self.pool.size if self.pool is not None else 0])
        self.last_stats = stats
        if self.pool is None:
            self.epochs_run += 1
            measured: list[tuple[int, float]] = []
            yield from self._inline(batches, epoch, batch_size, stats, measured)
            self._after_epoch(measured, stats)
            return
        ds = self.ds
        plan = EpochPlan(run=self.epochs_run, epoch=epoch, batch_size=batch_size, order=self.pipeline.order,
                         on_error=self.on_error, task_items=self.task_items or max(1, batch_size // (2 * self.pool.size)),
                         prefetch_batches=self.prefetch_batches, adaptive=self.adaptive, max_workers=self.max_workers,
                         exactly_once=self.exactly_once, drop_last=self.drop_last,
                         step_warning=self.step_warning, step_timeout=self.step_timeout)
        # MinatoLoader profiles offline for its first timeout: we have the sample's times
        timeout = SlowTimeout(list(self.known.values()) or self.sample.item_seconds)
        run = EpochRun(self.pool, iter(batches), plan, stats, timeout,
                       lambda i: self.known.get(item_digest(ds, i)[:DIGEST_BYTES]), self._describe,
                       getattr(self.feed, "resolve", None))
        self.last_run = run
        self.epochs_run += 1
        for batch in run:
            yield [i for i, _ in batch], [item for _, item in batch]
        stats.timeout = timeout.seconds
        self._after_epoch(run.measured, stats)

    def _after_epoch(self, per_item: list[tuple[int, float]], stats: PreprocessStats) -> None:
        """After a whole epoch (workers or in-process alike): the items' measured seconds
        into the cost memory; after the first, AutoOrder's revision on the epoch's bytes."""
        measured = [(item_digest(self.ds, i), s) for i, s in per_item]
        if self.memory is not None and measured:
            self.memory.update(measured)
            self.known.update((d[:DIGEST_BYTES], s) for d, s in measured)
        if self.auto_order and self.epochs_run == 1 and self.sample is not None:
            epoch_bytes = {j: (s.bytes_in, s.bytes_out) for j, s in stats.steps.items() if s.items}
            if self._revise(epoch_bytes):
                self.fingerprint = None
                try:
                    self.fingerprint = self.pipeline.fingerprint()
                except Uncacheable as e:
                    self.uncacheable = str(e)

    def _revise(self, epoch_bytes: dict[int, tuple[int, int]]) -> bool:
        """AutoOrder's revision after the first epoch (True: the order changed). It runs the
        steps on sample items again, watched and bounded as when the loader was made; a step
        over step_timeout there keeps the order the epoch ran, unrevised from then on (a
        warning): the epoch's items are all made, and a revised order not verified whole
        must serve none."""
        p = self.pipeline
        before = (p.order, p.order_report, dict(p.auto_factors))
        try:
            report = self._run_watched(lambda: revise(p, epoch_bytes, self.sample))
            if report is not None:
                self._verify_order("after the first epoch")
        except StepTimeout as e:
            p.set_order(before[0], before[1])
            p.auto_factors = before[2]
            self.auto_order = False
            log.warning("preprocessing: AutoOrder kept the order %s, unrevised: revising it after the first epoch "
                        "ran past step_timeout (%s)", p.describe(), e)
            return False
        return p.order != before[0]

    def _verify_order(self, when: str) -> None:
        """AutoOrder's swaps were checked pair by pair on the sample items only: before its
        order serves any item, the whole order is checked against the written one on up to
        VERIFY_ITEMS other items. Where one differs the written order runs from then on, and a
        warning names the item (never silently other items than the pipeline as written makes)."""
        written = tuple(range(len(self.pipeline.steps)))
        if self.pipeline.order == written:
            return
        ds, n, seen = self.ds, len(self.ds), set(self.sample_indices)
        rng = random.Random(f"{self.job_seed}/verify/{when}")
        pick = rng.sample(range(n), min(n, VERIFY_ITEMS + len(seen)))
        idx = [i for i in pick if i not in seen][:VERIFY_ITEMS]
        if not idx:
            return
        raw = self._sample_read(idx)
        if pairs(ds):
            raw = [x for x, _ in raw]
        ctxs = [ItemContext(self.job_seed, -1, item_digest(ds, i)) for i in idx]
        self._sample_names.update((c.digest, i) for c, i in zip(ctxs, idx))  # named if a step sticks
        k = self._run_watched(lambda: first_disagreement(self.pipeline, written, raw, ctxs))
        if k is None:
            return
        i = idx[k]
        report = (f"AutoOrder went back to the written order: {self.pipeline.describe()} gave item {i} "
                  f"({self._describe(i)}) another output than the order as written ({when}); mark the steps "
                  "whose order matters keep_position=True")
        log.warning("preprocessing: %s", report)
        self.pipeline.set_order(written, report)
        self.auto_order = False  # no later revision brings such an order back

    def _inline(self, batches: Iterable[list[int]], epoch: int, batch_size: int, stats: PreprocessStats,
                measured: list[tuple[int, float]]) -> Iterator[tuple[list[int], list[Any]]]:
        """num_workers=0: every step in this process, batch by batch; each finished item's
        seconds of work go to `measured`, as the workers report theirs (engine.EpochRun).
        Batches are regrouped as the workers' are, so a skipped item leaves no short batch
        mid-epoch (and, with drop_last, none at its end either). A watchdog thread warns
        about a step stuck on an item (stall.py); with step_timeout the reads and steps run
        in a helper thread, abandoned once one is over it (inline.py)."""
        done: list[int] = []
        out: list[Any] = []
        slot = local_slot()
        watch = self._stall_watch(lambda i: f"{i} ({self._describe(i)})")
        runner = InlineRunner(watch) if self.step_timeout else None
        dog = Watchdog(watch, {"inline": slot}) if runner is None else contextlib.nullcontext()
        if runner is None:
            self._watchdogs.add(dog)  # close() stops it: an iterator kept past close() keeps its thread
        try:
            with dog:
                for batch in batches:
                    try:
                        if runner is None:
                            self._inline_batch(slot, batch, epoch, stats, measured, done, out)
                        else:
                            self._bounded_batch(runner, batch, epoch, stats, measured, done, out)
                    finally:
                        stats.stalled = watch.warned
                    while len(done) >= batch_size:
                        yield done[:batch_size], out[:batch_size]
                        del done[:batch_size], out[:batch_size]
        finally:
            if runner is not None:
                runner.close()
        if done and self.drop_last:
            stats.dropped += len(done)
        elif done:
            yield done, out
        self.feed.idle()

    def _inline_batch(self, slot: Any, batch: list[int], epoch: int, stats: PreprocessStats,
                      measured: list[tuple[int, float]], done: list[int], out: list[Any]) -> None:
        prev = bound()  # bound per batch: the generator may be resumed from another thread
        bind(slot)
        try:
            for i, f in zip(batch, self.feed.fetch(batch, epoch), strict=True):
                slot.item(i)
                self._account(i, *self._run_one(i, f, epoch), stats, measured, done, out)
                slot.idle()
        finally:
            bind(prev)

    def _bounded_batch(self, runner: InlineRunner, batch: list[int], epoch: int, stats: PreprocessStats,
                       measured: list[tuple[int, float]], done: list[int], out: list[Any]) -> None:
        """A batch with step_timeout: a read over it is retried item by item (only the hung
        item fails); a step over it fails its item (inline.py). Results are taken here, in
        the loader's thread: an abandoned thread that goes on later changes nothing."""
        try:
            fed = runner.call(marked_read, lambda ix: self.feed.fetch(ix, epoch), batch)
        except Overdue as e:
            if len(batch) == 1:
                return self._overdue(e, stats)
            for i in batch:
                self._bounded_batch(runner, [i], epoch, stats, measured, done, out)
            return None
        for i, f in zip(batch, fed, strict=True):
            try:
                result = runner.call(self._marked_one, i, f, epoch)
            except Overdue as e:
                self._overdue(e, stats)
            else:
                self._account(i, *result, stats, measured, done, out)
        return None

    def _marked_one(self, i: int, f: Any, epoch: int) -> tuple[Any, list, StepError | None]:
        bound().item(i)
        return self._run_one(i, f, epoch)

    def _run_one(self, i: int, f: Any, epoch: int) -> tuple[Any, list, StepError | None]:
        """Run item i (fed as f) in this thread: (output, step records, its step's error)."""
        records: list = []
        x, tgt = f.item if pairs(self.ds) else (f.item, None)
        ctx = ItemContext(self.job_seed, epoch, item_digest(self.ds, i))
        try:
            y = run_item(self.pipeline, self.feed, f.keep, f.token, x, ctx, f.start, None, records)[0]
        except StepError as e:
            return None, records, e
        return ((y, tgt) if pairs(self.ds) else y), records, None

    def _account(self, i: int, y: Any, records: list, error: StepError | None, stats: PreprocessStats,
                 measured: list[tuple[int, float]], done: list[int], out: list[Any]) -> None:
        """Item i's outcome: appended to done/out, or skipped (or raised, on_error="raise")."""
        if error is not None:
            if self.on_error == "raise":
                raise PipelineError(f"item {i} ({self._describe(i)}): {error}") from error
            stats.skipped += 1
        else:
            done.append(i)
            out.append(y)
            stats.items += 1
            if records:  # one no step ran on is no measurement (the workers never get those: feed.resolve)
                measured.append((i, sum(r[1] for r in records)))
        stats.add(records)

    def _overdue(self, e: Overdue, stats: PreprocessStats, sample: bool = False) -> None:
        """A step (or read) in this process ran past step_timeout: its item fails as on_error
        says (the sample's, before the first epoch, always raises), as in a worker process."""
        i, j = e.item, e.step
        doing = self._watched_name(j) if j == READ else f"step {j} ({self._watched_name(j)})"
        what = (f"item {self._sample_name(i) if sample else f'{i} ({self._describe(i)})'}: {doing} ran for "
                f"{e.seconds:.1f} s, over step_timeout={self.step_timeout:g} s; in the loader's own process: "
                "its thread was left behind (a thread cannot be stopped), the rest goes on in another")
        if sample:
            raise StepTimeout(f"preparing the pipeline on sample items: {what}") from None
        stats.timed_out += 1
        if self.on_error == "skip":
            stats.skipped += 1
            if len(stats.errors) < 10:
                stats.errors.append(what)
            log.warning("preprocessing: %s; the item is skipped (on_error='skip')", what)
            return
        raise StepTimeout(what) from None

    def _describe(self, i: int) -> str:
        return describe(self.ds, i)

    def _sample_read(self, idx: list[int]) -> list[Any]:
        """The sample items' read; with step_timeout bounded as the epochs' are (inline.py)."""
        if not self.step_timeout:
            return self.feed.read(idx)
        runner = InlineRunner(self._stall_watch(lambda i: f"{i} ({self._describe(i)}; a sample item)"))
        try:
            return runner.call(marked_read, self.feed.read, idx)
        except Overdue as e:
            raise StepTimeout(f"preparing the pipeline: reading sample items {idx[:8]} (the first: item "
                              f"{e.item} ({self._describe(e.item)})) ran for {e.seconds:.1f} s, over "
                              f"step_timeout={self.step_timeout:g} s; its thread was left behind") from None
        finally:
            runner.close()

    def _trace_sample(self, raw: list[Any], ctxs: list[ItemContext], idx: list[int]) -> Trace:
        """Profile the pipeline on the sample (determinism check, AutoOrder) in this process,
        a step stuck there named by the watchdog (the steps mark their item by its context);
        with step_timeout in a helper thread, one over it failing the loader (inline.py)."""
        self._sample_names = {c.digest: i for c, i in zip(ctxs, idx)}

        def run() -> Trace:
            with recording() as opened:  # the files each step opens, for _warn_unkeyed
                return traced(opened)

        def traced(opened: dict[int, set[str]]) -> Trace:
            self._opened = opened
            tr = trace(self.pipeline, raw, ctxs)
            check_declared(self.pipeline, tr)
            if self.auto_order:
                choose_order(self.pipeline, tr)
                tr = trace(self.pipeline, tr.inputs[0], tr.ctxs)  # the items that got through, with their own contexts
            return tr

        try:
            return self._run_watched(run)
        except StepError as e:
            raise PipelineError(f"preparing the pipeline on sample items {idx[:4]}...: {e}") from e

    def _warn_unkeyed(self) -> None:
        """Files a step opened on the sample items that its fingerprint does not cover (a name
        built at run time): warned about, naming the step (reads.py); in `unkeyed_reads`."""
        self.unkeyed_reads = unkeyed(self.pipeline, self._opened)
        for j, files in self.unkeyed_reads.items():
            shown = ", ".join(repr(f) for f in files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
            log.warning("preprocessing: step %d (%s) read %s on the sample items, which its fingerprint does not "
                        "cover (the name is built when it runs): items cached under the pipeline's key would not "
                        "change when they do; declare them: step(fn, reads=[...]) or a `reads` attribute "
                        "(docs/preprocess.md, Fingerprints)", j, self.pipeline.steps[j].name, shown)

    def _run_watched(self, fn: Callable[[], Any]) -> Any:
        """fn() on sample items in this process (their steps mark the item by its context): a
        stuck step is warned about; with step_timeout fn runs in a helper thread, and a step
        over it raises StepTimeout naming the item and the step (inline.py)."""
        watch = self._stall_watch(self._sample_name)
        if self.step_timeout:
            runner = InlineRunner(watch, by_context=True)
            try:
                return runner.call(fn)
            except Overdue as e:
                self._overdue(e, PreprocessStats({}), sample=True)
                raise AssertionError("unreachable: _overdue raised") from e
            finally:
                runner.close()
        slot, prev = local_slot(by_context=True), bound()
        bind(slot)
        try:
            with Watchdog(watch, {"profile": slot}):
                return fn()
        finally:
            bind(prev)

    def _sample_name(self, c: Any) -> str:
        i = self._sample_names.get(getattr(c, "digest", None))
        return "?" if i is None else f"{i} ({self._describe(i)}; a sample item, run before the first epoch)"

    def _watched_name(self, j: int) -> str:
        return READING if j == READ else self.pipeline.steps[j].name

    def _stall_watch(self, item_name: Callable[[Any], str]) -> StallWatch:
        """Steps stuck in this process (before the first epoch, and with num_workers=0):
        warned about; with step_timeout, over it their caller abandons them (inline.py)."""
        return StallWatch(self.step_warning, self.step_timeout, self._watched_name, item_name,
                          lambda _: "in the loader's own process", "a step that never returns holds up the "
                          "loader (step_timeout= fails its item instead)")

    def yielded(self) -> set[int]:
        """Items of the current (or last) epoch handed to the training loop so far."""
        return set(self.last_run.yielded) if self.last_run else set()

    def close(self) -> None:
        for dog in list(self._watchdogs):
            dog.stop()
        self._watchdogs.clear()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        self.feed.close()
