"""Pipeline: an ordered chain of steps, run per item with timing and byte counts.

`order` is the execution order as indices into `steps` (the order as written until
AutoOrder changes it). Random steps are seeded per item from (job seed, epoch,
item digest, the step's written position) before they run (seeding.py)."""
from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .fingerprint import Uncacheable, fingerprint, library_version, sub_fingerprint
from .measure import nbytes
from .reads import inputs_key
from .seeding import SEEDING, Abandoned, item_seed, seed_globals
from .stall import bound
from .steps import Step, as_step

log = logging.getLogger("preprocess")

EVERY_EPOCH = -2  # what a per_epoch=False step is seeded with in place of the epoch

# (written position, seconds, bytes in, bytes out) of one step on one item
StepRecord = tuple[int, float, int, int]


@dataclass(frozen=True)
class ItemContext:
    """What seeds an item's random steps."""
    job_seed: int
    epoch: int
    digest: bytes


class StepError(Exception):
    """A step raised; names the step (the item is named by whoever ran it)."""

    def __init__(self, position: int, name: str, error: BaseException) -> None:
        super().__init__(f"step {position} ({name}) raised {type(error).__name__}: {error}")
        self.position, self.name, self.error = position, name, error


class _Marker:
    """`preprocess.autocache`: written between two steps of a Pipeline, it marks where
    autocache may keep items (docs/preprocess.md, "Autocache")."""

    def __repr__(self) -> str:
        return "preprocess.autocache"


autocache = _Marker()


class Pipeline:
    """Steps run per item in `order`. `auto_order=True`: AutoOrder may reorder steps between
    barriers, checked against the written order on sample items only (autoorder.VERIFY_ITEMS):
    mark a step whose effect depends on rare items keep_position=True (docs/preprocess.md)."""

    def __init__(self, steps: Iterable[Callable[[Any], Any] | Step | _Marker], *, auto_order: bool = False,
                 cache_at: int | None = None) -> None:
        written = list(steps)
        marks = [k for k, s in enumerate(written) if isinstance(s, _Marker)]
        if len(marks) > 1 or (marks and cache_at is not None and cache_at != marks[0]):
            raise ValueError("a Pipeline takes one caching point: one preprocess.autocache marker or cache_at=")
        self.steps: tuple[Step, ...] = tuple(as_step(s) for s in written if not isinstance(s, _Marker))
        if not self.steps:
            raise ValueError("a Pipeline needs at least one step")
        # the caching point: after this many written steps (None: the cacheable prefix's end)
        self.cache_at: int | None = marks[0] if marks else cache_at
        if self.cache_at is not None and not 1 <= self.cache_at <= len(self.steps):
            raise ValueError(f"the caching point must come after 1 to {len(self.steps)} steps, "
                             f"got cache_at={self.cache_at}")
        self.order: tuple[int, ...] = tuple(range(len(self.steps)))
        self.auto_order = auto_order
        self.caught_random: dict[int, str] = {}  # declared non-random, but differs under two seeds
        self.order_report: str = "as written"
        self.auto_factors: dict[int, float] = {}  # inflation factors the order was chosen with

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        return f"Pipeline([{', '.join(self.steps[j].name for j in self.order)}])"

    def is_random(self, j: int) -> bool:
        return self.steps[j].random or j in self.caught_random

    def per_epoch(self, j: int) -> bool:
        """Does step j's output change from epoch to epoch (random, and not declared
        per_epoch=False, or caught drawing without being declared)?"""
        return self.is_random(j) and (self.steps[j].per_epoch or j in self.caught_random)

    def set_order(self, order: Sequence[int], report: str = "") -> None:
        if SEEDING.fenced():  # AutoOrder's work in a thread left behind after step_timeout: ended, not applied
            raise Abandoned("a thread left behind after step_timeout does not change the pipeline's order")
        if sorted(order) != list(range(len(self.steps))):
            raise ValueError(f"order {list(order)} is not a permutation of {len(self.steps)} steps")
        k = self.cache_at
        if k is not None and set(order[:k]) != set(range(k)):
            raise ValueError(f"order {list(order)} moves a step across the caching point (after step {k - 1})")
        self.order = tuple(order)
        self.order_report = report or self.order_report

    # ---- running ----------------------------------------------------------
    def run(self, x: Any, ctx: ItemContext | None, start: int = 0, deadline: float | None = None,
            records: list[StepRecord] | None = None, stop: int | None = None) -> tuple[Any, int]:
        """Run steps order[start:stop] on x; stops early (returning the next position) once
        `deadline` (time.perf_counter) has passed after a step. Raises StepError."""
        out = records if records is not None else []
        pos = start
        end = len(self.order) if stop is None else stop
        while pos < end:
            j = self.order[pos]
            b_in = nbytes(x)
            t0 = time.perf_counter()
            x = self.call_step(j, x, ctx)
            t1 = time.perf_counter()
            out.append((j, t1 - t0, b_in, nbytes(x)))
            pos += 1
            if deadline is not None and t1 > deadline:
                break
        return x, pos

    def call_step(self, j: int, x: Any, ctx: ItemContext | None) -> Any:
        """Step j (written position) on x, seeded if it is random and ctx is given;
        raises StepError."""
        s = self.steps[j]
        slot = bound()  # marks which step runs since when, for the stuck-step watcher (stall.py)
        if slot is not None:
            slot.at(j, ctx)
        try:
            if SEEDING.fenced():  # left behind after step_timeout: its result is thrown away
                raise Abandoned(f"the thread running step {j} was left behind after step_timeout")
            if ctx is not None and self.is_random(j):
                return self._seeded(j, x, ctx)
            return s.fn(x)
        except Exception as e:
            raise StepError(j, s.name, e) from e
        finally:
            if slot is not None:
                slot.out()

    def _seeded(self, j: int, x: Any, ctx: ItemContext) -> Any:
        """Step j seeded for its item. The generators are global: no other thread (a worker's
        background one) may re-seed them between this seeding and this step's draws."""
        epoch = ctx.epoch if self.per_epoch(j) else EVERY_EPOCH
        holder = SEEDING.acquire()
        try:
            seed_globals(item_seed(ctx.job_seed, epoch, ctx.digest, j))
            return self.steps[j].fn(x)
        finally:
            if SEEDING.release(holder):  # it was left behind holding the lock, and other steps ran since
                log.warning("preprocessing: step %d (%s), left behind after step_timeout, returned after other "
                            "items' random steps ran without waiting for it: had it drawn from random's, numpy's "
                            "or torch's global generator meanwhile, those items may have drawn other numbers "
                            "than their seeds give", j, self.steps[j].name)

    def apply(self, x: Any, ctx: ItemContext | None = None) -> Any:
        """All steps on one item, in the current order. Without ctx random steps are not
        seeded: they draw from the generators as they stand (as in DataLoader workers,
        where `scheduler="torch"` and `ds[i]` run the pipeline)."""
        return self.run(x, ctx)[0]

    __call__ = apply

    # ---- what workers receive -----------------------------------------------
    def check_picklable(self) -> None:
        """Workers are separate processes and get the pipeline by pickling: refuse one they
        could not receive, naming the step, before any worker starts."""
        for j, s in enumerate(self.steps):
            try:
                pickle.loads(pickle.dumps(s.fn))
            except Exception as e:
                raise TypeError(
                    f"pipeline step {j} ({s.name}) cannot be pickled: {type(e).__name__}: {e}. The loader's "
                    f"workers are separate processes and receive the pipeline by pickling, so each step must be a "
                    f"module-level function or an instance of a module-level class (not a lambda, a local "
                    f"function or an object holding open files, locks or sockets)") from None

    # ---- keys -----------------------------------------------------------
    def step_fingerprint(self, j: int) -> str:
        s = self.steps[j]
        try:
            flags = (s.keep_position, self.is_random(j)) + ((("per_epoch", False),) if not self.per_epoch(j)
                                                             and self.is_random(j) else ())
            if s.reads:  # declared inputs (reads.py); none: the key stays as it was
                flags += (("reads", inputs_key(s.reads, s.name)),)
            return fingerprint((s.fn, *flags), path=s.name)
        except Uncacheable as e:
            raise Uncacheable(f"pipeline step {j} ({s.name}) cannot be fingerprinted: {e}") from None
        except RecursionError:
            raise Uncacheable(f"pipeline step {j} ({s.name}) cannot be fingerprinted: nested too deeply") from None

    def fingerprint(self, upto: int | None = None) -> str:
        """Structural key of the first `upto` steps in execution order (all by default),
        including the order; raises Uncacheable naming the first step that fails."""
        n = len(self.order) if upto is None else upto
        parts = [self.step_fingerprint(j) for j in self.order[:n]]
        return sub_fingerprint(("mlcache-pipeline/1", library_version("numpy"), parts))

    def cacheable_prefix(self) -> int:
        """How many leading steps (execution order) come before the first one whose
        output changes per epoch (random, unless declared per_epoch=False)."""
        for pos, j in enumerate(self.order):
            if self.per_epoch(j):
                return pos
        return len(self.order)

    def seeded(self, upto: int) -> bool:
        """Do the first `upto` steps draw random numbers (seeded alike every epoch)? Their
        output then depends on the job's seed too, and so does its key."""
        return any(self.is_random(j) for j in self.order[:upto])

    def barriers(self) -> set[int]:
        """Steps (written positions) AutoOrder moves nothing across: keep_position ones,
        and the last step before the caching point."""
        out = {j for j, s in enumerate(self.steps) if s.keep_position}
        return out | ({self.cache_at - 1} if self.cache_at else set())

    def caching_point(self) -> int:
        """Execution position where autocache keeps items: the user's marker, else the
        end of the cacheable prefix (0: nothing can be kept). ValueError for a marker
        after a random step: a random step's output is never cached."""
        n = self.cacheable_prefix()
        k = self.cache_at
        if k is None or k <= n:
            return n if k is None else k
        j = self.order[n]
        raise ValueError(f"the caching point after step {k - 1} ({self.steps[k - 1].name}) comes after random "
                         f"step {j} ({self.steps[j].name}): its outputs differ per epoch and are never cached; "
                         f"move preprocess.autocache before it")

    def prefix_fingerprint(self) -> str | None:
        """Key of the cacheable prefix, None when it is empty."""
        n = self.cacheable_prefix()
        return self.fingerprint(n) if n else None

    def describe(self) -> str:
        names = [self.steps[j].name + ("*" if self.is_random(j) else "") for j in self.order]
        if self.cache_at is not None:
            names.insert(self.cache_at, "[autocache]")
        return f"{' -> '.join(names)} ({self.order_report})"


def as_pipeline(transform: Any) -> Pipeline | None:
    """CachedDataset's `transform=`: a Pipeline, a list of steps, one callable, or None."""
    if transform is None or isinstance(transform, Pipeline):
        return transform
    if isinstance(transform, (list, tuple)):
        return Pipeline(transform)
    if callable(transform):
        return Pipeline([transform])
    raise TypeError(f"transform must be a Pipeline, a list of callables or a callable, "
                    f"got {type(transform).__name__}")
