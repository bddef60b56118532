"""Allocation step and the periodic decision loop.

``reallocate`` runs inside ``ManagerModel.apply`` (deterministic, journaled):
it feeds the probe board's measured gains to ``allocate()`` under the budget
(``--budget`` or the alive servers' total capacity), and rebuilds a dataset's
``DoubleBuffer`` whenever its option or chunk size changes.

``DecisionLoop`` is the clock: every ``--decision-seconds`` it turns the passage
of time into events -- servers that missed heartbeats leave the ring, jobs
silent for too long are unregistered, and a ``tick`` lets the policy time out
probe phases, force-evict stragglers and re-run allocation -- and then has the
actuator reconcile every server with the state.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from .effects import Effect, EvictDataset, note
from .policy import Allocation, DoubleBuffer, Option, allocate, demands, num_chunks

if TYPE_CHECKING:
    from .actuator import Actuator
    from .membership import Liveness
    from .model import ManagerModel
    from .state import StateStore

log = logging.getLogger("manager.decisions")


def reallocate(m: "ManagerModel", now: float) -> list[Effect]:
    cfg = m.config
    gains = m.board.job_gains()
    sizes: dict[str, int] = {}
    kept: dict[str, Allocation] = {}
    reserved = 0
    for ds, rec in sorted(m.datasets.items()):
        a = m.allocs.get(ds)
        # A dataset whose jobs all left keeps its space (or its spare entries) for a
        # grace period: a job restarting (or the next one of a pipeline) would
        # otherwise find its cached dataset evicted and reload it from the store.
        if (ds not in gains and a is not None and (a.option is not Option.NONE or a.spare)
                and rec.idle_since is not None and now - rec.idle_since < cfg.dataset_grace_s):
            why = "idle: kept during the grace period after its last job left; "
            kept[ds] = a if a.reason.startswith(why) else Allocation(
                a.dataset, a.option, a.bytes, a.chunk_size, a.value, why + a.reason, a.spare)
            reserved += a.bytes
        else:
            sizes[ds] = rec.bytes
    current = {ds: a.knapsack_option for ds, a in m.allocs.items()}  # hysteresis, also under --no-chunks
    new = allocate(demands(gains, sizes), max(0, m.budget() - reserved), cfg.alloc, current)
    new.update(kept)
    out: list[Effect] = []
    for ds in sorted(new):
        old, a = m.allocs.get(ds), new[ds]
        if (old is None or old.option is not a.option or old.spare != a.spare
                or (a.option is Option.CHUNKED and old.chunk_size != a.chunk_size)):
            out += _reconfigure(m, ds, old, a, now)
    m.allocs = new
    # Forget datasets nobody used for a whole grace period (their space is already
    # freed; spare entries they left go too, as nobody will read them).
    for ds, rec in sorted(m.datasets.items()):
        if (rec.idle_since is not None and now - rec.idle_since >= cfg.dataset_grace_s
                and m.option(ds) is Option.NONE and ds not in gains):
            del m.datasets[ds]
            out.append(EvictDataset(ds, "forgotten: no job for a whole grace period"))
            m.allocs.pop(ds, None)
    return out


def _reconfigure(m: "ManagerModel", ds: str, old: Allocation | None, a: Allocation,
                 now: float) -> list[Effect]:
    old_opt = old.option if old is not None else Option.NONE
    rec = m.datasets[ds]
    m.counters["decisions"] = m.counters.get("decisions", 0) + 1
    m.decisions.append({"at": now, "dataset": ds, "option": a.option.value, "reason": a.reason})
    del m.decisions[:-50]
    out: list[Effect] = [note("allocation", dataset=ds, old=old_opt.value, new=a.option.value,
                              bytes=a.bytes, reason=a.reason)]
    buf = m.buffers.pop(ds, None)
    rec.plan_base = rec.plan_base + (buf.version if buf else 0) + 1
    if a.option is Option.NONE:
        # Leaving chunks or full: NONE holds no chunk, so free the dataset (its jobs
        # insert spare entries again if allowed). Spare turning on or off only
        # changes the plan: spare entries left behind take room nobody needs, and
        # evicting them would make a flip (a new job's prior, then its measured
        # benefit) cost a reload.
        if old_opt is not Option.NONE:
            out.append(EvictDataset(ds, a.reason))
        return out
    # Going from chunks to FULL keeps what is resident (everything is wanted
    # now). Any other change invalidates the chunk tags already on the
    # servers (they number chunks of another plan): start from a clean slate.
    if old_opt is not Option.NONE and not (old_opt is Option.CHUNKED and a.option is Option.FULL):
        out.append(EvictDataset(ds, f"re-plan {old_opt.value} -> {a.option.value}"))
    k = 1 if a.option is Option.FULL else num_chunks(rec.bytes, a.chunk_size, rec.n_items)
    buf, actions = DoubleBuffer.create(ds, rec.n_items, k, now, m.config.buffer)
    for job in sorted(j for j, r in m.jobs.items() if r.dataset == ds):
        actions += buf.attach(job, now)
    m.buffers[ds] = buf
    return out + m.effects_of_actions(actions)


class DecisionLoop:
    """The manager's clock; one thread."""

    def __init__(self, store: "StateStore", liveness: "Liveness", actuator: "Actuator", *,
                 interval: float, heartbeat_s: float, misses: int, job_timeout_s: float,
                 reconcile_every: int = 1, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.liveness = liveness
        self.actuator = actuator
        self.interval = interval
        self.server_timeout = heartbeat_s * misses
        self.job_timeout_s = job_timeout_s
        self.reconcile_every = max(1, reconcile_every)
        self.clock = clock
        self.runs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decisions", daemon=True)

    def run_once(self) -> None:
        now = self.clock()
        dead = self.store.read(lambda m: self.liveness.dead_servers(m.registry, now, self.server_timeout))
        for sid in dead:
            self.store.submit({"type": "server_leave", "server_id": sid, "now": now,
                               "reason": f"no heartbeat for {self.server_timeout:.1f}s"})
        jobs = self.store.read(lambda m: sorted(m.jobs))
        for job in self.liveness.idle_jobs(jobs, now, self.job_timeout_s):
            self.store.submit({"type": "job_unregister", "job": job, "now": now,
                               "reason": f"no contact for {self.job_timeout_s:.0f}s"})
            self.liveness.forget_job(job)
        # Journaled only when it changed something (most ticks do not).
        self.store.submit({"type": "tick", "now": now}, only_if_changed=True)
        self.runs += 1
        if (self.runs - 1) % self.reconcile_every == 0:
            self.actuator.reconcile()

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
