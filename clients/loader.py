"""The DataLoader that `CachedDataset.loader()` returns.

A standard torch DataLoader (so it drops into any training loop) whose batch
sampler is the substitutable-hit sampler, plus per-epoch statistics gathered
from the sampler (main process) and the workers (shared counters). Batch time
is the time between batches handed to the training loop: with and without the
cache it is what probing compares (manager)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator

from torch.utils.data import DataLoader

from .sampler import SubstitutableBatchSampler
from .stats import EpochStats


class CachedLoader(DataLoader):
    def __init__(self, dataset, batch_sampler: SubstitutableBatchSampler, **kwargs) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self.epoch_stats: list[EpochStats] = []
        self.batch_times: list[float] = []
        self.on_epoch_end: list[Callable[[EpochStats], None]] = []
        self.on_batch_time: list[Callable[[float, float], None]] = []
        self.on_epoch_start: list[Callable[[], None]] = []

    def __iter__(self) -> Iterator:
        ds = self.dataset
        for cb in self.on_epoch_start:
            cb()
        before = ds.counters.totals()
        sampler: SubstitutableBatchSampler = self.batch_sampler
        epoch = sampler.epoch
        times: list[float] = []
        t0 = last = time.perf_counter()
        for batch in super().__iter__():
            # Interval between batches handed over: the training step plus the wait for data.
            now = time.perf_counter()
            times.append(now - last)
            for cb in self.on_batch_time:
                cb(time.time(), now - last)
            last = now
            yield batch
        elapsed = time.perf_counter() - t0
        after = ds.counters.totals()
        d = {k: after[k] - before[k] for k in after}
        s = sampler.stats
        st = EpochStats(epoch=epoch, batches=len(times), items=s.items, seconds=elapsed, hits=d["hits"],
                        misses=d["misses"], substituted=s.substituted, store_bytes=d["store_bytes"],
                        cache_bytes=d["cache_bytes"], poisoned=d["poisoned"], inserted=d["inserted"],
                        coalesced=d["coalesced"], planned_hit_rate=s.planned_hit_rate,
                        batch_time_median=statistics.median(times) if times else 0.0,
                        batch_time_p95=sorted(times)[int(0.95 * (len(times) - 1))] if times else 0.0)
        self.batch_times = times
        self.epoch_stats.append(st)
        for cb in self.on_epoch_end:
            cb(st)


def make_loader(ds, batch_size: int, *, num_workers: int = 0, seed: int = 0, lookahead: int = 10,
                substitute: bool = True, miss_seed: int | None = None, **kwargs) -> CachedLoader:
    coord = ds.coordinator
    sampler = SubstitutableBatchSampler(len(ds), batch_size, ds.lookup_codes if substitute else None,
                                        seed=seed, lookahead=lookahead,
                                        prefer=coord.prefer if coord else None,
                                        on_batch=coord.consumed if coord else None, miss_seed=miss_seed)
    if num_workers > 0:
        # Workers are spawned, not forked: the main process runs gRPC and maybe the
        # embedded server's threads, which must not be forked mid-flight.
        kwargs.setdefault("multiprocessing_context", "spawn")
        kwargs.setdefault("persistent_workers", True)
    kwargs.setdefault("collate_fn", _as_list)
    loader = CachedLoader(ds, sampler, num_workers=num_workers, **kwargs)
    if coord is not None:  # mini-batch times feed probing; chunk passes feed double-buffering
        loader.on_batch_time.append(coord.batch_time)
        loader.on_epoch_start.append(coord.epoch_start)
        coord.start()
    return loader


def _as_list(batch: list) -> list:
    """Items are bytes (or what `decode` returns): hand the batch over as a list."""
    return batch
