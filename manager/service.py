"""gRPC adapter: Manager RPCs -> events on the state store (state.py) and
answers read from the model. Mutating calls answer only after their event is
journaled (fsynced), so an acknowledged registration, release or load report
survives a crash."""
from __future__ import annotations

import functools
import math
import logging
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from google.protobuf import json_format

from cacheserver.counters import Counters
from cacheserver.identity import grpc_identity
from cacheserver.proto import manager_pb2 as mpb
from cacheserver.proto import manager_pb2_grpc as mpb_grpc
from cacheserver.roles import Roles
from cacheserver.vocab import source_tag

from . import jobtokens, statusview
from .membership import Liveness, address_taken
from .model import ManagerModel, Rejected
from .modelrecords import MAX_PLAN_VERSION, PLAN_VERSION_HEADER
from .pipelines import PipelineRecord, pipeline_key
from .policy import CacheMode, Option, dataset_gain
from .policy.scaling import Measurement
from .state import StateStore
from .workers import WorkerScaling

log = logging.getLogger("manager.service")
HEX = frozenset("0123456789abcdef")  # lower-case: one spelling per dataset


def _rpc(fn: Callable) -> Callable:
    """Count calls; map refusals to precise status codes."""

    @functools.wraps(fn)
    def wrapper(self: "ManagerService", request, context: grpc.ServicerContext):
        self.counters.add("rpc_" + fn.__name__)
        try:
            return fn(self, request, context)
        except Rejected as e:
            context.abort(getattr(grpc.StatusCode, e.code), str(e))
        except OSError as e:  # the journal could not be written: nothing was decided
            context.abort(grpc.StatusCode.UNAVAILABLE, f"manager state not writable: {e}")

    return wrapper


def plan_message(p: dict[str, Any]) -> mpb.Plan:
    return mpb.Plan(dataset=p["dataset"], option=Option(p["option"]).code, k=p["k"], n_items=p["n_items"],
                    chunk_size=p["chunk_size"], active=p["active"], loading=p["loading"],
                    chunks=p["chunks"], version=p["version"], waiting=p["waiting"], spare=p["spare"])


def _check_batches(batches: list[list]) -> None:
    """Batch reports decide bypass probes and, through hit ratios, other datasets' admission:
    a NaN or out-of-range value is refused, naming it, before it reaches the state."""
    for i, (end, duration, hit) in enumerate(batches):
        if not (math.isfinite(end) and math.isfinite(duration) and duration >= 0):
            raise Rejected("INVALID_ARGUMENT", f"batches[{i}]: end and duration must be finite and the "
                                               f"duration >= 0, got end {end!r}, duration {duration!r}")
        if hit is not None and not 0.0 <= hit <= 1.0:
            raise Rejected("INVALID_ARGUMENT", f"batches[{i}].hit_ratio must be in [0, 1], got {hit!r}")


def held_version(context: Any) -> int | None:
    """The plan version a job's call says it holds (PLAN_VERSION_HEADER), or None; Rejected for
    one that is no version this manager could have handed out."""
    try:
        md = context.invocation_metadata() or ()
    except Exception:  # a context without metadata (in-process calls)
        return None
    raw = dict(md).get(PLAN_VERSION_HEADER)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit() and int(raw) <= MAX_PLAN_VERSION):
        raise Rejected("INVALID_ARGUMENT", f"metadata {PLAN_VERSION_HEADER} must be a plan version (a whole "
                                           f"number <= {MAX_PLAN_VERSION}), got {raw[:40]!r}")
    return int(raw)


def _mode(m: ManagerModel, job: str) -> int:
    j = m.board.jobs.get(job)
    return (j.mode if j is not None else CacheMode.NORMAL).code


class ManagerService(mpb_grpc.ManagerServicer):
    def __init__(self, store: StateStore, liveness: Liveness, *, heartbeat_s: float, decision_s: float,
                 counters: Counters, scaling: WorkerScaling | None = None, roles: Roles | None = None,
                 job_timeout_s: float = 900.0, server_timeout_s: float | None = None,
                 on_server_start: Callable[[str], None] | None = None,
                 on_unknown_with_entries: Callable[[str], None] | None = None) -> None:
        self.store = store
        # Called (under the store's lock, before the join) with the address of a server that
        # registers with entries under an id the state does not know (forgotten while away):
        # the actuator owes it the evictions it may have missed (Actuator.owe_chunked).
        self.on_unknown_with_entries = on_unknown_with_entries
        # Called with a server's address when it registers (a server registers when it starts):
        # the actuator brings it up to date at once, not at the next reconcile round.
        self.on_server_start = on_server_start
        self.roles = roles or Roles(None)  # the manager's role: full Status, ReportLoaded without a job
        self.scaling = scaling or WorkerScaling()
        self.scaling.attach(StoreJournal(store))
        self.liveness = liveness
        self.heartbeat_s = heartbeat_s
        self.decision_s = decision_s
        self.job_timeout_s = job_timeout_s
        # Silence after which a server is dead (--heartbeat-seconds x --heartbeat-misses): until
        # then its address is its own, and a new id registering there is refused.
        self.server_timeout_s = heartbeat_s * 3 if server_timeout_s is None else server_timeout_s
        self.counters = counters

    def _now(self) -> float:
        return self.store.clock()

    def _act_as(self, job: str, context) -> None:
        """Refuse a caller without ``job``'s token (call with the store's lock held); an
        unknown job passes (the call then answers NOT_FOUND or does nothing)."""
        rec = self.store.model.jobs.get(job)
        if rec is not None and not jobtokens.matches(jobtokens.presented(context), rec.token_hash):
            self.counters.add("job_token_refused")
            raise Rejected("PERMISSION_DENIED", self._not_the_job(job))

    def _not_the_job(self, job: str) -> str:
        """Why a caller without ``job``'s token is refused, and what it can do."""
        wait = self.liveness.job_expires_in(job, self._now(), self.job_timeout_s) + self.decision_s
        return (f"job {job!r} is registered with a token this caller did not send: only the job acts as itself. "
                f"If this is that job run again: give all its processes the same {jobtokens.SECRET_ENV} "
                "(torchrun ranks share their run id), or run it as the same user on the same machine (a lone "
                "process keeps its token in ~/.cache/mlcache/jobs); else choose another job name, or wait "
                f"about {wait:.0f} s until the manager drops the old registration (no contact for "
                f"--job-timeout-seconds={self.job_timeout_s:.0f}). docs/security.md, Job tokens")

    def _may_report_loaded(self, dataset: str, job: str, context) -> None:
        """A load report moves a dataset's chunks on: only from a job registered on it (or on
        the dataset a transformed tag derives from), with its token, or the manager's role."""
        if self.roles.is_manager(context):
            return
        rec = self.store.model.jobs.get(job)
        if rec is None or source_tag(dataset) != rec.dataset:
            self.counters.add("job_token_refused")
            raise Rejected("PERMISSION_DENIED",
                           f"ReportLoaded changes the chunk states of dataset {dataset[:16]}: it needs the job "
                           f"registered on it and that job's token (got job {job!r}), or the manager's role")
        self._act_as(job, context)

    def _catch_up(self, dataset: str, job: str, context) -> None:
        """A job registered on ``dataset`` (or its source) holds a plan version above the state's
        (held_version): the state went back, restored from an older backup whose later journal
        is lost, and the job would keep the lost plan as the newer one (ManagerClient._remember)
        until the dataset's plan changed again. Journal a lift above it (plan_lift), so the plan
        answered is new to it. Call with the store's lock held, after the caller was checked."""
        held = held_version(context)
        m = self.store.model
        rec = m.jobs.get(job)
        if held is None or rec is None or source_tag(dataset) != rec.dataset or dataset not in m.datasets:
            return
        was = m.plan_version(dataset)
        if held <= was:
            return
        log.warning("job %s holds version %d of dataset %s's plan, above this state's %d: the state went "
                    "back (restored from an older backup?); lifting the version above it", job, held,
                    dataset[:16], was)
        self.counters.add("plan_versions_lifted")
        self.store.submit({"type": "plan_lift", "dataset": dataset,
                           "floor": min(MAX_PLAN_VERSION, max(held + 1, int(self._now() * 1000)))})

    # ---------------------------------------------------------------- servers
    def _join_if_needed(self, sid: str, address: str, capacity: int, now: float) -> None:
        if self.store.read(lambda m: m.registry.needs_join(sid, address, capacity)):
            self.store.submit({"type": "server_join", "server_id": sid, "address": address,
                               "capacity": int(capacity), "now": now})

    def _may_join(self, context, op: str) -> None:
        """Joining the ring (and staying in it) is for cache servers: the manager sends the
        cluster token to every server it reconciles, and a server's capacity sets the budget.
        A server proves it with that token or, under mutual TLS, its server certificate."""
        if self.roles.is_cache_server(context):
            return
        self.counters.add("server_refused")
        raise Rejected("PERMISSION_DENIED",
                       f"{op} is for cache servers: it needs the cluster token (--cluster-token-file, the "
                       f"same file as the manager's) or, under mutual TLS, a server certificate")

    def _refuse_taken_address(self, sid: str, address: str, now: float) -> None:
        """Two live servers advertising one address would take it from each other at every
        heartbeat (each told "not registered", each re-registering): the second is refused
        while the first heartbeats. Volatile heartbeats decide, not the model: journals that
        hold such a replacement still replay."""
        holder = self.liveness.live_holder(self.store.model.registry, sid, address, now, self.server_timeout_s)
        if holder is not None:
            why = address_taken(address, holder, sid, self.server_timeout_s)
            log.warning("RegisterServer refused: %s", why)
            raise Rejected("ALREADY_EXISTS", why)

    @_rpc
    def RegisterServer(self, request: mpb.RegisterServerRequest, context) -> mpb.RegisterServerResponse:
        self._may_join(context, "RegisterServer")
        if not request.server_id or not request.address:
            raise Rejected("INVALID_ARGUMENT", "server_id and address must not be empty")
        now = self._now()
        with self.store.lock:
            self._refuse_taken_address(request.server_id, request.address, now)
            self.liveness.beat(request.server_id, now, request.used, request.items)
            if (request.used and self.on_unknown_with_entries is not None
                    and request.server_id not in self.store.model.registry.servers):
                self.on_unknown_with_entries(request.address)
            self._join_if_needed(request.server_id, request.address, request.capacity, now)
            reg = self.store.model.registry
            answer = mpb.RegisterServerResponse(ring_version=reg.version, heartbeat_seconds=self.heartbeat_s,
                                                addresses=reg.addresses())
        if self.on_server_start is not None:
            self.on_server_start(request.address)
        return answer

    @_rpc
    def Heartbeat(self, request: mpb.HeartbeatRequest, context) -> mpb.HeartbeatResponse:
        self._may_join(context, "Heartbeat")
        now = self._now()
        with self.store.lock:
            reg = self.store.model.registry
            if request.server_id not in reg.servers:
                return mpb.HeartbeatResponse(registered=False, ring_version=reg.version,
                                             heartbeat_seconds=self.heartbeat_s, addresses=reg.addresses())
            self.liveness.beat(request.server_id, now, request.used, request.items)
            cap = request.capacity or reg.servers[request.server_id].capacity
            self._join_if_needed(request.server_id, request.address, cap, now)  # back from the dead
            return mpb.HeartbeatResponse(registered=True, ring_version=reg.version,
                                         heartbeat_seconds=self.heartbeat_s, addresses=reg.addresses())

    @_rpc
    def GetRing(self, request: mpb.GetRingRequest, context) -> mpb.RingResponse:
        return self.store.read(lambda m: mpb.RingResponse(version=m.registry.version,
                                                          addresses=m.registry.addresses()))

    # ---------------------------------------------------------------- jobs
    @_rpc
    def RegisterJob(self, request: mpb.RegisterJobRequest, context) -> mpb.JobInfo:
        ds = request.dataset
        if len(ds) < 8 or len(ds) > 128 or any(c not in HEX for c in ds):
            raise Rejected("INVALID_ARGUMENT", f"dataset must be a hex fingerprint (8-128 hex digits), got {ds!r}")
        token = jobtokens.presented(context)
        with self.store.lock:
            self._act_as(request.job, context)
            old = self.store.model.jobs.get(request.job)
            if old is None or not old.token_hash:
                token = token or jobtokens.new_token()
            if old is not None and not old.token_hash:  # the model gives it this token
                log.warning("job %s, from a state written before job tokens, now takes the token of this "
                            "registration (from %s)", request.job, grpc_identity(context))
            self.store.submit({"type": "job_register", "job": request.job, "dataset": request.dataset,
                               "dataset_bytes": request.dataset_bytes, "n_items": request.n_items,
                               "n_gpus": request.n_gpus, "token_hash": jobtokens.token_hash(token) if token else ""})
            self.liveness.touch_job(request.job, self._now())
            m = self.store.model
            return mpb.JobInfo(job=request.job, dataset=request.dataset, mode=_mode(m, request.job),
                               plan=plan_message(m.plan(request.dataset, request.job)),
                               ring_version=m.registry.version, token=token or "")

    @_rpc
    def ReportBatches(self, request: mpb.ReportBatchesRequest, context) -> mpb.ReportBatchesResponse:
        now = self._now()
        # Map the client's clock onto ours: its batches ended (sent_at - end) before it sent them.
        shift = now - request.sent_at if request.sent_at > 0 else 0.0
        batches = [[b.end + shift, b.duration, b.hit_ratio if b.HasField("hit_ratio") else None]
                   for b in request.batches]
        _check_batches(batches)
        # A numbered report (its client sends a report whose call failed again, under the
        # same number) is applied once: one whose number the job's stream had is not journaled.
        stream = f"{request.report_stream:016x}"
        number = {"stream": stream, "seq": request.report_seq} if request.report_seq else {}
        with self.store.lock:
            self._act_as(request.job, context)
            m = self.store.model
            rec = m.jobs.get(request.job)
            repeat = bool(number) and rec is not None and rec.applied(stream) >= request.report_seq
            if batches and not repeat:
                self.store.submit({"type": "batches", "job": request.job, "batches": batches, "now": now,
                                   **number})
            m = self.store.model  # a failed write reloads the state: another model
            if request.job not in m.jobs:
                raise Rejected("NOT_FOUND", f"unknown job {request.job!r}: register it again")
            if repeat:
                self.counters.add("batch_reports_repeated")
                log.info("job %s sent report %d of stream %s again: applied once, not counted again",
                         request.job, request.report_seq, stream)
            rec = m.jobs[request.job]
            self.liveness.touch_job(request.job, now)
            return mpb.ReportBatchesResponse(mode=_mode(m, request.job), plan_version=m.plan_version(rec.dataset),
                                             report_seq=rec.applied(stream) if number else 0)

    @_rpc
    def GetPlan(self, request: mpb.GetPlanRequest, context) -> mpb.Plan:
        with self.store.lock:
            self._act_as(request.job, context)  # "" asks for the dataset-wide plan: its fingerprint is the key
            if request.job in self.store.model.jobs:
                self.liveness.touch_job(request.job, self._now())
            self._catch_up(request.dataset, request.job, context)
            return plan_message(self.store.model.plan(request.dataset, request.job))

    @_rpc
    def ReleaseChunk(self, request: mpb.ReleaseChunkRequest, context) -> mpb.Plan:
        with self.store.lock:
            self._act_as(request.job, context)
            self.store.submit({"type": "release", "job": request.job, "dataset": request.dataset,
                               "chunk": request.chunk})
            self.liveness.touch_job(request.job, self._now())
            self._catch_up(request.dataset, request.job, context)
            return plan_message(self.store.model.plan(request.dataset, request.job))

    @_rpc
    def ReportLoaded(self, request: mpb.ReportLoadedRequest, context) -> mpb.Plan:
        if not 0.0 <= request.fraction <= 1.0:
            raise Rejected("INVALID_ARGUMENT", f"fraction must be in [0, 1], got {request.fraction}")
        with self.store.lock:
            self._may_report_loaded(request.dataset, request.job, context)
            if not self.store.model.evicting(request.dataset, request.chunk):  # else not counted (model.py)
                self.store.submit({"type": "loaded", "dataset": request.dataset, "chunk": request.chunk,
                                   "fraction": request.fraction})
            self._catch_up(request.dataset, request.job, context)
            return plan_message(self.store.model.plan(request.dataset, request.job))

    @_rpc
    def UnregisterJob(self, request: mpb.UnregisterJobRequest, context) -> mpb.UnregisterJobResponse:
        with self.store.lock:  # RegisterJob touches under it: a registration right after keeps its contact
            self._act_as(request.job, context)
            if request.job in self.store.model.jobs:  # else nothing to journal (another rank's, a retry)
                self.store.submit({"type": "job_unregister", "job": request.job,
                                   "reason": "unregistered by client"})
            if request.job not in self.store.model.jobs:
                self.liveness.forget_job(request.job)
        return mpb.UnregisterJobResponse()

    @_rpc
    def ReportPipeline(self, request: mpb.ReportPipelineRequest, context) -> mpb.AutocacheDecision:
        fp = request.fingerprint
        if len(fp) < 16 or len(fp) > 128 or any(c not in HEX for c in fp):
            raise Rejected("INVALID_ARGUMENT", f"fingerprint must be 16-128 lower-case hex digits, got {fp!r}")
        if not request.HasField("costs"):
            raise Rejected("INVALID_ARGUMENT", "costs are required")
        costs = json_format.MessageToDict(request.costs, preserving_proto_field_name=True,
                                          always_print_fields_with_no_presence=True)
        costs["items"], costs["epochs_left"] = int(costs["items"]), int(costs["epochs_left"])
        with self.store.lock:
            self._act_as(request.job, context)
            fixed = {"fixed": True} if request.fixed else {}  # absent otherwise: events as before
            self.store.submit({"type": "pipeline", "job": request.job, "dataset": request.dataset,
                               "fingerprint": fp, "costs": costs, "now": self._now(), **fixed})
            self.liveness.touch_job(request.job, self._now())
            rec = self.store.model.pipelines[pipeline_key(request.dataset, fp)]
            return decision_message(rec)

    # ---------------------------------------------------------------- remote workers
    @_rpc
    def ScaleWorkers(self, request: mpb.ScaleWorkersRequest, context) -> mpb.ScaleWorkersResponse:
        if not (0 <= request.batch_time < math.inf and 0 <= request.queue < math.inf):
            raise Rejected("INVALID_ARGUMENT", f"batch_time and queue must be finite and >= 0, got "
                                               f"{request.batch_time}, {request.queue}")
        m = Measurement(request.batch_time, request.queue) if request.batch_time > 0 else None
        # All under the store's lock (taken before the scaling's, as everywhere): a job
        # registered or dropped meanwhile must not gain or lose a policy, and a changed
        # policy is journaled before the answer.
        with self.store.lock:
            self._act_as(request.job, context)
            jobs = set(self.store.model.jobs)
            if request.job not in jobs:
                raise Rejected("NOT_FOUND", f"unknown job {request.job!r}: register it first")
            self.liveness.touch_job(request.job, self._now())
            self.scaling.forget_except(jobs)
            try:
                c = self.scaling.decide(request.job, request.policy, m, request.remote, request.local)
            except ValueError as e:
                raise Rejected("INVALID_ARGUMENT", str(e)) from None
        if c.reason:
            log.info("job %s workers: remote %d, local %d (%s)", request.job, c.remote, c.local, c.reason)
        return mpb.ScaleWorkersResponse(ray_address=self.scaling.ray_address, remote=c.remote, local=c.local,
                                        reason=c.reason, phase=c.phase)

    # ---------------------------------------------------------------- status
    @_rpc
    def Status(self, request: mpb.StatusRequest, context) -> mpb.StatusResponse:
        now = self._now()
        with self.store.lock:
            m = self.store.model
            r = build_status(m, self.liveness, now, seq=self.store.seq,
                             heartbeat_s=self.heartbeat_s, decision_s=self.decision_s)
            if self.roles.is_manager(context):
                return r
            jobs = statusview.visible_jobs(m.jobs, statusview.presented_tokens(context))
            return statusview.restrict(r, jobs, {m.jobs[j].dataset for j in jobs})


class StoreJournal:
    """Worker-scaling policies journaled on the state store (``workers`` events, fsynced
    like any answer the manager gives; callers hold the store's lock)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def saved(self, job: str) -> Mapping[str, Any] | None:
        return self.store.model.workers.get(job)

    def save(self, job: str, saved: dict[str, Any]) -> None:
        self.store.submit({"type": "workers", "job": job, "kind": saved["kind"], "state": saved["state"]})


def decision_message(rec: PipelineRecord) -> mpb.AutocacheDecision:
    d = rec.decision or {"mode": "", "costs": {}, "reason": ""}
    return mpb.AutocacheDecision(dataset=rec.dataset, fingerprint=rec.fingerprint, mode=d["mode"],
                                 costs=d["costs"], reason=d["reason"], decided_at=rec.decided_at, tag=rec.tag,
                                 jobs=sorted(rec.measured), fixed=rec.fixed,
                                 room_bytes=-1.0 if rec.room_bytes is None else rec.room_bytes)


def _pipelines(r: mpb.StatusResponse, m: ManagerModel) -> None:
    for key in sorted(m.pipelines):
        rec = m.pipelines[key]
        c = rec.combined()
        measured = mpb.PipelineCosts(**{k: v for k, v in vars(c).items() if k != "room_bytes"})
        r.pipelines.add(decision=decision_message(rec), measured=measured)


def build_status(m: ManagerModel, live: Liveness, now: float, *, seq: int, heartbeat_s: float,
                 decision_s: float) -> mpb.StatusResponse:
    r = mpb.StatusResponse(ring_version=m.registry.version, budget=m.budget(),
                           budget_from_capacity=m.config.budget is None,
                           allocated=sum(a.bytes for a in m.allocs.values()), journal_seq=seq,
                           state_digest=m.digest(), heartbeat_seconds=heartbeat_s,
                           decision_seconds=decision_s, now=now)
    for sid in sorted(m.registry.servers):
        s = m.registry.servers[sid]
        beat = live.server(sid, now)  # ages true across a wall-clock step
        r.servers.add(server_id=sid, address=s.address, capacity=s.capacity, alive=s.alive,
                      used=beat.used if beat else 0, items=beat.items if beat else 0,
                      last_heartbeat_age=now - beat.at if beat else -1.0)
    gains = {ds: dataset_gain(js, m.board.config.prior_benefit) for ds, js in m.job_gains().items()}
    for ds in sorted(m.datasets):
        rec, a, buf = m.datasets[ds], m.allocs.get(ds), m.buffers.get(ds)
        d = r.datasets.add(dataset=ds, bytes=rec.bytes, n_items=rec.n_items, option=m.option(ds).code,
                           allocated_bytes=a.bytes if a else 0, chunk_size=a.chunk_size if a else 0,
                           value=a.value if a else 0.0, gain=gains.get(ds, 0.0), reason=a.reason if a else "",
                           plan_version=m.plan_version(ds), spare=bool(a and a.spare),
                           jobs=sorted(j for j, x in m.jobs.items() if x.dataset == ds))
        if buf is not None:
            d.k, d.loaded_fraction, d.straggler_timeout = buf.k, buf.loaded_fraction, buf.straggler_timeout()
            for name in ("active", "loading", "marked"):
                v = getattr(buf, name)
                setattr(d, name, -1 if v is None else v)
            for c in buf.resident():
                d.chunks.add(chunk=c, state=buf.state(c).value, jobs=buf.holders(c))
            d.waiting.extend(buf.waiting())
        else:
            d.active = d.loading = d.marked = -1
    for job in sorted(m.jobs):
        jr, p = m.jobs[job], m.board.jobs.get(job)
        buf = m.buffers.get(jr.dataset)
        slot = buf.jobs.get(job) if buf is not None else None
        js = r.jobs.add(job=job, dataset=jr.dataset, n_gpus=jr.n_gpus, mode=_mode(m, job),
                        batches=jr.batches, chunk=-1 if slot is None or slot.chunk is None else slot.chunk)
        if p is not None:
            js.phase, js.inconclusive, js.probes, js.reason = p.phase.value, p.inconclusive, p.probes, p.reason
            for name in ("benefit", "t_miss", "t_hit", "hit_ratio"):
                if getattr(p, name) is not None:
                    setattr(js, name, getattr(p, name))
    for d in m.decisions:
        r.decisions.add(at=d["at"], dataset=d["dataset"], option=Option(d["option"]).code, reason=d["reason"])
    _pipelines(r, m)
    return r

