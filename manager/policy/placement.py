"""AutoPlacement of preprocessing workers between the trainer's host (local,
a sunk cost) and remote CPU machines (paid for): Pecan section 5.1,
Algorithm 1, as an explicit state machine fed one Measurement per window.

Batch cost is ``batch_time x (trainer_price x trainers + worker_price x remote)``;
prices are configuration (any unit, only their ratio matters).

States and transitions (each change sets ``settle_left = settle``; the next
``settle`` measurements are dropped because they straddle the change)::

    REMOTE (local = 0; Cachew's rule, autoscale.Autoscaler, on remote workers)
      -- the autoscaler converged -----------> bpt_conv := its batch time;
                                               iteration starts       (ADD_LOCAL)
    ADD_LOCAL (good = last measurement at an accepted count, None at the start)
      -- good is None, no remote worker left to replace ------------> end
      -- good is None --------------------------> good := m; add a local worker
                     (at max_local: ref_cost := cost(m); remove a remote one  (REMOVE_REMOTE))
      -- batch time / bpt_conv - 1 >= T --------> remove that local worker; ref_cost
                                                  := cost(good); remove a remote one
                                                                        (REMOVE_REMOTE)
      -- otherwise ------------------------------> good := m; ref_cost := cost(m);
                                                  remove a remote one           (TRIM)
    TRIM (the local workers replace remote ones, one removal at a time)
      -- cost <= ref_cost and batch time within slowdown_guard of bpt_conv
                 -----> ref_cost := cost; remove another (none left to remove: end)
      -- otherwise -----> add the last remote worker back and a local worker
                          (at max_local: only the remote one; end)      (ADD_LOCAL)
    REMOVE_REMOTE (Pecan's: local workers no longer help)
      -- as TRIM, except -- otherwise --> add the last remote worker back; end
      end of an iteration: counts as at its start -------------------> CONVERGED
                           else a new iteration -------------------> ADD_LOCAL
    CONVERGED, every recheck_every measurements:
      -- batch time > ref x (1 + T) -------> add a remote worker, Cachew's rule
                                             again from this count          (REMOTE)
         (ref: bpt_conv, or the batch time at the converged counts where the guard
          kept a removal slower than bpt_conv, at most the guard above it)

Pecan adds local workers until one slows batches (or max_local) and only then
removes remote ones. On a host with many spare cores no local worker slows
batches, so it spent the whole run adding them (tools/bench/placement on 16
cores: 15 local workers after 40 s, every remote worker still paid for, cost
1.00x remote-only's). TRIM instead removes remote workers as soon as a local one
keeps batch time, and adds a local worker only when a removal fails: local
workers stop where they have replaced what they can, and no local worker is
added once no remote one is left to replace (they would only take the trainer's
cores). Each iteration adds local workers net and removes remote ones net, so the
loop ends within max_local + max_remote iterations. ``slowdown_guard`` (not in the
paper, None turns it off) keeps the cost rule from trading much throughput for
a cheaper worker bill: a removal that slows batches by more than it is undone.
Phase 1 keeps no headroom above the plateau by default (``headroom`` 0, unlike
AutoscaleConfig's 1): the remote count it ends on is only where TRIM starts, and
TRIM would take a headroom worker back when batch cost does not rise without it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Mapping

from .autoscale import AutoscaleConfig, Autoscaler
from .scaling import Change, Measurement, relative


class PlacePhase(str, Enum):
    REMOTE = "remote"
    ADD_LOCAL = "add_local"
    TRIM = "trim"
    REMOVE_REMOTE = "remove_remote"
    CONVERGED = "converged"


@dataclass(frozen=True)
class PlacementConfig:
    threshold: float = 0.03          # T
    settle: int = 1
    recheck_every: int = 10
    trainer_price: float = 1.0       # per trainer (accelerator) host, per unit time
    worker_price: float = 0.1        # per remote worker, per unit time
    trainers: int = 1
    max_local: int = 8
    min_remote: int = 0
    max_remote: int = 64
    slowdown_guard: float | None = 0.05
    climb: str = "ramp"              # phase 1's climb: see AutoscaleConfig.climb
    headroom: int = 0                # phase 1's ramp: see AutoscaleConfig.headroom (0: TRIM owns the remote
    #                                  count after phase 1 and would take a headroom worker back by cost)
    linear_share: float = 0.9        # phase 1's ramp: see AutoscaleConfig.linear_share

    def __post_init__(self) -> None:
        if self.trainer_price < 0 or self.worker_price < 0 or self.trainers < 1:
            raise ValueError(f"need prices >= 0 and trainers >= 1, got {self.trainer_price}, "
                             f"{self.worker_price}, {self.trainers}")
        if self.max_local < 0 or not 0 <= self.min_remote <= self.max_remote or self.max_remote < 1:
            raise ValueError(f"need max_local >= 0, 0 <= min_remote <= max_remote >= 1, got "
                             f"{self.max_local}, {self.min_remote}, {self.max_remote}")
        self.autoscale()  # phase 1's settings (climb, threshold, headroom, ...) checked now, not at a job's call

    def autoscale(self) -> AutoscaleConfig:
        # settle is handled here, for every phase alike
        return AutoscaleConfig(threshold=self.threshold, settle=0, recheck_every=self.recheck_every,
                               min_workers=max(1, self.min_remote), max_workers=self.max_remote,
                               climb=self.climb, headroom=self.headroom, linear_share=self.linear_share)

    def cost(self, batch_time: float, remote: int) -> float:
        return batch_time * (self.trainer_price * self.trainers + self.worker_price * remote)


@dataclass
class Placement:
    config: PlacementConfig
    scaler: Autoscaler
    remote: int = 1
    local: int = 0
    phase: PlacePhase = PlacePhase.REMOTE
    settle_left: int = 0
    bpt_conv: float | None = None
    good: Measurement | None = None
    ref_cost: float | None = None
    start: tuple[int, int] = (1, 0)   # (remote, local) when the iteration began
    since_check: int = 0
    settled: float | None = None      # batch time at the counts it converged on (CONVERGED)

    @classmethod
    def start_with(cls, config: PlacementConfig | None = None) -> "Placement":
        """ResetLocal(): one remote worker, no local ones."""
        cfg = config or PlacementConfig()
        scaler = Autoscaler.start(cfg.autoscale())
        return cls(cfg, scaler, scaler.workers, 0, start=(scaler.workers, 0))

    @property
    def converged(self) -> bool:
        return self.phase is PlacePhase.CONVERGED

    def cost(self, m: Measurement) -> float:
        return self.config.cost(m.batch_time, self.remote)

    def observe(self, m: Measurement) -> Change | None:
        if self.settle_left > 0:
            self.settle_left -= 1
            return None
        step = {PlacePhase.REMOTE: self._remote, PlacePhase.ADD_LOCAL: self._add_local,
                PlacePhase.TRIM: self._remove_remote, PlacePhase.REMOVE_REMOTE: self._remove_remote,
                PlacePhase.CONVERGED: self._recheck}[self.phase]
        return step(m)

    # -- transitions
    def _remote(self, m: Measurement) -> Change | None:
        c = self.scaler.observe(m)
        if self.scaler.converged:
            assert self.scaler.conv is not None
            self.bpt_conv = self.scaler.conv.batch_time
            self._begin_iteration(self.remote + (c.remote_delta if c else 0), self.local)
        if c is None:
            return None
        return self._change(c.remote_delta, 0, c.reason)

    def _add_local(self, m: Measurement) -> Change | None:
        assert self.bpt_conv is not None
        if self.good is None:
            self.good = m
            if not self._may_remove_remote(self.local + 1):
                return self._end_iteration(0, 0, "")  # no remote worker left to replace
            if self.local < self.config.max_local:
                return self._change(0, +1, "batch time within T of the plateau: add a local worker")
            return self._to_remove_remote(m, 0, "local workers at max_local", PlacePhase.REMOVE_REMOTE)
        if relative(m.batch_time, self.bpt_conv) >= self.config.threshold:
            return self._to_remove_remote(self.good, -1, "the last local worker slowed batches",
                                          PlacePhase.REMOVE_REMOTE)
        self.good = m
        return self._to_remove_remote(m, 0, "the local worker kept batch time", PlacePhase.TRIM)

    def _to_remove_remote(self, good: Measurement, local_delta: int, why: str,
                          phase: PlacePhase) -> Change | None:
        self.phase = phase
        self.ref_cost = self.config.cost(good.batch_time, self.remote)
        if self._may_remove_remote(self.local + local_delta):
            return self._change(-1, local_delta, f"{why}; remove a remote worker")
        return self._end_iteration(0, local_delta, why)

    def _remove_remote(self, m: Measurement) -> Change | None:
        assert self.ref_cost is not None and self.bpt_conv is not None
        guard = self.config.slowdown_guard
        cost = self.cost(m)
        if cost <= self.ref_cost and (guard is None or relative(m.batch_time, self.bpt_conv) <= guard):
            self.ref_cost, self.good = cost, m  # good: the last measurement at counts it keeps
            if self._may_remove_remote(self.local):
                return self._change(-1, 0, "batch cost did not rise: remove another remote worker")
            return self._end_iteration(0, 0, "")
        if self.phase is PlacePhase.TRIM and self.local < self.config.max_local:
            self.phase = PlacePhase.ADD_LOCAL  # good: the measurement before this removal
            return self._change(+1, +1, "removal raised batch cost: add the remote worker back "
                                        "and a local worker")
        return self._end_iteration(+1, 0, "removal raised batch cost: add the remote worker back")

    def _may_remove_remote(self, local: int) -> bool:
        """Above min_remote, and some worker is left: with none, no batch would finish,
        so no measurement would ever come to undo the removal."""
        return self.remote > self.config.min_remote and self.remote - 1 + local >= 1

    def _end_iteration(self, remote_delta: int, local_delta: int, why: str) -> Change | None:
        after = (self.remote + remote_delta, self.local + local_delta)
        change = self._change(remote_delta, local_delta, why) if (remote_delta or local_delta) else None
        if after == self.start:
            self.phase, self.since_check = PlacePhase.CONVERGED, 0
            # good was measured at `after` (every caller): what the re-check compares against
            self.settled = None if self.good is None else self.good.batch_time
        else:
            self._begin_iteration(*after)
        return change

    def _begin_iteration(self, remote: int, local: int) -> None:
        self.phase, self.good, self.start = PlacePhase.ADD_LOCAL, None, (remote, local)

    def _recheck(self, m: Measurement) -> Change | None:
        assert self.bpt_conv is not None
        self.since_check += 1
        if self.since_check < self.config.recheck_every:
            return None
        self.since_check = 0
        if relative(m.batch_time, self._recheck_ref()) <= self.config.threshold:
            return None
        self.phase, self.scaler.workers = PlacePhase.REMOTE, self.remote
        c = self.scaler.regrow(m)
        return None if c is None else self._change(c.remote_delta, 0, c.reason)

    def _recheck_ref(self) -> float:
        """The batch time a re-check compares against: bpt_conv, or the batch time it converged
        at where the guard let the cost rule keep a slower count (at most the guard above
        bpt_conv). Judged against bpt_conv, a count kept 3-5% slower (T 3%, guard 5%) re-ran
        the climb at every re-check, for ever. Pecan's pure rule (no guard) keeps bpt_conv."""
        assert self.bpt_conv is not None
        guard = self.config.slowdown_guard
        if guard is None or self.settled is None:
            return self.bpt_conv
        return max(self.bpt_conv, min(self.settled, self.bpt_conv * (1.0 + guard)))

    def _change(self, remote_delta: int, local_delta: int, reason: str) -> Change:
        self.remote += remote_delta
        self.local += local_delta
        self.scaler.workers = self.remote
        self.settle_left = self.config.settle
        return Change(remote_delta, local_delta, self.remote, self.local, reason)

    # -- journal
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["scaler"] = self.scaler.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Placement":
        good = d["good"]
        return cls(PlacementConfig(**d["config"]), Autoscaler.from_dict(d["scaler"]), d["remote"],
                   d["local"], PlacePhase(d["phase"]), d["settle_left"], d["bpt_conv"],
                   None if good is None else Measurement(**good), d["ref_cost"],
                   tuple(d["start"]), d["since_check"], d.get("settled"))  # None: from before it
