"""Cache-server membership: who is in the ring.

Two halves, kept apart on purpose:

* ``Registry`` -- the durable part (journaled through manager.model): server
  ids, addresses, capacities, alive or not, and the ring version. Every change
  of the set of alive addresses bumps the version, so clients can tell a stale
  ring from a current one. Pure: no clock, no I/O.
* ``Liveness`` -- heartbeat times and reported usage, in memory only. It is
  not journaled (a heartbeat every few seconds per server would dominate the
  journal and says nothing a fresh heartbeat does not). After a manager
  restart every registered server gets a grace period (``misses`` intervals,
  at least ``restart_grace``) before it is declared dead; its decision to
  leave the ring is journaled as an explicit event, so replay does not depend
  on heartbeat timing. Time out of the ring, before a server is forgotten, is
  measured on the same clock (``forgettable``), and the beats of servers the
  registry dropped go with them (``dead_servers``).

Removals are checked twice: a scan (``dead_servers``, ``idle_jobs``) names the
candidates, and each is re-checked (``is_dead``, ``is_idle``) and removed under
the state store's lock, which every RPC that beats or touches holds while it
does: a heartbeat or a job's call that lands after the scan keeps its server or
job (decisions.py, service.UnregisterJob).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

# A wall-clock change larger than this between two calls is a step, not drift.
STEP_TOLERANCE_S = 2.0


@dataclass
class ServerRecord:
    server_id: str
    address: str
    capacity: int
    alive: bool = True
    joined_at: float = 0.0
    left_at: float | None = None
    joins: int = 1


@dataclass
class Registry:
    servers: dict[str, ServerRecord] = field(default_factory=dict)
    version: int = 0

    def addresses(self) -> list[str]:
        """The ring: alive servers' addresses, sorted (clients hash over this list)."""
        return sorted({s.address for s in self.servers.values() if s.alive})

    def alive(self) -> list[ServerRecord]:
        return [self.servers[k] for k in sorted(self.servers) if self.servers[k].alive]

    def capacity(self) -> int:
        return sum(s.capacity for s in self.alive())

    def needs_join(self, server_id: str, address: str, capacity: int) -> bool:
        """Whether a register/heartbeat from this server changes the durable state."""
        s = self.servers.get(server_id)
        return s is None or not s.alive or s.address != address or s.capacity != capacity

    def join(self, server_id: str, address: str, capacity: int, now: float) -> bool:
        """Register or re-register; returns True if the ring (alive addresses) changed."""
        before = self.addresses()
        s = self.servers.get(server_id)
        # One address, one server: a new server id on an old address (data dir
        # wiped, or another process took the port) replaces the old record, which
        # would otherwise be listed as down for ever (the model notes it).
        for other in self.others_at(server_id, address):
            del self.servers[other.server_id]
        if s is None:
            self.servers[server_id] = ServerRecord(server_id, address, int(capacity), True, now)
        else:
            if not s.alive:
                s.joins += 1
                s.joined_at = now
            s.address, s.capacity, s.alive, s.left_at = address, int(capacity), True, None
        return self._bump_if_changed(before)

    def others_at(self, server_id: str, address: str) -> list[ServerRecord]:
        """Records of other server ids at ``address``, by id: those a join of ``server_id`` there replaces."""
        return [self.servers[k] for k in sorted(self.servers)
                if k != server_id and self.servers[k].address == address]

    def leave(self, server_id: str, now: float) -> bool:
        s = self.servers.get(server_id)
        if s is None or not s.alive:
            return False
        before = self.addresses()
        s.alive, s.left_at = False, now
        return self._bump_if_changed(before)

    def forget(self, server_id: str) -> ServerRecord:
        """Drop the record of a server out of the ring (the ring, hence its version, stays):
        ids and addresses change with each restart of a pod on an empty data dir, and the
        records of those gone would otherwise pile up for the manager's life. KeyError:
        unknown; ValueError: in the ring."""
        s = self.servers[server_id]
        if s.alive:
            raise ValueError(f"server {server_id} is in the ring")
        return self.servers.pop(server_id)

    def _bump_if_changed(self, before: list[str]) -> bool:
        if self.addresses() != before:
            self.version += 1
            return True
        return False

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version,
                "servers": {k: asdict(v) for k, v in sorted(self.servers.items())}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Registry":
        return cls({k: ServerRecord(**v) for k, v in d.get("servers", {}).items()},
                   int(d.get("version", 0)))


def address_taken(address: str, holder: str, server_id: str, timeout: float) -> str:
    """Why a registration at a live server's address is refused, and what to do."""
    return (f"address {address} is held by server {holder}, which still heartbeats: server {server_id} "
            f"cannot register there. Two cache servers advertise the same address; give each the address "
            f"clients dial it at (--listen). If {holder} has stopped, {server_id} takes its place once "
            f"{holder} has missed heartbeats for {timeout:.0f} s")


@dataclass
class Beat:
    at: float            # daemon clock of the last heartbeat (or of the restart)
    used: int = 0
    items: int = 0
    seen: bool = False   # a real heartbeat arrived since this process started


class Liveness:
    """Last heartbeat per server and per job (volatile; thread-safe)."""

    def __init__(self, started: float, restart_grace: float = 10.0,
                 mono: Callable[[], float] | None = None) -> None:
        self._lock = threading.Lock()
        self.started = started
        # Servers reconnect to a restarted manager only after their channel's
        # reconnect back-off: give them at least this long before the first beat.
        self.restart_grace = restart_grace
        self._servers: dict[str, Beat] = {}
        self._jobs: dict[str, float] = {}
        # With a monotonic clock (the daemon's), a step of the wall clock the ``now``s come
        # from (NTP, a resumed VM) moves every time kept here by as much, so a step forward
        # past --heartbeat-seconds x misses does not declare every server dead at once.
        self._mono = mono
        self._offset = None if mono is None else started - mono()
        # Servers out of the ring: (journaled left_at, when they left on the clock kept here).
        # Forgetting them is measured like silences: a step does not forget all at once.
        self._out: dict[str, tuple[float, float]] = {}

    def _follow_steps(self, now: float) -> None:
        """Shift the kept times by a step of the wall clock (call with the lock held)."""
        if self._mono is None or self._offset is None:
            return
        offset = now - self._mono()
        step = offset - self._offset
        if abs(step) <= STEP_TOLERANCE_S:
            return  # drift and the time between reading the two clocks
        self._offset = offset
        self.started += step
        for b in self._servers.values():
            b.at += step
        for job in self._jobs:
            self._jobs[job] += step
        for sid, (left_at, since) in self._out.items():
            self._out[sid] = (left_at, since + step)

    def beat(self, server_id: str, now: float, used: int = 0, items: int = 0) -> None:
        with self._lock:
            self._follow_steps(now)
            self._servers[server_id] = Beat(now, int(used), int(items), True)

    def forget_server(self, server_id: str) -> None:
        with self._lock:
            self._servers.pop(server_id, None)

    def server(self, server_id: str, now: float | None = None) -> Beat | None:
        """``server_id``'s last beat; with ``now``, its time moved by any wall-clock step up
        to ``now`` first, so ``now - at`` is its true age (Status reports it)."""
        with self._lock:
            if now is not None:
                self._follow_steps(now)
            return self._servers.get(server_id)

    def live_holder(self, registry: Registry, server_id: str, address: str, now: float,
                    timeout: float) -> str | None:
        """The id of another server in the ring at ``address`` whose heartbeats are within
        ``timeout``, if any: a registration of ``server_id`` there would replace the record of a
        live server. Two live servers advertising one address (a misconfiguration) would take
        it from each other at every heartbeat, the budget changing each time; one that stopped
        (a pod restarted on a new data dir) is out of the ring, or late, within ``timeout``."""
        with self._lock:
            self._follow_steps(now)
            for o in registry.others_at(server_id, address):
                if o.alive and not self._late(o.server_id, now, timeout):
                    return o.server_id
        return None

    def dead_servers(self, registry: Registry, now: float, timeout: float) -> list[str]:
        """Alive servers whose last heartbeat (or the restart) is older than ``timeout``.

        Also drops the beats of servers ``registry`` no longer holds: one whose address a new
        id took (Registry.join removes its record in that id's join, so nothing else would)
        or one forgotten. Call with the state's lock held: RegisterServer beats and joins
        under it, so no beat of a server still joining is dropped."""
        with self._lock:
            self._follow_steps(now)
            for sid in [k for k in self._servers if k not in registry.servers]:
                del self._servers[sid]
            return [s.server_id for s in registry.alive() if self._late(s.server_id, now, timeout)]

    def forgettable(self, registry: Registry, now: float, after: float) -> list[str]:
        """Servers out of the ring for more than ``after`` seconds, measured on the clock kept
        here (not the journaled wall times): from the leave as this process first
        saw it, so a step of the wall clock neither forgets every server out of the ring at
        once nor puts forgetting off by the step. One already out when the manager started
        counts from its journaled ``left_at``; never from a time ahead of ``now`` (the state
        journals a leave at its own time, which does not follow a step back)."""
        with self._lock:
            self._follow_steps(now)
            out: dict[str, tuple[float, float]] = {}
            for sid, s in sorted(registry.servers.items()):
                if s.alive or s.left_at is None:
                    continue
                seen = self._out.get(sid)
                if seen is None or seen[0] != s.left_at:  # seen out first now, or out again since
                    seen = (s.left_at, min(s.left_at, now))
                out[sid] = seen
            self._out = out  # servers back in the ring or forgotten drop out of it
            return [sid for sid, (_, since) in out.items() if now - since > after]

    def is_dead(self, server_id: str, now: float, timeout: float) -> bool:
        """Whether ``server_id``'s last heartbeat (or the restart) is older than ``timeout``."""
        with self._lock:
            self._follow_steps(now)
            return self._late(server_id, now, timeout)

    def _late(self, server_id: str, now: float, timeout: float) -> bool:
        last = self._servers.get(server_id)
        if last is not None:
            return now - last.at > timeout
        return now - self.started > max(timeout, self.restart_grace)

    def touch_job(self, job: str, now: float) -> None:
        with self._lock:
            self._follow_steps(now)
            self._jobs[job] = now

    def forget_job(self, job: str) -> None:
        with self._lock:
            self._jobs.pop(job, None)

    def job_expires_in(self, job: str, now: float, timeout: float) -> float:
        """Seconds until ``job`` has been idle ``timeout`` seconds (idle_jobs then names it)."""
        with self._lock:
            self._follow_steps(now)
            return max(0.0, timeout - (now - self._jobs.get(job, self.started)))

    def idle_jobs(self, jobs: list[str], now: float, timeout: float) -> list[str]:
        with self._lock:
            self._follow_steps(now)
            return [j for j in jobs if now - self._jobs.get(j, self.started) > timeout]

    def is_idle(self, job: str, now: float, timeout: float) -> bool:
        with self._lock:
            self._follow_steps(now)
            return now - self._jobs.get(job, self.started) > timeout
