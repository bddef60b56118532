"""Benefit without bypass probes: regress mini-batch time on the batch's miss fraction.

A job reading through a cache that holds part of its dataset sees batches with
different miss fractions ``m = 1 - hit_ratio`` (substitutable hits come first,
spare entries come and go). With a pipelined loader ``t ~ max(t_hit, m * t_miss)``;
a least-squares line through the reported ``(m, t)`` pairs, read at ``m = 0``
and ``m = 1``, estimates ``t_hit`` and ``t_miss`` with no batch run slower for
the measurement. The line under-reads the hinge a little (it averages the flat
part with the rising one), so ``b`` comes out conservative.

The estimate is only *confident* with enough samples spread over enough miss
fractions; otherwise the caller falls back to a bypass probe (probing.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Estimate:
    t_hit: float
    t_miss: float
    benefit: float
    n: int
    spread: float        # standard deviation of the miss fractions seen
    rel_stderr: float    # standard error of t_miss, relative to it


def regress_benefit(obs: Sequence[tuple[float, float]], min_n: int = 30, min_spread: float = 0.1,
                    max_rel_stderr: float = 0.15) -> Estimate | None:
    """``obs``: (miss fraction, batch seconds) pairs. None when too few samples,
    too little spread in the miss fraction, or too noisy a fit."""
    pts = [(min(1.0, max(0.0, m)), t) for m, t in obs if t > 0 and math.isfinite(t)]
    n = len(pts)
    if n < min_n:
        return None
    mx = sum(m for m, _ in pts) / n
    my = sum(t for _, t in pts) / n
    sxx = sum((m - mx) ** 2 for m, _ in pts)
    spread = math.sqrt(sxx / n)
    if spread < min_spread:
        return None
    slope = sum((m - mx) * (t - my) for m, t in pts) / sxx
    icpt = my - slope * mx
    resid = sum((t - icpt - slope * m) ** 2 for m, t in pts) / max(1, n - 2)
    # t_miss = icpt + slope: its variance from the usual OLS formulas at m = 1
    se = math.sqrt(resid * (1.0 / n + (1.0 - mx) ** 2 / sxx))
    fastest = min(t for _, t in pts)
    t_hit = max(icpt, fastest)  # the line can dip below every batch seen: no batch was faster
    t_miss = max(icpt + slope, t_hit)
    rel = se / t_miss
    if rel > max_rel_stderr:
        return None
    return Estimate(t_hit, t_miss, t_miss / t_hit, n, spread, rel)
