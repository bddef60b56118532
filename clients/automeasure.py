"""What "auto" decides from (manager.policy.autocache.PipelineCosts), measured on this
job's own read path at the sizes involved:

- the read path, probed once when the loader is made, after the scheduler profiled
  its sample and before the preprocessing workers start (`probe`): a busy job
  measures its own reads several times slower than they cost in the mode that
  reads them (a transformed hit with no step after the caching point is read while
  the workers idle): the store read, the cache read of a source item and of a
  transformed item, per item: the scheduler's sample items (16) read as a batch, as
  the loader reads, by the same read path (store only; cache only;
  TransformedItems), the fastest of REPEAT reads of each (the store's once its
  connections are open): other work only ever slows a read, and one slowed read
  (a flush of the items just put, on a busy host) made the median of three 4x the
  epochs' cost and a clear, wrong estimate. The transformed items
  read are the sample's own outputs at the caching point, put first: real items
  under the real key, hits later if transformed is chosen. Also the CPU to encode
  and seal one, and to hand one back from a worker; and the put, in PUT_GROUPS
  puts whose median per item is taken (one put may wait on the server's flush of
  the others, several times its usual cost: alone it would make a clear, wrong
  estimate);
- the steps' CPU seconds per item before and after the caching point: first the
  sample's (`estimate`, which sets the mode the measured window runs in), then the
  epoch's own step records in the workers (`measure`, at the decision), plus the
  decode before the first step; and where the measured window put outputs (at least
  MIN_PUTS), the put's cost as the job's own put threads saw it (a sustained fill of
  large outputs stalls the server's writes far more than the probe's few puts).
Reads made here count in no epoch's statistics."""
from __future__ import annotations

import os
import pickle
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from preprocess.channel import HEADER, READ_BYTES

from .autofeed import raw, reader, speculative_chunk
from .stats import SharedCounters

REPEAT = 3  # reads of the cache, the fastest taken (as for the store: other work only slows one)
MIN_STEP_ITEMS = 8  # step records of the epoch taken over the sample's
MIN_PUTS = 32  # the job's own puts taken over the probe's
MIN_HANDOFFS = 32  # outputs the scheduler read before its hand-off cost counts
STORE_REPEAT = 2  # store reads cost its bandwidth: the faster of two
PUT_GROUPS = 3  # the probe's puts: the sample's outputs in this many puts, the median per item taken
SHARE_SAMPLE = 256  # items looked up to estimate how much of the dataset is cached


def fastest_per_item(fn: Callable[[], Any], n: int, repeat: int = REPEAT) -> float:
    """Seconds per item of the fastest of `repeat` calls of fn, which handles n items
    (other work on the host only ever slows a call)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) / max(1, n)


def _quiet(v: Any) -> Any:
    v.counters = SharedCounters()  # reads made to measure are no epoch's
    return v


def step_seconds(pipeline: Any, stats: Any, cut: int, tr: Any = None) -> tuple[float, float]:
    """(seconds per item of the steps before the caching point, of those after it),
    from an epoch's step records; a step with fewer than MIN_STEP_ITEMS records (the
    sampler serves cached items first: a transformed hit runs no step before the
    point) is taken from the profiled sample `tr` where there is one."""
    per = sample_seconds(tr)
    per.update({j: s.seconds / s.items for j, s in stats.steps.items()
                if s.items and (s.items >= MIN_STEP_ITEMS or j not in per)})
    return split_steps(pipeline, per, cut)


def sample_seconds(tr: Any) -> dict[int, float]:
    """Seconds per item of each step in the scheduler's profiled sample (preprocess.profile.Trace)."""
    n = len(tr.ctxs) if tr is not None else 0
    return {j: s / n for j, s in tr.seconds.items()} if n else {}


def sample_step_seconds(pipeline: Any, tr: Any, cut: int) -> tuple[float, float]:
    """step_seconds from the scheduler's profiled sample alone."""
    return split_steps(pipeline, sample_seconds(tr), cut)


def split_steps(pipeline: Any, per: dict[int, float], cut: int) -> tuple[float, float]:
    return (sum(per.get(j, 0.0) for j in pipeline.order[:cut]),
            sum(per.get(j, 0.0) for j in pipeline.order[cut:]))


def marker_read(ac: Any, kept: list[tuple[bytes, Any]]) -> dict[str, float]:
    """marker_bytes (mean bytes of an encoded transformed item), cache_read_marker_s
    (seconds per item to read one back) and put_marker_s (seconds per item to encode
    one, and to seal and put it: the put's wall time, which holds the server's write,
    as much a burden on the cores the steps run on as the encoding), from `kept`:
    (source key, output at the caching point) of sample items, which are put first."""
    out = {"marker_bytes": 0.0, "cache_read_marker_s": 0.0, "put_marker_s": 0.0, "encode_marker_s": 0.0}
    if not ac.key or not kept:
        return out
    t = ac.transformed()
    t0 = time.process_time()
    pairs = [(K, p) for K, p in ((K, t.encode(x)) for K, x in kept) if p is not None]
    encode_s = time.process_time() - t0
    out["encode_marker_s"] = encode_s / len(kept)
    if not pairs:
        out["put_marker_s"] = encode_s / len(kept)
        return out
    Ks = [K for K, _ in pairs]
    out["put_marker_s"] = encode_s / len(kept) + put_seconds(t, pairs, speculative_chunk(ac.ds))
    out["marker_bytes"] = statistics.fmean(len(p) for _, p in pairs)
    out["cache_read_marker_s"] = fastest_per_item(lambda: t.get(Ks), len(Ks))
    return out


def put_seconds(t: Any, pairs: list[tuple[bytes, bytes]], chunk: int, groups: int = PUT_GROUPS) -> float:
    """Seconds per item to seal and put `pairs` (key, encoded payload), put in up to
    `groups` puts: the median of their per-item costs (puts can only be measured once
    each, and one may wait on a flush of the others that a sustained fill spreads)."""
    n = min(groups, len(pairs))
    per: list[float] = []
    for g in range(n):
        part = pairs[g::n]
        t0 = time.perf_counter()
        t.put_payloads([K for K, _ in part], [p for _, p in part], chunk)
        per.append((time.perf_counter() - t0) / len(part))
    return statistics.median(per) if per else 0.0


def handoff(outputs: list[Any]) -> float:
    """CPU seconds per item the loader's process spends taking a worker's output back:
    reading its frame from a pipe (as preprocess/channel.py does) and unpickling it.
    Measured through a real pipe, the frames written by a thread: unpickling alone
    missed the copies out of the pipe, which dominate for large (inflated) outputs
    (at 8x 128 KiB: 0.08-0.10 ms unpickled against 0.64 ms measured in epochs)."""
    if not outputs:
        return 0.0
    from multiprocessing.reduction import ForkingPickler

    frames = [HEADER.pack(len(d)) + d for d in
              (bytes(ForkingPickler.dumps(("done", 0, 0, 0, x, [], False))) for x in outputs)]
    return statistics.median(_read_frames(frames) for _ in range(REPEAT)) / len(outputs)


def _read_frames(frames: list[bytes]) -> float:
    """CPU seconds of this thread to read and unpickle ``frames`` from a pipe."""
    r, w = os.pipe()

    def write() -> None:
        try:
            for f in frames:
                view = memoryview(f)
                while view:
                    view = view[os.write(w, view):]
        finally:
            os.close(w)

    writer = threading.Thread(target=write, daemon=True)
    t0 = time.thread_time()
    writer.start()
    buf = bytearray()
    try:
        while chunk := os.read(r, READ_BYTES):
            buf += chunk
            while len(buf) >= HEADER.size:
                (n,) = HEADER.unpack_from(buf)
                if len(buf) < HEADER.size + n:
                    break
                pickle.loads(bytes(buf[HEADER.size:HEADER.size + n]))
                del buf[:HEADER.size + n]
    finally:
        os.close(r)
        spent = time.thread_time() - t0
        writer.join(5.0)
    return spent


def cached_shares(ac: Any, n: int = SHARE_SAMPLE) -> tuple[float, float]:
    """(share of the source items cached now, share of the transformed items), from a
    look-up of up to n items spread over the dataset."""
    ds = ac.ds
    idx = list(range(0, len(ds), max(1, len(ds) // n)))[:n]
    src = statistics.fmean(ds.lookup(idx)) if idx else 0.0
    if not ac.key or ds.samples is not None:
        return src, 0.0
    return src, statistics.fmean(ac.transformed().lookup([ds.digest.hashes[i].tobytes() for i in idx]))


def sample_outputs(ac: Any, engine: Any) -> list[tuple[bytes, Any]]:
    """The scheduler's profiled sample at the caching point: (source key, output)."""
    tr = engine.sample
    if not ac.key or tr is None or tr.order != engine.pipeline.order:
        return []
    return [(c.digest, x) for c, x in zip(tr.ctxs, tr.inputs[ac.cut])]


def read_costs(ac: Any, idx: list[int], kept: list[tuple[bytes, Any]], fill: bool = True) -> dict[str, float]:
    """Per item: the store read, the cache read of the source and of the kept item at
    the caching point (and its bytes), the decode; over sample items `idx`. `fill`: read
    those not cached through the cache first (False where the epoch just read them so:
    what is missing would not be inserted again, and the read would count in its stats)."""
    ds = ac.ds
    store, cached = _quiet(raw(reader(ds, cache=False))), _quiet(raw(reader(ds, cache=True)))
    try:
        data: list[Any] = []
        store.read(idx[:1])  # opens the reader's connections: once per process, not per item
        store_s = fastest_per_item(lambda: data.__setitem__(slice(None), store.read(idx)), len(idx), STORE_REPEAT)
        out = {"store_read_s": store_s, "decode_s": 0.0,
               "source_bytes": statistics.fmean(ds.entry(i).length for i in idx) if idx else 0.0}
        if ds.decode is not None:
            out["decode_s"] = fastest_per_item(lambda: [ds._decode(i, None, x) for i, x in zip(idx, data)], len(idx), 1)
        missing = [i for i, p in zip(idx, ds.lookup(idx)) if not p]
        if missing and fill:  # not read through the cache yet, evicted since, or outside the manager's plan
            ds.read(missing)
        out["cache_read_source_s"] = fastest_per_item(lambda: cached.read(idx), len(idx))
        out.update(marker_read(ac, kept))
    finally:
        for v in (store, cached):
            if v._state is not None:
                v._state.close()
    return out


def costs(ac: Any, reads: dict[str, float], items: int, done: int, prefix_s: float, rest_s: float,
          workers: int, handoff_s: float = 0.0) -> Any:
    """PipelineCosts from the reads measured and the steps' seconds, `done` items into
    the epoch (the room is the manager's to know: unbounded here)."""
    from manager.policy.autocache import PipelineCosts

    source_cached, transformed_cached = cached_shares(ac)
    return PipelineCosts(
        items=max(1, items), epochs_left=ac.epochs_left(), source_bytes=reads["source_bytes"],
        marker_bytes=reads["marker_bytes"], store_read_s=reads["store_read_s"],
        cache_read_source_s=reads["cache_read_source_s"], cache_read_marker_s=reads["cache_read_marker_s"],
        prefix_s=prefix_s + reads["decode_s"], rest_s=rest_s, workers=max(1, workers), cacheable=bool(ac.key),
        why_not=ac.why_not, source_cached=source_cached, transformed_cached=transformed_cached,
        put_marker_s=reads["put_marker_s"], epoch_done=min(1.0, done / max(1, items)), handoff_s=handoff_s,
        cores=float(len(os.sched_getaffinity(0))))


def busy_factor(engine: Any, cut: int, steps_s: float) -> float:
    """How much slower the steps ran in the workers (`steps_s` per item) than in the
    profiled sample before they started (>= 1): the probes, taken then, are scaled by it
    where what they time competes for the same cores."""
    idle = sum(sample_step_seconds(engine.pipeline, engine.sample, cut))
    return max(1.0, steps_s / idle) if idle > 0 else 1.0


def probe(ac: Any, engine: Any) -> dict[str, float]:
    """The read path's costs (read_costs, and handoff_s where workers run the steps),
    taken once before the workers start."""
    out = read_costs(ac, list(engine.sample_indices), sample_outputs(ac, engine))
    tr = engine.sample
    out["handoff_s"] = handoff(tr.inputs[-1]) if engine.workers > 0 and tr is not None else 0.0
    return out


def estimate(ac: Any, engine: Any, items: int) -> Any:
    """PipelineCosts before the first epoch: the probes and the sample's step times."""
    prefix_s, rest_s = sample_step_seconds(engine.pipeline, engine.sample, ac.cut)
    return costs(ac, ac.probes, items, 0, prefix_s, rest_s, max(1, engine.workers), ac.probes["handoff_s"])


def measure(ac: Any, engine: Any, epoch_items: int) -> Any:
    """The PipelineCosts of the loader whose Autocache is `ac`, `engine.last_stats.items`
    into its first epoch: the steps as its workers ran them, the read path as probed."""
    stats = engine.last_stats
    prefix_s, rest_s = step_seconds(engine.pipeline, stats, ac.cut, engine.sample)
    reads = dict(ac.probes) if ac.probes is not None else probe(ac, engine)
    n, put_s = ac.feed.put_times.totals()
    if n >= MIN_PUTS:  # the job's own puts so far: a sustained fill costs more than the probe's few
        reads["put_marker_s"] = reads["encode_marker_s"] + put_s / n
    elif ac.probes is not None:  # a put takes the cores the steps take: as slowed as they are now
        reads["put_marker_s"] *= busy_factor(engine, ac.cut, prefix_s + rest_s)
    workers = engine.pool.size if engine.pool is not None else 1
    return costs(ac, reads, epoch_items, stats.items, prefix_s, rest_s, workers,
                 handoff_seen(reads["handoff_s"], engine.pool))


def handoff_seen(probed: float, pool: Any) -> float:
    """The hand-off per item: the larger of the probe's and what the scheduler's thread
    spent reading and decoding the workers' outputs so far (MIN_HANDOFFS of them at
    least). Both undercount (the probe's reads vary with how they interleave with its
    writer: 0.35-0.99 ms per 1 MiB output from run to run; the scheduler's leave out the
    items' way to the workers), and a source epoch projected too cheap would choose
    source where transformed wins."""
    if pool is None or pool.handoff_items < MIN_HANDOFFS:
        return probed
    return max(probed, pool.handoff_cpu_s / pool.handoff_items)
