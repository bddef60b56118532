"""What the scheduler needs to know of a dataset's items, duck-typed on CachedDataset:
an item's content digest (seeds, the cost memory), its place (error messages) and
whether reads yield (sample, target) pairs (the pipeline then transforms the sample
and the target passes through, as torchvision's transform and target_transform)."""
from __future__ import annotations

import hashlib
from typing import Any


def item_digest(ds: Any, i: int) -> bytes:
    """SHA-256 of dataset index i's content. A WebDataset sample's covers all its members:
    its first member alone (often a class label, the same in many samples) gave samples
    of other content one seed, and so the same draws."""
    samples = getattr(ds, "samples", None)
    if samples is None:
        return ds.digest.hashes[i].tobytes()
    members = samples.flatten([i])
    if len(members) == 1:
        return ds.digest.hashes[members[0]].tobytes()
    h = hashlib.sha256(b"mlcache-sample/1")
    for m in members:
        h.update(ds.digest.hashes[m].tobytes())
    return h.digest()


def describe(ds: Any, i: int) -> str:
    entry = getattr(ds, "entry", None)
    if entry is not None:
        e = entry(i)
        return f"{e.path} @ {e.offset}+{e.length}"
    path, offset, length = ds.digest.location(i)
    return f"{path} @ {offset}+{length}"


def pairs(ds: Any) -> bool:
    return getattr(ds, "target", None) is not None
