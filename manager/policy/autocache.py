"""Autocache: per (dataset, pipeline), compute, cache the source items, or cache
the transformed items at the caching point -- from the job's first-epoch
measurements (Cachew ATC '22, section 4.4). Pure: no I/O, no clocks.

Cost model. Our loader reads (store or cache) on threads while worker processes
run the steps, so an epoch is *pipelined*: per item it costs about

    max(read, cpu / workers) + (1 - overlap) * min(read, cpu / workers)

``overlap = 1`` is the pure pipeline, ``overlap = 0`` Cachew's sum
(``N x step time`` vs ``M x read + steps after``). ``DEFAULT_OVERLAP`` is what
fits ``tools/bench/autocache`` best (docs/benchmarks.md gives the error of each).

Options, per item, with ``phi`` the fraction of the set that fits ``room_bytes``
(a transformed set larger than the room cannot be all hits: the rest is
computed from the store every epoch):

* compute:     read = store,                          cpu = prefix + rest
* source:      read = phi_s cache_src + (1-phi_s) store,  cpu = prefix + rest
* transformed: read = phi_t cache_marker + (1-phi_t) store,
               cpu  = phi_t rest + (1-phi_t) (prefix + rest)

and, where the host's ``cores`` are known, no option runs faster than its CPU per item on
the host (cache reads, the hand-off at both ends, the steps, the puts) over those cores;
where an item that runs steps also costs the loader ``handoff_s`` on the read side
(passing it to a worker and its output back: large inflated outputs cost more to
move than to read from the cache); a transformed hit with no steps after the caching
point never goes to a worker.

Fills are projected, not assumed: ``source_cached`` and ``transformed_cached``
say what is cached at the decision; the rest of the current epoch (``1 -
epoch_done``: "auto" decides a tenth into its first epoch) and every later
epoch hit what is cached and put what they miss (a transformed put also pays
``put_marker_s`` of CPU), up to what the room holds. Costs are seconds per
remaining epoch, fills included, so a short job does not pay for a fill it
cannot amortise.

Tie rule: options within ``TIE`` (2%) of the cheapest are tied; among tied
options the one that takes fewer cache bytes wins -- compute (none), then the
smaller of source and transformed, source on equal bytes (it serves every
pipeline over the dataset). Measurement noise is a few percent, so a near-tie
is not worth cache space another dataset could use.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping, Sequence

MODES = ("compute", "source", "transformed")
TIE = 0.02
HEDGE = 0.05  # measuring_mode: an estimate's margin taken as clear
CLEAR = 0.25  # clear_estimate: a margin no measurement of the first epoch is expected to overturn
REDECIDE = 0.25  # redecide: how much dearer the mode in force must project before it is changed
DEFAULT_OVERLAP = 1.0


@dataclass(frozen=True)
class PipelineCosts:
    """Measured in the job's first epoch (means per item)."""
    items: int                # items per epoch for this job
    epochs_left: int          # whole epochs still to run after the decision (after the current one: epoch_done)
    source_bytes: float       # bytes per source item
    marker_bytes: float       # bytes per item at the caching point (encoded transformed payload)
    store_read_s: float       # wall seconds per item reading source items from the store (our read path)
    cache_read_source_s: float  # wall seconds per item reading source items from the cache
    cache_read_marker_s: float  # wall seconds per item reading transformed items (marker_bytes) from the cache
    prefix_s: float           # CPU seconds per item of the steps before the caching point
    rest_s: float             # CPU seconds per item of the steps after it
    workers: int              # preprocess workers running the steps in parallel
    cacheable: bool           # False: prefix empty / random unseeded / output not encodable
    why_not: str = ""         # the reason when not cacheable
    room_bytes: float = math.inf      # cache bytes this dataset may hold (its budget share)
    source_cached: float = 0.0        # fraction of source items already cached at the decision
    transformed_cached: float = 0.0   # fraction of transformed items already cached
    put_marker_s: float = 0.0         # seconds per item to encode, seal and put a transformed item (the
                                      # server's write included), taken from the cores the steps run on
    epoch_done: float = 1.0           # share of the current epoch done at the decision (its rest runs
                                      # in the chosen mode and fills what that mode caches)
    handoff_s: float = 0.0            # wall seconds per item, in the loader's process, to hand an item to a
                                      # worker and take its output back (pickling, pipes); 0: unknown
    cores: float = 0.0                # cores the loader's process and its workers share; 0: unknown (no
                                      # limit: each worker and the loader's threads have a core of their own)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or isinstance(v, str):
                continue
            if not (v >= 0) or (f.name != "room_bytes" and math.isinf(v)):
                raise ValueError(f"PipelineCosts.{f.name} must be a finite number >= 0, got {v!r}")
        if self.items < 1:
            raise ValueError(f"PipelineCosts.items must be >= 1, got {self.items}")
        for name in ("source_cached", "transformed_cached", "epoch_done"):
            if getattr(self, name) > 1:
                raise ValueError(f"PipelineCosts.{name} is a fraction in [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class Decision:
    mode: str                 # "compute" | "source" | "transformed"
    costs: dict[str, float]   # projected seconds per remaining epoch per option
    reason: str               # one line: why (the measured costs)


def item_time(read_s: float, cpu_s: float, workers: int, overlap: float = DEFAULT_OVERLAP,
              host_cpu_s: float = 0.0, cores: float = 0.0) -> float:
    """Seconds per item of a loader that reads on threads and computes on ``workers``;
    with ``cores`` known, never less than the host's CPU per item (``host_cpu_s``) spread
    over them: the loader's process and the workers share those cores."""
    c = cpu_s / max(1, workers)
    t = max(read_s, c) + (1.0 - overlap) * min(read_s, c)
    return max(t, host_cpu_s / cores) if cores > 0 else t


def fit_fraction(set_bytes: float, room_bytes: float) -> float:
    """How much of a set of ``set_bytes`` a room of ``room_bytes`` holds."""
    if set_bytes <= 0:
        return 1.0
    return max(0.0, min(1.0, room_bytes / set_bytes))


def _source_item(c: PipelineCosts, hit: float, fill: float, src_hit: float, overlap: float) -> float:
    read = hit * c.cache_read_source_s + (1 - hit) * c.store_read_s + c.handoff_s
    cpu = c.prefix_s + c.rest_s
    # host CPU: cache reads, the hand-off at both ends (a worker writes what the loader reads), the steps
    host = hit * c.cache_read_source_s + 2 * c.handoff_s + cpu
    return item_time(read, cpu, c.workers, overlap, host, c.cores)


def _transformed_item(c: PipelineCosts, hit: float, fill: float, src_hit: float, overlap: float) -> float:
    miss_read = src_hit * c.cache_read_source_s + (1 - src_hit) * c.store_read_s
    # a hit goes to a worker only if steps follow the caching point
    handoff = (1 - hit) * c.handoff_s + (hit * c.handoff_s if c.rest_s > 0 else 0.0)
    read = hit * c.cache_read_marker_s + (1 - hit) * miss_read + handoff
    cpu = hit * c.rest_s + (1 - hit) * (c.prefix_s + c.rest_s) + fill * c.put_marker_s
    host = hit * c.cache_read_marker_s + (1 - hit) * src_hit * c.cache_read_source_s + 2 * handoff + cpu
    return item_time(read, cpu, c.workers, overlap, host, c.cores)


def _source_left(c: PipelineCosts) -> float:
    """Fraction of source items cached that a full transformed set leaves room for."""
    t_set = c.items * c.marker_bytes
    room_left = c.room_bytes - t_set * fit_fraction(t_set, c.room_bytes)
    return min(c.source_cached, fit_fraction(c.items * c.source_bytes, room_left))


def _run(c: PipelineCosts, per_item, cached: float, fit: float, overlap: float) -> float:
    """Seconds of the rest of the current epoch and ``epochs_left`` epochs of one
    option. The rest of the current epoch reads the items it has not read yet: what
    is cached beyond the ``epoch_done`` share it read (and cached) is its hits. Each
    epoch puts what it misses, up to the fraction ``fit`` the room holds. A
    transformed miss reads its source item from the cache where it is cached: the
    items read before the decision, so first the misses of the next epoch."""
    total, h = 0.0, min(cached, fit)
    src, rest = _source_left(c), 1.0 - c.epoch_done
    if rest > 0:
        hit = min(fit, max(0.0, cached - c.epoch_done) / rest)
        src_hit = min(1.0, max(0.0, src - c.epoch_done) / rest)
        total += rest * c.items * per_item(c, hit, max(0.0, fit - hit), src_hit, overlap)
        h = min(fit, cached + rest * (1.0 - hit))
    def epoch(h: float) -> float:
        src_hit = min(1.0, src / (1.0 - h)) if h < 1 else 0.0
        return c.items * per_item(c, h, fit - h, src_hit, overlap)

    if c.epochs_left > 0:  # every epoch after the next starts where the last left off, at `fit`:
        total += epoch(h) + (c.epochs_left - 1) * epoch(fit)  # one term, not a loop of epochs_left
    return total


def project(c: PipelineCosts, overlap: float = DEFAULT_OVERLAP) -> dict[str, float]:
    """Projected seconds per remaining epoch of each option (transformed only if cacheable),
    fills included, over the rest of the current epoch and ``epochs_left`` more."""
    span = max(1e-9, c.epochs_left + 1.0 - c.epoch_done)
    phi_s = fit_fraction(c.items * c.source_bytes, c.room_bytes)
    out = {"compute": _run(c, _source_item, 0.0, 0.0, overlap) / span,
           "source": _run(c, _source_item, c.source_cached, phi_s, overlap) / span}
    if c.cacheable:
        phi_t = fit_fraction(c.items * c.marker_bytes, c.room_bytes)
        out["transformed"] = _run(c, _transformed_item, c.transformed_cached, phi_t, overlap) / span
    return out


def _bytes_taken(c: PipelineCosts, mode: str) -> float:
    return {"compute": 0.0, "source": c.source_bytes,
            "transformed": c.marker_bytes}[mode] * c.items


def choose(c: PipelineCosts, costs: Mapping[str, float], tie: float = TIE) -> str:
    """The tie rule: cheapest within ``tie``, then fewest cache bytes, then MODES order."""
    best = min(costs.values())
    tied = [m for m in MODES if m in costs and costs[m] <= best * (1 + tie)]
    return min(tied, key=lambda m: (_bytes_taken(c, m), MODES.index(m)))


def _ms(x: float) -> str:
    return f"{x * 1e3:.3g}"


def explain(c: PipelineCosts, costs: Mapping[str, float], mode: str) -> str:
    """One line: the choice, every option's projection and the measurements behind them."""
    others = ", ".join(f"{m} {costs[m]:.3g}" for m in MODES if m in costs and m != mode)
    why = "" if c.cacheable else f"; transformed not cacheable: {c.why_not or 'unknown'}"
    fit = ""
    if math.isfinite(c.room_bytes):
        fit = (f"; room {c.room_bytes / 1e6:.4g} MB holds {fit_fraction(c.items * c.marker_bytes, c.room_bytes):.0%}"
               f" transformed, {fit_fraction(c.items * c.source_bytes, c.room_bytes):.0%} source")
    return (f"{mode} {costs[mode]:.3g} s/epoch vs {others} over {c.epochs_left} epochs"
            f" (per item ms: store {_ms(c.store_read_s)}, cache src {_ms(c.cache_read_source_s)}"
            f" marker {_ms(c.cache_read_marker_s)}, prefix {_ms(c.prefix_s)}, rest {_ms(c.rest_s)},"
            f" hand-off {_ms(c.handoff_s)};"
            f" {c.workers} workers; marker {c.marker_bytes / max(c.source_bytes, 1):.3g}x source){fit}{why}")


def decide(c: PipelineCosts, overlap: float = DEFAULT_OVERLAP, tie: float = TIE) -> Decision:
    """Compute, cache source or cache transformed, whichever the model projects
    cheapest over the remaining epochs (tie rule in the module docstring)."""
    if c.epochs_left <= 0 and c.epoch_done >= 1:
        costs = project(replace(c, epochs_left=1), overlap)
        return Decision("compute", costs, "no epochs left: nothing to gain from caching")
    costs = project(c, overlap)
    mode = choose(c, costs, tie)
    return Decision(mode, costs, explain(c, costs, mode))


def measuring_mode(c: PipelineCosts, overlap: float = DEFAULT_OVERLAP, tie: float = TIE
                   ) -> tuple[str, bool, Decision]:
    """Before a job's first epoch is measured, from an estimate (the read path probed,
    the profiled sample's step times, ``epoch_done`` 0): the mode the part of the
    epoch before the decision runs in, whether it keeps the outputs at the caching
    point as they are made, and the estimate's decision.

    * transformed cheaper than every other option by ``HEDGE``: run as transformed
      (it puts its outputs; a transformed decision then costs nothing more);
    * transformed within ``HEDGE`` of the cheapest (a near tie): run as source, which
      caches the source items, and keep the outputs too, so either decision makes
      nothing of that part again;
    * transformed clearly dearer (an inflated output costs more to put and read back
      than the steps it saves), or not cacheable: run exactly as source, putting
      nothing that is then not used."""
    d = decide(c, overlap, tie)
    t = d.costs.get("transformed", math.inf) if c.cacheable else math.inf
    others = min(v for m, v in d.costs.items() if m != "transformed")
    if t * (1 + HEDGE) <= others:
        return "transformed", True, d
    return "source", t <= min(others, t) * (1 + HEDGE), d


def clear_estimate(d: Decision, margin: float | None = None) -> bool:
    """Whether an estimate's decision (measuring_mode's) is taken as final before the
    first epoch: its option projects cheaper than every other by ``margin``. Then the
    first epoch is not measured first: it runs in the chosen mode from its first item
    (nothing put speculatively, nothing made in a form then not used). The steps run
    slower in busy workers than in the profiled sample, and the probes are noisy by a
    few percent: within ``margin`` the measured part of the first epoch decides."""
    margin = CLEAR if margin is None else margin
    mine = d.costs.get(d.mode)
    return mine is not None and all(mine * (1 + margin) <= v for m, v in d.costs.items() if m != d.mode)


def redecide(current: Decision, c: PipelineCosts, margin: float = REDECIDE, overlap: float = DEFAULT_OVERLAP,
             tie: float = TIE) -> Decision | None:
    """A pipeline decided already, measured again (``c``: every job's measurements,
    merge_costs): the new decision where the mode in force projects more than
    ``margin`` dearer than the new choice (or can no longer be kept: a job found the
    pipeline not cacheable); else None. The margin is well beyond measurement noise:
    a changed decision leaves a cached set behind and makes another, so it is not
    churned over a few percent. The new reason says what it replaced."""
    new = decide(c, overlap, tie)
    if new.mode == current.mode:
        return None
    old = new.costs.get(current.mode)
    if old is not None and old <= new.costs[new.mode] * (1 + margin):
        return None
    was = "not cacheable now" if old is None else f"{old:.3g} s/epoch now"
    return replace(new, reason=f"re-decided, was {current.mode} ({was}): {new.reason}")


def merge_costs(measured: Sequence[PipelineCosts]) -> PipelineCosts:
    """Several jobs' measurements of one (dataset, pipeline) as one: item-weighted
    means of the per-item figures, and the *sum* of their remaining epochs (a
    cached set serves every job, so its fill is amortised over all of them).
    Cacheable only if every job found it cacheable."""
    if not measured:
        raise ValueError("merge_costs needs at least one PipelineCosts")
    if len(measured) == 1:
        return measured[0]
    w = [m.items for m in measured]
    total = float(sum(w))

    def mean(name: str) -> float:
        return sum(getattr(m, name) * k for m, k in zip(measured, w)) / total
    means = {f.name: mean(f.name) for f in fields(PipelineCosts)
             if f.name not in ("items", "epochs_left", "workers", "cacheable", "why_not", "room_bytes")}
    blocked = [m.why_not for m in measured if not m.cacheable]
    return PipelineCosts(items=max(w), epochs_left=sum(m.epochs_left for m in measured),
                         workers=max(1, round(sum(m.workers * k for m, k in zip(measured, w)) / total)),
                         cacheable=not blocked, why_not=blocked[0] if blocked else "",
                         room_bytes=min(m.room_bytes for m in measured), **means)


def costs_to_dict(c: PipelineCosts) -> dict[str, Any]:
    d = asdict(c)
    if math.isinf(c.room_bytes):
        d["room_bytes"] = None  # JSON has no infinity
    return d


def costs_from_dict(d: Mapping[str, Any]) -> PipelineCosts:
    d = dict(d)
    if d.get("room_bytes") is None:
        d.pop("room_bytes", None)
    known = {f.name for f in fields(PipelineCosts)}
    return PipelineCosts(**{k: v for k, v in d.items() if k in known})


def decision_to_dict(x: Decision) -> dict[str, Any]:
    return {"mode": x.mode, "costs": dict(x.costs), "reason": x.reason}


def decision_from_dict(d: Mapping[str, Any]) -> Decision:
    if d.get("mode") not in MODES:
        raise ValueError(f"Decision.mode must be one of {MODES}, got {d.get('mode')!r}")
    return Decision(d["mode"], {k: float(v) for k, v in d["costs"].items()}, str(d["reason"]))
