"""Client of the cache manager, for cache clients (training jobs) and tools.

Every call has a short deadline (``timeout``, 1 s by default) and fails with
``ManagerUnavailable`` when the manager cannot be reached in time. Training
must not depend on the manager being up: catch it, keep using the last plan
(``last_plan``) and the last ring (``last_ring``), and try again later.
Refusals (unknown job, bad arguments) raise ``ManagerError`` with the
server's message.

    mc = ManagerClient("manager:7000")
    info = mc.register_job("job-1", fingerprint, dataset_bytes, n_items, n_gpus=4)
    # this client now holds the job's token (info.token; manager/jobtokens.py) and sends it
    try:
        mode = mc.report_batches("job-1", [(end, duration, hit_ratio), ...]).mode
        plan = mc.release_chunk("job-1", fingerprint, chunk)
    except ManagerUnavailable:
        plan = mc.last_plan(fingerprint, "job-1")
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Union

import grpc
from google.protobuf import json_format

from cacheserver.proto import manager_pb2 as mpb
from cacheserver.proto import manager_pb2_grpc as mpb_grpc
from cacheserver.roles import check_printable
from cacheserver.roles import metadata as roles_metadata
from cacheserver.tls import FAST_RECONNECT, TlsFiles, grpc_channel
from cacheserver.vocab import CacheMode, Option

from . import jobtokens
from .modelrecords import PLAN_VERSION_HEADER
from .policy import Batch, chunk_members, chunk_of
from .policy.autocache import Decision, PipelineCosts, costs_to_dict
from .policy.scaling import Measurement

#: A reported mini-batch: (end, duration), (end, duration, hit_ratio) or a policy Batch.
BatchLike = Union[tuple[float, float], tuple[float, float, Union[float, None]], Batch]

_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def _mode_name(code: int) -> str:
    try:
        return CacheMode.of_code(code).value
    except ValueError:
        return CacheMode.NORMAL.value


class ManagerError(Exception):
    """The manager refused the call; ``code`` is the gRPC status code."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class ManagerUnavailable(ManagerError):
    """The manager did not answer in time. Safe to ignore: keep the last plan."""


@dataclass(frozen=True)
class Plan:
    """Which chunk(s) a job reads. ``option``: "full", "chunked" or "none"
    (none: no room of its own; with ``spare``, misses go in as spare entries,
    else read from the store and insert nothing). ``chunks``: the chunks this
    job may read now; empty while ``waiting`` (read pending items from the
    store) or when not chunked. Items of chunk c: ``members(c)``."""
    dataset: str
    option: str
    k: int
    n_items: int
    chunk_size: int
    active: int | None
    loading: int | None
    chunks: tuple[int, ...]
    version: int
    waiting: bool = False
    spare: bool = False  # insert items outside the chunks as spare entries (also with "none")

    @classmethod
    def from_message(cls, p: mpb.Plan) -> "Plan":
        option = Option.of_code(p.option, Option.NONE).value
        spare = p.spare or option == Option.CHUNKED  # a chunked plan inserts spare entries, with or without the field
        return cls(p.dataset, option, max(1, p.k), p.n_items, p.chunk_size,
                   None if p.active < 0 else p.active, None if p.loading < 0 else p.loading,
                   tuple(p.chunks), p.version, p.waiting, spare)

    @property
    def cached(self) -> bool:
        return self.option != Option.NONE

    def chunk_of(self, i: int) -> int:
        return chunk_of(i, self.n_items, self.k)

    def members(self, c: int) -> list[range]:
        return chunk_members(c, self.n_items, self.k)

    def readable(self, i: int) -> bool:
        """Is item ``i`` in a chunk this job may read now (FULL: every item)? Items
        outside it are still inserted as spare entries when ``spare`` is set."""
        return self.option == Option.FULL or (self.option == Option.CHUNKED and self.chunk_of(i) in self.chunks)


@dataclass(frozen=True)
class JobInfo:
    job: str
    dataset: str
    mode: str                 # "normal" | "bypass" (the servers already apply it)
    plan: Plan
    ring_version: int
    token: str = ""           # the job's token (manager/jobtokens.py); this client sends it from now on


@dataclass(frozen=True)
class BatchReply:
    mode: str
    plan_version: int         # > your plan's version: call get_plan
    # Of a numbered report: the highest number of its stream the manager has applied; 0 for an
    # unnumbered one, or from a manager that predates numbering (it counts a report sent again twice).
    report_seq: int = 0


@dataclass(frozen=True)
class NumberedBatches:
    """Batches sent as report ``seq`` of ``stream`` (report_batches): the manager applies a
    number of a job's stream once, so a report whose call failed after the manager may have
    applied it (a deadline, a lost reply) can be sent again, whole, under the same number.
    Iterates over its batches."""
    stream: int               # a random 64-bit id per reporting client (new_report_stream)
    seq: int                  # 1, 2, ... within the stream
    batches: tuple[BatchLike, ...]

    def __iter__(self) -> Iterator[BatchLike]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def new_report_stream() -> int:
    """A report stream id: random from the OS, so processes that seeded ``random`` alike (DDP
    ranks of one job) never share one, which would drop one's reports as the other's repeats."""
    return int.from_bytes(os.urandom(8), "big") or 1


@dataclass(frozen=True)
class Ring:
    version: int
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class WorkerCounts:
    """The manager's answer to ScaleWorkers: where remote workers run and how many."""
    ray_address: str | None   # None: the manager knows no Ray cluster (no cachemanager --ray)
    remote: int
    local: int
    reason: str               # why the counts changed in this call ("" when they did not)
    phase: str


@dataclass
class _Cache:
    plans: dict[tuple[str, str], Plan] = field(default_factory=dict)
    ring: Ring | None = None


def _int64_fields(msg: Any, d: dict[str, Any]) -> dict[str, Any]:
    """proto3 JSON writes 64-bit integers as strings; give them back as numbers."""
    for f in msg.DESCRIPTOR.fields:
        if f.name not in d or (f.message_type is not None and f.message_type.GetOptions().map_entry):
            continue  # maps here hold no 64-bit integers
        if f.message_type is not None:
            subs = getattr(msg, f.name)
            for sub, sd in (zip(subs, d[f.name]) if f.is_repeated else [(subs, d[f.name])]):
                _int64_fields(sub, sd)
        elif f.cpp_type in (f.CPPTYPE_INT64, f.CPPTYPE_UINT64):
            d[f.name] = [int(x) for x in d[f.name]] if f.is_repeated else int(d[f.name])
    return d


class ManagerClient:
    def __init__(self, address: str, *, tls: TlsFiles | None = None, timeout: float = 1.0,
                 cluster_token: bytes | None = None) -> None:
        self.address = address
        self._role_md = roles_metadata(cluster_token) or ()  # the manager's role: Status shows every job
        self.timeout = timeout
        self.channel = grpc_channel(address, tls, FAST_RECONNECT)
        self.stub = mpb_grpc.ManagerStub(self.channel)
        self._cache = _Cache()
        self._jobs: dict[str, str] = {}  # dataset -> the job registered on it through this client
        self._tokens: dict[str, str] = {}  # job -> its token (jobtokens.py), from its registration
        self._lock = threading.Lock()
        self.closed = False  # set by close(): its channel then answers every call with a ValueError

    def job_token(self, job: str) -> str | None:
        """The token this client acts as ``job`` with: the one its registration returned,
        else the one derived from the launcher's secret (jobtokens.job_token), else None."""
        with self._lock:
            token = self._tokens.get(job)
        return token if token is not None else jobtokens.job_token(job)

    def set_job_token(self, job: str, token: str) -> None:
        """Act as ``job`` with ``token`` (one another client's registration returned);
        ValueError for one that cannot travel as gRPC metadata."""
        check_printable(token.encode(), f"job token for {job!r}")
        with self._lock:
            self._tokens[job] = token

    def _call(self, method: str, request: Any, timeout: float | None = None, job: str | None = None,
              extra: tuple[tuple[str, str], ...] = (), wait: bool = False) -> Any:
        """Call ``method`` with the cluster token (if given), ``job``'s token and ``extra`` metadata;
        ``wait``: connect (again) until the deadline rather than fail at the first failed connect."""
        job_md = (jobtokens.metadata(self.job_token(job)) if job else None) or ()
        md = self._role_md + job_md + extra or None
        try:
            return getattr(self.stub, method)(request, timeout=timeout or self.timeout, metadata=md,
                                              wait_for_ready=wait or None)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            if code in _DOWN:
                raise ManagerUnavailable(f"manager {self.address} unavailable ({method}): {details}", code) from None
            raise ManagerError(f"manager {self.address} refused {method}: {details}", code) from None

    def _held(self, dataset: str, job: str) -> tuple[tuple[str, str], ...]:
        """Metadata naming the version of ``job``'s plan of ``dataset`` this client holds: a manager
        whose state went back below it (restored from an older backup) lifts the dataset's version
        above it, or this client would keep the lost plan (_remember) until the plan changed."""
        with self._lock:
            held = self._cache.plans.get((dataset, job))
        return ((PLAN_VERSION_HEADER, str(held.version)),) if held is not None else ()

    def _remember(self, plan: Plan, job: str) -> Plan:
        with self._lock:
            key = (plan.dataset, job)
            old = self._cache.plans.get(key)
            if old is None or plan.version >= old.version:  # never go back to an older plan
                self._cache.plans[key] = plan
            return self._cache.plans[key]

    # ---------------------------------------------------------------- jobs
    def register_job(self, job: str, dataset: str, dataset_bytes: int, n_items: int, n_gpus: int = 1) -> JobInfo:
        r = self._call("RegisterJob", mpb.RegisterJobRequest(job=job, dataset=dataset, dataset_bytes=dataset_bytes,
                                                             n_items=n_items, n_gpus=n_gpus), job=job)
        plan = Plan.from_message(r.plan)
        with self._lock:  # the registration's plan stands, whatever version was seen before (a
            # manager restarted on an empty state dir counts afresh): the job's other cached plans
            # (a transformed set's) and the dataset-wide one go too, or their higher versions
            # would hide the new manager's plans
            for key in [k for k in self._cache.plans if k[1] == job or k == (dataset, "")]:
                del self._cache.plans[key]
            self._cache.plans[(plan.dataset, job)] = plan
            self._jobs[dataset] = job
            if r.token:
                self._tokens[job] = r.token
        return JobInfo(r.job, r.dataset, _mode_name(r.mode), plan, r.ring_version, r.token)

    def report_batches(self, job: str, batches: Iterable[BatchLike]) -> BatchReply:
        """``batches``: (end, duration[, hit_ratio]) tuples or policy ``Batch``es,
        ``end`` from time.time() on this machine (the manager corrects for clock
        offset), or ``NumberedBatches`` of them (applied once however often sent). The
        reply's ``mode`` is what the servers apply to the job now."""
        msgs = []
        for b in batches:
            end, dur, hit = (b.end, b.duration, b.hit_ratio) if isinstance(b, Batch) else (
                b[0], b[1], b[2] if len(b) > 2 else None)
            m = mpb.BatchTime(end=float(end), duration=float(dur))
            if hit is not None:
                m.hit_ratio = float(hit)
            msgs.append(m)
        req = mpb.ReportBatchesRequest(job=job, batches=msgs, sent_at=time.time())
        if isinstance(batches, NumberedBatches):
            req.report_stream, req.report_seq = batches.stream, batches.seq
        r = self._call("ReportBatches", req, job=job)
        return BatchReply(_mode_name(r.mode), r.plan_version, r.report_seq)

    def get_plan(self, dataset: str, job: str = "") -> Plan:
        r = self._call("GetPlan", mpb.GetPlanRequest(dataset=dataset, job=job), job=job or None,
                       extra=self._held(dataset, job))
        return self._remember(Plan.from_message(r), job)

    def release_chunk(self, job: str, dataset: str, chunk: int) -> Plan:
        """The job finished its pass over ``chunk``; returns its next plan."""
        r = self._call("ReleaseChunk", mpb.ReleaseChunkRequest(job=job, dataset=dataset, chunk=chunk), job=job,
                       extra=self._held(dataset, job))
        return self._remember(Plan.from_message(r), job)

    def report_loaded(self, dataset: str, chunk: int, fraction: float, job: str | None = None) -> Plan:
        """Share of the loading chunk's items now in the cache (>= 0.98 activates it).
        Returns ``job``'s plan; by default that of the job this client registered
        on ``dataset`` (the dataset-wide plan, without ``chunks``, if none)."""
        if job is None:
            with self._lock:
                job = self._jobs.get(dataset, "")
        r = self._call("ReportLoaded", mpb.ReportLoadedRequest(dataset=dataset, chunk=chunk, fraction=fraction,
                                                               job=job), job=job or None,
                       extra=self._held(dataset, job))
        return self._remember(Plan.from_message(r), job)

    def unregister_job(self, job: str) -> None:
        self._call("UnregisterJob", mpb.UnregisterJobRequest(job=job), job=job)
        with self._lock:
            self._tokens.pop(job, None)
            for key in [k for k in self._cache.plans if k[1] == job]:
                del self._cache.plans[key]
            for ds in [d for d, j in self._jobs.items() if j == job]:
                del self._jobs[ds]

    def report_pipeline(self, job: str, dataset: str, fingerprint: str, costs: PipelineCosts,
                        fixed: bool = False) -> Decision:
        """A job's first-epoch costs of a pipeline; returns the (dataset, pipeline)'s
        decision (made by the first job that reported it, the same for every job).
        ``fixed``: the job's loader runs transformed whatever is decided; the manager
        counts it on the transformed set all the same."""
        d = costs_to_dict(costs)
        d.pop("room_bytes", None)  # the manager knows the room
        r = self._call("ReportPipeline", mpb.ReportPipelineRequest(
            job=job, dataset=dataset, fingerprint=fingerprint, costs=mpb.PipelineCosts(**d),
            fixed=fixed), job=job)
        return Decision(r.mode, dict(r.costs), r.reason)

    def scale_workers(self, job: str, policy: str, m: Measurement | None = None, remote: int = 0,
                      local: int = 0) -> WorkerCounts:
        """Remote preprocessing workers: without a measurement, the Ray address and the
        counts to start with (the job's policy starts afresh); with one (a window of
        batches), the counts to run now. ``policy``: "autoscale" or "placement"."""
        r = self._call("ScaleWorkers", mpb.ScaleWorkersRequest(
            job=job, policy=policy, batch_time=m.batch_time if m else 0.0, queue=m.queue if m else 0.0,
            remote=remote, local=local), job=job)
        return WorkerCounts(r.ray_address or None, r.remote, r.local, r.reason, r.phase)

    def get_ring(self) -> Ring:
        r = self._call("GetRing", mpb.GetRingRequest())
        ring = Ring(r.version, tuple(r.addresses))
        with self._lock:
            self._cache.ring = ring
        return ring

    def status(self, timeout: float | None = None, wait: bool = False) -> mpb.StatusResponse:
        """The manager's Status: everything with the cluster token, else the jobs this
        client holds tokens of (statusview.py) and aggregates of the rest. ``wait``: keep
        connecting until the deadline (a manager still starting, a failed handshake)."""
        with self._lock:
            tokens = sorted(set(self._tokens.values()))
        return self._call("Status", mpb.StatusRequest(), timeout,
                          extra=tuple((jobtokens.TOKEN_HEADER, t) for t in tokens), wait=wait)

    def status_dict(self, timeout: float | None = None, wait: bool = False) -> dict[str, Any]:
        """Status as a JSON-ready dict (field names as in manager.proto; enums by name)."""
        msg = self.status(timeout, wait)
        d = json_format.MessageToDict(msg, preserving_proto_field_name=True,
                                      always_print_fields_with_no_presence=True)
        return _int64_fields(msg, d)

    # ---------------------------------------------------------------- fallbacks
    def last_plan(self, dataset: str, job: str = "") -> Plan | None:
        """The newest plan received for (dataset, job), or None."""
        with self._lock:
            return self._cache.plans.get((dataset, job))

    def last_ring(self) -> Ring | None:
        with self._lock:
            return self._cache.ring

    def close(self) -> None:
        self.closed = True
        self.channel.close()

    def __enter__(self) -> "ManagerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
