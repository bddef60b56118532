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
batch of `read_batch` items (tf_batches.py) and `.unbatch()` splits it in C++: one Python call
per batch, never per item. A `.prefetch(read_ahead)` of those batches runs the
generator, and so the reads, in a thread of TensorFlow's while the pipeline
works on the batches before: store or cache latency overlaps with the
pipeline's work without a thread of ours to hand batches over from (which cost
more CPU: tools/bench/tfdata); `read_ahead=0` reads in the pipeline's own thread.
`read_parallel=N` reads up to N batches at once in TensorFlow's threads, in the
same order (tf_batches.TicketFeed; off by default: docs/client.md).

Each iteration of the dataset is one epoch of the sampler (a new order, new
stats); `.repeat()` and `model.fit(epochs=...)` start one per pass. One
iteration at a time: an iterator still open when another starts has its epoch
ended, and its next step raises an error that says so (tf_batches.overlapped).
`rank`/`world_size` give each training process its share of every epoch.
`ds.mlcache.state_dict()` saves where an epoch is; `tf_dataset(..., state=)` resumes
it: the first pass is that epoch's rest (the dataset's cardinality, one per dataset,
is then not declared), the later ones whole epochs. Batches read ahead of the training
loop count as taken: a state saved so records it and warns (InexactStateWarning), as
its resume does (docs/client.md).

With `map_fn=` (a function of TF ops) the items go through our preprocessing
workers instead and the dataset yields the function's outputs (tf_transform.py).
"""
from __future__ import annotations

import numbers
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .dataset import CachedDataset
from .digest import Digest
from .epochs import EpochLog, EpochRun, make_sampler
from .sampler import SubstitutableBatchSampler
from . import tf_transform
from .tf_batches import Feed, Starter, TicketFeed, batches_dataset, ticket_batches_dataset

if TYPE_CHECKING:
    import tensorflow as tf

READ_BATCH = 64  # items per Python call (and per sampler batch)
READ_AHEAD = 4  # batches read ahead of the one the pipeline is taking (a prefetch of batches)
READ_PARALLEL = 1  # batches read at once (TicketFeed from 2); 2 cost more CPU and time here (docs/benchmarks.md)


class InexactStateWarning(UserWarning):
    """A state saved mid-epoch by a tf_dataset that reads ahead of the training loop: what it
    read ahead counts as taken, so a resume from it leaves those items out of that epoch."""


class TFSource(EpochLog):
    """What `tf_dataset` returns as `ds.mlcache`: the CachedDataset, the sampler, and the
    epoch log (`epoch_stats`, `batch_times`, callbacks), as on the PyTorch loader."""

    def __init__(self, cached: CachedDataset, sampler: SubstitutableBatchSampler, read_ahead: int,
                 engine: Any = None, read_parallel: int = 1, resumed: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.cached = cached
        self.sampler = sampler
        self.read_ahead = max(0, read_ahead)
        self.read_parallel = max(1, read_parallel)
        self.preprocess = engine  # a preprocess.Scheduler running map_fn in its workers, or None
        self.autocache: Any = None  # clients.autocache.Autocache in a mode other than source (transform or map_fn)
        self.declared: int | None = None  # the items per pass the dataset asserts (its cardinality), if any
        self.feed = Feed(self.epoch)  # the epochs of the dataset's iterations (tf_batches.py)
        self.tickets = TicketFeed(lambda: _EpochReads(self))  # the same, read_parallel batches at once
        self.starter = Starter(self.epoch)  # from_generator's (map_fn=, autocache modes): the same epochs
        self._warned = False  # InexactStateWarning given at a save (once: states are saved often)
        self._resumed_ahead = _ahead_of(resumed)  # the loaded state's "reads_ahead", while its epoch waits
        self.attach_coordinator(cached, sampler)

    def epoch(self) -> Iterator[Any]:
        """One epoch: numpy object arrays of item bytes, one per sampler batch (with a
        map_fn: the function's outputs). An epoch that stops early (abandoned, or a read
        failed) is recorded with complete=False."""
        self.check_pass()
        run = EpochRun(self.cached, self.sampler, self)
        complete = False
        try:
            yield from (self._batches(run) if self.preprocess is None else self._mapped(run))
            complete = True
        finally:
            run.finish(complete, self.preprocess.last_stats if self.preprocess is not None else None,
                       self.autocache)

    def _mapped(self, run: EpochRun) -> Iterator[Any]:
        """Batches of map_fn's outputs as the workers finish them (or single outputs,
        where they cannot be stacked); the sampler learns which items each one held."""
        stacked = tf_transform.stackable(tf_transform.tf_map_step(self.preprocess).element_spec)
        for indices, out in tf_transform.batches(self.preprocess, self.sampler, self.autocache):
            run.batch(indices)
            if not indices:  # every item of it was skipped (on_error="skip"): nothing to hand over
                continue
            if stacked:
                yield out
            else:
                yield from out

    def _batches(self, run: EpochRun) -> Iterator[np.ndarray]:
        """One sampler batch per call, read here, in TensorFlow's thread: a prefetch of
        `read_ahead` batches (tf_dataset) runs this in a thread of TensorFlow's, so the
        reads overlap with the pipeline's own work without a thread of ours (no hand-off)."""
        for batch in self.sampler:
            items = self.read(batch)
            run.batch()
            yield items

    def read(self, batch: list[int]) -> np.ndarray:
        """A batch's items as a numpy object array (converted to a tf.string tensor in C++)."""
        items = self.cached.__getitems__(batch)
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out

    def state_dict(self) -> dict[str, Any]:
        """Where training is (the PyTorch loader's format): the epoch in progress and the
        items of the batches already handed over; resume with tf_dataset(..., state=).
        A dataset that reads ahead of its consumer counts what it read ahead as handed over:
        its state says so ("reads_ahead"), and a mid-epoch one warns (InexactStateWarning)."""
        state: dict[str, Any] = {"sampler": self.sampler.state_dict()}
        # a loaded state whose epoch has not started yet is saved as it was loaded, no more exact
        pending = self.sampler.progress.resumed(self.sampler.epoch)[0]
        ahead = self._resumed_ahead if pending else self.reads_ahead()
        if ahead is not None:
            state["reads_ahead"] = ahead
            if state["sampler"]["items_delivered"] and not self._warned:
                self._warned = True
                st = state["sampler"]
                warnings.warn(inexact_message("this state is saved", st["items_delivered"], st["epoch"], ahead),
                              InexactStateWarning, stacklevel=2)
        return state

    def reads_ahead(self) -> dict[str, int] | None:
        """What reads ahead of this dataset's consumer, None if nothing: read_ahead (a prefetch
        of batches; on the other paths tf.data's injected prefetch, which read_ahead=0 turns
        off) and read_parallel (parallel reads, on the plain path only: _elements)."""
        parallel = self.read_parallel if self.preprocess is None and self.autocache is None else 1
        if not self.read_ahead and parallel == 1:
            return None
        return {"read_ahead": self.read_ahead, "read_parallel": parallel}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a state that starts an epoch whole (one saved at an epoch's end); one saved
        mid-epoch is a ValueError unless this dataset declares no cardinality (check_pass):
        pass it to tf_dataset(..., state=) instead. The sampler is left as it was then."""
        before = self.sampler.state_dict()
        self.sampler.load_state_dict(sampler_state(state))
        try:
            self.check_pass()
            _warn_if_inexact(state, self.sampler)  # a mid-epoch state loads where none is declared
        except ValueError:
            self.sampler.load_state_dict(before)
            raise
        self._resumed_ahead = _ahead_of(state)

    def check_pass(self) -> None:
        """At a pass's start: a dataset that asserts whole epochs (`declared`, its cardinality,
        fixed when it was made) cannot run the rest of a resumed one. Refused here, before
        anything is read, rather than by TensorFlow's check at the pass's end, after the
        training loop took the rest (the state stays loaded: a new tf_dataset can take it)."""
        done = self.sampler.progress.resumed(self.sampler.epoch)[0]
        if self.declared is None or not done:
            return
        raise ValueError(f"this tf_dataset declares {self.declared} items per pass (ds.cardinality(), fixed "
                         f"when it was made), but the sampler state loaded into it resumes epoch "
                         f"{self.sampler.epoch} after {done} items: pass the state when making the dataset, "
                         f"tf_dataset(..., state=state), whose first pass is that epoch's rest")

    def close(self) -> None:
        """Ends an iteration left open and releases the cache client and workers; the
        dataset cannot be iterated again (TensorFlow keeps its feeds, which let go of this)."""
        self.feed.close()
        self.tickets.close()
        self.starter.close()
        if self.preprocess is not None:  # stops the preprocessing workers
            self.preprocess.close()
        if self.autocache is not None:
            self.autocache.close()
        self.cached.close()


class _EpochReads:
    """One epoch of a TFSource's batches as TicketFeed drives it (tf_batches.EpochReads):
    the sampler plans in order, reads run in several of TensorFlow's threads at once."""

    def __init__(self, source: TFSource) -> None:
        source.check_pass()
        self.source = source
        self.run = EpochRun(source.cached, source.sampler, source)
        self.batches = iter(source.sampler)

    def plan(self) -> list[int] | None:
        return next(self.batches, None)

    def read(self, batch: list[int]) -> np.ndarray:
        return self.source.read(batch)

    def delivered(self) -> None:
        self.run.batch()

    def finish(self, complete: bool) -> None:
        self.run.finish(complete, None, self.source.autocache)


def tf_dataset(digest: str | os.PathLike | Digest, cache: str | None | bool = None,
               manager: str | None = None, job: str | None = None, seed: int = 0, *,
               read_batch: int = READ_BATCH, read_ahead: int = READ_AHEAD, read_parallel: int = READ_PARALLEL,
               lookahead: int = 10, substitute: bool = True, miss_seed: int | None = None,
               map_fn: Callable[[Any], Any] | None = None, num_workers: int | None = None,
               rank: int | None = None, world_size: int | None = None,
               transform: Any = None, autocache: str = "source", epochs: int | None = None,
               state: dict[str, Any] | None = None, **dataset_kwargs: Any) -> "tf.data.Dataset":
    """A tf.data.Dataset of tf.string items, one per digest entry, read through the cache.

    `transform` (a function of a tf.data.Dataset of items returning one element per
    item, e.g. `lambda ds: ds.map(parse)`) is applied to it; with `autocache` other than
    "source" ("transformed", "compute", "auto"; docs/preprocess.md) its outputs may be
    kept in the cache instead of being made again each epoch (clients/tf_autocache.py).

    `cache`, `manager`, `job` and the keyword arguments (`storage_options`, `cache_dir`,
    `capacity`, `verify_hash`, `insert`, `fetch_threads`, `claims`, ...) are
    CachedDataset's; `seed`, `lookahead`, `substitute` and `miss_seed` are its loader's.
    Items are read `read_batch` per Python call, `read_ahead` batches ahead of the pipeline,
    `read_parallel` batches at once (TicketFeed, tf_batches.py; docs/client.md says when it pays).
    `map_fn` (a function of TF ops on one item, or a preprocess.tf_map.TFMap) runs in
    `num_workers` preprocessing worker processes (None: adaptive, 0: in this process);
    the dataset then yields its outputs (`on_error`, `cost_dir`, `task_items`, `exactly_once`,
    `step_warning`, `step_timeout` are the scheduler's, docs/preprocess.md); `autocache` then decides
    whether the outputs are kept, as for the PyTorch loader's transform. `rank`/`world_size` give this
    process its share of every epoch, as DistributedSampler (with tf.distribute:
    `input_context.input_pipeline_id` and `num_input_pipelines`).
    `state` (ds.mlcache.state_dict()): the first pass is its epoch's rest. `ds.mlcache`: epoch_stats, close()."""
    import tensorflow as tf

    options = _check_arguments(read_batch, read_ahead, read_parallel, rank, world_size, map_fn, num_workers,
                               dataset_kwargs)
    _check_modes(autocache, transform, map_fn)
    # samples=False: one element per digest entry, tar members too (no WebDataset grouping)
    cached = CachedDataset(digest, cache, manager, job, samples=False, **dataset_kwargs)
    engine = ac = None
    try:
        sampler = make_sampler(cached, read_batch, seed=seed, lookahead=lookahead, substitute=substitute,
                               miss_seed=miss_seed, rank=rank or 0, world_size=1 if world_size is None else world_size)
        if state is not None:  # before the dataset is made: its cardinality depends on it (_declared)
            _resume(sampler, state)
        if map_fn is not None:  # autocache keeps map_fn's outputs, as the PyTorch loader its transform's
            engine, ac = tf_transform.make_engine(cached, map_fn, num_workers, seed, options, autocache, epochs)
            if ac is not None and substitute:  # the look-ahead finds what this mode reads as hits
                sampler.lookup = ac.lookup_codes
        source = TFSource(cached, sampler, read_ahead, engine, read_parallel, state)
        source.autocache, source.declared = ac, _declared(sampler, options)
    except BaseException:
        if engine is not None:
            engine.close()
        if ac is not None:
            ac.close()
        cached.close()
        raise
    try:
        ds = _keep_share(source, _elements(source, engine, options, transform, autocache, epochs))
    except BaseException:
        source.close()
        raise
    return _handed_out(ds, source)


def _handed_out(ds: "tf.data.Dataset", source: TFSource) -> "tf.data.Dataset":
    """ds with its source as `ds.mlcache`, closed once ds is collected: TensorFlow keeps the
    feeds, and so the source (cache client, threads, preprocessing workers), for the life of
    the process. Not a dataset made while tracing (in a tf.function, a dataset's function):
    the traced graph runs it after its Python object is gone."""
    import tensorflow as tf

    ds.mlcache = source
    if tf.executing_eagerly():
        weakref.finalize(ds, source.close)
    return ds


def _check_arguments(read_batch: int, read_ahead: int, read_parallel: int, rank: int | None,
                     world_size: int | None, map_fn: Any, num_workers: int | None,
                     dataset_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Refuse what tf_dataset cannot do, naming what to do instead; take the scheduler's
    options out of dataset_kwargs (returned)."""
    for name, value, least in (("read_batch", read_batch, 1), ("read_ahead", read_ahead, 0),
                               ("read_parallel", read_parallel, 1)):
        if not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if (rank is None) != (world_size is None):
        raise ValueError(f"pass rank= and world_size= together (got rank={rank}, world_size={world_size})")
    for name in ("decode", "target", "samples"):
        if name in dataset_kwargs:
            raise TypeError(f"tf_dataset does not take {name}=: it yields each digest entry's bytes; "
                            f"decode in a .map() of the dataset, or pass map_fn= to run it in our workers")
    if "drop_last" in dataset_kwargs:  # else CachedDataset's TypeError, which says nothing of what to do
        raise TypeError("tf_dataset does not take drop_last=: every pass yields each item once, the last "
                        "read_batch partial; drop a short last batch in your pipeline, .batch(n, drop_remainder=True)")
    options = {k: dataset_kwargs.pop(k) for k in tf_transform.SCHEDULER_OPTIONS if k in dataset_kwargs}
    if map_fn is None and (options or num_workers is not None):
        named = [*options, *(["num_workers"] if num_workers is not None else [])]
        raise ValueError(f"{', '.join(named)}: options of the preprocessing workers, which run only with a map_fn=")
    return options


def _check_modes(autocache: str, transform: Any, map_fn: Any) -> None:
    if autocache != "source" and transform is None and map_fn is None:
        raise ValueError(f"autocache={autocache!r}: caching modes other than 'source' need a transform= "
                         f"or a map_fn=")
    if transform is not None and map_fn is not None:
        raise ValueError("pass transform= (a chain of the dataset) or map_fn= (run in our workers), not both")


def _elements(source: TFSource, engine: Any, options: dict[str, Any], transform: Any, autocache: str,
              epochs: int | None) -> "tf.data.Dataset":
    """The items (a map_fn's outputs with an engine), transformed by `transform` where given:
    in TensorFlow, or in autocache's generator in its other modes (clients/tf_autocache.py)."""
    import tensorflow as tf

    if autocache != "source" and engine is None:
        from .tf_autocache import transformed_dataset

        # a function of one item passed as transform= fails inside the chain: say so, as in source mode
        ds = transformed_dataset(source, lambda d: apply_chain(transform, d), autocache, epochs)
        return _no_read_ahead(source, ds)
    if engine is None:
        batches = (batches_dataset(source.feed) if source.read_parallel == 1
                   else ticket_batches_dataset(source.tickets, source.read_parallel))
        if source.read_ahead:  # reads in a thread of TensorFlow's, read_ahead batches ahead
            batches = batches.prefetch(source.read_ahead)
        ds = batches.unbatch()
    else:
        ds = tf_transform.element_dataset(source.starter, tf_transform.tf_map_step(engine).element_spec)
    ds = _no_read_ahead(source, ds)  # before the user's transform: options it sets win
    if source.declared is not None:
        ds = ds.apply(tf.data.experimental.assert_cardinality(source.declared))
    return ds if transform is None else apply_chain(transform, ds)


def _no_read_ahead(source: TFSource, ds: "tf.data.Dataset") -> "tf.data.Dataset":
    """read_ahead=0 reads nothing ahead of the pipeline: tf.data's own optimization would
    otherwise inject a prefetch that reads the next batch in its thread, and a state_dict()
    saved between batches counted it (its items lost on resume)."""
    import tensorflow as tf

    if source.read_ahead:
        return ds
    opts = tf.data.Options()
    opts.experimental_optimization.inject_prefetch = False
    return ds.with_options(opts)


def sampler_state(state: Any) -> dict[str, Any]:
    """The sampler's part of a state_dict() (TFSource's or the PyTorch loader's, alike)."""
    if not isinstance(state, dict) or not isinstance(state.get("sampler"), dict):
        what = f"a dict with keys {sorted(map(str, state))}" if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"a tf_dataset resumes from what ds.mlcache.state_dict() (or a loader's state_dict()) "
                         f"returned (a dict with 'sampler'), got {what}")
    return state["sampler"]


def _resume(sampler: SubstitutableBatchSampler, state: Any) -> None:
    sampler.load_state_dict(sampler_state(state))
    _warn_if_inexact(state, sampler, 4)


def _ahead_of(state: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if state is None else state.get("reads_ahead")


def _warn_if_inexact(state: dict[str, Any], sampler: SubstitutableBatchSampler, stacklevel: int = 3) -> None:
    """Resuming mid-epoch from a state saved while reading ahead (TFSource.state_dict): say
    that the items read ahead are left out, rather than lose them silently. A warning, not an
    error: after a crash, an epoch short of a few batches beats no resume."""
    ahead, done = state.get("reads_ahead"), sampler.progress.resumed(sampler.epoch)[0]
    if ahead is None or not done:
        return
    if not (isinstance(ahead, dict) and all(isinstance(ahead.get(k), numbers.Integral)
                                            for k in ("read_ahead", "read_parallel"))):
        raise ValueError(f"the state's 'reads_ahead' must be a dict of integers 'read_ahead' and "
                         f"'read_parallel' (as ds.mlcache.state_dict() saves it), got {ahead!r}")
    warnings.warn(inexact_message("this resumed epoch was saved", done, sampler.epoch, ahead), InexactStateWarning,
                  stacklevel=stacklevel)


def inexact_message(what: str, items: int, epoch: int, ahead: dict[str, Any]) -> str:
    """InexactStateWarning's text for a state saved `items` into `epoch` reading `ahead`."""
    return (f"{what} {items} items into epoch {epoch} by a tf_dataset that reads ahead "
            f"of the training loop (read_ahead={ahead['read_ahead']}, read_parallel={ahead['read_parallel']}): "
            f"the items read ahead but not yet taken (a few batches of read_batch) count as taken, and a resume "
            f"leaves them out of that epoch. For a state with no item left out save it with read_ahead=0, "
            f"read_parallel=1, nothing after tf_dataset reading ahead (prefetch, a parallel map), at a multiple "
            f"of read_batch items (docs/client.md, Resume)")


def _declared(sampler: SubstitutableBatchSampler, options: dict[str, Any]) -> int | None:
    """The items every pass yields, which the dataset asserts (its cardinality, for Keras'
    progress and as a check that none was left out); None where passes differ."""
    if options.get("on_error", "raise") != "raise" or not options.get("exactly_once", True):
        return None  # items may be left out
    if sampler.progress.resumed(sampler.epoch)[0]:
        return None  # the first pass is a resumed epoch's rest, the later ones whole epochs
    return sampler.share.size


def _keep_share(source: TFSource, ds: "tf.data.Dataset") -> "tf.data.Dataset":
    """With world_size > 1 the dataset is already this rank's share: tf.distribute's
    auto-sharding (experimental_distribute_dataset, Keras fit under
    MultiWorkerMirroredStrategy) finds no files and would shard it again by element,
    each worker keeping 1/world_size of its share. Turn it off."""
    import tensorflow as tf

    if source.sampler.share.world == 1:
        return ds
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.with_options(opts)


def apply_chain(transform: Any, ds: "tf.data.Dataset") -> "tf.data.Dataset":
    """transform(ds), or a TypeError that says what transform= is (not map_fn=)."""
    try:
        return transform(ds)
    except (TypeError, ValueError) as e:
        raise TypeError(f"transform= is a function of a tf.data.Dataset of items (lambda ds: ds.map(parse)); "
                        f"calling it on the dataset failed ({type(e).__name__}: {str(e)[:200]}). For a function "
                        f"of one item, pass map_fn= (run in our workers) or .map() the dataset") from None
