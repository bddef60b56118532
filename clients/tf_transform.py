"""tf_dataset(..., map_fn=parse, num_workers=N): the `.map` runs in our preprocessing workers.

The function (TF ops only) becomes a pipeline step (preprocess/tf_map.py:
traced once, shipped to each worker as a SavedModel, keyed by the chain's
fingerprint) and preprocess.Scheduler runs it per item in its worker
processes, as it runs a PyTorch loader's transform: it consumes the same
sampler (substitutable hits, exactly once per epoch), the workers read the
items through the same CachedDataset, a killed worker is replaced and its items
run again, and batches form as items finish. The training process receives the
function's outputs (numpy) and hands them to TensorFlow a batch per Python call
(stacked per component, then `.unbatch()`); outputs whose shape varies from item
to item cannot be stacked and go one item per call.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

# tf_dataset options passed on to preprocess.Scheduler (docs/preprocess.md)
SCHEDULER_OPTIONS = ("on_error", "cost_dir", "task_items", "exactly_once", "step_warning", "step_timeout")


def make_engine(cached: Any, map_fn: Callable[[Any], Any], num_workers: int | None, seed: int,
                options: dict[str, Any], autocache: str = "source", epochs: int | None = None
                ) -> tuple[Any, Any]:
    """A started preprocess.Scheduler running map_fn (a TFMap, or a function to make one of),
    and its clients.autocache.Autocache (None with autocache="source"), as the PyTorch
    loader makes them (clients/loader.py): the step's outputs are what autocache keeps,
    keyed by the TF function's fingerprint (preprocess/tf_map.py)."""
    from preprocess.pipeline import Pipeline
    from preprocess.scheduler import Scheduler
    from preprocess.steps import step
    from preprocess.tf_map import TFMap

    from .autocache import Autocache

    fn = map_fn if isinstance(map_fn, TFMap) else TFMap(map_fn)
    ac = Autocache(cached, autocache, epochs) if autocache != "source" else None
    engine = Scheduler(cached, Pipeline([step(fn, name=fn.__name__, random=fn.random)]),
                       num_workers=num_workers, job_seed=seed, feed=ac.feed if ac is not None else None,
                       **options)
    try:
        engine.prepare()  # profiles the step on sample items and starts the workers
        if ac is not None:
            ac.prepare(engine)
    except BaseException:
        engine.close()
        if ac is not None:
            ac.close()
        raise
    return engine, ac


def tf_map_step(engine: Any) -> Any:
    return engine.pipeline.steps[0].fn


def stackable(spec: Any) -> bool:
    """Can a batch of these outputs be stacked per component (every shape fully known)?"""
    import tensorflow as tf

    return all(s.shape.is_fully_defined() for s in tf.nest.flatten(spec))


def output_signature(spec: Any) -> Any:
    """What the generator yields: batches of `spec` when stackable, else single items."""
    import tensorflow as tf

    if not stackable(spec):
        return spec
    return tf.nest.map_structure(lambda s: tf.TensorSpec([None, *s.shape], s.dtype), spec)


def batches(engine: Any, sampler: Any, ac: Any = None) -> Iterator[tuple[list[int], Any]]:
    """(indices, outputs) per batch the scheduler forms: outputs stacked per component,
    or (not stackable) a list of single outputs. `ac`: the Autocache, which starts
    each epoch and (auto) decides once enough of the first is measured, or at the end
    of an epoch that ended still measuring."""
    import tensorflow as tf

    spec = tf_map_step(engine).element_spec
    stack = stackable(spec)
    if ac is not None:
        ac.start_epoch(engine)
    for indices, items in engine.epoch(sampler, sampler.epoch, sampler.batch_size):
        if stack and items:
            yield indices, tf.nest.map_structure(lambda *xs: _stack(xs), *items)
        else:
            yield indices, items
        if ac is not None:
            ac.after_batch(engine, sampler.share.size, sampler.batch_size)
    if ac is not None:  # an epoch too short to measure (a resumed one: its rest) decides at its end
        ac.epoch_ended(engine, sampler.share.size, sampler.batch_size)


def _stack(xs: tuple) -> np.ndarray:
    if isinstance(xs[0], bytes):  # a scalar tf.string comes back as bytes
        out = np.empty(len(xs), dtype=object)
        out[:] = xs
        return out
    return np.stack(xs)


def element_dataset(gen: Callable[[], Iterator[Any]], spec: Any) -> "tf.data.Dataset":
    """The dataset of single outputs from the generator of batches (or single items)."""
    import tensorflow as tf

    ds = tf.data.Dataset.from_generator(gen, output_signature=output_signature(spec))
    return ds.unbatch() if stackable(spec) else ds
