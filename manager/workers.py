"""Remote preprocessing workers as the manager runs them (docs/preprocess.md,
Remote workers): the Ray cluster's address (`cachemanager --ray`) handed to jobs,
and each job's worker-scaling policy (manager/policy: Cachew's autoscaling or
Pecan's AutoPlacement) fed the measurements the job reports (ScaleWorkers).

A job's first call (no measurement) starts its policy afresh; each later call is
one window's measurement and gets the counts to run. With a journal (the daemon's
state store: ``attach``) each policy is journaled (manager/workerstate.py: after
every call that changed it in more than its window counters), so after a manager
restart a job's next measurement continues its policy where it was: same phase,
counts, plateau. The policy starts again from the counts the job reports where
none is journaled, where the job asks for another kind, or where the journaled one
was made under another --policy-config. A job the manager no longer has
registered is forgotten (its journaled policy goes with its ``job_unregister``).
Without a journal (``WorkerScaling`` alone, as unit tests use it) they live in memory only."""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .policy.autoscale import AutoscaleConfig, Autoscaler
from .policy.placement import Placement, PlacementConfig
from .policy.scaling import Measurement
from .workerstate import KINDS, Policy, decisive, decisive_key, kind_of, restore, saved_form

log = logging.getLogger("manager.workers")
POLICIES = KINDS


class PolicyJournal(Protocol):
    """Where journaled policies live (the daemon: its state store, service.py)."""

    def saved(self, job: str) -> Mapping[str, Any] | None:
        """The job's last journaled policy (workerstate's form), None if none."""

    def save(self, job: str, saved: dict[str, Any]) -> None:
        """Journal it (durably) before the call that changed it is answered."""


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
        self.jobs: dict[str, Policy] = {}
        self.journal: PolicyJournal | None = None
        self.journaled: dict[str, tuple[Any, Any]] = {}   # job -> (decisive_key, the journal's entry) last seen
        self.lock = threading.Lock()

    def attach(self, journal: PolicyJournal) -> None:
        """Journal policies there from now on, and resume them from it."""
        with self.lock:
            self.journal = journal

    def decide(self, job: str, policy: str, m: Measurement | None, remote: int = 0, local: int = 0) -> Counts:
        """m None: the job starts its workers (a fresh policy); else one window's
        measurement, with the counts the job runs (where its policy is not known here,
        it starts from them; where they are not the policy's, the window is dropped)."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        with self.lock:
            p = self.jobs.get(job)
            if p is None and m is not None:
                p = self._resumed(job, policy)
            if m is None or p is None or kind_of(p) != policy:
                p = self._start(policy, None if m is None else (remote, local))
            self.jobs[job] = p
            change = p.observe(m) if m is not None and _measured_at(p, remote, local) else None
            self._journal(job, p, fresh=m is None)
            return Counts(*_counts(p), change.reason if change is not None else "", p.phase.value)

    def forget_except(self, jobs: Iterable[str]) -> None:
        keep = set(jobs)
        with self.lock:
            for job in [j for j in self.jobs if j not in keep]:
                del self.jobs[job]
                self.journaled.pop(job, None)

    def _resumed(self, job: str, policy: str) -> Policy | None:
        """The job's journaled policy (after a manager restart), if it is of this kind
        and was made under this configuration (else its state may not hold under
        the new bounds and thresholds: it starts again from the job's counts)."""
        saved = self.journal.saved(job) if self.journal is not None else None
        if saved is None or saved.get("kind") != policy:
            return None
        try:
            p = restore(saved)
        except ValueError as e:  # another version's form (a snapshot): not the job's request at fault
            log.warning("job %s: its journaled %s policy cannot be read here (%s); starting again from "
                        "the job's counts", job, policy, e)
            return None
        if p.config != (self.autoscale if policy == "autoscale" else self.placement):
            log.info("job %s: its journaled %s policy was made under another --policy-config; "
                     "starting again from the job's counts", job, policy)
            return None
        return p

    def _journal(self, job: str, p: Policy, fresh: bool) -> None:
        """Journal the policy where this call changed it in more than its window
        counters (why not every window: manager/workerstate.py). A fresh start over
        nothing journaled is not: a restarted manager builds the same policy from the
        counts it answers, and the job's first call (a 1 s deadline, whose timeout
        it reads as "no manager") then writes nothing."""
        if self.journal is None:
            return
        key, entry = decisive_key(p), self.journal.saved(job)
        last = self.journaled.get(job)
        if last is not None and last[1] is entry and last[0] == key:
            return  # the journal holds what we last journaled, and nothing decisive moved
        saved = saved_form(p)
        if decisive(saved) != decisive(entry) and not (fresh and entry is None):
            try:
                self.journal.save(job, saved)
            except BaseException:
                del self.jobs[job]  # not durable, so it did not happen: the next call resumes the journal's
                self.journaled.pop(job, None)
                raise
            entry = self.journal.saved(job)
        self.journaled[job] = (key, entry)

    def _start(self, policy: str, counts: tuple[int, int] | None) -> Policy:
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


def _measured_at(p: Policy, remote: int, local: int) -> bool:
    """Whether a window the job measured at these counts is the policy's: not where
    the job runs others (it did not get the answer that changed them: its deadline
    passed, or the manager died after journaling it); the policy's counts are then
    answered again. (0, 0): the caller reports no counts (a policy keeps a worker)."""
    return (remote, local) in ((0, 0), _counts(p))


def _counts(p: Policy) -> tuple[int, int]:
    return (p.workers, 0) if isinstance(p, Autoscaler) else (p.remote, p.local)
