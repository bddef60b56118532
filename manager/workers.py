"""Remote preprocessing workers as the manager runs them (docs/preprocess.md,
Remote workers): the Ray cluster's address (`cachemanager --ray`) handed to jobs,
and each job's worker-scaling policy (manager/policy: Cachew's autoscaling or
Pecan's AutoPlacement) fed the measurements the job reports (ScaleWorkers).

A job's first call (no measurement) starts its policy afresh; each later call is
one window's measurement and gets the counts to run. Policies live in memory, not
in the journal: after a manager restart a job's next measurement starts its policy
again from the counts the job reports it runs (the job keeps its counts while the
manager is away). A job the manager no longer has registered is forgotten."""
from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from .policy.autoscale import AutoscaleConfig, Autoscaler
from .policy.placement import Placement, PlacementConfig
from .policy.scaling import Measurement

POLICIES = ("autoscale", "placement")


def check_ray_address(address: str) -> str:
    """`ray://HOST:PORT` (a Ray head's client server), else ValueError naming what is wrong."""
    if not isinstance(address, str) or not address.startswith("ray://"):
        raise ValueError(f"a Ray address is 'ray://HOST:PORT' (the Ray head's client server), got {address!r}")
    host, _, port = address[len("ray://"):].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"Ray address {address!r}: expected ray://HOST:PORT with a port number")
    return address


@dataclass(frozen=True)
class Counts:
    remote: int
    local: int
    reason: str   # why they changed in this call; "" when they did not
    phase: str    # the policy's state


class WorkerScaling:
    def __init__(self, ray_address: str | None = None, autoscale: AutoscaleConfig | None = None,
                 placement: PlacementConfig | None = None) -> None:
        self.ray_address = check_ray_address(ray_address) if ray_address else ""
        self.autoscale = autoscale or AutoscaleConfig()
        self.placement = placement or PlacementConfig()
        self.jobs: dict[str, Autoscaler | Placement] = {}
        self.lock = threading.Lock()

    def decide(self, job: str, policy: str, m: Measurement | None, remote: int = 0, local: int = 0) -> Counts:
        """m None: the job starts its workers (a fresh policy); else one window's
        measurement, with the counts the job runs (where its policy is not known here)."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        with self.lock:
            p = self.jobs.get(job)
            if m is None or p is None or _kind(p) != policy:
                p = self._start(policy, None if m is None else (remote, local))
                self.jobs[job] = p
            change = p.observe(m) if m is not None else None
            return Counts(*_counts(p), change.reason if change is not None else "", p.phase.value)

    def forget_except(self, jobs: Iterable[str]) -> None:
        keep = set(jobs)
        with self.lock:
            for job in [j for j in self.jobs if j not in keep]:
                del self.jobs[job]

    def _start(self, policy: str, counts: tuple[int, int] | None) -> Autoscaler | Placement:
        if policy == "autoscale":
            cfg = self.autoscale
            n = None if counts is None else min(cfg.max_workers, max(cfg.min_workers, counts[0], 1))
            return Autoscaler.start(cfg, n)
        cfg = self.placement
        if counts is None:
            return Placement.start_with(cfg)
        remote = min(cfg.max_remote, max(cfg.min_remote, counts[0]))
        local = min(cfg.max_local, max(0, counts[1]))
        if remote + local < 1:
            remote = max(1, cfg.min_remote)
        return Placement(cfg, Autoscaler.resume(cfg.autoscale(), remote), remote, local, start=(remote, local))


def _kind(p: Autoscaler | Placement) -> str:
    return "autoscale" if isinstance(p, Autoscaler) else "placement"


def _counts(p: Autoscaler | Placement) -> tuple[int, int]:
    return (p.workers, 0) if isinstance(p, Autoscaler) else (p.remote, p.local)
