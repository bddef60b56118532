"""Striped chunk plan: which items of a dataset's digest belong to which chunk.

The digest order (item indices ``0..n-1``) is cut into ``k`` contiguous
*partitions*; each partition is cut into ``k`` contiguous *stripe units*;
chunk ``c`` is stripe unit ``c`` of every partition (Quiver section 5.1). So a
chunk holds a slice from every region of the digest: a uniform sample even when
the dataset is stored sorted (e.g. LibriSpeech by utterance length), while each
stripe unit is itself contiguous, so a mini-batch drawn from one unit still has
homogeneous lengths.

Uneven sizes. With ``n = q*k*k + r`` every (partition, unit) cell holds ``q`` or
``q+1`` items. The ``r`` extra items go to cells walked diagonal by diagonal
(diagonal ``d`` = cells whose unit index is ``(partition + d) mod k``); every
diagonal meets each partition once and each chunk once, so:

* partitions are the standard balanced split (sizes differ by at most 1), and
* chunk sizes differ by at most 1 overall -- better than the naive
  ``floor(L*c/k)`` split per partition, where the spare items of every
  partition land in the same units and chunk sizes can differ by up to ``k``.

All maps are O(1) arithmetic (no per-item tables), so a client can compute its
chunk from ``(n, k)`` alone and every process agrees without exchanging lists.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterator


def num_chunks(dataset_bytes: int, chunk_bytes: int, n_items: int | None = None) -> int:
    """``k = ceil(dataset_bytes / chunk_bytes)``, at least 1 and at most ``n_items``
    (more chunks than items would only create empty chunks).

    ``chunk_bytes <= 0`` or ``chunk_bytes >= dataset_bytes`` means one chunk (FULL)."""
    if dataset_bytes < 0:
        raise ValueError(f"dataset_bytes must be >= 0, got {dataset_bytes}")
    if chunk_bytes <= 0 or chunk_bytes >= dataset_bytes:
        k = 1
    else:
        k = -(-dataset_bytes // chunk_bytes)
    if n_items is not None:
        k = max(1, min(k, n_items))
    return k


def _check(n: int, k: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")


def partition_bounds(p: int, n: int, k: int) -> tuple[int, int]:
    """Half-open item range of partition ``p`` (balanced: the first ``n % k``
    partitions hold one item more)."""
    _check(n, k)
    if not 0 <= p < k:
        raise ValueError(f"partition {p} out of range for k={k}")
    base, rem = divmod(n, k)
    start = p * base + min(p, rem)
    return start, start + base + (1 if p < rem else 0)


def _row_extras(p: int, n: int, k: int) -> tuple[int, int]:
    """(q, e): every cell of partition ``p`` holds ``q`` items, plus one for the
    ``e`` cells whose unit index lies in the cyclic interval ``[p, p+e)``."""
    K = k * k
    q, r = divmod(n, K)
    full, part = divmod(r, k)
    return q, full + (1 if p < part else 0)


def _in_cyclic(c: int, start: int, length: int, k: int) -> bool:
    return (c - start) % k < length


def _count_cyclic_below(c: int, start: int, length: int, k: int) -> int:
    """How many x in [0, c) lie in the cyclic interval [start, start+length) mod k."""
    if length <= 0:
        return 0
    end = start + length
    if end <= k:
        return max(0, min(end, c) - start) if c > start else 0
    # wraps: [start, k) and [0, end-k)
    return (max(0, c - start) if c > start else 0) + min(c, end - k)


def _unit_bounds(p: int, c: int, n: int, k: int) -> tuple[int, int]:
    """Half-open item range of stripe unit ``c`` of partition ``p``."""
    q, e = _row_extras(p, n, k)
    p_start, _ = partition_bounds(p, n, k)
    start = p_start + c * q + _count_cyclic_below(c, p, e, k)
    return start, start + q + (1 if _in_cyclic(c, p, e, k) else 0)


def chunk_of(i: int, n: int, k: int) -> int:
    """Chunk of item ``i`` (0 <= i < n), O(1)."""
    _check(n, k)
    if not 0 <= i < n:
        raise ValueError(f"item {i} out of range for n={n}")
    base, rem = divmod(n, k)
    big = rem * (base + 1)
    p = i // (base + 1) if i < big else rem + (i - big) // base
    off = i - (p * base + min(p, rem))
    q, e = _row_extras(p, n, k)
    # Units of this partition in column order form <= 3 runs of equal size
    # (the extra cells are a cyclic interval); walk the runs.
    end = p + e
    cuts = sorted({0, k, p % k, min(end, k), (end - k) if end > k else 0})
    pos = 0
    for a, b in zip(cuts, cuts[1:]):
        if a == b:
            continue
        size = q + (1 if _in_cyclic(a, p, e, k) else 0)
        span = size * (b - a)
        if off < pos + span:
            return a + (off - pos) // size
        pos += span
    raise AssertionError("unreachable: offset beyond partition")


def chunk_members(c: int, n: int, k: int) -> list[range]:
    """Items of chunk ``c`` as ``k`` contiguous ranges (one per partition,
    possibly empty when ``n < k*k``), in digest order."""
    _check(n, k)
    if not 0 <= c < k:
        raise ValueError(f"chunk {c} out of range for k={k}")
    return [range(*_unit_bounds(p, c, n, k)) for p in range(k)]


def iter_chunk(c: int, n: int, k: int) -> Iterator[int]:
    """Item indices of chunk ``c`` in digest order."""
    for r in chunk_members(c, n, k):
        yield from r


def chunk_len(c: int, n: int, k: int) -> int:
    return sum(len(r) for r in chunk_members(c, n, k))


@dataclass(frozen=True)
class ChunkPlan:
    """What clients and servers need to know about a dataset's chunking.

    ``active``: chunk new jobs read (None before the first chunk is loaded).
    ``loading``: chunk being preloaded (None when none). ``version`` grows on
    every change so a stale plan can be recognised and ignored.
    """

    dataset: str
    n_items: int
    k: int
    active: int | None = None
    loading: int | None = None
    version: int = 0

    def __post_init__(self) -> None:
        _check(self.n_items, self.k)
        for name in ("active", "loading"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.k:
                raise ValueError(f"{name} chunk {v} out of range for k={self.k}")

    def chunk_of(self, i: int) -> int:
        return chunk_of(i, self.n_items, self.k)

    def members(self, c: int) -> list[range]:
        return chunk_members(c, self.n_items, self.k)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChunkPlan":
        return cls(dataset=str(d["dataset"]), n_items=int(d["n_items"]), k=int(d["k"]),
                   active=None if d.get("active") is None else int(d["active"]),
                   loading=None if d.get("loading") is None else int(d["loading"]),
                   version=int(d.get("version", 0)))
