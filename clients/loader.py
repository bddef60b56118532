"""The DataLoader that `CachedDataset.loader()` returns.

A standard torch DataLoader (so it drops into any training loop) whose batch
sampler is the substitutable-hit sampler, plus per-epoch statistics gathered
from the sampler (main process) and the workers (shared counters). Batch time
is the time between batches handed to the training loop: with and without the
cache it is what probing compares (manager)."""
from __future__ import annotations

import pickle
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from .sampler import SubstitutableBatchSampler
from .stats import EpochStats

# DataLoader arguments the batch sampler replaces, and what to use instead.
_OURS = {
    "shuffle": "the loader shuffles every epoch itself (seed= fixes the order; substitute=False "
               "gives a plain seeded permutation)",
    "sampler": "the loader picks each batch's items itself (cached items first); for "
               "DistributedSampler pass rank= and world_size= (or initialise torch.distributed), "
               "for a fixed order substitute=False with seed=",
    "batch_sampler": "the loader's batch sampler is its own (SubstitutableBatchSampler); "
                     "pass batch_size=, drop_last=, seed=, rank=, world_size=",
    "in_order": "batches are delivered in order, which state_dict() relies on",
}
_HARMLESS = {"shuffle": False, "in_order": True}  # values that change nothing


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
        complete = False
        try:
            for batch in super().__iter__():
                # Interval between batches handed over: the training step plus the wait for data.
                now = time.perf_counter()
                times.append(now - last)
                for cb in self.on_batch_time:
                    cb(time.time(), now - last)
                last = now
                sampler.delivered()
                yield batch
            complete = True
        finally:  # an epoch stopped early keeps its statistics too (complete=False)
            self._end_epoch(epoch, before, times, time.perf_counter() - t0, complete)

    def _end_epoch(self, epoch: int, before: dict[str, int], times: list[float], elapsed: float,
                   complete: bool) -> None:
        after = self.dataset.counters.totals()
        d = {k: after[k] - before[k] for k in after}
        s = self.batch_sampler.stats
        st = EpochStats(epoch=epoch, batches=len(times), items=s.delivered_items, seconds=elapsed,
                        hits=d["hits"], misses=d["misses"], substituted=s.substituted,
                        store_bytes=d["store_bytes"], cache_bytes=d["cache_bytes"], poisoned=d["poisoned"],
                        inserted=d["inserted"], coalesced=d["coalesced"], planned_hit_rate=s.planned_hit_rate,
                        batch_time_median=statistics.median(times) if times else 0.0,
                        batch_time_p95=sorted(times)[int(0.95 * (len(times) - 1))] if times else 0.0,
                        complete=complete)
        self.batch_times = times
        self.epoch_stats.append(st)
        for cb in self.on_epoch_end:
            cb(st)

    def state_dict(self) -> dict[str, Any]:
        """Where training is, for a checkpoint (torchdata StatefulDataLoader's convention):
        the epoch in progress and the items of the batches already handed over."""
        return {"sampler": self.batch_sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration yields exactly the saved epoch's items not yet
        handed over; later iterations are the following epochs. ValueError if the state
        belongs to another dataset, split (rank, world size, drop_last) or seed."""
        self.batch_sampler.load_state_dict(state["sampler"])


def check_kwargs(kwargs: dict[str, Any]) -> None:
    """DataLoader arguments that our batch sampler replaces: refused, naming ours. Their
    DataLoader defaults (None, shuffle=False, in_order=True) ask for nothing: accepted."""
    for name, instead in _OURS.items():
        if name not in kwargs:
            continue
        value = kwargs.pop(name)
        if value is not None and value is not _HARMLESS.get(name):
            raise ValueError(f"CachedDataset.loader() does not take {name}=: {instead}")


def check_picklable(ds, kwargs: dict[str, Any]) -> None:
    """Workers are spawned: what they run travels pickled. Say which callable fails, and
    why, before any worker starts (not a bare PicklingError from inside torch)."""
    parts = {"decode": ds.decode, "target": getattr(ds, "target", None),
             "collate_fn": kwargs.get("collate_fn"), "worker_init_fn": kwargs.get("worker_init_fn")}
    for name, fn in parts.items():
        if fn is None or isinstance(fn, str):
            continue
        try:
            pickle.dumps(fn)
        except Exception as e:
            what = getattr(fn, "__qualname__", repr(fn))
            raise TypeError(
                f"{name}={what} cannot be sent to DataLoader worker processes ({type(e).__name__}: {e}). "
                "Workers are spawned, so what they run must pickle: define it with def at the top level "
                "of a module (not a lambda, nor a function nested in another), or use num_workers=0"
            ) from None


def distributed_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): as given, else torch.distributed's when initialised, else (0, 1)."""
    if rank is None and world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError(f"pass rank= and world_size= together (got rank={rank}, world_size={world_size})")
    return rank, world_size


def make_loader(ds, batch_size: int, *, num_workers: int = 0, seed: int = 0, lookahead: int = 10,
                substitute: bool = True, miss_seed: int | None = None, drop_last: bool = False,
                rank: int | None = None, world_size: int | None = None, **kwargs) -> CachedLoader:
    check_kwargs(kwargs)
    if num_workers > 0:
        check_picklable(ds, kwargs)
    rank, world_size = distributed_rank(rank, world_size)
    coord = ds.coordinator
    prefer, on_batch, on_epoch = ds.plan_hooks()
    sampler = SubstitutableBatchSampler(len(ds), batch_size, ds.lookup_codes if substitute else None,
                                        seed=seed, lookahead=lookahead, drop_last=drop_last,
                                        prefer=prefer, on_batch=on_batch, on_epoch=on_epoch,
                                        miss_seed=miss_seed, rank=rank, world_size=world_size)
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
