"""Autoscaling of one job's preprocessing workers (Cachew section 4.3), as an
explicit state machine fed one Measurement per window of batches.

Two climbs from the starting count (``AutoscaleConfig.climb``):

* ``"ramp"`` (the default, ours): a galloping climb, then a bracketing search.
  RAMPING steps from the last accepted count ``hi`` to ``hi + step`` and judges
  the gain against the gain the step should bring while workers are the
  bottleneck (climb.judge_step): at least ``linear_share`` of it (relative, so
  a big step judged under load is not held to a few absolute points) doubles
  the step; more than the threshold but less resets it to one (gains are
  flattening: walk on one at a time, as Cachew does); no more than
  the threshold means ``hi`` was on the plateau. REFINING then searches the
  bracket (lo, hi] -- lo known slower than the plateau by more than the
  threshold -- for the smallest count within the threshold of the plateau,
  probing the linear model's estimate (climb.next_probe), and settles
  ``headroom`` workers above it. From one worker to a plateau at 13 this visits
  1, 2, 4, 8, 16, 17, 13, 12 -> 14: on the plateau after four changes instead
  of twelve.
* ``"cachew"``: the paper's rule, one worker per measurement (GROWING below).

States and transitions (``observe(m)`` is the only event; every change sets
``settle_left = settle``, and the next ``settle`` measurements are dropped
because they straddle the change -- Cachew pauses metric collection)::

    RAMPING  (hi = last accepted count, hi_m its measurement, None at the start;
              lo = the accepted count before it, start - 1 at first; step)
      -- hi_m is None -------------------------------> hi := n; add step (1)   (RAMPING)
      -- gain LINEAR ---> lo := hi; hi := n; step x 2; add step               (RAMPING)
      -- gain PARTIAL --> lo := hi; hi := n; step := 1; add step              (RAMPING)
                         (at max_workers: conv := m ---------------------> CONVERGED)
      -- gain NONE -----> plateau := max(hi_m, m) batch time; top := n; a probe in
                          (lo, hi), or SETTLE when none is left
    REFINING (lo, hi, plateau)
      -- m within threshold of the plateau --> hi := n;                   then
      -- otherwise --------------------------> lo := n;                   then
         a probe in (lo, hi) (REFINING), or SETTLE
    SETTLE: go to h = max(hi, min(hi + headroom, top, max_workers)) where hi is known
            to be the smallest (lo measured slower, or lo below min_workers); else h = hi
         h = hi: conv := hi_m -------------------------------------------> CONVERGED
         h > hi: ----------------------------------------------------------> SETTLING
    SETTLING (the count is h; nothing measured there yet)
      -- any m ------> conv := m, its batch time at most the plateau's    (CONVERGED)
    GROWING  (climb "cachew"; ref = measurement with one worker fewer, or None)
      -- ref is None --------------------------------> ref := m; add one    (GROWING)
      -- m improves on ref by > threshold ------------> ref := m; add one    (GROWING)
                         (at max_workers: conv := m ----------------------> CONVERGED)
      -- m improves by <= threshold ------------------> remove the worker that did
                         not help; conv := ref ---------------------------> CONVERGED
    CONVERGED (conv = batch time and queue recorded at convergence)
      every ``recheck_every`` measurements, on the interval's mean (m):
      -- batch time > conv x (1 + threshold) ---------> ref := the last window; add
                                                   one (GROWING, or RAMPING from step 1)
      -- queue > conv.queue x (1 + queue_growth) + queue_slack, at the first
         re-check after the ramp settled -------------> conv.queue := m.queue (CONVERGED)
         (the settle's one window saw the queue still filling after the move)
      -- the same, later ---------> top := n; remove one                (SHRINKING)
    SHRINKING (conv kept as the reference; ref = the measurement that started it)
      -- batch time > conv x (1 + threshold) ---------> add the last one back, and the
                         headroom up to top (the ramp only);
                         conv.queue := max(conv.queue, ref.queue) ----------> (CONVERGED)
      -- queue still above the bar, above min --------> remove one           (SHRINKING)
      -- otherwise -----------------------------------> conv.queue := m.queue (CONVERGED)

Better than the paper: the worker whose addition did not help is removed again
(Cachew keeps it), so the job finds the smallest count on the plateau; the ramp
then keeps ``headroom`` workers above it (default 1, 0 settles on the smallest
count): "within the threshold of the plateau" allows that count to be up to 3%
slower, and a count whose production is barely above demand lets the queue run
dry on every jitter. The headroom never goes above ``top``, the highest count
measured on the plateau, nor above max_workers. A shrink (the queue grew: the
work got cheaper) that stops because the queue fell back under its bar keeps
that count: the bar is its margin; one undone because batch time suffered found
the smallest count again and restores the headroom, at most to where it began,
whose queue is the one recorded. ``climb="cachew"`` takes no headroom;
``queue_slack`` keeps an empty queue at convergence from turning noise into
removals; a shrink that had to be undone raises the recorded queue size, so a
count whose queue runs full without being removable is not probed again at
every re-check; the re-check judges the interval's mean, not one noisy window.
Counts stay within [min_workers, max_workers].
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, Mapping

from .climb import Gain, judge_step, next_probe, on_plateau
from .scaling import Change, Measurement, relative

CLIMBS = ("ramp", "cachew")


class ScalePhase(str, Enum):
    RAMPING = "ramping"
    REFINING = "refining"
    GROWING = "growing"
    CONVERGED = "converged"
    SHRINKING = "shrinking"
    SETTLING = "settling"


@dataclass(frozen=True)
class AutoscaleConfig:
    threshold: float = 0.03      # relative batch-time gain a worker must bring (Cachew: 3%)
    settle: int = 1              # measurements dropped after each change
    recheck_every: int = 10      # measurements between re-checks once converged
    queue_growth: float = 0.4    # queue this much above its converged size: remove a worker
    queue_slack: float = 2.0     # plus this many items, so an empty queue is not noise-bait
    min_workers: int = 1
    max_workers: int = 64
    climb: str = "ramp"          # "ramp" (ours: gallop, then bracket) or "cachew" (one at a time)
    linear_share: float = 0.9    # a ramp step bringing this share of its expected gain is linear
    headroom: int = 1            # the ramp settles this many workers above the plateau's smallest count

    def __post_init__(self) -> None:
        if self.climb not in CLIMBS:
            raise ValueError(f"climb must be one of {CLIMBS}, got {self.climb!r}")
        if not 0 < self.linear_share <= 1:
            raise ValueError(f"linear_share must be in (0, 1], got {self.linear_share}")
        if isinstance(self.headroom, bool) or not isinstance(self.headroom, int) or self.headroom < 0:
            raise ValueError(f"headroom must be a whole number >= 0, got {self.headroom!r}")
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
    check_sum: tuple[float, float] = (0.0, 0.0)   # batch time, queue summed since the last re-check
    # RAMPING / REFINING: lo is slower than the plateau, hi (measured hi_m) is on it
    lo: int = 0
    lo_m: Measurement | None = None
    hi: int = 0
    hi_m: Measurement | None = None
    step: int = 1
    plateau: float | None = None
    top: int = 0    # the highest count measured on the plateau: headroom stays at or below it
    fresh_bar: bool = False  # conv.queue is one window's right after a settle: the first re-check re-bases it

    @classmethod
    def start(cls, config: AutoscaleConfig | None = None, workers: int | None = None) -> "Autoscaler":
        cfg = config or AutoscaleConfig()
        n = max(1, cfg.min_workers) if workers is None else workers
        if not cfg.min_workers <= n <= cfg.max_workers:
            raise ValueError(f"workers={n} is outside [{cfg.min_workers}, {cfg.max_workers}]")
        return cls.resume(cfg, n)

    @classmethod
    def resume(cls, config: AutoscaleConfig, workers: int) -> "Autoscaler":
        """The configured climb from a count this policy did not choose (a job's counts
        after a manager restart; the placement policy's remote workers, which local ones
        may leave at 0): not checked against [min_workers, max_workers]."""
        scaler = cls(config, workers)
        if config.climb == "ramp":
            scaler._ramp_from(None)
        return scaler

    @property
    def converged(self) -> bool:
        return self.phase is ScalePhase.CONVERGED

    def observe(self, m: Measurement) -> Change | None:
        if self.settle_left > 0:
            self.settle_left -= 1
            return None
        if self.phase is ScalePhase.RAMPING:
            return self._ramp(m)
        if self.phase is ScalePhase.REFINING:
            return self._refine(m)
        if self.phase is ScalePhase.GROWING:
            return self._grow(m)
        if self.phase is ScalePhase.SHRINKING:
            return self._shrink(m)
        if self.phase is ScalePhase.SETTLING:
            return self._settled(m)
        return self._recheck(m)

    def regrow(self, m: Measurement) -> Change | None:
        """Batch time degraded at the current count: add a worker and grow
        again from here (used by the placement policy after it converged)."""
        if self.config.climb == "ramp":
            self._ramp_from(m)
            return self._ramp_up("batch time degraded: add a worker")
        self.phase, self.ref = ScalePhase.GROWING, m
        if self.workers >= self.config.max_workers:
            return self._converge(m)
        return self._change(+1, "batch time degraded: add a worker")

    # -- transitions: the ramp (climb "ramp")
    def _ramp_from(self, m: Measurement | None) -> None:
        self.phase, self.step, self.plateau = ScalePhase.RAMPING, 1, None
        self.lo, self.lo_m, self.hi, self.hi_m = self.workers - 1, None, self.workers, m

    def _ramp(self, m: Measurement) -> Change | None:
        if self.hi_m is None:
            self.hi_m = m
            return self._ramp_up("first measurement: try one more worker")
        cfg, n = self.config, self.workers
        gain = judge_step(self.hi, self.hi_m.batch_time, n, m.batch_time, cfg.threshold, cfg.linear_share)
        if gain is Gain.NONE:   # hi and n both sample the plateau: the higher, so noise in
            # one window does not make every count below look slower than the plateau
            self.phase, self.plateau = ScalePhase.REFINING, max(self.hi_m.batch_time, m.batch_time)
            self.top = n
            return self._probe(f"{n - self.hi} more worker(s) improved batch time by <= threshold")
        self.lo, self.lo_m, self.hi, self.hi_m = self.hi, self.hi_m, n, m
        self.step = 2 * self.step if gain is Gain.LINEAR else 1
        return self._ramp_up(f"{gain.value} gain: try {self.step} more")

    def _ramp_up(self, reason: str) -> Change | None:
        target = min(self.config.max_workers, self.hi + self.step)
        if target <= self.workers:
            assert self.hi_m is not None
            return self._converge(self.hi_m)
        return self._change(target - self.workers, reason)

    def _refine(self, m: Measurement) -> Change | None:
        assert self.plateau is not None
        if on_plateau(m.batch_time, self.plateau, self.config.threshold):
            self.hi, self.hi_m = self.workers, m
            return self._probe(f"{self.workers} on the plateau: try fewer")
        self.lo, self.lo_m = self.workers, m
        return self._probe(f"{self.workers} slower than the plateau: try more")

    def _probe(self, reason: str) -> Change | None:
        """Go to the next count to try in (lo, hi), or settle on hi when none is left."""
        assert self.hi_m is not None and self.plateau is not None
        if self.hi - self.lo < 2 or self.lo_m is None:
            return self._settle(reason)
        target = next_probe(self.lo, self.lo_m.batch_time, self.hi, self.plateau)
        return self._change(target - self.workers, f"{reason}: probe {target}")

    def _settle(self, reason: str) -> Change | None:
        """Settle on hi, the smallest count found on the plateau, plus the headroom. At hi
        itself, hi's measurement is the one recorded at convergence; above it, the first
        measurement at the settled count is (SETTLING), so the re-check's queue bar is the
        queue the headroom worker builds, not a reason to remove it."""
        assert self.hi_m is not None
        # hi is known to be the smallest when the count under it was measured slower, or
        # is none; not after a regrow (or resume) whose first step brought nothing: the
        # count before it, which holds its headroom already, is kept (no ratchet)
        smallest = self.lo_m is not None or self.lo < max(1, self.config.min_workers)
        target = self._with_headroom(self.hi) if smallest else self.hi
        if target == self.hi:
            self._converge(self.hi_m, fresh_bar=True)
        else:
            self.phase, self.lo_m, self.hi_m = ScalePhase.SETTLING, None, None
            reason = f"{reason}; {target - self.hi} worker(s) of headroom"
        return self._change(target - self.workers, f"{reason}; settle on {target}") \
            if target != self.workers else None

    def _settled(self, m: Measurement) -> None:
        """SETTLING -> CONVERGED: the queue bar is the headroom count's queue; the batch-time
        reference stays the plateau's (one window after a move is no judged measurement:
        a slow one recorded as the reference would hide a real slowdown from the re-check)."""
        ref = m.batch_time if self.plateau is None else min(m.batch_time, self.plateau)
        self._converge(replace(m, batch_time=ref), fresh_bar=True)

    def _with_headroom(self, n: int) -> int:
        """n, the smallest count known on the plateau, plus the ramp's headroom, capped at
        max_workers and at ``top``, the highest count measured on the plateau: never above
        it. Cachew's climb keeps the paper's rule."""
        extra = self.config.headroom if self.config.climb == "ramp" else 0
        return max(n, min(n + extra, self.top, self.config.max_workers))

    # -- transitions: Cachew's rule (climb "cachew")
    def _grow(self, m: Measurement) -> Change | None:
        cfg = self.config
        if self.ref is not None and -relative(m.batch_time, self.ref.batch_time) <= cfg.threshold:
            self._converge(self.ref)
            return self._change(-1, "the last worker improved batch time by <= threshold")
        first, self.ref = self.ref is None, m
        if self.workers >= cfg.max_workers:
            return self._converge(m)
        return self._change(+1, "first measurement: try one more worker" if first else
                            "the last worker improved batch time by > threshold")

    def _recheck(self, last: Measurement) -> Change | None:
        cfg, conv = self.config, self.conv
        assert conv is not None
        self.since_check += 1
        self.check_sum = (self.check_sum[0] + last.batch_time, self.check_sum[1] + last.queue)
        if self.since_check < cfg.recheck_every:
            return None
        # the interval's mean, not its last window: one noisy window must not add a worker
        m = Measurement(self.check_sum[0] / self.since_check, self.check_sum[1] / self.since_check)
        self.since_check, self.check_sum = 0, (0.0, 0.0)
        fresh, self.fresh_bar = self.fresh_bar, False
        if relative(m.batch_time, conv.batch_time) > cfg.threshold:
            return self.regrow(last)      # the climb's reference: batch time as it is now
        if fresh and self._queue_high(m):  # the queue was still filling after the move: the bar is this
            self.conv = replace(conv, queue=m.queue)  # interval's, not a reason to remove a worker
            return None
        if self._queue_high(m) and self.workers > cfg.min_workers:
            self.phase, self.ref, self.top = ScalePhase.SHRINKING, m, self.workers
            return self._change(-1, "queue well above its size at convergence")
        return None

    def _shrink(self, m: Measurement) -> Change | None:
        cfg, conv = self.config, self.conv
        assert conv is not None
        if relative(m.batch_time, conv.batch_time) > cfg.threshold:
            # workers + 1 is the smallest count on the plateau: back to it plus the headroom,
            # at most to where the shrink began, whose queue (ref's) is as high as it was:
            # not a reason to shrink again
            high = max(conv.queue, self.ref.queue if self.ref else 0.0)
            target = self._with_headroom(self.workers + 1)
            self._converge(replace(conv, queue=high))
            return self._change(target - self.workers, "removal slowed batches: add the worker back"
                                + (" and the headroom" if target > self.workers + 1 else ""))
        if self._queue_high(m) and self.workers > cfg.min_workers:
            return self._change(-1, "queue still well above its size at convergence")
        return self._converge(replace(conv, queue=m.queue))

    def _converge(self, m: Measurement, fresh_bar: bool = False) -> None:
        """fresh_bar: m's queue is one window's right after the ramp settled (see fresh_bar)."""
        self.phase, self.conv, self.ref, self.since_check = ScalePhase.CONVERGED, m, None, 0
        self.fresh_bar = fresh_bar
        self.check_sum = (0.0, 0.0)
        self.lo_m = self.hi_m = None
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
        config = dict(d["config"])
        # linear_slack (absolute points) has no exact relative equivalent: the default share
        config.pop("linear_slack", None)
        # a state without top (from before the headroom) settles without headroom: max(n, ...)
        fields = dict(d, config=AutoscaleConfig(**config), phase=ScalePhase(d["phase"]))
        for name in ("ref", "conv", "lo_m", "hi_m"):
            fields[name] = meas(d.get(name))
        fields["check_sum"] = tuple(d.get("check_sum", (0.0, 0.0)))
        if "check_sum" not in d:  # a state from before the mean: its windows so far were not summed
            fields["since_check"] = 0
        return cls(**fields)
