"""Greedy benefit-per-byte allocation of cache space to datasets (Quiver 5.3).

Each dataset gets one of three options:

* FULL    -- cost = dataset size; every job gets cache hits.
* CHUNKED -- cost = 2 chunks (double buffering), chunk = min(chunk_bytes,
  10% of the dataset); jobs get substitutable hits and co-operative misses.
* NONE    -- cost 0.

Value model (GPU-equivalents saved; a job with benefit b on n GPUs does the work
of b*n GPUs when cached, so caching saves (b-1)*n; G - sum(n) for a dataset):

    V_full    = sum_i n_i * (b_i - 1)
    V_chunked = eta * sum_i n_i * (min(b_i, J) - 1)       J = jobs on the dataset

Why ``min(b, J)``: with co-operative misses the J jobs share the remote reads,
each fetching ~1/J of the items (Quiver 5.2), so a store-bound job's I/O time
drops from t_miss to ~t_miss/J and its time per batch to
max(t_hit, t_miss/J). Its speed-up is then min(b, J): a lone job gains
nothing from a chunk (the paper: a single job that does not fit "does not
benefit"), a large multi-job gets nearly the full-hit speed-up (Fig. 3c).
``eta`` (0.9) discounts staggered jobs and chunk switches. Jobs with b below
``min_benefit`` (1.05, within measurement noise) count as b = 1.

Algorithm (multiple-choice knapsack):

1. Per dataset, the upper convex hull of (0,0), (cost_chunked, V_chunked),
   (cost_full, V_full) gives *incremental items*: CHUNKED, then an upgrade
   CHUNKED->FULL with its own incremental value/cost; if CHUNKED lies below
   the line to FULL, the single item FULL (and CHUNKED only as a fallback
   when FULL cannot fit). Greedy by value/cost over these items is the exact
   LP-relaxation order, so upgrades compete fairly with other datasets' chunks.
2. Greedy is run once plain and once per forced "seed" option (each dataset's
   CHUNKED / FULL taken first); the best total wins. This partial enumeration
   fixes greedy's classic failure (a large, valuable dataset shut out by
   smaller items with better ratios) and guarantees >= 1/2 of the optimum.
3. Datasets whose benefit is unknown (no conclusive measurement) and that got
   nothing are given CHUNKED from leftover space, smallest first, so they can
   be probed (exploration).

Spare entries (beyond the paper). A dataset's items outside its chunks are
inserted as spare entries, which servers keep only in room nobody's chunks
need (cacheserver/store.py, is_spare). They cost no reserved space, so a NONE
dataset whose jobs do benefit from the cache (it did not fit, or was
outranked) still gets ``spare=True``: its jobs insert their misses there and
concurrent jobs share them, as with a plain LRU cache, instead of every job
reading everything from the store. Only a dataset whose jobs gain nothing
(b below ``min_benefit``) inserts nothing, which saves the inserts' CPU.

Hysteresis: options matching ``current`` get ``incumbent_bonus`` (10%) extra
value when ranking, so small measurement noise does not flap a dataset between
options (each change costs a reload from the remote store). Ties are broken by
dataset name, so the result is deterministic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from cacheserver.vocab import Option

from .chunks import num_chunks
from .probing import DEFAULT_PRIOR_BENEFIT, JobGain, dataset_gain

GB = 10**9


@dataclass(frozen=True)
class DatasetDemand:
    """A dataset, its size and the jobs using it. ``measured=False`` marks a
    dataset whose benefit is only a prior / lower bound (eligible for
    exploration space); by default: measured if any job has a conclusive benefit."""
    name: str
    size_bytes: int
    jobs: tuple[JobGain, ...] = ()
    measured: bool | None = None
    n_items: int | None = None  # chunks are runs of whole items: with few items, fewer, larger chunks

    def is_measured(self) -> bool:
        if self.measured is not None:
            return self.measured
        return any(j.benefit is not None and not j.lower_bound for j in self.jobs)


def demands(job_gains: Mapping[str, Iterable[JobGain]], sizes: Mapping[str, int],
            items: Mapping[str, int] | None = None) -> list[DatasetDemand]:
    """Join per-dataset job gains (ProbeBoard.job_gains()) with dataset sizes (and
    item counts, where known). Datasets in ``sizes`` without jobs are included (they
    get NONE); datasets with jobs but no known size are left out (they cannot be
    allocated yet)."""
    names = sorted(set(sizes) | set(job_gains))
    items = items or {}
    return [DatasetDemand(n, int(sizes[n]), tuple(job_gains.get(n, ())), n_items=items.get(n))
            for n in names if n in sizes]


@dataclass(frozen=True)
class AllocConfig:
    chunk_bytes: int = 15 * GB          # the paper's fixed chunk size
    chunk_fraction: float = 0.10        # ... or 10% of the dataset, if smaller
    min_benefit: float = 1.05           # below: no benefit (measurement noise)
    chunked_efficiency: float = 0.9     # eta in V_chunked
    prior_benefit: float = DEFAULT_PRIOR_BENEFIT
    incumbent_bonus: float = 0.10
    explore: bool = True
    # False (--no-chunks): a dataset allocated CHUNKED gets no chunks; it is
    # NONE with spare entries instead, so its jobs share the room FULL datasets
    # leave, as an LRU with substitutable hits. The knapsack still counts two
    # chunks of budget for it, so it keeps out FULL datasets worth less.
    # (tools/bench/allocation: better than double buffering at small budgets.)
    chunked: bool = True
    # "shares" (default): each dataset holds a pinned share sized by benefit
    # (shares.py), the rest is one LRU of spare entries; "chunks": the knapsack
    # above with FULL / CHUNKED (double buffering) / NONE. tools/bench/allocation
    # measures both (docs/benchmarks.md).
    mechanism: str = "shares"
    # shares: the part of the budget pinned shares leave to the shared LRU while
    # any benefiting dataset is not pinned whole (tools/bench/allocation: pinning
    # 90 of 100 GB lost 38% against one LRU; half the budget lost nothing).
    spare_reserve: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.spare_reserve <= 1.0:
            raise ValueError(f"spare_reserve must be in [0, 1], not {self.spare_reserve}")
        if self.mechanism not in ("shares", "chunks"):
            raise ValueError(f"mechanism must be 'shares' or 'chunks', not {self.mechanism!r}")


@dataclass(frozen=True)
class Allocation:
    dataset: str
    option: Option
    bytes: int            # space reserved
    chunk_size: int       # bytes per chunk (FULL: the dataset size; NONE: 0)
    value: float          # estimated GPU-equivalents saved
    reason: str
    spare: bool = False   # jobs insert items outside the chunks as spare entries
    share: int = 0        # bytes of the dataset pinned as its share (shares.py; FULL: its size)

    @property
    def knapsack_option(self) -> Option:
        """The option the knapsack chose: CHUNKED for one that --no-chunks turned
        into NONE with spare entries (it still holds budget), for hysteresis."""
        if self.option is Option.NONE and self.spare and self.bytes > 0:
            return Option.CHUNKED
        return self.option

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "option": self.option.value, "bytes": self.bytes,
                "chunk_size": self.chunk_size, "value": self.value, "reason": self.reason,
                "spare": self.spare, **({"share": self.share} if self.share else {})}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Allocation":
        # without the field: a chunked plan inserts spare entries
        opt = Option(d["option"])
        return cls(str(d["dataset"]), opt, int(d["bytes"]), int(d["chunk_size"]), float(d["value"]),
                   str(d["reason"]), bool(d.get("spare", opt is Option.CHUNKED)), int(d.get("share", 0)))


def budget_from_capacities(capacities: Iterable[int], reserve_fraction: float = 0.0) -> int:
    """Default budget: the servers' total capacity, less a reserve (e.g. for
    the servers' own fallback eviction slack)."""
    total = sum(max(0, int(c)) for c in capacities)
    return int(total * (1.0 - reserve_fraction))


def chunk_size_for(size_bytes: int, cfg: AllocConfig = AllocConfig(), n_items: int | None = None) -> int:
    """min(chunk_bytes, chunk_fraction * size), at least 1 byte; with ``n_items``, at
    least a chunk's share of the dataset when there are fewer items than chunks of
    that size (the buffer's k is capped at the item count: policy/chunks.num_chunks)."""
    chunk = max(1, min(cfg.chunk_bytes, int(size_bytes * cfg.chunk_fraction)))
    if n_items is not None and n_items > 0 and size_bytes > 0:
        chunk = max(chunk, -(-size_bytes // num_chunks(size_bytes, chunk, n_items)))
    return chunk


def benefits(d: DatasetDemand, cfg: AllocConfig) -> list[tuple[int, float]]:
    """(n_gpus, b) per job: the prior where unmeasured, 1 below ``min_benefit``."""
    out = []
    for j in d.jobs:
        b = j.benefit if j.benefit is not None else cfg.prior_benefit
        out.append((j.n_gpus, b if b >= cfg.min_benefit else 1.0))
    return out


def option_values(d: DatasetDemand, cfg: AllocConfig = AllocConfig()) -> tuple[float, float]:
    """(V_chunked, V_full) for a dataset, see the module docstring."""
    nb = benefits(d, cfg)
    J = len(nb)
    v_full = sum(n * (b - 1.0) for n, b in nb)
    v_chunk = cfg.chunked_efficiency * sum(n * (min(b, J) - 1.0) for n, b in nb)
    return max(0.0, v_chunk), max(0.0, v_full)


# ---------------------------------------------------------------- greedy core

@dataclass(frozen=True)
class _Item:
    dataset: str
    stage: int          # 0: CHUNKED from NONE, 1: FULL from CHUNKED, 2: FULL from NONE, 3: CHUNKED fallback
    value: float        # true incremental value
    rank: float         # value with incumbent bonus, for ordering
    cost: int

    @property
    def ratio(self) -> float:
        return math.inf if self.cost == 0 else self.rank / self.cost


@dataclass
class _Plan:
    cost_c: int
    cost_f: int
    v_c: float
    v_f: float
    rank_c: float = 0.0   # values with the incumbent bonus applied
    rank_f: float = 0.0
    items: list[_Item] = field(default_factory=list)


def _plans(datasets: Sequence[DatasetDemand], cfg: AllocConfig,
           current: Mapping[str, Option]) -> dict[str, _Plan]:
    plans: dict[str, _Plan] = {}
    bonus = 1.0 + cfg.incumbent_bonus
    for d in datasets:
        if d.size_bytes <= 0 or not d.jobs:
            continue
        v_c, v_f = option_values(d, cfg)
        cost_f = d.size_bytes
        cost_c = 2 * chunk_size_for(d.size_bytes, cfg, d.n_items)
        if cost_c >= cost_f:
            v_c = 0.0  # two chunks cost as much as the whole: FULL is strictly better
        cur = current.get(d.name, Option.NONE)
        bc = bonus if cur in (Option.CHUNKED, Option.FULL) else 1.0
        bf = bonus if cur is Option.FULL else 1.0
        p = _Plan(cost_c, cost_f, v_c, v_f, rank_c=v_c * bc, rank_f=v_f * bf)
        plans[d.name] = p
        if v_c > 0 and v_c / cost_c > v_f / cost_f:   # CHUNKED is on the hull
            p.items.append(_Item(d.name, 0, v_c, p.rank_c, cost_c))
            if v_f > v_c:
                up = (v_f - v_c) * bf
                p.items.append(_Item(d.name, 1, v_f - v_c, up, cost_f - cost_c))
                p.rank_f = p.rank_c + up
            else:
                p.rank_f = 0.0  # never chosen: upgrading adds nothing
        else:
            if v_f > 0:
                p.items.append(_Item(d.name, 2, v_f, p.rank_f, cost_f))
            if v_c > 0:
                p.items.append(_Item(d.name, 3, v_c, p.rank_c, cost_c))
    return plans


def _greedy(plans: Mapping[str, _Plan], budget: int, seed: tuple[str, Option] | None
            ) -> tuple[float, dict[str, Option], int] | None:
    """Greedy by (bonus-adjusted) value per byte; returns (rank total, options,
    bytes left), or None when the seed does not fit or is worthless."""
    chosen: dict[str, Option] = {}
    left = budget
    total = 0.0
    if seed is not None:
        name, opt = seed
        p = plans[name]
        cost, val, rank = ((p.cost_f, p.v_f, p.rank_f) if opt is Option.FULL
                           else (p.cost_c, p.v_c, p.rank_c))
        if cost > left or val <= 0 or rank <= 0:
            return None
        chosen[name], left, total = opt, left - cost, rank
    items = [it for p in plans.values() for it in p.items]
    items.sort(key=lambda it: (-it.ratio, it.dataset, it.stage))
    for it in items:
        if it.cost > left:
            continue
        have = chosen.get(it.dataset, Option.NONE)
        if it.stage in (0, 2, 3) and have is Option.NONE:
            chosen[it.dataset] = Option.FULL if it.stage == 2 else Option.CHUNKED
        elif it.stage == 1 and have is Option.CHUNKED:
            chosen[it.dataset] = Option.FULL
        else:
            continue
        left -= it.cost
        total += it.rank
    return total, chosen, left


def allocate(datasets: Iterable[DatasetDemand], budget_bytes: int,
             cfg: AllocConfig = AllocConfig(),
             current: Mapping[str, Option] | None = None) -> dict[str, Allocation]:
    """Decide an option for every dataset within ``budget_bytes``.

    ``current``: options now in force (for hysteresis). Returns one
    Allocation per dataset, keyed by name, in name order."""
    ds = sorted(datasets, key=lambda d: d.name)
    names = [d.name for d in ds]
    if len(set(names)) != len(names):
        raise ValueError("duplicate dataset names")
    current = dict(current or {})
    budget = max(0, int(budget_bytes))
    plans = _plans(ds, cfg, current)

    best = _greedy(plans, budget, None)
    assert best is not None
    for name in sorted(plans):
        for opt in (Option.CHUNKED, Option.FULL):
            r = _greedy(plans, budget, (name, opt))
            # strictly better only (with a little slack for float noise): ties keep
            # the plain greedy, then the first seed in name order
            if r is not None and r[0] > best[0] * (1 + 1e-9) + 1e-12:
                best = r
    _, chosen, left = best

    # exploration: unknown datasets that got nothing take a chunk pair from what is left
    explored: set[str] = set()
    if cfg.explore:
        cands = [d for d in ds if d.name in plans and chosen.get(d.name, Option.NONE) is Option.NONE
                 and not d.is_measured() and plans[d.name].cost_c < plans[d.name].cost_f]
        for d in sorted(cands, key=lambda d: (plans[d.name].cost_c, d.name)):
            if plans[d.name].cost_c <= left:
                chosen[d.name] = Option.CHUNKED
                left -= plans[d.name].cost_c
                explored.add(d.name)

    out: dict[str, Allocation] = {}
    for d in ds:
        a = _explain(d, plans.get(d.name), chosen.get(d.name, Option.NONE), d.name in explored, budget, cfg)
        if a.option is Option.CHUNKED and not cfg.chunked:
            a = Allocation(d.name, Option.NONE, a.bytes, 0, a.value,
                           f"shared (--no-chunks): counts {_gb(a.bytes)} of the budget, held as spare "
                           f"entries, no chunks; as {a.reason}", spare=True)
        out[d.name] = a
    return out


def _gb(n: float) -> str:
    return f"{n / GB:.3g}GB"


def _explain(d: DatasetDemand, p: _Plan | None, opt: Option, explored: bool,
             budget: int, cfg: AllocConfig) -> Allocation:
    if d.size_bytes <= 0:
        return Allocation(d.name, Option.NONE, 0, 0, 0.0, "empty dataset: nothing to cache")
    if not d.jobs or p is None:
        return Allocation(d.name, Option.NONE, 0, 0, 0.0, "no jobs use it")
    chunk = p.cost_c // 2
    bs = [j.benefit if j.benefit is not None else cfg.prior_benefit for j in d.jobs]
    btxt = (f"G={dataset_gain(d.jobs, cfg.prior_benefit):.2f} over {len(bs)} job(s), "
            f"max b={max(bs):.3f}" + ("" if d.is_measured() else " (not measured: prior/lower bound)"))
    if opt is Option.FULL:
        return Allocation(d.name, opt, d.size_bytes, d.size_bytes, p.v_f,
                          f"full: saves {p.v_f:.2f} GPU-eq for {_gb(d.size_bytes)}; {btxt}")
    if opt is Option.CHUNKED:
        if explored:
            return Allocation(d.name, opt, p.cost_c, chunk, p.v_c,
                              f"exploration: benefit not measured conclusively yet; 2x{_gb(chunk)} chunks"
                              f" from spare space; {btxt}", spare=True)
        why_not_full = (f"full (+{_gb(p.cost_f - p.cost_c)}, +{p.v_f - p.v_c:.2f}) did not fit or ranked lower"
                        if p.v_f > p.v_c else "full adds nothing over chunked")
        return Allocation(d.name, opt, p.cost_c, chunk, p.v_c,
                          f"chunked: saves {p.v_c:.2f} GPU-eq for 2x{_gb(chunk)}; {why_not_full}; {btxt}",
                          spare=True)
    # NONE
    if max(bs) < cfg.min_benefit or (p.v_f <= 0 and p.v_c <= 0):
        why = f"no job benefits (max b={max(bs):.3f} < {cfg.min_benefit})"
        return Allocation(d.name, Option.NONE, 0, 0, 0.0, f"none: {why}; {btxt}")
    if min(p.cost_c if p.v_c > 0 else math.inf, p.cost_f) > budget:
        why = (f"smallest useful option ({_gb(min(p.cost_c if p.v_c > 0 else math.inf, p.cost_f))})"
               f" exceeds the whole budget ({_gb(budget)})")
    else:
        why = "outranked: other datasets save more GPU time per byte"
    if p.v_c <= 0 < p.v_f and len(d.jobs) == 1:
        why += "; a single job gains nothing from chunked caching"
    return Allocation(d.name, Option.NONE, 0, 0, 0.0,
                      f"none: {why}; misses shared as spare entries; {btxt}", spare=True)
