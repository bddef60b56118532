"""The arithmetic of the autoscaler's fast climb (autoscale.py, ``climb="ramp"``):
how to read one growth step's gain against the gain it should have brought, and
which count to probe next while bracketing the smallest count on the plateau.
Pure functions of measured batch times; the state lives in autoscale.Autoscaler.

While workers are the bottleneck, batch time falls in proportion to their count
(``b(m) = b(n) x n / m``), so a step from n to m workers should bring a relative
gain of ``1 - n / m``. A step that brings at least a share of that (0.9 by
default) says the plateau is still above m; one that brings more than the
threshold but less says the plateau was reached inside the step, or that gains
are flattening; one that brings no more than the threshold says n was already
on the plateau.
"""
from __future__ import annotations

import math
from enum import Enum


class Gain(str, Enum):
    LINEAR = "linear"     # about the expected gain: keep ramping, with a larger step
    PARTIAL = "partial"   # more than the threshold, clearly less than expected: step by one
    NONE = "none"         # at most the threshold: the count before the step was on the plateau


def expected_gain(n: int, m: int) -> float:
    """Relative batch-time gain of going from n to m workers while they are the bottleneck."""
    return 1.0 - n / m


def judge_step(n: int, before: float, m: int, after: float, threshold: float, share: float) -> Gain:
    """Batch times ``before`` at n workers and ``after`` at m > n workers. LINEAR when
    the gain is at least ``share`` of the expected one: relative, so a big step judged
    under load (4 -> 8 bringing 46% of an expected 50%) counts as linear as a small one does."""
    gain = 1.0 - after / before
    if gain <= threshold:
        return Gain.NONE
    return Gain.LINEAR if gain >= share * expected_gain(n, m) else Gain.PARTIAL


def next_probe(lo: int, lo_time: float, hi: int, plateau: float) -> int:
    """The count to try inside the bracket (lo, hi): lo is known to be slower than the
    plateau by more than the threshold, hi to be on it. The linear model's estimate of
    the count that reaches the plateau from lo, kept strictly inside the bracket, so
    every probe narrows it (at worst one count per probe, like Cachew's own walk)."""
    if hi - lo < 2:
        raise ValueError(f"no count strictly between {lo} and {hi}")
    estimate = math.ceil(lo * lo_time / plateau - 1e-9)
    return min(hi - 1, max(lo + 1, estimate))


def on_plateau(batch_time: float, plateau: float, threshold: float) -> bool:
    return batch_time <= plateau * (1.0 + threshold)
