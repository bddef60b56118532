"""The manager's durable state machine: every change is an *event* applied here.

``ManagerModel.apply(event)`` is deterministic: the same events in the same
order give the same state, byte for byte (time comes in the event as ``now``;
the policy layer is pure). That is what makes the journal (state.py) exact:
after ``kill -9`` the daemon reloads the last snapshot, re-applies the events
journaled after it, and has the same decisions, chunk states and registries it
had acknowledged. Side effects come back as ``Effect`` values (effects.py) for
the caller to carry out -- or, during replay, to drop.

Events (dicts; ``type`` and ``now`` always present):

  server_join {server_id, address, capacity}   server_leave {server_id, reason}
  server_forget {server_id, reason}            (out of the ring past --forget-servers-after)
  job_register {job, dataset, dataset_bytes, n_items, n_gpus, token_hash}
  job_unregister {job, reason}                 batches {job, batches: [[end, dur, hit|None]][, stream, seq]}
  release {job, dataset, chunk}                loaded {dataset, chunk, fraction}
  tick {}                                      configure {config}
  pipeline {job, dataset, fingerprint, costs[, fixed]}  (autocache: pipelines.py)
  workers {job, kind, state}                   (a job's worker-scaling policy: workerstate.py)
  evictions_owed {owed}                        (EvictDatasets servers missed: evictledger.py)
  plan_floor {floor}                           (a state started afresh: versions start at its clock)
  plan_lift {dataset, floor}                   (a job holds a newer version: a restored state, service.py)

A plan version that changes takes at least the event's ``now`` in ms (``_clock_versions``).

A request the model refuses raises ``Rejected`` before anything is mutated,
so refused requests are never journaled.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from .allocstep import AllocationStep
from .effects import Effect, RingChanged, ServerForgotten, SetMode, note
from .evictledger import Owed, checked as checked_owed
from .jobtokens import journaled_hash
from .membership import Registry
from .modelrecords import (MAX_DECISIONS, MAX_PLAN_VERSION, DatasetRecord, JobRecord, ManagerConfig, Rejected,
                           canonical, report_number)
from .pipelines import PipelineRecord, job_left, move_gains, pipeline_key
from .pipelines import report as report_pipeline
from .policy import Allocation, Batch, CacheMode, DoubleBuffer, Option, ProbeBoard
from .policy.admission import AdmissionBoard
from .policy.shares import share_items
from .workerstate import checked as checked_policy

# Importable from here as before the split (tests, state.py, service.py, managerd.py).
__all__ = ["MAX_DECISIONS", "DatasetRecord", "JobRecord", "ManagerConfig", "ManagerModel", "Rejected",
           "canonical"]


@dataclass
class ManagerModel(AllocationStep):
    config: ManagerConfig = field(default_factory=ManagerConfig)
    now: float = 0.0
    registry: Registry = field(default_factory=Registry)
    board: ProbeBoard = field(default_factory=ProbeBoard)
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    datasets: dict[str, DatasetRecord] = field(default_factory=dict)
    allocs: dict[str, Allocation] = field(default_factory=dict)
    buffers: dict[str, DoubleBuffer] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    pipelines: dict[str, PipelineRecord] = field(default_factory=dict)  # autocache, by pipeline_key
    admission: AdmissionBoard = field(default_factory=AdmissionBoard)   # who inserts into the shared LRU
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)   # job -> its journaled scaling policy
    owed: Owed = field(default_factory=dict)  # server address -> datasets whose EvictDataset it missed
    # Plan versions of a dataset created now start here: above every version a forgotten
    # dataset handed out, so a name forgotten and registered again never goes back (a
    # client keeps the newer of two plans it holds); and, for a state started afresh, at its
    # wall clock in ms (plan_floor event), above what a manager whose state was lost gave out.
    plan_floor: int = 0

    def __post_init__(self) -> None:
        if self.board.config != self.config.probe:
            self.board.config = self.config.probe

    # ---------------------------------------------------------------- events
    def apply(self, ev: Mapping[str, Any]) -> list[Effect]:
        handler = getattr(self, "_on_" + str(ev.get("type")), None)
        if handler is None:
            raise Rejected("INVALID_ARGUMENT", f"unknown event type {ev.get('type')!r}")
        # The clock never runs backwards inside the state (wall-clock steps):
        # timers in the policy layer compare against earlier `now`s.
        now = max(float(ev["now"]), self.now)
        before = {ds: self.plan_version(ds) for ds in self.datasets}
        out = handler(ev, now)
        self.now = now
        self._clock_versions(before, now)
        return out

    def _clock_versions(self, before: Mapping[str, int], now: float) -> None:
        """A plan version that changed is at least the event's time in ms. A manager restored from
        an older snapshot (its later journal lost) replays the versions it handed out since: each
        would name another plan, which a job holding it takes for the one it has. Tied to the
        clock, the next version after any restart is above them, as long as they grew by fewer
        than 1000 a second and the clock did not go back. Deterministic: ``now`` is the event's."""
        floor = int(now * 1000)
        for ds, rec in self.datasets.items():
            v = self.plan_version(ds)
            if v != before.get(ds) and v < floor:
                rec.plan_base += floor - v

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _on_configure(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        try:  # fields a config does not have; values are checked where flags enter (managerd.py)
            self.config = ManagerConfig.from_dict(ev["config"])
        except (ValueError, TypeError) as e:
            raise Rejected("INVALID_ARGUMENT", f"bad configuration: {e}") from None
        self.board.config = self.config.probe
        for buf in self.buffers.values():  # new straggler / load thresholds apply at once
            buf.config = self.config.buffer
        return [note("configuration changed", budget=self.config.budget)] + self.reallocate(now)

    def _on_server_join(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        sid, addr, cap = str(ev["server_id"]), str(ev["address"]), int(ev["capacity"])
        if not sid or not addr:
            raise Rejected("INVALID_ARGUMENT", "server_id and address must not be empty")
        budget = self.budget()
        replaced = self.registry.others_at(sid, addr)  # join drops their records: say so
        changed = self.registry.join(sid, addr, cap, now)
        out: list[Effect] = [note("server joined", server_id=sid, address=addr, capacity=cap)]
        out += [note("server replaced: a new server id registered at its address", server_id=o.server_id,
                     address=o.address, by=sid, was_in_ring=o.alive) for o in replaced]
        if changed:
            self._count("ring_changes")
            out.append(RingChanged(self.registry.version, tuple(self.registry.addresses())))
        return out + self._budget_changed(budget, now)

    def _on_server_leave(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        sid = str(ev["server_id"])
        budget = self.budget()
        if not self.registry.leave(sid, now):
            return []
        self._count("ring_changes")
        return [note("server left the ring", server_id=sid, reason=ev.get("reason", "")),
                RingChanged(self.registry.version, tuple(self.registry.addresses()))] + self._budget_changed(budget, now)

    def _on_server_forget(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        """The record goes, and with it the EvictDatasets owed to addresses no record holds
        now (never a live server's: its address is its record's)."""
        sid = str(ev["server_id"])
        try:
            s = self.registry.forget(sid)
        except (KeyError, ValueError) as e:
            raise Rejected("FAILED_PRECONDITION", f"cannot forget server {sid!r}: {e}") from None
        known = {r.address for r in self.registry.servers.values()}
        self.owed = {a: ds for a, ds in self.owed.items() if a in known}
        return [note("server forgotten", server_id=sid, address=s.address, reason=ev.get("reason", "")),
                ServerForgotten(sid, s.address, tuple(sorted(known)))]

    def _budget_changed(self, before: int, now: float) -> list[Effect]:
        """A budget taken from the servers' capacity follows them at once: allocations
        made for a larger one must not outlive the server that left until the next tick."""
        return self.reallocate(now) if self.budget() != before else []

    def _on_job_register(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        job, ds = str(ev["job"]), str(ev["dataset"])
        size, n, gpus = int(ev["dataset_bytes"]), int(ev["n_items"]), int(ev["n_gpus"])
        if not job or not ds:
            raise Rejected("INVALID_ARGUMENT", "job and dataset must not be empty")
        if gpus < 1 or size < 0 or n < 0:
            raise Rejected("INVALID_ARGUMENT", f"need n_gpus >= 1 and sizes >= 0 (got {gpus}, {size}, {n})")
        rec = self.datasets.get(ds)
        if rec is not None and (rec.bytes, rec.n_items) != (size, n):
            raise Rejected("INVALID_ARGUMENT", f"dataset {ds} is registered with {rec.bytes} bytes and "
                                               f"{rec.n_items} items, not {size} and {n}")
        old = self.jobs.get(job)
        if old is not None:
            if old.dataset != ds:
                raise Rejected("FAILED_PRECONDITION",
                               f"job {job} is registered on dataset {old.dataset}; unregister it first")
            if not old.token_hash and journaled_hash(ev.get("token_hash")):  # from a state before tokens:
                self.jobs[job] = replace(old, token_hash=journaled_hash(ev["token_hash"]))  # the first binds it
            return []  # a client retrying, or re-attaching after a manager restart
        if rec is None:
            rec = self._new_dataset(ds, size, n)
        rec.idle_since = None
        self.jobs[job] = JobRecord(job, ds, gpus, now, token_hash=journaled_hash(ev.get("token_hash")))
        out: list[Effect] = [note("job registered", job=job, dataset=ds, n_gpus=gpus)]
        out += self._transitions(self.board.add_job(job, ds, gpus, now))
        if ds in self.buffers:
            out += self.effects_of_actions(self.buffers[ds].attach(job, now))
        return out + self.reallocate(now)

    def _on_job_unregister(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        job = str(ev["job"])
        rec = self.jobs.pop(job, None)
        if rec is None:
            return []
        self.workers.pop(job, None)
        job_left(self.pipelines, job)
        out: list[Effect] = [note("job unregistered", job=job, reason=ev.get("reason", ""))]
        probe = self.board.jobs.get(job)
        if probe is not None and probe.probing:  # counted here: removing the job makes no transition
            self._count("probes_aborted")
        if probe is not None and probe.mode is CacheMode.BYPASS:
            self._count("mode_switches")
            out.append(SetMode(job, CacheMode.NORMAL.value, "job left during a probe"))
        out += self._transitions(self.board.remove_job(job, now))
        if rec.dataset in self.buffers:
            out += self.effects_of_actions(self.buffers[rec.dataset].detach(job, now))
        if not any(j.dataset == rec.dataset for j in self.jobs.values()):
            self.datasets[rec.dataset].idle_since = now
        return out + self.reallocate(now)

    def _job(self, job: str) -> JobRecord:
        rec = self.jobs.get(job)
        if rec is None:
            raise Rejected("NOT_FOUND", f"unknown job {job!r} (expired or never registered): register it again")
        return rec

    def _on_batches(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        rec = self._job(str(ev["job"]))
        number = report_number(ev)
        if number is not None and rec.applied(number[0]) >= number[1]:
            return []  # a report sent again (its reply was lost): its batches are counted already
        batches = [Batch(float(b[0]), float(b[1]), None if b[2] is None else float(b[2]))
                   for b in ev["batches"]]
        rec.batches += len(batches)
        if number is not None:
            rec.note_report(*number, now)
        self.admission.observe(rec.dataset, batches, self.config.admission)
        return self._transitions(self.board.report(rec.job, batches, now))

    def _buffer_for(self, job: str | None, ds: str, chunk: int) -> DoubleBuffer | None:
        if job is not None and self._job(job).dataset != ds:
            raise Rejected("INVALID_ARGUMENT", f"job {job} reads dataset {self.jobs[job].dataset}, not {ds}")
        buf = self.buffers.get(ds)
        if buf is not None and not 0 <= chunk < buf.k:
            raise Rejected("INVALID_ARGUMENT", f"chunk {chunk} out of range: dataset {ds} has {buf.k} chunks")
        return buf

    def _on_release(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        buf = self._buffer_for(str(ev["job"]), str(ev["dataset"]), int(ev["chunk"]))
        return [] if buf is None else self.effects_of_actions(buf.release(str(ev["job"]), int(ev["chunk"]), now))

    def _on_loaded(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        buf = self._buffer_for(None, str(ev["dataset"]), int(ev["chunk"]))
        if buf is None:
            return []
        return self.effects_of_actions(buf.loaded(int(ev["chunk"]), float(ev["fraction"]), now))

    def evicting(self, ds: str, chunk: int) -> list[str]:
        """Servers in the ring that have not taken an EvictDataset of ``ds`` yet (``owed``);
        Rejected for a chunk out of range. A load report of a re-planned dataset's chunk counts
        only once there are none: the late eviction deletes the new plan's puts too (Stats and
        tags cannot tell them from the old plan's), so a chunk activated before it would be
        active yet empty on that server for a whole pass (service.ReportLoaded)."""
        self._buffer_for(None, ds, chunk)
        ring = set(self.registry.addresses())
        return sorted(a for a, owed in self.owed.items() if a in ring and ds in owed)

    def _on_pipeline(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        """A job's first-epoch costs of a pipeline: the (dataset, pipeline) is decided
        by its first report; a transformed set becomes a dataset of its own."""
        job, ds, fp = str(ev["job"]), str(ev["dataset"]), str(ev["fingerprint"])
        if self._job(job).dataset != ds:
            raise Rejected("INVALID_ARGUMENT", f"job {job} reads dataset {self.jobs[job].dataset}, not {ds}")
        key = pipeline_key(ds, fp)
        rec = self.pipelines.get(key) or PipelineRecord(ds, fp)
        fixed = ev.get("fixed", False)  # optional (journals before it have none): transformed whatever is decided
        if not isinstance(fixed, bool):
            raise Rejected("INVALID_ARGUMENT", f"fixed must be true or false, got {fixed!r}")
        try:
            decided = report_pipeline(rec, job, ev["costs"], self._room(ds, rec.tag), now, fixed=fixed)
        except (ValueError, TypeError, KeyError) as e:
            raise Rejected("INVALID_ARGUMENT", f"bad pipeline costs: {e}") from None
        self.pipelines[key] = rec
        out: list[Effect] = []
        if decided:
            self._count("autocache_decisions")
            out.append(note("autocache", dataset=ds, fingerprint=fp, mode=rec.mode,
                            reason=rec.decision["reason"] if rec.decision else ""))
        if rec.needs_set() and rec.tag not in self.datasets:
            size, n = rec.transformed_bytes()
            self._new_dataset(rec.tag, size, n)
        return out + self.reallocate(now)

    def _on_workers(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        """A job's worker-scaling policy as it stands after a call that changed it
        (manager/workers.py decides; the model only keeps it, validated)."""
        job = self._job(str(ev["job"])).job
        try:
            self.workers[job] = checked_policy({"kind": ev.get("kind"), "state": ev.get("state")})
        except ValueError as e:
            raise Rejected("INVALID_ARGUMENT", str(e)) from None
        return []

    def _on_evictions_owed(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        try:
            self.owed = checked_owed(ev["owed"])
        except ValueError as e:
            raise Rejected("INVALID_ARGUMENT", str(e)) from None
        return []

    def _on_plan_floor(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        """Versions of datasets created from now on start at least at ``floor`` (never lowered)."""
        floor = ev.get("floor")
        if type(floor) is not int or floor < 0:
            raise Rejected("INVALID_ARGUMENT", f"plan_floor: floor must be a whole number >= 0, got {floor!r}")
        self.plan_floor = max(self.plan_floor, floor)
        return []

    def _on_plan_lift(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        """A job holds a version of the dataset's plan above the state's, which went back (restored
        from an older backup, the journal after it lost): the version goes to at least ``floor``,
        so that the job takes the plan answered for a new one rather than keep the one it holds."""
        ds, floor = str(ev["dataset"]), ev.get("floor")
        if type(floor) is not int or not 0 <= floor <= MAX_PLAN_VERSION:
            raise Rejected("INVALID_ARGUMENT", f"plan_lift: floor must be a whole number in [0, "
                                               f"{MAX_PLAN_VERSION}], got {floor!r}")
        rec = self.datasets.get(ds)
        if rec is None:
            raise Rejected("NOT_FOUND", f"plan_lift: unknown dataset {ds!r}")
        was = self.plan_version(ds)
        rec.plan_base += max(0, floor - was)
        return [note("plan version lifted above one a job holds (a state restored from an older backup?)",
                     dataset=ds, was=was, version=self.plan_version(ds))]

    def _new_dataset(self, name: str, size: int, n_items: int) -> DatasetRecord:
        rec = self.datasets[name] = DatasetRecord(name, size, n_items, plan_base=self.plan_floor)
        return rec

    def _room(self, ds: str, tag: str) -> float:
        """Cache bytes a dataset's pipeline may count on: the budget less what the
        other datasets hold now."""
        return float(max(0, self.budget() - sum(a.bytes for d, a in self.allocs.items() if d not in (ds, tag))))

    def job_gains(self) -> dict[str, list]:
        """Per dataset its jobs' gains, transformed sets taking theirs (pipelines.move_gains)."""
        gains = self.board.job_gains()
        move_gains(self.pipelines, {j: r.n_gpus for j, r in self.jobs.items()}, gains)
        return gains

    def _mark_idle_sets(self, gains: Mapping[str, list], now: float) -> None:
        """A transformed set whose jobs all left starts its grace period like any dataset."""
        for rec in self.pipelines.values():
            t = self.datasets.get(rec.tag)
            if t is not None:
                t.idle_since = None if rec.tag in gains else (t.idle_since if t.idle_since is not None else now)

    def _on_tick(self, ev: Mapping[str, Any], now: float) -> list[Effect]:
        out = self._transitions(self.board.tick(now))
        for ds in sorted(self.buffers):
            out += self.effects_of_actions(self.buffers[ds].tick(now))
        return out + self.reallocate(now)

    # ---------------------------------------------------------------- queries
    def option(self, ds: str) -> Option:
        a = self.allocs.get(ds)
        return Option.NONE if a is None else a.option

    def plan_version(self, ds: str) -> int:
        rec = self.datasets.get(ds)
        buf = self.buffers.get(ds)
        return (rec.plan_base if rec else 0) + (buf.version if buf else 0)

    def plan(self, ds: str, job: str = "") -> dict[str, Any]:
        """What a client needs: option, chunking, and the chunks ``job`` may read."""
        rec = self.datasets.get(ds)
        if rec is None:
            raise Rejected("NOT_FOUND", f"unknown dataset {ds!r}: register a job on it first")
        a = self.allocs.get(ds)
        buf = self.buffers.get(ds)
        chunks = buf.readable(job) if (buf is not None and job) else []
        waiting = bool(buf is not None and job in buf.jobs and buf.jobs[job].chunk is None)
        return {"dataset": ds, "option": self.option(ds).value, "spare": bool(a and a.spare),
                "k": buf.k if buf else 1,
                "n_items": rec.n_items, "chunk_size": a.chunk_size if a else 0,
                "share_items": share_items(a.share, rec.bytes, rec.n_items) if a else 0,
                "active": -1 if buf is None or buf.active is None else buf.active,
                "loading": -1 if buf is None or buf.loading is None else buf.loading,
                "chunks": chunks, "version": self.plan_version(ds), "waiting": waiting}

    def budget(self) -> int:
        return self.config.budget if self.config.budget is not None else self.registry.capacity()

    # ---------------------------------------------------------------- persistence
    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(), "now": self.now,
            "registry": self.registry.to_dict(), "board": self.board.to_dict(),
            "jobs": {k: v.to_dict() for k, v in sorted(self.jobs.items())},
            "datasets": {k: asdict(v) for k, v in sorted(self.datasets.items())},
            "allocs": {k: v.to_dict() for k, v in sorted(self.allocs.items())},
            "buffers": {k: v.to_dict() for k, v in sorted(self.buffers.items())},
            "decisions": list(self.decisions), "counters": dict(sorted(self.counters.items())),
        } | self._optional_dict()

    def _optional_dict(self) -> dict[str, Any]:
        """Parts left out while empty: a state without them reads (and digests) as before."""
        out: dict[str, Any] = {}
        if self.admission.key:
            out["admission"] = self.admission.to_dict()
        if self.pipelines:
            out["pipelines"] = {k: v.to_dict() for k, v in sorted(self.pipelines.items())}
        if self.workers:
            out["workers"] = {k: dict(v) for k, v in sorted(self.workers.items())}
        if self.plan_floor:
            out["plan_floor"] = self.plan_floor
        if self.owed:
            out["owed"] = {k: list(v) for k, v in sorted(self.owed.items())}
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ManagerModel":
        cfg = ManagerConfig.from_dict(d.get("config", {}))
        return cls(
            config=cfg, now=float(d.get("now", 0.0)),
            registry=Registry.from_dict(d.get("registry", {})),
            board=ProbeBoard.from_dict(d.get("board", {"config": asdict(cfg.probe)})),
            jobs={k: JobRecord(**v) for k, v in d.get("jobs", {}).items()},
            datasets={k: DatasetRecord(**v) for k, v in d.get("datasets", {}).items()},
            allocs={k: Allocation.from_dict(v) for k, v in d.get("allocs", {}).items()},
            buffers={k: DoubleBuffer.from_dict(v) for k, v in d.get("buffers", {}).items()},
            decisions=list(d.get("decisions", [])), counters=dict(d.get("counters", {})),
            pipelines={k: PipelineRecord.from_dict(v) for k, v in d.get("pipelines", {}).items()},
            admission=AdmissionBoard.from_dict(d.get("admission", {})),
            workers={k: dict(v) for k, v in d.get("workers", {}).items()},
            plan_floor=int(d.get("plan_floor", 0)),
            owed=checked_owed(d.get("owed", {})),
        )

    def digest(self) -> str:
        """sha256 of the canonical JSON state: equal digests mean equal state."""
        return hashlib.sha256(canonical(self.to_dict())).hexdigest()
