"""Benefit-aware shares: how many bytes of the cache each dataset holds for good.

A *share* is a fixed subset of a dataset's items (the first ``share_items`` of
its pinned order, see ``share_members``) that stays cached once read; the rest of
the cache is one LRU of spare entries that every benefiting dataset shares.
With substitutable hits a job reads its dataset's cached items first, so a
share holding a fraction ``f`` of the dataset serves a fraction ``f`` of every
epoch of every job of it from the cache, for as long as it stays.

Value model (GPU-equivalents saved, as in allocation.py). A job's batch time with
a pipelined loader is ``max(t_hit, (1 - f) * t_miss)``, so its speed-up is

    s(f) = min(b, 1 / (1 - f))             b = t_miss / t_hit (measured)

which is *convex* in ``f`` up to ``f* = 1 - 1/b`` and flat after it: a job whose
compute takes a third of its I/O time needs two thirds of its dataset cached
to run at full speed, and nothing more. ``V(S) = sum_i n_i * (s_i(S/N) - 1)``.
Because the curve is convex, spreading a small cache thinly over every dataset
(what one LRU does) wastes it: a few datasets filled to their saturation point
save more. The allocator is an exact knapsack over candidate shares: each
job's saturation point ``(1 - 1/b_i) * N``, the whole dataset, and every
multiple of ``budget / grain``, solved by dynamic programming over the budget
in ``grain`` steps (a few datasets: microseconds to milliseconds).

Hysteresis: the share a dataset holds now counts with ``incumbent_bonus`` extra
value when ranking, so measurement noise does not move bytes back and forth
(each move costs store reads).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .allocation import AllocConfig, DatasetDemand
from .allocation import benefits as _gains


def job_speedup(b: float, f: float) -> float:
    """Speed-up of a job with benefit ``b`` when a fraction ``f`` of its dataset is cached."""
    if b <= 1.0 or f <= 0.0:
        return 1.0
    if f >= 1.0:
        return b
    return min(b, 1.0 / (1.0 - f))


def spare_value(d: DatasetDemand, cfg: AllocConfig = AllocConfig()) -> float:
    """What the shared LRU of spare entries already saves for ``d`` without a share:
    with substitutable hits and co-operative misses its ``J`` concurrent jobs read
    each item from the store about once for all of them (as with chunks), so a job
    runs ~``min(b, J)`` times faster, discounted by ``chunked_efficiency``."""
    nb = _gains(d, cfg)
    return cfg.chunked_efficiency * sum(n * (min(b, len(nb)) - 1.0) for n, b in nb)


def share_value(d: DatasetDemand, share_bytes: int, cfg: AllocConfig = AllocConfig()) -> float:
    """GPU-equivalents a share of ``share_bytes`` saves for dataset ``d`` beyond
    what the shared LRU already gives it (``spare_value``)."""
    if d.size_bytes <= 0 or share_bytes <= 0:
        return 0.0
    f = min(1.0, share_bytes / d.size_bytes)
    total = sum(n * (job_speedup(b, f) - 1.0) for n, b in _gains(d, cfg))
    return max(0.0, total - spare_value(d, cfg))


def _candidates(d: DatasetDemand, budget: int, grain: int, cfg: AllocConfig, whole_only: bool = False) -> list[int]:
    """Shares worth considering for ``d``: the saturation points, the whole
    dataset, and every budget step below them (all capped by size and budget)."""
    top = min(d.size_bytes, budget)
    out = {top}
    if len(d.jobs) > 1 or whole_only:
        # Concurrent jobs already share their reads through the spare LRU; a part
        # of the dataset pinned takes that room and gains little over it: whole only.
        return [top] if top >= d.size_bytes else []
    for _, b in _gains(d, cfg):
        if b > 1.0:
            out.add(min(top, math.ceil((1.0 - 1.0 / b) * d.size_bytes)))
    step = max(1, budget // grain)
    out.update(range(step, top, step))
    return sorted(s for s in out if s > 0)


@dataclass(frozen=True)
class Share:
    dataset: str
    bytes: int           # bytes held for the dataset (0: none; size: all of it)
    value: float         # GPU-equivalents saved (unbiased)
    reason: str


def allocate_shares(datasets: Iterable[DatasetDemand], budget_bytes: int,
                    cfg: AllocConfig = AllocConfig(), current: Mapping[str, int] | None = None,
                    grain: int = 200) -> dict[str, Share]:
    """The shares that save the most GPU time within ``budget_bytes``.

    ``current``: bytes each dataset holds now (hysteresis). Exact over the
    candidate shares up to the budget's ``grain`` rounding. Deterministic;
    one Share per dataset, in name order."""
    ds = sorted(datasets, key=lambda d: d.name)
    if len({d.name for d in ds}) != len(ds):
        raise ValueError("duplicate dataset names")
    budget = max(0, int(budget_bytes))
    current = dict(current or {})
    # Pinned shares must leave the shared LRU room to work in, unless every dataset
    # that uses it is pinned whole (then nobody needs it), or datasets pinned whole
    # past that reserve save more than those left unpinned lose of the LRU (all of
    # it, at worst): a dataset gaining 1.1x must not keep one gaining 4x from being
    # pinned whole. Partial shares past the reserve starve the LRU (docs/benchmarks.md).
    rank, picks = _solve(ds, int(budget * (1.0 - cfg.spare_reserve)), budget, current, grain, cfg)
    rank2, picks2 = _solve(ds, budget, budget, current, grain, cfg, whole_only=True)
    lost = sum(spare_value(d, cfg) for i, d in enumerate(ds) if d.jobs and picks2[i] < d.size_bytes)
    if rank2 > (rank + lost) * (1.0 + 1e-6) + 1e-9:  # a tie (a saturation share = whole) keeps the reserve
        picks = picks2
    return {d.name: _explain(d, picks[i], budget, cfg) for i, d in enumerate(ds)}


def _solve(ds: Sequence[DatasetDemand], room: int, budget: int, current: Mapping[str, int], grain: int,
           cfg: AllocConfig, whole_only: bool = False) -> tuple[float, tuple[int, ...]]:
    """Knapsack by dynamic programming over ``room`` in steps of ``budget / grain``
    (``whole_only``: each dataset whole or not at all, and only one whose benefit
    was measured: a pin on a prior alone is evicted again once measured)."""
    unit = max(1, math.ceil(budget / grain)) if budget else 1
    slots = max(0, room) // unit
    best: list[tuple[float, tuple[int, ...]]] = [(0.0, ())] * (slots + 1)
    for d in ds:
        opts = [(0, 0, 0.0)]
        if d.jobs and d.size_bytes > 0 and room > 0 and (d.is_measured() or not whole_only):
            for s in _candidates(d, room, grain, cfg, whole_only):
                v = share_value(d, s, cfg)
                if v > 0:
                    near = abs(s - current.get(d.name, -1)) <= unit
                    opts.append((math.ceil(s / unit), s, v * (1.0 + cfg.incumbent_bonus if near else 1.0)))
        best = _dp_step(best, opts)
    choice = max(range(slots + 1), key=lambda c: (best[c][0], -c))
    return best[choice]


def _dp_step(best: Sequence[tuple[float, tuple[int, ...]]],
             opts: Sequence[tuple[int, int, float]]) -> list[tuple[float, tuple[int, ...]]]:
    out = []
    for c in range(len(best)):
        top = (-1.0, ())
        for cost, s, rank in opts:
            if cost <= c:
                r = best[c - cost][0] + rank
                if r > top[0] + 1e-12:
                    top = (r, best[c - cost][1] + (s,))
        out.append(top)
    return out


def _explain(d: DatasetDemand, s: int, budget: int, cfg: AllocConfig) -> Share:
    bs = [j.benefit if j.benefit is not None else cfg.prior_benefit for j in d.jobs]
    gb = 1e9
    if not d.jobs:
        return Share(d.name, 0, 0.0, "no jobs use it")
    btxt = f"{len(bs)} job(s), b={min(bs):.2f}..{max(bs):.2f}"
    if s <= 0:
        if max(bs) < cfg.min_benefit:
            why = f"no job benefits (b < {cfg.min_benefit}): its misses are not cached"
        elif not budget:
            why = "no budget"
        elif len(d.jobs) > 1 and d.size_bytes > budget * (1.0 - cfg.spare_reserve):
            why = ("the whole dataset does not fit beside the shared LRU; its jobs share their reads "
                   "through spare entries")
        else:
            why = "outranked: other datasets save more GPU time per byte; misses go in as spare entries"
        return Share(d.name, 0, 0.0, f"no share: {why}; {btxt}")
    v = share_value(d, s, cfg)
    sat = max(1.0 - 1.0 / max(b, 1.0) for b in bs)
    return Share(d.name, s, v, f"share {s / gb:.3g}GB, {s / d.size_bytes:.0%} of {d.size_bytes / gb:.3g}GB "
                               f"(its jobs gain nothing beyond {sat:.0%}), saves {v:.2f} GPU-eq over the "
                               f"shared LRU; {btxt}")


# ---------------------------------------------------------------- which items

_STRIDE = 2654435761  # a prime: i -> i * _STRIDE mod n is a permutation of 0..n-1 for n it does not divide


def share_items(share_bytes: int, size_bytes: int, n_items: int) -> int:
    """How many of the dataset's ``n_items`` items a share of ``share_bytes`` holds."""
    if share_bytes <= 0 or size_bytes <= 0 or n_items <= 0:
        return 0
    if share_bytes >= size_bytes:
        return n_items
    return min(n_items, share_bytes * n_items // size_bytes)


def in_share(i: int, n_items: int, m: int) -> bool:
    """Whether item ``i`` (digest order) belongs to a share of ``m`` items: a fixed
    pseudo-random sample, so a share of a length-sorted dataset still mixes, and a
    share that grows keeps what it held."""
    if m <= 0:
        return False
    if m >= n_items:
        return True
    stride = _STRIDE if n_items % _STRIDE else _STRIDE + 2
    return (i * stride) % n_items < m
