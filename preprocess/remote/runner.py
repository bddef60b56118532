"""The work of one remote preprocessing worker, without Ray: given a job's WorkSpec
and a task (a few item indices of an epoch), skip the items whose transformed
item the cache already holds, read the others through the dataset's read path
(the ring, else the store, verified), run the cacheable prefix on them and put
the results into the ring under their transformed keys (clients/transformed.py).
The trainer then finds them as hits. Nothing but a small report goes back:
per item (index, seconds, status).

A step stuck on an item is logged by a watchdog thread of the worker's (Ray passes
its workers' logs on to the driver): Ray cannot cancel a running task of an actor
like this one, so past the spec's step_timeout the worker ends its own process,
and the trainer makes the items of its tasks (pool.py: a dead worker)."""
from __future__ import annotations

import os
import time
import traceback
from typing import Any

from clients.transformed import TransformedItems

from ..items import describe, item_digest, pairs
from ..pipeline import ItemContext, StepError
from ..stall import Running, StallWatch, Watchdog, bind, local_slot, log, seconds
from .spec import WorkSpec, open_dataset

# statuses in a report
MADE, PRESENT, FAILED = "made", "present", "failed"

Report = list[tuple[int, float, str]]  # (index, seconds of work, status)


class SpecMismatch(RuntimeError):
    """A task for a spec version this worker was not given."""


class PrefixRunner:
    def __init__(self) -> None:
        self.spec: WorkSpec | None = None
        self.ds: Any = None
        self.items: TransformedItems | None = None
        self.done = 0
        self.refused: str | None = None  # why the last spec could not be taken: its tasks say it
        self.slot = local_slot()  # the item and step the task runs (stall.py)
        self.watchdog: Watchdog | None = None

    def pid(self) -> int:
        return os.getpid()

    def configure(self, spec: WorkSpec) -> int:
        """Take (a new version of) the job's spec; returns its version."""
        if self.spec is not None and self.spec.version == spec.version:
            return spec.version
        self.close()
        self.spec = self.items = None  # no half-taken spec: a task for it is refused, saying why
        try:
            ds = open_dataset(spec)  # the steps' modules must be importable here
        except Exception as e:
            self.refused = f"could not take spec version {spec.version}: {type(e).__name__}: {e}"
            raise
        ring = ds._proc().ring
        if ring is None:
            ds.close()
            self.refused = f"could not take spec version {spec.version}: no cache ring (cache=False given)"
            raise ValueError("remote workers need a cache ring to put transformed items into (cache=False given)")
        self.spec, self.ds, self.refused = spec, ds, None
        self.items = TransformedItems(ring, ds.job, ds.dataset_tag, spec.fingerprint, spec.key_seed)
        self._watch(spec, ds)
        return spec.version

    def _watch(self, spec: WorkSpec, ds: Any) -> None:
        """One watchdog thread per spec taken (not per task or item)."""
        watch = StallWatch(spec.step_warning, spec.step_timeout, lambda j: ds.transform.steps[j].name,
                           lambda i: f"{i} ({describe(ds, i)})", lambda _: f"remote worker, pid {os.getpid()}")
        self.watchdog = Watchdog(watch, {"task": self.slot}, self._timed_out)
        self.watchdog.__enter__()

    def _timed_out(self, r: Running, secs: float) -> None:
        """A step over step_timeout: Ray cannot stop a running actor task, this process can
        end itself; its tasks fail as a dead worker's, and the trainer makes their items."""
        log.error("preprocessing: %s ran for %s, over step_timeout=%g s; this remote worker (pid %s) ends "
                  "itself, the trainer makes its items", self.watchdog.watch.what(r[1], r[2]), seconds(secs),
                  self.spec.step_timeout, os.getpid())
        os._exit(1)

    def run(self, version: int, epoch: int, indices: list[int]) -> Report:
        spec, ds = self.spec, self.ds
        if spec is None or spec.version != version:
            why = f" (it {self.refused})" if self.refused else ""  # configure's error is not awaited
            raise SpecMismatch(f"task for spec version {version}, worker has "
                               f"{None if spec is None else spec.version}{why}")
        Ks = [item_digest(ds, i) for i in indices]
        present = self.items.lookup(Ks)
        report: Report = [(i, 0.0, PRESENT) for i, p in zip(indices, present) if p]
        todo = [(i, K) for i, K, p in zip(indices, Ks, present) if not p]
        if not todo:
            return report
        t0 = time.perf_counter()
        try:
            raw = ds.read([i for i, _ in todo])
        except Exception:  # the trainer reads and computes these itself
            text = traceback.format_exc(limit=2).strip().splitlines()[-1]
            return report + [(i, 0.0, f"{FAILED}: reading: {text}") for i, _ in todo]
        read_share = (time.perf_counter() - t0) / len(todo)
        outs, keys = [], []
        bind(self.slot)  # per task: Ray may run them on any thread
        for (i, K), x in zip(todo, raw):
            t1 = time.perf_counter()
            self.slot.item(i)
            try:
                y = self._prefix(x[0] if pairs(ds) else x, ItemContext(spec.job_seed, epoch, K))
            except StepError as e:  # the trainer runs it again and reports it as on_error says
                report.append((i, read_share + time.perf_counter() - t1, f"{FAILED}: {e}"))
                continue
            finally:
                self.slot.idle()
            outs.append(y)
            keys.append(K)
            report.append((i, read_share + time.perf_counter() - t1, MADE))
        if outs:
            self.items.put(keys, outs)
        self.done += len(outs)
        return report

    def _prefix(self, x: Any, ctx: ItemContext) -> Any:
        pipe = self.ds.transform
        for pos in range(self.spec.prefix):
            x = pipe.call_step(pipe.order[pos], x, ctx)
        return x

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.ds is not None:
            self.ds.close()
            self.ds = None
