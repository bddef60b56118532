"""Which datasets may insert into the shared LRU of spare entries: reuse per byte.

The shared LRU (shares.py) gives every benefiting dataset room in proportion to
how fast its jobs miss, not to how much that room gives back. A dataset whose
items are rarely read again before they are evicted -- a large dataset read by
a few jobs whose look-aheads seldom pass over each other's inserts -- fills the
LRU with entries that yield few hits and pushes out those of datasets whose
jobs would have shared them. One LRU cannot tell the two apart; the manager
can, from what clients already report (each batch's hit fraction).

Model, per dataset ``d`` using the LRU, measured while all of them insert:
``R_d`` items read per second by its jobs together, ``h_d`` the fraction that
hit, so ``H_d = h_d R_d`` hits and ``M_d = (1 - h_d) R_d`` inserts per second.
Every insert lives about as long in an LRU, so ``d`` holds a fraction
``M_d / sum M`` of it. If ``d`` stops inserting:

* it loses its hits: ``loss = H_d`` (an upper bound: its jobs still find what
  the others' own reads leave);
* the others get its room. At their present hits per byte that is
  ``H_o * M_d / (sum M - M_d)``, but an LRU shared by ``J`` concurrent jobs
  that read in different orders gives at most ``1 - 1/J`` of a dataset that
  does not fit as hits (each item read from the store once for all of them), so
  their gain is capped by ``sum_o (1 - 1/J_o - h_o)^+ R_o``.

``d`` stops inserting when the capped gain exceeds ``(1 + margin)`` times its
loss; greedily, the dataset with the fewest hits per insert first, at most all
but one. A hit is counted as one store read saved: with one shared store every
read saved speeds up whoever is waiting on it. Rates are in batches when
batch sizes are unknown (the manager's reports carry no item counts), which
is exact for jobs with equal batch sizes.

``AdmissionBoard`` runs this as a state machine per configuration (the jobs,
their datasets, the LRU's users and the budget):

    MEASURING --(settle_s, then measure_s of reports from every user)--> DECIDED
        ^                                                                  |
        +---------------- the configuration changed (all insert again) ----+

Measurements are taken with everyone inserting; a decision stands until the
configuration changes (the others' hit fractions after an exclusion say nothing
about the excluded dataset).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .probing import Batch


@dataclass(frozen=True)
class SpareUse:
    """A dataset's use of the shared LRU: ``jobs`` concurrent jobs reading ``rate``
    items (or batches) per second together, a fraction ``hit`` of them cache hits."""
    dataset: str
    jobs: int
    rate: float
    hit: float

    @property
    def hits(self) -> float:
        return self.hit * self.rate

    @property
    def inserts(self) -> float:
        return (1.0 - self.hit) * self.rate

    @property
    def headroom(self) -> float:
        """Hits per second more room could add at most: up to ``1 - 1/J`` of its reads."""
        return max(0.0, 1.0 - 1.0 / max(1, self.jobs) - self.hit) * self.rate


def _gain_if_excluded(d: SpareUse, others: Sequence[SpareUse]) -> float:
    m_others = sum(o.inserts for o in others)
    if not others or m_others <= 0:
        return 0.0
    linear = sum(o.hits for o in others) * d.inserts / m_others
    return min(linear, sum(o.headroom for o in others))


def spare_exclusions(uses: Iterable[SpareUse], margin: float = 0.25) -> dict[str, str]:
    """Datasets that should stop inserting spare entries, with the reason. Greedy:
    the fewest hits per insert first, while the others' capped gain beats the loss."""
    left = sorted((u for u in uses if u.rate > 0), key=lambda u: (u.hit, u.dataset))
    out: dict[str, str] = {}
    for _ in range(len(left)):
        if len(left) < 2:
            break
        d, others = left[0], left[1:]
        gain, loss = _gain_if_excluded(d, others), d.hits
        if gain <= (1.0 + margin) * loss:
            break
        out[d.dataset] = (f"inserts nothing: its {d.jobs} job(s) hit {d.hit:.0%} of their reads in the shared "
                          f"LRU; the room its misses take would give the others {gain:.3g} hits/s "
                          f"against the {loss:.3g} hits/s it gets")
        left = others
    return out


@dataclass(frozen=True)
class AdmissionConfig:
    enabled: bool = True        # False: every benefiting dataset inserts (one plain shared LRU)
    settle_s: float = 120.0     # after a change: the LRU refills before anything is counted
    measure_s: float = 300.0    # then this long of reports
    min_batches: int = 20       # per dataset in the window
    margin: float = 0.25        # the gain must beat the loss by this much (noise)

    def __post_init__(self) -> None:
        for name in ("settle_s", "measure_s", "margin"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"admission {name} must be >= 0, not {getattr(self, name)!r}")
        if self.min_batches < 1:
            raise ValueError(f"admission min_batches must be >= 1, not {self.min_batches!r}")


@dataclass
class AdmissionBoard:
    """Measures the LRU's users and decides who inserts; journalable (to_dict)."""
    key: str = ""
    since: float = 0.0
    decided: bool = False
    acc: dict[str, list[float]] = field(default_factory=dict)   # dataset -> [batches, hit sum]
    excluded: dict[str, str] = field(default_factory=dict)

    def observe(self, dataset: str, batches: Iterable[Batch], cfg: AdmissionConfig) -> None:
        """Count a job's reported batches (those that started after the settle time)."""
        if self.decided or not self.key:
            return
        start = self.since + cfg.settle_s
        a = self.acc.get(dataset)
        for b in batches:
            if b.hit_ratio is None or b.end - b.duration < start or a is None:
                continue
            a[0] += 1
            a[1] += b.hit_ratio

    def step(self, jobs: Mapping[str, str], users: Iterable[str], budget: int, now: float,
             cfg: AdmissionConfig) -> bool:
        """``jobs``: job -> dataset; ``users``: datasets that insert spare entries.
        Returns whether the exclusions changed."""
        users = sorted(set(users)) if cfg.enabled else []
        key = f"{budget}|" + ",".join(users) + "|" + ",".join(f"{j}={d}" for j, d in sorted(jobs.items()))
        before = dict(self.excluded)
        if key != self.key:
            self.key, self.since, self.decided, self.excluded = key, now, False, {}
            self.acc = {d: [0.0, 0.0] for d in users} if len(users) > 1 else {}
        elif not self.decided and self.acc and now >= self.since + cfg.settle_s + cfg.measure_s:
            if all(a[0] >= cfg.min_batches for a in self.acc.values()):
                span = now - self.since - cfg.settle_s
                counts = {d: sum(1 for x in jobs.values() if x == d) for d in self.acc}
                uses = [SpareUse(d, counts[d], a[0] / span, a[1] / a[0]) for d, a in sorted(self.acc.items())]
                self.excluded, self.decided = spare_exclusions(uses, cfg.margin), True
        return self.excluded != before

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "since": self.since, "decided": self.decided,
                "acc": {k: list(v) for k, v in sorted(self.acc.items())}, "excluded": dict(self.excluded)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AdmissionBoard":
        return cls(str(d.get("key", "")), float(d.get("since", 0.0)), bool(d.get("decided", False)),
                   {k: [float(x) for x in v] for k, v in d.get("acc", {}).items()},
                   {k: str(v) for k, v in d.get("excluded", {}).items()})
