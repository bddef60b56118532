"""Autoscaling of one job's preprocessing workers (Cachew section 4.3), as an
explicit state machine fed one Measurement per window of batches.

States and transitions (``observe(m)`` is the only event; every change sets
``settle_left = settle``, and the next ``settle`` measurements are dropped
because they straddle the change -- Cachew pauses metric collection)::

    GROWING  (ref = measurement with one worker fewer, or None)
      -- ref is None --------------------------------> ref := m; add one    (GROWING)
      -- m improves on ref by > threshold ------------> ref := m; add one    (GROWING)
                         (at max_workers: conv := m ----------------------> CONVERGED)
      -- m improves by <= threshold ------------------> remove the worker that did
                         not help; conv := ref ---------------------------> CONVERGED
    CONVERGED (conv = batch time and queue recorded at convergence)
      every ``recheck_every`` measurements:
      -- batch time > conv x (1 + threshold) ---------> ref := m; add one    (GROWING)
      -- queue > conv.queue x (1 + queue_growth) + queue_slack
                                                 ---> remove one           (SHRINKING)
    SHRINKING (conv kept as the reference; ref = the measurement that started it)
      -- batch time > conv x (1 + threshold) ---------> add the last one back;
                         conv.queue := max(conv.queue, ref.queue) ----------> (CONVERGED)
      -- queue still above the bar, above min --------> remove one           (SHRINKING)
      -- otherwise -----------------------------------> conv.queue := m.queue (CONVERGED)

Better than the paper: the worker whose addition did not help is removed again
(Cachew keeps it), so the job converges on the smallest count on the plateau;
``queue_slack`` keeps an empty queue at convergence from turning noise into
removals; a shrink that had to be undone raises the recorded queue size, so a
count whose queue runs full without being removable is not probed again at
every re-check. Counts stay within [min_workers, max_workers].
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, Mapping

from .scaling import Change, Measurement, relative


class ScalePhase(str, Enum):
    GROWING = "growing"
    CONVERGED = "converged"
    SHRINKING = "shrinking"


@dataclass(frozen=True)
class AutoscaleConfig:
    threshold: float = 0.03      # relative batch-time gain a worker must bring (Cachew: 3%)
    settle: int = 1              # measurements dropped after each change
    recheck_every: int = 10      # measurements between re-checks once converged
    queue_growth: float = 0.4    # queue this much above its converged size: remove a worker
    queue_slack: float = 2.0     # plus this many items, so an empty queue is not noise-bait
    min_workers: int = 1
    max_workers: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.threshold < 1:
            raise ValueError(f"threshold must be in [0, 1), got {self.threshold}")
        if self.settle < 0 or self.recheck_every < 1:
            raise ValueError(f"need settle >= 0 and recheck_every >= 1, got "
                             f"{self.settle}, {self.recheck_every}")
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ValueError(f"need 0 <= min_workers <= max_workers, max_workers >= 1, got "
                             f"{self.min_workers}, {self.max_workers}")


@dataclass
class Autoscaler:
    """One job's worker count. Start with ``Autoscaler.start(config)``; call
    ``observe`` with each measurement and carry out the Change it returns."""
    config: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    workers: int = 1
    phase: ScalePhase = ScalePhase.GROWING
    settle_left: int = 0
    ref: Measurement | None = None    # GROWING: measured with one worker fewer
    conv: Measurement | None = None   # CONVERGED / SHRINKING: recorded at convergence
    since_check: int = 0

    @classmethod
    def start(cls, config: AutoscaleConfig | None = None, workers: int | None = None) -> "Autoscaler":
        cfg = config or AutoscaleConfig()
        n = max(1, cfg.min_workers) if workers is None else workers
        if not cfg.min_workers <= n <= cfg.max_workers:
            raise ValueError(f"workers={n} is outside [{cfg.min_workers}, {cfg.max_workers}]")
        return cls(cfg, n)

    @property
    def converged(self) -> bool:
        return self.phase is ScalePhase.CONVERGED

    def observe(self, m: Measurement) -> Change | None:
        if self.settle_left > 0:
            self.settle_left -= 1
            return None
        if self.phase is ScalePhase.GROWING:
            return self._grow(m)
        if self.phase is ScalePhase.SHRINKING:
            return self._shrink(m)
        return self._recheck(m)

    def regrow(self, m: Measurement) -> Change | None:
        """Batch time degraded at the current count: add a worker and grow
        again from here (used by the placement policy after it converged)."""
        self.phase, self.ref = ScalePhase.GROWING, m
        if self.workers >= self.config.max_workers:
            return self._converge(m)
        return self._change(+1, "batch time degraded: add a worker")

    # -- transitions
    def _grow(self, m: Measurement) -> Change | None:
        cfg = self.config
        if self.ref is not None and -relative(m.batch_time, self.ref.batch_time) <= cfg.threshold:
            conv = self.ref
            self.phase, self.conv, self.ref, self.since_check = ScalePhase.CONVERGED, conv, None, 0
            return self._change(-1, "the last worker improved batch time by <= threshold")
        first, self.ref = self.ref is None, m
        if self.workers >= cfg.max_workers:
            return self._converge(m)
        return self._change(+1, "first measurement: try one more worker" if first else
                            "the last worker improved batch time by > threshold")

    def _recheck(self, m: Measurement) -> Change | None:
        cfg, conv = self.config, self.conv
        assert conv is not None
        self.since_check += 1
        if self.since_check < cfg.recheck_every:
            return None
        self.since_check = 0
        if relative(m.batch_time, conv.batch_time) > cfg.threshold:
            return self.regrow(m)
        if self._queue_high(m) and self.workers > cfg.min_workers:
            self.phase, self.ref = ScalePhase.SHRINKING, m
            return self._change(-1, "queue well above its size at convergence")
        return None

    def _shrink(self, m: Measurement) -> Change | None:
        cfg, conv = self.config, self.conv
        assert conv is not None
        if relative(m.batch_time, conv.batch_time) > cfg.threshold:
            # this count's queue is as high as it was: not a reason to shrink again
            high = max(conv.queue, self.ref.queue if self.ref else 0.0)
            self.phase, self.since_check = ScalePhase.CONVERGED, 0
            self.conv, self.ref = replace(conv, queue=high), None
            return self._change(+1, "removal slowed batches: add the worker back")
        if self._queue_high(m) and self.workers > cfg.min_workers:
            return self._change(-1, "queue still well above its size at convergence")
        return self._converge(replace(conv, queue=m.queue))

    def _converge(self, m: Measurement) -> None:
        self.phase, self.conv, self.ref, self.since_check = ScalePhase.CONVERGED, m, None, 0
        return None

    def _queue_high(self, m: Measurement) -> bool:
        assert self.conv is not None
        return m.queue > self.conv.queue * (1 + self.config.queue_growth) + self.config.queue_slack

    def _change(self, delta: int, reason: str) -> Change:
        self.workers += delta
        self.settle_left = self.config.settle
        return Change(delta, 0, self.workers, 0, reason)

    # -- journal
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Autoscaler":
        def meas(x: Mapping[str, Any] | None) -> Measurement | None:
            return None if x is None else Measurement(**x)
        return cls(AutoscaleConfig(**d["config"]), d["workers"], ScalePhase(d["phase"]),
                   d["settle_left"], meas(d["ref"]), meas(d["conv"]), d["since_check"])
