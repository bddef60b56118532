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


def marker_read(ac: Any, engine: Any) -> tuple[float, float]:
    """(mean bytes of an encoded transformed item, seconds per item to read one back)."""
    tr = engine.sample
    if not ac.key or tr is None or tr.order != engine.pipeline.order:
        return 0.0, 0.0
    t = ac.transformed()
    Ks = [c.digest for c in tr.ctxs]
    outputs = tr.inputs[ac.cut]
    payloads = [t.encode(x) for x in outputs]
    kept = [(K, p) for K, p in zip(Ks, payloads) if p is not None]
    if not kept:
        return 0.0, 0.0
    t.put_payloads([K for K, _ in kept], [p for _, p in kept])
    Ks = [K for K, _ in kept]
    return statistics.fmean(len(p) for _, p in kept), _per_item(lambda: t.get(Ks), len(Ks))


def measure(ac: Any, engine: Any, epoch_items: int, epochs_left: int) -> Any:
    """The PipelineCosts of the loader whose Autocache is `ac`."""
    from manager.policy.autocache import PipelineCosts

    ds, pipe, idx = ac.ds, engine.pipeline, list(engine.sample_indices)
    prefix_s, rest_s = step_seconds(pipe, engine.last_stats, ac.cut)
    store, cached = _quiet(raw(reader(ds, cache=False))), _quiet(raw(reader(ds, cache=True)))
    try:
        t0 = time.perf_counter()
        data = store.read(idx)
        store_read_s = (time.perf_counter() - t0) / max(1, len(idx))
        if ds.decode is not None:
            prefix_s += _per_item(lambda: [ds._decode(i, None, x) for i, x in zip(idx, data)], len(idx), 1)
        missing = [i for i, p in zip(idx, ds.lookup(idx)) if not p]
        if missing:  # evicted since the sample was read, or outside the manager's plan
            ds.read(missing)
        cache_source_s = _per_item(lambda: cached.read(idx), len(idx))
        marker_bytes, cache_marker_s = marker_read(ac, engine)
    finally:
        for v in (store, cached):
            if v._state is not None:
                v._state.close()
    workers = engine.pool.size if engine.pool is not None else 1
    return PipelineCosts(
        items=epoch_items, epochs_left=epochs_left,
        source_bytes=statistics.fmean(ds.entry(i).length for i in idx) if idx else 0.0, marker_bytes=marker_bytes,
        store_read_s=store_read_s, cache_read_source_s=cache_source_s, cache_read_marker_s=cache_marker_s,
        prefix_s=prefix_s, rest_s=rest_s, workers=max(1, workers), cacheable=bool(ac.key), why_not=ac.why_not)
