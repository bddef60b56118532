"""What the scheduler needs to know of a dataset's items, duck-typed on CachedDataset:
an item's content digest (seeds, the cost memory), its place (error messages) and
whether reads yield (sample, target) pairs (the pipeline then transforms the sample
and the target passes through, as torchvision's transform and target_transform)."""
from __future__ import annotations

from typing import Any


def item_digest(ds: Any, i: int) -> bytes:
    """SHA-256 of dataset index i's content (a WebDataset sample's: its first member's)."""
    samples = getattr(ds, "samples", None)
    j = samples.first_member(i) if samples is not None else i
    return ds.digest.hashes[j].tobytes()


def describe(ds: Any, i: int) -> str:
    entry = getattr(ds, "entry", None)
    if entry is not None:
        e = entry(i)
        return f"{e.path} @ {e.offset}+{e.length}"
    path, offset, length = ds.digest.location(i)
    return f"{path} @ {offset}+{length}"


def pairs(ds: Any) -> bool:
    return getattr(ds, "target", None) is not None
