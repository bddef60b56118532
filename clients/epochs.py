"""What every front end of CachedDataset shares: its sampler and its epochs.

The PyTorch loader (loader.py) and the tf.data source (tf_source.py) are two
front ends over one read path (CachedDataset.__getitems__) and one sampler
(SubstitutableBatchSampler). This module builds that sampler the same way for
both, hooks the cache manager's coordinator to their epochs, and measures an
epoch the same way for both (EpochStats). It imports neither torch nor TensorFlow.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

from .sampler import SubstitutableBatchSampler
from .stats import T_FIELDS, EpochStats, LoaderCounters, SharedCounters


class Source(Protocol):
    """What the front ends need of a CachedDataset (dataset.py imports this module's
    users, so it is named by its shape here, not imported)."""
    counters: SharedCounters
    coordinator: Any
    cache_spec: str | None  # None: no cache
    dataset_tag: str  # the digest's fingerprint (hex)

    def __len__(self) -> int: ...

    def plan_hooks(self) -> tuple[Any, Any, Any]: ...

    def lookup_codes(self, indices: Any) -> Any: ...


def make_sampler(ds: Source, batch_size: int, *, seed: int = 0, lookahead: int = 10,
                 substitute: bool = True, miss_seed: int | None = None, drop_last: bool = False,
                 rank: int = 0, world_size: int = 1) -> SubstitutableBatchSampler:
    """The substitutable-hit sampler over ds, steered by the manager's plan (if any); with
    no cache (cache=False) the plain seeded permutation: nothing to substitute, and misses
    drawn per loader would only make `seed` not repeat the order."""
    prefer, on_batch, on_epoch = ds.plan_hooks()
    return SubstitutableBatchSampler(len(ds), batch_size, ds.lookup_codes if substitute and ds.cache_spec else None,
                                     seed=seed, lookahead=lookahead, drop_last=drop_last,
                                     prefer=prefer, on_batch=on_batch, on_epoch=on_epoch,
                                     miss_seed=miss_seed, rank=rank, world_size=world_size,
                                     dataset=ds.dataset_tag)


class EpochLog:
    """A front end's record of its epochs: `epoch_stats` (one EpochStats each, also for
    an epoch stopped early), `batch_times` (the last epoch's intervals between batches),
    and the user's callbacks at epoch start, per batch handed over (wall-clock end, interval)
    and at epoch end. The coordinator's own hooks (`coordinator_hits`: probing compares batch
    times; chunk passes drive double-buffering) are kept out of those lists: EpochRun calls
    them around the user's, so that a callback that raises, or one put before them, leaves
    no epoch of the chunk accounting begun (it would hold chunks from the job's other loaders)."""

    def __init__(self) -> None:
        self.epoch_stats: list[EpochStats] = []
        self.batch_times: list[float] = []
        self.on_epoch_start: list[Callable[[], None]] = []
        self.on_batch_time: list[Callable[[float, float], None]] = []
        self.on_epoch_end: list[Callable[[EpochStats], None]] = []
        self.counters: LoaderCounters | None = None  # what this front end's own reads counted (stats.py)
        self.coordinator_hits: Any = None  # the coordinator's hooks of this front end (batchreports.LoaderHits)

    def attach_coordinator(self, ds: Source, sampler: SubstitutableBatchSampler) -> None:
        """This front end's own hooks (LoaderHits): of a job's loaders (train and eval, two
        batch sizes) each reports its own batches' hit fractions to the manager, and its
        epochs are a stream of their own in the chunk accounting."""
        coord = ds.coordinator
        if coord is not None:  # each batch's hit fraction goes with its time (benefit by regression)
            self.coordinator_hits = coord.watch_hits(sampler)
            coord.start()


class EpochRun:
    """One epoch of one front end, from its start to `finish()`: the counters' change
    over the epoch (all processes) less what the dataset's other loaders read meanwhile
    (an eval epoch run inside a train epoch is the eval loader's), the sampler's view, and
    the intervals between batches handed to the training loop (the training step plus
    the wait for data)."""

    def __init__(self, ds: Source, sampler: SubstitutableBatchSampler, log: EpochLog) -> None:
        for cb in log.on_epoch_start:  # one that raises: the epoch never starts, nothing to end
            cb()
        self.counters = ds.counters
        self.sampler = sampler
        self.log = log
        self.epoch = sampler.epoch  # the sampler advances it when its iteration starts
        self.before, self.others = ds.counters.totals_with(self._others())
        self.times: list[float] = []
        self.t0 = self.last = time.perf_counter()
        if log.coordinator_hits is not None:  # last: begun only for an epoch that will end (finish)
            log.coordinator_hits.epoch_start()

    def _others(self) -> list[LoaderCounters]:
        """The counters of the dataset's other loaders (none for a dataset of one loader)."""
        return [c for c in getattr(self.counters, "loaders", ()) if c is not self.log.counters]

    def batch(self, indices: list[int] | None = None) -> None:
        """A batch is being handed over now (`indices`: its items, when the preprocess
        scheduler regrouped them; else it is the sampler's oldest batch not yet handed over)."""
        now, end = time.perf_counter(), time.time()
        # the user's first: one that raises ends the epoch before this batch is handed
        # over, and nothing (stats, the manager's batch times, the sampler) counts it
        for cb in self.log.on_batch_time:
            cb(end, now - self.last)
        if self.log.coordinator_hits is not None:
            self.log.coordinator_hits.batch_time(end, now - self.last)
        self.times.append(now - self.last)
        self.last = now
        if indices is None:
            self.sampler.delivered()
        else:
            self.sampler.delivered_items(indices)

    def finish(self, complete: bool, preprocess: Any = None, autocache: Any = None) -> EpochStats:
        """The epoch's stats (complete=False: it stopped early), recorded in the log;
        then the log's epoch-end callbacks run. `autocache`: the front end's
        (clients/autocache.py), whose mode and counts the stats then carry."""
        elapsed = time.perf_counter() - self.t0
        # first, whatever raises below: an epoch over holds no chunk (coordination.py)
        if self.log.coordinator_hits is not None:
            self.log.coordinator_hits.epoch_end()
        if complete:  # what the epoch left out (a transform's skipped items) is over with it
            self.sampler.epoch_over()
        after, others = self.counters.totals_with(self._others())
        d = {k: after[k] - self.before[k] for k in after}
        for c, now in others.items():  # one made after the epoch's start: all of its counts are the span's
            was = self.others.get(c)
            for k in d:
                d[k] -= now[k] - (was[k] if was is not None else 0)
        s, times = self.sampler.stats, self.times
        st = EpochStats(epoch=self.epoch, batches=len(times), items=s.delivered_items, seconds=elapsed,
                        hits=d["hits"], misses=d["misses"], substituted=s.substituted,
                        store_bytes=d["store_bytes"], cache_bytes=d["cache_bytes"], poisoned=d["poisoned"],
                        inserted=d["inserted"], coalesced=d["coalesced"], planned_hit_rate=s.planned_hit_rate,
                        batch_time_median=statistics.median(times) if times else 0.0,
                        batch_time_p95=sorted(times)[int(0.95 * (len(times) - 1))] if times else 0.0,
                        complete=complete, preprocess=preprocess)
        if autocache is not None:
            st.transformed = {k[2:]: d[k] for k in T_FIELDS}
            st.autocache = autocache.line()
        self.log.batch_times = times
        self.log.epoch_stats.append(st)
        for cb in self.log.on_epoch_end:
            cb(st)
        return st
