"""The tf.data front end of CachedDataset: `tf_dataset(digest, ...)`.

    from clients import tf_dataset

    ds = tf_dataset("train.dig", cache="10.0.0.1:7070", seed=0)   # tf.string items
    train = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE).batch(64).prefetch(2)
    model.fit(train, epochs=10)
    print(ds.mlcache.epoch_stats[-1].line())

A second front end over the same parts as the PyTorch loader: the sampler
(substitutable hits, co-operative misses, every item exactly once per epoch;
epochs.make_sampler) picks each batch of indices, and CachedDataset's batched
read path (`__getitems__`: get, decrypt, verify, claim and read misses from the
store, insert) reads it. A Python generator yields one tf.string tensor per
batch of `read_batch` items and `.unbatch()` splits it in C++: one Python call
per batch, never per item. While TensorFlow consumes a batch, a reader thread
is already reading the next ones (`read_ahead` batches), so store or cache
latency overlaps with the pipeline's own work; `read_ahead=0` reads in
TensorFlow's thread instead (no hand-off between threads).

Each iteration of the dataset is one epoch of the sampler (a new order, new
stats); `.repeat()` and `model.fit(epochs=...)` start one per pass. One
iteration at a time: two interleaved iterators would share one sampler.
"""
from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from .dataset import CachedDataset
from .digest import Digest
from .epochs import EpochLog, EpochRun, make_sampler
from .sampler import SubstitutableBatchSampler

if TYPE_CHECKING:
    import tensorflow as tf

READ_BATCH = 64  # items per Python call (and per sampler batch)
READ_AHEAD = 4  # batches read ahead of the one TensorFlow is taking


class TFSource(EpochLog):
    """What `tf_dataset` returns as `ds.mlcache`: the CachedDataset, the sampler, and the
    epoch log (`epoch_stats`, `batch_times`, callbacks), as on the PyTorch loader."""

    def __init__(self, cached: CachedDataset, sampler: SubstitutableBatchSampler, read_ahead: int) -> None:
        super().__init__()
        self.cached = cached
        self.sampler = sampler
        self.read_ahead = max(0, read_ahead)
        self._pool: ThreadPoolExecutor | None = None
        self.attach_coordinator(cached)

    def epoch(self) -> Iterator[np.ndarray]:
        """One epoch: numpy object arrays of item bytes, one per sampler batch. An epoch
        that stops early (abandoned, or a read failed) is recorded with complete=False."""
        run = EpochRun(self.cached, self.sampler, self)
        complete = False
        try:
            yield from self._batches(run)
            complete = True
        finally:
            run.finish(complete)

    def _batches(self, run: EpochRun) -> Iterator[np.ndarray]:
        if not self.read_ahead:  # read in TensorFlow's thread: no hand-off between threads
            for batch in self.sampler:
                yield self._handed_over(run, self.cached.__getitems__(batch))
            return
        pending: deque[Future] = deque()
        read = self._reader().submit
        try:
            for batch in self.sampler:
                pending.append(read(self.cached.__getitems__, batch))
                if len(pending) > self.read_ahead:
                    yield self._handed_over(run, pending.popleft().result())
            while pending:
                yield self._handed_over(run, pending.popleft().result())
        finally:  # its reads end before another epoch starts
            for f in pending:
                f.cancel()
            wait(pending)

    @staticmethod
    def _handed_over(run: EpochRun, items: list[bytes]) -> np.ndarray:
        """A batch for TensorFlow: an object array converts to a tf.string tensor in C++."""
        run.batch()
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out

    def _reader(self) -> ThreadPoolExecutor:
        # One thread: reads stay in the sampler's order (the sampler looks up what the
        # reads before it inserted); the read path spreads its own work over threads.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mlcache-tf-read")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.cached.close()


def tf_dataset(digest: str | os.PathLike | Digest, cache: str | None | bool = None,
               manager: str | None = None, job: str | None = None, seed: int = 0, *,
               read_batch: int = READ_BATCH, read_ahead: int = READ_AHEAD, lookahead: int = 10,
               substitute: bool = True, miss_seed: int | None = None, **dataset_kwargs: Any) -> "tf.data.Dataset":
    """A tf.data.Dataset of tf.string items, one per digest entry, read through the cache.

    `cache`, `manager`, `job` and the keyword arguments (`storage_options`, `cache_dir`,
    `capacity`, `verify_hash`, `insert`, `fetch_threads`, `claims`, ...) are
    CachedDataset's; `seed`, `lookahead`, `substitute` and `miss_seed` are its loader's.
    The dataset's `mlcache` attribute (a TFSource) holds `epoch_stats` and `close()`."""
    import tensorflow as tf

    if read_batch < 1:
        raise ValueError(f"read_batch must be >= 1, got {read_batch}")
    for name in ("decode", "target", "samples"):
        if name in dataset_kwargs:
            raise TypeError(f"tf_dataset does not take {name}=: it yields each digest entry's bytes; "
                            f"decode in a .map() of the dataset")
    # samples=False: one element per digest entry, tar members too (no WebDataset grouping)
    cached = CachedDataset(digest, cache, manager, job, samples=False, **dataset_kwargs)
    try:
        sampler = make_sampler(cached, read_batch, seed=seed, lookahead=lookahead, substitute=substitute,
                               miss_seed=miss_seed)
        source = TFSource(cached, sampler, read_ahead)
    except BaseException:
        cached.close()
        raise
    batches = tf.data.Dataset.from_generator(source.epoch, output_signature=tf.TensorSpec([None], tf.string))
    ds = batches.unbatch().apply(tf.data.experimental.assert_cardinality(len(cached)))
    ds.mlcache = source
    return ds

