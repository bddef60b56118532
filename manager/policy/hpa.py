"""The Kubernetes Horizontal Pod Autoscaler's rule on CPU utilisation, as the
peer the autoscaling benchmark compares Cachew's rule against (Cachew section
6.2 uses it at an 80% target).

``desired = ceil(current x utilisation / target)``, left unchanged while the
ratio is within ``tolerance`` of 1 (Kubernetes' default 10%), clamped to
[min, max]. Scaling down follows the highest recommendation of the last
``stabilization`` measurements (Kubernetes' downscale stabilisation window),
so a brief dip does not drop workers. Explicit state: the recent
recommendations.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from .scaling import Change, Measurement


@dataclass(frozen=True)
class HpaConfig:
    target: float = 0.8
    tolerance: float = 0.1
    stabilization: int = 5      # measurements in the scale-down window
    min_workers: int = 1
    max_workers: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.target <= 1 or self.tolerance < 0 or self.stabilization < 1:
            raise ValueError(f"need 0 < target <= 1, tolerance >= 0, stabilization >= 1, got "
                             f"{self.target}, {self.tolerance}, {self.stabilization}")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got "
                             f"{self.min_workers}, {self.max_workers}")


def hpa_desired(current: int, utilisation: float, config: HpaConfig = HpaConfig()) -> int:
    """One HPA recommendation, without the stabilisation window."""
    ratio = utilisation / config.target
    if abs(ratio - 1.0) <= config.tolerance:
        return current
    # a tiny epsilon so 0.8/0.8 * 10 does not ceil to 11 on float error
    return min(config.max_workers, max(config.min_workers, math.ceil(current * ratio - 1e-9)))


@dataclass
class HpaScaler:
    config: HpaConfig = field(default_factory=HpaConfig)
    workers: int = 1
    recent: list[int] = field(default_factory=list)   # recommendations, newest last

    def observe(self, m: Measurement) -> Change | None:
        want = hpa_desired(self.workers, m.cpu, self.config)
        self.recent = (self.recent + [want])[-self.config.stabilization:]
        # up at once; down only as far as the highest recent recommendation
        target = want if want > self.workers else min(self.workers, max(self.recent))
        if target == self.workers:
            return None
        delta, self.workers = target - self.workers, target
        return Change(delta, 0, target, 0, f"cpu {m.cpu:.0%} vs target {self.config.target:.0%}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HpaScaler":
        return cls(HpaConfig(**d["config"]), d["workers"], list(d["recent"]))
