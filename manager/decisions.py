"""The periodic decision loop.

``DecisionLoop`` is the clock: every ``--decision-seconds`` it turns the passage
of time into events -- servers that missed heartbeats leave the ring, servers
out of it for ``forget_after_s`` are forgotten (their records and what they are
owed: a pod restarted on an empty data dir comes back under a new id), jobs
silent for too long are unregistered, and a ``tick`` lets the policy time out
probe phases, force-evict stragglers and re-run allocation -- and, every
``reconcile_s`` (not every round), has the actuator reconcile every server with
the state. Reconciling is a safety net (a missed call, a restarted server; a
joining server is reconciled at once by the actuator): its Stats calls cost every
server CPU, so a short decision period must not multiply them (the demo's 0.5 s
rounds cost its 2-core machine ~0.5 CPU-s per run in the servers).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .actuator import Actuator
    from .membership import Liveness
    from .state import StateStore

log = logging.getLogger("manager.decisions")


def steady_wall_clock(wall: Callable[[], float] = time.time,
                      mono: Callable[[], float] = time.monotonic) -> Callable[[], float]:
    """Wall time read once, then advanced by the monotonic clock: journaled times still mean
    the same after a restart, and a step of the wall clock while the manager runs (NTP, a
    resumed VM) neither fires every timer of the model at once (grace periods, probe phases,
    straggler evictions) nor, stepping back, freezes them."""
    base = wall() - mono()
    return lambda: base + mono()


class DecisionLoop:
    """The manager's clock; one thread."""

    def __init__(self, store: "StateStore", liveness: "Liveness", actuator: "Actuator", *,
                 interval: float, heartbeat_s: float, misses: int, job_timeout_s: float,
                 reconcile_s: float = 5.0, forget_after_s: float = 86400.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.liveness = liveness
        self.actuator = actuator
        self.interval = interval
        self.server_timeout = heartbeat_s * misses
        self.job_timeout_s = job_timeout_s
        if not reconcile_s >= 0:
            raise ValueError(f"reconcile period must be >= 0 seconds, not {reconcile_s!r}")
        self.reconcile_s = reconcile_s
        if not forget_after_s > 0:
            raise ValueError(f"server retention must be > 0 seconds, not {forget_after_s!r}")
        self.forget_after_s = forget_after_s
        self._reconciled_at: float | None = None  # monotonic time of the last reconcile
        self.clock = clock
        self.runs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decisions", daemon=True)

    def run_once(self) -> None:
        now = self.clock()
        dead = self.store.read(lambda m: self.liveness.dead_servers(m.registry, now, self.server_timeout))
        for sid in dead:
            self._leave_if_dead(sid, now)
        for sid in self.store.read(lambda m: self.liveness.forgettable(m.registry, now, self.forget_after_s)):
            self._forget_if_gone(sid, now)
        jobs = self.store.read(lambda m: sorted(m.jobs))
        for job in self.liveness.idle_jobs(jobs, now, self.job_timeout_s):
            self._unregister_if_idle(job, now)
        # Journaled only when it changed something (most ticks do not).
        self.store.submit({"type": "tick", "now": now}, only_if_changed=True)
        self.runs += 1
        mono = time.monotonic()
        if self._reconciled_at is None or mono - self._reconciled_at >= self.reconcile_s:
            self._reconciled_at = mono
            self.actuator.reconcile()

    def _leave_if_dead(self, sid: str, now: float) -> None:
        """Check again and remove in one hold of the store's lock, which Heartbeat and
        RegisterServer hold while they beat: a heartbeat that came after the scan keeps
        its server in the ring (instead of a leave, a rejoin and two re-plans)."""
        with self.store.lock:
            s = self.store.model.registry.servers.get(sid)
            if s is None or not s.alive or not self.liveness.is_dead(sid, now, self.server_timeout):
                return
            self.store.submit({"type": "server_leave", "server_id": sid, "now": now,
                               "reason": f"no heartbeat for {self.server_timeout:.1f}s"})

    def _forget_if_gone(self, sid: str, now: float) -> None:
        """Check again and forget in one hold of the store's lock: a server that registered
        again after the scan is in the ring, and keeps its record. Time out of the ring is
        measured like silences (Liveness.forgettable): a step of the wall clock moves nothing."""
        with self.store.lock:
            if sid not in self.liveness.forgettable(self.store.model.registry, now, self.forget_after_s):
                return
            self.store.submit({"type": "server_forget", "server_id": sid, "now": now,
                               "reason": f"out of the ring for over {self.forget_after_s:.0f}s"})
            self.liveness.forget_server(sid)

    def _unregister_if_idle(self, job: str, now: float) -> None:
        """Check again, unregister and forget the job's last contact in one hold of the
        store's lock, which every call that touches a job holds: a report that came after
        the scan keeps the job, and a registration right after the removal keeps its contact."""
        with self.store.lock:
            if job not in self.store.model.jobs or not self.liveness.is_idle(job, now, self.job_timeout_s):
                return
            self.store.submit({"type": "job_unregister", "job": job, "now": now,
                               "reason": f"no contact for {self.job_timeout_s:.0f}s"})
            if job not in self.store.model.jobs:  # still gone (not registered again meanwhile)
                self.liveness.forget_job(job)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.run_once()
            except Exception:  # one bad round must not stop the clock
                log.exception("decision round failed")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
