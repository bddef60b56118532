"""What "auto" decides from (manager.policy.autocache.PipelineCosts), measured on this
job's own read path at the sizes involved, once, during the first epoch:

- the steps' CPU seconds per item before and after the caching point: the epoch's
  own step records so far (preprocess.stats), plus the decode before the first step;
- the store read, the cache read of a source item and of a transformed item, per
  item: the scheduler's sample items (16) read as a batch, as the loader reads, by
  the same read path (store only; cache only; TransformedItems), the median of
  REPEAT reads where a repeat costs nothing but the cache. The transformed items
  read are the sample's own outputs at the caching point, put first: real items
  under the real key, hits later if transformed is chosen.
Reads made here count in no epoch's statistics."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from .autofeed import raw, reader
from .stats import SharedCounters

REPEAT = 3


def _per_item(fn: Callable[[], Any], n: int, repeat: int = REPEAT) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / max(1, n)


def _quiet(v: Any) -> Any:
    v.counters = SharedCounters()  # reads made to measure are no epoch's
    return v


def step_seconds(pipeline: Any, stats: Any, cut: int) -> tuple[float, float]:
    """(seconds per item of the steps before the caching point, of those after it)."""
    per = {j: s.seconds / s.items for j, s in stats.steps.items() if s.items}
    return (sum(per.get(j, 0.0) for j in pipeline.order[:cut]),
            sum(per.get(j, 0.0) for j in pipeline.order[cut:]))


def marker_read(ac: Any, kept: list[tuple[bytes, Any]]) -> tuple[float, float]:
    """(mean bytes of an encoded transformed item, seconds per item to read one back),
    from `kept`: (source key, output at the caching point) of sample items, put first."""
    if not ac.key:
        return 0.0, 0.0
    t = ac.transformed()
    pairs = [(K, p) for K, p in ((K, t.encode(x)) for K, x in kept) if p is not None]
    if not pairs:
        return 0.0, 0.0
    Ks = [K for K, _ in pairs]
    t.put_payloads(Ks, [p for _, p in pairs])
    return statistics.fmean(len(p) for _, p in pairs), _per_item(lambda: t.get(Ks), len(Ks))


def sample_outputs(ac: Any, engine: Any) -> list[tuple[bytes, Any]]:
    """The scheduler's profiled sample at the caching point: (source key, output)."""
    tr = engine.sample
    if not ac.key or tr is None or tr.order != engine.pipeline.order:
        return []
    return [(c.digest, x) for c, x in zip(tr.ctxs, tr.inputs[ac.cut])]


def read_costs(ac: Any, idx: list[int], kept: list[tuple[bytes, Any]]) -> dict[str, float]:
    """Per item: the store read, the cache read of the source and of the kept item at
    the caching point (and its bytes), the decode; over sample items `idx`."""
    ds = ac.ds
    store, cached = _quiet(raw(reader(ds, cache=False))), _quiet(raw(reader(ds, cache=True)))
    try:
        t0 = time.perf_counter()
        data = store.read(idx)
        out = {"store_read_s": (time.perf_counter() - t0) / max(1, len(idx)), "decode_s": 0.0,
               "source_bytes": statistics.fmean(ds.entry(i).length for i in idx) if idx else 0.0}
        if ds.decode is not None:
            out["decode_s"] = _per_item(lambda: [ds._decode(i, None, x) for i, x in zip(idx, data)], len(idx), 1)
        missing = [i for i, p in zip(idx, ds.lookup(idx)) if not p]
        if missing:  # not read through the cache yet, evicted since, or outside the manager's plan
            ds.read(missing)
        out["cache_read_source_s"] = _per_item(lambda: cached.read(idx), len(idx))
        out["marker_bytes"], out["cache_read_marker_s"] = marker_read(ac, kept)
    finally:
        for v in (store, cached):
            if v._state is not None:
                v._state.close()
    return out


def costs(ac: Any, reads: dict[str, float], items: int, epochs_left: int, prefix_s: float, rest_s: float,
          workers: int) -> Any:
    from manager.policy.autocache import PipelineCosts

    return PipelineCosts(
        items=items, epochs_left=epochs_left, source_bytes=reads["source_bytes"],
        marker_bytes=reads["marker_bytes"], store_read_s=reads["store_read_s"],
        cache_read_source_s=reads["cache_read_source_s"], cache_read_marker_s=reads["cache_read_marker_s"],
        prefix_s=prefix_s + reads["decode_s"], rest_s=rest_s, workers=max(1, workers), cacheable=bool(ac.key),
        why_not=ac.why_not)


def measure(ac: Any, engine: Any, epoch_items: int, epochs_left: int) -> Any:
    """The PipelineCosts of the loader whose Autocache is `ac`."""
    prefix_s, rest_s = step_seconds(engine.pipeline, engine.last_stats, ac.cut)
    reads = read_costs(ac, list(engine.sample_indices), sample_outputs(ac, engine))
    workers = engine.pool.size if engine.pool is not None else 1
    return costs(ac, reads, epoch_items, epochs_left, prefix_s, rest_s, workers)
