"""What a remote worker needs to make a job's transformed items: the dataset (its
digest travels as bytes, with the ring's addresses and the job's name), the
pipeline in the order the trainer runs it, where the steps whose outputs are
cached end and their fingerprint. Built by the trainer after the pipeline is
prepared (AutoOrder may reorder it; a changed order is a new version). Metadata
only: no training data travels this way."""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkSpec:
    version: int
    dataset: bytes        # CachedDataset.remote_copy(): digest bytes, ring addresses, job, decode, target, pipeline
    prefix: int           # steps (execution order) the remote worker runs
    fingerprint: str      # key of those steps (clients/derived.py)
    job_seed: int
    key_seed: int | None = None  # the derived key's seed (a kept step that draws random numbers)


def prefix_of(pipeline: Any) -> int:
    """Where the steps whose outputs are cached end: the caching point where the
    pipeline has one (autocache), else the end of the cacheable prefix."""
    point = getattr(pipeline, "caching_point", None)
    return point() if point is not None else pipeline.cacheable_prefix()


def make_spec(ds: Any, pipeline: Any, job_seed: int, version: int, *, key: str | None = None,
              prefix: int | None = None, key_seed: int | None = None) -> WorkSpec | None:
    """The spec of a prepared pipeline; None when it has no cacheable prefix (nothing a
    remote worker could make that the trainer would find) or it cannot be keyed.
    `key`, `prefix`, `key_seed`: what the trainer side keys its transformed items by,
    after how many steps, under which seed (the loader's autocache); by default the
    prefix's own fingerprint, no seed."""
    from preprocess.fingerprint import Uncacheable

    n = prefix_of(pipeline) if prefix is None else prefix
    if n == 0:
        return None
    try:
        fp = pipeline.fingerprint(n) if key is None else key
    except Uncacheable:
        return None
    return WorkSpec(version, ds.remote_copy(pipeline), n, fp, job_seed, key_seed)


def open_dataset(spec: WorkSpec) -> Any:
    """The dataset in a worker process (its connections open on first use)."""
    return pickle.loads(spec.dataset)
