"""A job's batch times on their way to the manager (clients/coordination.py's reports): each
batch's time and its hit fraction (the sampler's planned hits, for the manager's regression of
batch time on it), queued by the training loop and taken in numbered reports by the
coordination thread. Each loader of the job pairs its own batches with its own sampler's hit
fractions (LoaderHits): a job's train and eval loaders (or two batch sizes) each report theirs.
A batch's time is the interval since the job's last batch handed over, whichever loader's: a
train batch taken after an eval epoch run inside the train epoch is one step, not the eval
epoch's length (one loader alone: the interval since its own last batch, as before).

A report whose call failed is put back and sent again, whole, under its number: the manager
applies a number once, so a reply lost after it applied the report (a deadline, a kill -9)
counts the batches once. Sent again always where the manager never applied it (the call never
reached it; NOT_FOUND: it forgot the job); after any other failure only once a reply showed the
manager numbers reports (an older one would count it twice). Refusals the same report would
meet again (REFUSED) drop its batches.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, ContextManager

import grpc

from manager.manager_client import NumberedBatches, new_report_stream

REPORT_MAX = 1000  # batches a report carries
QUEUED_MAX = 10_000  # batch times kept for the manager at most (the oldest go first)
NOT_APPLIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)


class LoaderHits:
    """One loader's side of the reports: the hit fraction of each batch its sampler issues
    (`sampled`, from the sampler's batch hook, maybe ahead of the training loop: DataLoader
    workers prefetch), handed in order to the batches the loader hands over (`batch_time`).
    `scope`: what the sampler's own hooks (on_batch, on_epoch) run under (the coordinator's
    chunk accounting of this loader); `on_end`: called at each of the loader's epoch ends."""

    def __init__(self, reports: "BatchReports", sampler: Any, on_epoch: Callable[[], None] | None = None,
                 scope: Callable[[], ContextManager[Any]] | None = None,
                 on_end: Callable[[], None] | None = None) -> None:
        self.reports, self.sampler, self._on_epoch, self._on_end = reports, sampler, on_epoch, on_end
        scope = scope or contextlib.nullcontext
        self._token = object()  # names this loader in reports.last_handed (without holding it)
        self._ratios: deque = deque(maxlen=QUEUED_MAX)  # per sampled batch, not yet handed over
        self._stats: Any = None  # the sampler's `stats` last seen (planned_hits, planned_misses; new each epoch)
        self._seen = (0, 0)
        inner = sampler.on_batch  # noted before the coordinator's hook, which may raise (closed)

        def on_batch(batch: list[int]) -> None:
            self.sampled()
            if inner is not None:
                with scope():
                    inner(batch)
        sampler.on_batch = on_batch
        inner_epoch = getattr(sampler, "on_epoch", None)
        if inner_epoch is not None:
            def on_epoch_items(items: Any) -> None:
                with scope():
                    inner_epoch(items)
            sampler.on_epoch = on_epoch_items

    def sampled(self) -> None:
        """A batch was sampled: note its hit fraction (the sampler's counts since the last)."""
        st = getattr(self.sampler, "stats", None)
        if st is None:
            return
        if st is not self._stats:  # a new epoch's counters
            self._stats, self._seen = st, (0, 0)
        hits, misses = st.planned_hits - self._seen[0], st.planned_misses - self._seen[1]
        self._seen = (st.planned_hits, st.planned_misses)
        self._ratios.append(hits / (hits + misses) if hits + misses > 0 else None)

    def epoch_start(self) -> None:
        self._ratios.clear()  # batches sampled ahead but never handed over
        if self._on_epoch is not None:
            self._on_epoch()

    def epoch_end(self, *_: Any) -> None:
        """The loader's epoch ended (or stopped early); takes the EpochStats of EpochLog's hook."""
        if self._on_end is not None:
            self._on_end()

    def batch_time(self, end: float, duration: float) -> None:
        now = time.perf_counter()
        last = self.reports.last_handed
        if last is not None and last[0] is not self._token:  # another loader's batches came in between
            duration = min(duration, now - last[1])
        self.reports.last_handed = (self._token, now)
        # Batches are handed over in the order they were sampled: the oldest
        # sampled batch's hit fraction belongs to this one.
        self.reports.add(end, duration, self._ratios.popleft() if self._ratios else None)


class BatchReports:
    """Thread-safe between the training loop (`add`) and the coordination thread
    (`next_report`, `failed`, `answered`)."""

    def __init__(self) -> None:
        self.queued: deque = deque(maxlen=QUEUED_MAX)  # (end, duration[, hit fraction])
        self._lock = threading.Lock()
        # reports numbered 1, 2, ... in a stream of its own; _again: a failed one put back
        self._stream, self._seq, self._again = new_report_stream(), 0, None
        self.numbered = False  # a reply showed that the manager applies a report's number once
        self.sampler: Any = None  # the last loader's sampler: the one the coordinator's own hooks pair with
        # (LoaderHits' token, time.perf_counter()) of the job's last batch handed over, whichever loader's
        self.last_handed: tuple[object, float] | None = None

    def add(self, end: float, duration: float, hit: float | None = None) -> None:
        with self._lock:
            self.queued.append((end, duration) if hit is None else (end, duration, hit))

    def next_report(self) -> NumberedBatches | list:
        """The failed report put back, with its number (less batches the queue's bound dropped
        since), else the next REPORT_MAX queued batches under a new number; [] with none."""
        with self._lock:
            again, self._again = self._again, None
            n = 0
            if again is not None:  # its batches are those up to its last one, if still queued
                n = next((i + 1 for i, b in enumerate(itertools.islice(self.queued, REPORT_MAX))
                          if b is again[1]), 0)
            if not n:  # nothing left of it: the next report
                again, n = None, min(REPORT_MAX, len(self.queued))
            if not n:
                return []
            if again is None:
                self._seq += 1
            return NumberedBatches(self._stream, self._seq if again is None else again[0],
                                   tuple(self.queued.popleft() for _ in range(n)))

    def failed(self, report: NumberedBatches | list, code: Any) -> None:
        """The report's call failed with `code`: put it back where the manager still wants it."""
        if report and (code in NOT_APPLIED or (self.numbered and code not in REFUSED)):
            self._put_back(report)

    def answered(self, report_seq: int) -> None:
        self.numbered = self.numbered or report_seq > 0

    def _put_back(self, report: NumberedBatches) -> None:
        """A failed report's batches, back in front of those queued since, in order, to be sent
        again under its number; beyond the queue's bound the oldest go first."""
        with self._lock:
            room = (self.queued.maxlen or 0) - len(self.queued)
            kept = report.batches[max(0, len(report) - room):]
            self.queued.extendleft(reversed(kept))
            if kept:
                self._again = (report.seq, kept[-1])
