"""What `CachedDataset` yields per index: the item (or sample), its metadata as an
`Entry`, its target, and how `decode` is called (with or without the entry)."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

from .digest import Digest

CLASS = "class"  # target="class": the target the digest records (tools/digest --targets)


class Entry(NamedTuple):
    """An item's (or WebDataset sample's) metadata, for `decode(data, entry)` and `target=`."""

    index: int  # the dataset index
    path: str  # file (shard) relative to the digest's root
    offset: int  # of the item's data in that file (a sample's first member)
    length: int  # bytes (a sample's: all its members')
    name: str | None  # tar member name; a sample's key; None for files and records
    target: int | None  # what the digest records (tools/digest --targets), else None
    class_name: str | None  # the class that target names, when the digest names classes


def takes_entry(decode: Callable[..., Any]) -> bool:
    """Whether decode asks for the entry: a second positional parameter without a default
    (or named `entry`), or *args. `def decode(data, size=224)` keeps its size."""
    try:
        params = inspect.signature(decode).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: decode(data)
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2:
        second = positional[1]
        return second.default is second.empty or second.name == "entry"
    return any(p.kind is p.VAR_POSITIONAL for p in params)


def check_target(target: Any, digest: Digest, source: str) -> None:
    """target= is None, 'class' (the digest must record targets) or a callable(entry)."""
    if target is None or callable(target):
        return
    if target != CLASS:
        raise ValueError(f"target={target!r}: expected 'class' (the digest's targets) or a "
                         "function of the item's Entry")
    if digest.targets is None:
        raise ValueError(f"target='class': the digest {source} records no targets; make it with "
                         "tools/digest SRC -o FILE --targets dir (ImageFolder classes) or --targets LABELS")


def entry(digest: Digest, index: int, items: list[int], name: str | None = None) -> Entry:
    """The Entry of dataset index `index` made of digest items `items` (one, or a sample's)."""
    path, offset, _ = digest.location(items[0])
    length = sum(digest.size(i) for i in items)
    if name is None and digest.has_names:
        name = digest.name(items[0])
    t = None if digest.targets is None else int(digest.targets[items[0]])
    return Entry(index, path, offset, length, name, t, None if t is None else digest.class_name(t))


def target_of(target: Any, e: Entry) -> Any:
    return e.target if target == CLASS else target(e)
