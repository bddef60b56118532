"""What a remote worker needs to make a job's transformed items: the dataset (its
digest travels as bytes, with the ring's addresses and the job's name), the
pipeline in the order the trainer runs it, where the steps whose outputs are
cached end and the key their outputs go under (default_key). Built by the trainer
after the pipeline is prepared (AutoOrder may reorder it; a changed order is a new
version). Metadata only: no training data travels this way."""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from ..stall import STEP_WARNING_S, check_limits


@dataclass(frozen=True)
class WorkSpec:
    version: int
    dataset: bytes        # CachedDataset.remote_copy(): digest bytes, ring addresses, job, decode, target, pipeline
    prefix: int           # steps (execution order) the remote worker runs
    fingerprint: str      # what their outputs are keyed by (clients/derived.py): the trainer's key, or default_key
    job_seed: int
    key_seed: int | None = None  # the derived key's seed (a kept step that draws random numbers)
    step_warning: float | None = STEP_WARNING_S  # a step stuck on an item this long is logged (stall.py)
    step_timeout: float | None = None  # ... this long: the worker ends itself, the trainer makes its items


def prefix_of(pipeline: Any) -> int:
    """Where the steps whose outputs are cached end: the caching point where the
    pipeline has one (autocache), else the end of the cacheable prefix."""
    point = getattr(pipeline, "caching_point", None)
    return point() if point is not None else pipeline.cacheable_prefix()


def make_spec(ds: Any, pipeline: Any, job_seed: int, version: int, *, key: str | None = None,
              prefix: int | None = None, key_seed: int | None = None, step_warning: float | None = STEP_WARNING_S,
              step_timeout: float | None = None) -> WorkSpec:
    """The spec of a prepared pipeline. `key`, `prefix`, `key_seed`: what the trainer side
    keys its transformed items by, after how many steps, under which seed (the loader's
    autocache). Without `key` both are derived as the loader's autocache derives them
    (default_key). Raises Uncacheable naming why there is nothing a remote worker could
    make that the trainer would find: no cacheable prefix, or outputs that cannot be keyed.
    `step_warning`, `step_timeout`: what the workers do about a step stuck on an item (stall.py)."""
    from preprocess.fingerprint import Uncacheable

    check_limits(step_warning, step_timeout)
    n = prefix_of(pipeline) if prefix is None else prefix
    if n == 0:
        raise Uncacheable("the pipeline has no cacheable prefix (its first step is random)")
    if key is None:
        if key_seed is not None:
            raise ValueError("key_seed= is the seed of a given key=; without key= the key and its seed are "
                             "derived from the dataset, the pipeline and the job's seed")
        key, key_seed = default_key(ds, pipeline, n, job_seed)
    elif not key:
        raise Uncacheable("the trainer keys no transformed items (its autocache keeps none)")
    return WorkSpec(version, ds.remote_copy(pipeline), n, key, job_seed, key_seed, step_warning, step_timeout)


def default_key(ds: Any, pipeline: Any, n: int, job_seed: int) -> tuple[str, int | None]:
    """(key, seed) of the outputs of the pipeline's first n steps when start() is given no
    key: the loader's autocache key (clients/autocache.transform_key), so the two find each
    other's items. With each item's content key it must tell apart whatever makes the
    outputs differ: the steps, and the dataset's decode that makes their input (the same
    files decoded otherwise give other outputs); where the steps draw random numbers
    (seeded alike every epoch), the job's seed too. Neither the dataset's name nor the job
    is in it: the same content through the same decode and steps gives the same outputs,
    shared by every job that makes them. Raises Uncacheable where an output is not a
    function of the item's content (WebDataset samples, a decode given the entry)."""
    from clients.autocache import transform_key
    from preprocess.fingerprint import Uncacheable

    seed = job_seed if pipeline.seeded(n) else None
    if seed is not None and not -(1 << 63) <= seed < (1 << 63):
        raise Uncacheable(f"the job's seed {seed} does not fit in 64 bits (the transformed items' keys hold it)")
    return transform_key(ds, pipeline, n, seed), seed


def open_dataset(spec: WorkSpec) -> Any:
    """The dataset in a worker process (its connections open on first use)."""
    return pickle.loads(spec.dataset)
