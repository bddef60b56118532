"""Autocache in the manager: per (dataset, pipeline fingerprint), the jobs'
first-epoch costs, the decision made from them (manager/policy/autocache.py)
and what it means for allocation.

* The first report of a (dataset, pipeline) decides, with the cache room the
  dataset can have (``room``: the budget less what other datasets hold). Later
  reports of other jobs are kept (status shows them combined); they change the
  decision only where, on all the jobs' measurements, the mode in force projects
  more than 25% dearer than another (policy ``redecide``; the reason says so):
  a second job with the same pipeline gets the decision already made, and the
  cached set it implies stays put unless the measurements say it is clearly
  wrong. Jobs running already keep their mode; later ones take the new one.
* A pipeline decided ``transformed`` becomes a dataset of its own under
  ``transformed_tag(dataset, fingerprint)`` (its items' tag on the servers),
  of ``items x marker_bytes`` bytes. Its jobs' gain moves from the source
  dataset to it, with the decision's projected benefit
  ``b = compute / transformed`` (their measured ``b`` is about source hits),
  so allocation counts its bytes and benefit against the same budget, and
  the source items it no longer needs lose their claim. Only while the job's
  registration that reported it lasts: a job registered again under the same
  name reads its source dataset until it reports the pipeline again.
* A job whose loader is fixed at ``transformed`` (its report says ``fixed``)
  reads the transformed set whatever the decision: the set exists and takes that
  job's gain (with the projected benefit of transformed) even where the pipeline
  is decided otherwise; the pipeline's other jobs follow the decision.

State is plain data (JSON round trip); the model (model.py) journals the
``pipeline`` event that changes it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from cacheserver.vocab import transformed_tag

from .policy import JobGain
from .policy.autocache import (PipelineCosts, costs_from_dict, costs_to_dict, decide,
                               decision_from_dict, decision_to_dict, merge_costs, redecide)


@dataclass
class PipelineRecord:
    dataset: str
    fingerprint: str
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)  # job -> PipelineCosts as a dict
    decision: dict[str, Any] | None = None                             # Decision as a dict
    decided_at: float = 0.0
    room_bytes: float | None = None                                    # None: unbounded
    # Measured jobs whose registration ended since their report (sorted): their costs still
    # count, but a job registered again under the name is a new run that has not chosen
    # this pipeline (until it reports it again), so no transformed set takes its gain.
    left: list[str] = field(default_factory=list)
    # Jobs whose last report said their loader runs transformed whatever the decision
    # (autocache="transformed", sorted): they read the transformed set, decided or not.
    fixed: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return pipeline_key(self.dataset, self.fingerprint)

    @property
    def tag(self) -> str:
        return transformed_tag(self.dataset, self.fingerprint)

    @property
    def mode(self) -> str:
        return self.decision["mode"] if self.decision else ""

    def combined(self, measured: Mapping[str, Any] | None = None) -> PipelineCosts:
        """Its jobs' costs merged (or those of `measured`, a candidate for them)."""
        measured = self.measured if measured is None else measured
        return merge_costs([costs_from_dict(measured[j]) for j in sorted(measured)])

    def transformed_bytes(self) -> tuple[int, int]:
        """(bytes, items) of its transformed set."""
        c = self.combined()
        return int(math.ceil(c.items * c.marker_bytes)), c.items

    def needs_set(self) -> bool:
        """Whether its transformed set is read: decided transformed, or a job fixed at it."""
        return self.mode == "transformed" or bool(self.fixed)

    def set_jobs(self, jobs: Mapping[str, Any]) -> list[str]:
        """Its live jobs that read the transformed set (all of them where it is decided)."""
        live = live_jobs(self, jobs)
        return live if self.mode == "transformed" else [j for j in live if j in self.fixed]

    def benefit(self, mode: str | None = None) -> float:
        """Projected speed-up of its jobs over compute: ``compute / chosen`` (or ``mode``)."""
        costs = self.decision["costs"] if self.decision else {}
        chosen = costs.get(mode or self.mode, 0.0)
        return max(1.0, costs.get("compute", 0.0) / chosen) if chosen > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = {"dataset": self.dataset, "fingerprint": self.fingerprint,
             "measured": {j: dict(c) for j, c in sorted(self.measured.items())},
             "decision": self.decision, "decided_at": self.decided_at, "room_bytes": self.room_bytes}
        if self.left:  # left out while empty: a state without it reads (and digests) as before
            d["left"] = list(self.left)
        if self.fixed:  # likewise
            d["fixed"] = list(self.fixed)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PipelineRecord":
        return cls(d["dataset"], d["fingerprint"], {j: dict(c) for j, c in d.get("measured", {}).items()},
                   d.get("decision"), float(d.get("decided_at", 0.0)), d.get("room_bytes"),
                   sorted(str(j) for j in d.get("left", [])), sorted(str(j) for j in d.get("fixed", [])))


def pipeline_key(dataset: str, fingerprint: str) -> str:
    return f"{dataset}/{fingerprint}"


def check_costs(d: Mapping[str, Any]) -> dict[str, Any]:
    """A reported costs dict validated (ValueError names the field) and normalised."""
    return costs_to_dict(costs_from_dict(d))


def report(rec: PipelineRecord, job: str, costs: Mapping[str, Any], room: float, now: float,
           fixed: bool = False) -> bool:
    """Record ``job``'s costs; decide if not decided yet, or decide again where the
    measurements say the decision in force is clearly wrong. True when it decided now.
    ``fixed``: the job's loader runs transformed whatever is decided (each report says
    so anew). Costs refused (ValueError: here, or merged with the other jobs') leave
    rec as it was."""
    measured = {**rec.measured, job: check_costs(costs)}  # taken only once everything below holds
    c = rec.combined(measured)
    if math.isfinite(room):
        c = PipelineCosts(**{**costs_to_dict(c), "room_bytes": max(0.0, room)})
    d = decide(c) if rec.decision is None else redecide(decision_from_dict(rec.decision), c)
    rec.measured = measured
    rec.left = [j for j in rec.left if j != job]  # this registration reported it
    rec.fixed = sorted({*rec.fixed, job} if fixed else {j for j in rec.fixed if j != job})
    if d is None:
        return False
    rec.decision = decision_to_dict(d)
    rec.decided_at, rec.room_bytes = now, (room if math.isfinite(room) else None)
    return True


def live_jobs(rec: PipelineRecord, jobs: Mapping[str, Any]) -> list[str]:
    """Its measured jobs registered now, in the registration that reported it."""
    return sorted(j for j in rec.measured if j in jobs and j not in rec.left)


def job_left(pipelines: Mapping[str, PipelineRecord], job: str) -> None:
    """``job``'s registration ended (in place): the pipelines it measured no longer count
    it live, so the same name registered again reads its source dataset until it reports."""
    for rec in pipelines.values():
        if job in rec.measured and job not in rec.left:
            rec.left = sorted([*rec.left, job])


def move_gains(pipelines: Mapping[str, PipelineRecord], n_gpus: Mapping[str, int],
               gains: dict[str, list[JobGain]]) -> None:
    """Give each transformed set the gain of its live jobs that read it (projected benefit
    of transformed), taking those jobs off their source dataset's demand (in place)."""
    for key in sorted(pipelines):
        rec = pipelines[key]
        jobs = rec.set_jobs(n_gpus)
        if not jobs:
            continue
        b = rec.benefit("transformed")
        gains[rec.tag] = [JobGain(j, n_gpus[j], b) for j in jobs]
        left = [g for g in gains.get(rec.dataset, []) if g.job_id not in jobs]
        if left:
            gains[rec.dataset] = left
        else:
            gains.pop(rec.dataset, None)
