"""The autocache feed of a CachedDataset: where the scheduler's items come from in
each mode (preprocess/feed.py), and the store of what passes the caching point.

    source       ds.read: through the cache, misses inserted (as without autocache)
    compute      the store only: nothing read from the cache, nothing put in it
    transformed  the item kept at the caching point when the cache holds it (the
                 steps before the point are skipped, the source is not read); else
                 the source (from the cache if it holds it, inserted only while auto
                 measures), every step run, and the sample put in the cache as it
                 passes the point

The mode is read from a SharedMode (clients/autocache.py) before each task, so a
decision taken in the main process reaches every worker at its next task. Puts go
through a thread of the process (Putter), a batch at a time: no item waits for one.
The feed is pickled into the preprocessing workers with the dataset; each process
opens its own state."""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

from preprocess.feed import Fed

from . import itemview
from .coordination import SPARE
from .procstate import per_process
from .stats import SharedCounters, SharedRows
from .transformed import TransformedItems

log = logging.getLogger("mlcache.autocache")
PUT_BATCH = 64      # kept items per put
PUT_QUEUE = 128     # kept items waiting for their put (then passed() waits: memory stays bounded)
FLUSH_LIMIT = 30.0  # longest wait for the puts in flight (idle, close)


def reader(ds: Any, cache: bool) -> Any:
    """ds reading the same items without inserting misses (cache=False: without the
    cache at all: the store only). A shallow twin: the digest and counters are shared,
    the per-process state (connections, pools) is its own."""
    v = object.__new__(type(ds))
    v.__dict__.update(ds.__dict__)
    v._state, v.coordinator, v.embedded = None, None, None
    v.insert, v.coalesce = False, False
    if not cache:
        v.cache_spec = None
    return v


def raw(ds: Any) -> Any:
    """A reader of ds's items as bytes: no decode, no target."""
    v = object.__new__(type(ds))
    v.__dict__.update(ds.__dict__)
    v.decode, v.target, v._decode_entry = None, None, False
    return v


def speculative_chunk(ds: Any) -> int:
    """The chunk of outputs kept before a decision: with a manager, a spare entry (the set is
    not allocated yet: spare entries live in room nobody needs and are not reconciled away);
    without one, chunk 0 as every insert."""
    return SPARE if ds.manager else 0


class PutTimes:
    """Items the put threads put and the wall seconds their puts took (seal, send, the
    server's write and any stall of it), one row per process in shared memory: what
    "auto" measures a transformed put by in the job itself."""

    def __init__(self) -> None:
        self._rows = SharedRows(2)

    def add(self, items: int, ns: int) -> None:
        self._rows.add({0: items, 1: ns})

    def totals(self) -> tuple[int, float]:
        """(items put, wall seconds)."""
        items, ns = self._rows.sums()
        return items, ns / 1e9


class Putter:
    """Kept items, encoded by the caller (steps after the point may change the item in
    place), sealed and put by this process's put thread, PUT_BATCH at a time."""

    def __init__(self, counters: SharedCounters, times: PutTimes | None = None) -> None:
        self.counters, self.times = counters, times
        self.q: queue.Queue = queue.Queue(PUT_QUEUE)
        self.thread: threading.Thread | None = None
        self._start = threading.Lock()  # a worker's foreground and background threads both add

    def add(self, token: tuple, x: Any) -> None:
        t, K, chunk, replace = token
        payload = t.encode(x)
        if payload is None:  # the format cannot store this output: counted, never cached
            self.counters.add(t_uncacheable=1)
            return
        with self._start:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="autocache-put", daemon=True)
                self.thread.start()
        self.q.put((t, K, payload, chunk, replace))

    def _run(self) -> None:
        while True:
            batch = [self.q.get()]
            while len(batch) < PUT_BATCH and batch[-1] is not None:
                try:
                    batch.append(self.q.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            entries = [e for e in batch if e is not None]
            groups: dict[tuple, list] = {}
            for t, K, payload, chunk, replace in entries:
                groups.setdefault((id(t), chunk, replace), [t, [], []])
                groups[(id(t), chunk, replace)][1].append(K)
                groups[(id(t), chunk, replace)][2].append(payload)
            for (_, chunk, replace), (t, Ks, payloads) in groups.items():
                try:
                    t0 = time.perf_counter_ns()
                    self.counters.add(t_puts=t.put_payloads(Ks, payloads, chunk, replace))
                    if self.times is not None:
                        self.times.add(len(Ks), time.perf_counter_ns() - t0)
                except Exception as e:  # a cache: a failed put is a later miss, never an error
                    log.warning("autocache: putting %d transformed items failed: %s", len(Ks), e)
            for _ in batch:
                self.q.task_done()
            if stop:
                return

    def flush(self) -> None:
        """Wait (bounded) until every item added so far has been put."""
        deadline = time.monotonic() + FLUSH_LIMIT
        while (self.q.unfinished_tasks and self.thread is not None and self.thread.is_alive()
               and time.monotonic() < deadline):
            time.sleep(0.002)

    def close(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            self.flush()
            try:  # a put thread stuck past the flush limit keeps its queue full: do not wait on it for ever
                self.q.put(None, timeout=FLUSH_LIMIT)
            except queue.Full:
                log.warning("autocache: the put thread is stuck; %d transformed items left unput", self.q.qsize())
                return
            self.thread.join(FLUSH_LIMIT)


class _ProcState:
    """One process's side of the feed."""

    def __init__(self, ds: Any, times: PutTimes | None = None) -> None:
        self.pid = os.getpid()
        self.store = reader(ds, cache=False)
        self.source = reader(ds, cache=True)
        self.putter = Putter(ds.counters, times)
        self.items: dict[tuple[str, int | None], TransformedItems] = {}

    def transformed(self, ds: Any, key: str, seed: int | None = None) -> TransformedItems:
        t = self.items.get((key, seed))
        if t is None:
            t = self.items[(key, seed)] = TransformedItems(ds._proc().ring, ds.job, ds.dataset_tag, key, seed)
        return t

    def close(self) -> None:
        self.putter.close()
        for v in (self.store, self.source):
            if v._state is not None:
                v._state.close()
                v._state = None


def kept_items(st: _ProcState, ds: Any, indices: list[int], key: str, seed: int | None
               ) -> tuple[TransformedItems, list[bytes], list[Any], list[int]]:
    """The transformed items of `indices` under `key` (and seed), counted in ds.counters:
    (their TransformedItems, source keys, item or None each, poisoned positions)."""
    t = st.transformed(ds, key, seed)
    Ks = [ds.digest.hashes[i].tobytes() for i in indices]
    before = (t.counts.hits, t.counts.misses, t.counts.poisoned)
    bad: list[int] = []
    got = t.get(Ks, bad)
    ds.counters.add(t_hits=t.counts.hits - before[0], t_misses=t.counts.misses - before[1],
                    t_poisoned=t.counts.poisoned - before[2])
    return t, Ks, got, bad


class CacheFeed:
    """preprocess.feed.Feed over a CachedDataset, in the mode `shared` says."""

    def __init__(self, ds: Any, shared: Any, plan: Any) -> None:
        self.ds, self.shared, self.plan = ds, shared, plan  # plan: the transformed set's (a SharedPlan)
        self.put_times = PutTimes()
        self._st: _ProcState | None = None

    def __getstate__(self) -> dict:
        return {"ds": self.ds, "shared": self.shared, "plan": self.plan, "put_times": self.put_times, "_st": None}

    def proc(self) -> _ProcState:
        return per_process(self, "_st", lambda: _ProcState(self.ds, self.put_times))

    def read(self, indices: list[int]) -> list[Any]:
        """Items before the pipeline, read as the mode reads sources."""
        return self._read(self.shared.read()[0], indices)

    def _read(self, mode: str, indices: list[int]) -> list[Any]:
        if mode == "source":
            return self.ds.read(indices)
        st = self.proc()
        return (st.store if mode == "compute" else st.source).read(indices)

    def fetch(self, indices: list[int], epoch: int) -> list[Fed]:
        mode, cut, key, seed, keep = self.shared.snapshot()
        if mode == "source" and key and keep:
            return self._kept(self.proc(), indices, cut, key, seed)
        if mode != "transformed" or not key:
            return [Fed(x) for x in self._read(mode, indices)]
        return self._transformed(self.proc(), indices, cut, key, seed, keep)

    def _kept(self, st: _ProcState, indices: list[int], cut: int, key: str, seed: int | None) -> list[Fed]:
        """Source mode that also puts every output at the caching point (auto, measuring)."""
        t, ds = st.transformed(self.ds, key, seed), self.ds
        return [Fed(x, 0, cut, (t, ds.digest.hashes[i].tobytes(), speculative_chunk(ds), False))
                for i, x in zip(indices, ds.read(indices))]

    def _transformed(self, st: _ProcState, indices: list[int], cut: int, key: str, seed: int | None,
                     spec: bool) -> list[Fed]:
        """Transformed mode; `spec`: auto measuring (the set has no plan yet)."""
        ds = self.ds
        t, Ks, got, bad = kept_items(st, ds, indices, key, seed)
        miss = [p for p, v in enumerate(got) if v is None]
        # measuring, the sources are inserted too: a source decision reads none of them again
        sources = iter((ds.read if spec else st.source.read)([indices[p] for p in miss]) if miss else [])
        with_target = ds.target is not None
        out = []
        for p, (i, v) in enumerate(zip(indices, got)):
            if v is None:
                # the manager's plan of the transformed set
                chunk = speculative_chunk(ds) if spec else self.plan.insert_chunk(i)
                out.append(Fed(next(sources), 0, None if chunk is None else cut, (t, Ks[p], chunk, p in bad)))
            else:
                out.append(Fed((v, itemview.target_of(ds.target, ds.entry(i))) if with_target else v, cut))
        return out

    def resolve(self, indices: list[int], epoch: int) -> dict[int, Any]:
        """In transformed mode with no step after the caching point, the kept items are
        the finished ones: taken in the loader's process, not handed to a worker and
        back. The rest go to the workers, which count them (hits are counted here)."""
        mode, _, key, seed = self.shared.read()
        if mode != "transformed" or not key or not self.shared.direct():
            return {}
        ds, st = self.ds, self.proc()
        t = st.transformed(ds, key, seed)
        hits = t.counts.hits
        got = t.get([ds.digest.hashes[i].tobytes() for i in indices])
        ds.counters.add(t_hits=t.counts.hits - hits)
        if ds.target is None:
            return {i: v for i, v in zip(indices, got) if v is not None}
        return {i: (v, itemview.target_of(ds.target, ds.entry(i))) for i, v in zip(indices, got) if v is not None}

    def passed(self, token: Any, x: Any) -> None:
        self.proc().putter.add(token, x)

    def idle(self) -> None:
        if self._st is not None and self._st.pid == os.getpid():
            self._st.putter.flush()

    def close(self) -> None:
        if self._st is not None and self._st.pid == os.getpid():
            self._st.close()
            self._st = None
