"""gRPC adapter: maps Cache RPCs onto CacheCore and errors onto precise status codes."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator

import grpc

from . import ops
from .chunkrefs import ChunkBusy, UnknownChunk
from .core import CacheCore
from .identity import grpc_identity, set_peer
from .vocab import BadRequest, split_ids
from .proto import cache_pb2 as pb
from .proto import cache_pb2_grpc as pb_grpc
from .roles import Roles, strip_tenants

log = logging.getLogger("cacheserver.grpc")
GET_MESSAGE_BYTES = 4 << 20  # values per streamed Get message


def _statuses(fn: Callable) -> Callable:
    """Translate domain errors to gRPC statuses; anything else is INTERNAL, logged."""

    @functools.wraps(fn)
    def wrapper(self: "CacheService", request, context: grpc.ServicerContext):
        self.core.counters.add("grpc_requests")
        set_peer(grpc_identity(context))
        try:
            return fn(self, request, context)
        except (BadRequest, UnicodeDecodeError) as e:
            self.core.counters.add("bad_requests")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except UnknownChunk as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        except ChunkBusy as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    return wrapper


def _served(op: ops.Op) -> Callable:
    """The rpc of a data-plane operation, served from its declaration (ops.py)."""
    def rpc(self: "CacheService", request, context):
        if op is ops.PUT and not self.values:
            _no_values(context)
        return op.serve_grpc(self.core, request)

    rpc.__name__ = op.rpc
    return _statuses(rpc)


def _no_values(context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.PERMISSION_DENIED,
                  "this cache holds plaintext records (an embedded cache): its values go only "
                  "over its owner's Unix socket, not over gRPC")


class CacheService(pb_grpc.CacheServicer):
    """Lookup, Claim, Adopt and Put come from ops.UNARY_RPCS (set below); Get streams."""
    def __init__(self, core: CacheCore, info: Callable[[], pb.InfoResponse], server_id: str,
                 roles: Roles | None = None, values: bool = True) -> None:
        self.core = core
        self.values = values  # False: Get and Put refused (a plain store's values stay off TCP)
        self._info = info
        self.server_id = server_id
        self.roles = roles or Roles(None)

    def Get(self, request: pb.GetRequest, context) -> Iterator[pb.GetResponse]:
        # A generator cannot use the decorator's abort path before its first
        # yield, so validate eagerly here.
        self.core.counters.add("grpc_requests")
        if not self.values:
            _no_values(context)
        try:
            ids = split_ids(request.ids)
            values = self.core.get(request.job, ids)
        except BadRequest as e:
            self.core.counters.add("bad_requests")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        yield from ops.grpc_values(values, GET_MESSAGE_BYTES)

    @_statuses
    def SetJobMode(self, request: pb.SetJobModeRequest, context) -> pb.SetJobModeResponse:
        self.roles.require_manager(context, "SetJobMode")
        return pb.SetJobModeResponse(previous=self.core.set_job_mode(request.job, int(request.mode)))

    @_statuses
    def ActiveChunk(self, request: pb.ActiveChunkRequest, context) -> pb.ActiveChunkResponse:
        if request.chunk >= 0:  # a change; -1 only asks
            self.roles.require_manager(context, "ActiveChunk")
        return pb.ActiveChunkResponse(active=self.core.chunks.set_active(request.dataset, request.chunk))

    @_statuses
    def RefChunk(self, request: pb.RefChunkRequest, context) -> pb.RefChunkResponse:
        self.roles.require_manager(context, "RefChunk")
        return pb.RefChunkResponse(refs=self.core.ref_chunk(request.dataset, request.chunk, request.job))

    @_statuses
    def UnrefChunk(self, request: pb.RefChunkRequest, context) -> pb.RefChunkResponse:
        self.roles.require_manager(context, "UnrefChunk")
        return pb.RefChunkResponse(refs=self.core.unref_chunk(request.dataset, request.chunk, request.job))

    @_statuses
    def EvictChunk(self, request: pb.EvictChunkRequest, context) -> pb.EvictResponse:
        self.roles.require_manager(context, "EvictChunk")
        items, freed = self.core.evict_chunk(request.dataset, request.chunk, request.force)
        return pb.EvictResponse(items=items, bytes=freed)

    @_statuses
    def EvictDataset(self, request: pb.EvictDatasetRequest, context) -> pb.EvictResponse:
        self.roles.require_manager(context, "EvictDataset")
        items, freed = self.core.evict_dataset(request.dataset)
        return pb.EvictResponse(items=items, bytes=freed)

    @_statuses
    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        store, chunks = self.core.store, self.core.chunks
        resp = pb.StatsResponse(server_id=self.server_id, capacity_bytes=store.capacity,
                                used_bytes=store.used, items=store.items,
                                counters=self.core.counters.snapshot(),
                                active_chunks=dict(chunks.active), job_modes=self.core.job_modes())
        usage = store.usage_by_tag()
        tags = set(usage) | set(chunks.refs)
        for dataset, chunk in sorted(t for t in tags if t[0]):
            u = usage.get((dataset, chunk))
            jobs = chunks.holders(dataset, chunk)
            resp.chunks.add(dataset=dataset, chunk=chunk, items=u.items if u else 0,
                            bytes=u.bytes if u else 0, refs=len(jobs), jobs=jobs)
        return resp if self.roles.is_manager(context) else strip_tenants(resp)

    @_statuses
    def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        return self._info()


for _op in ops.UNARY_RPCS:
    setattr(CacheService, _op.rpc, _served(_op))
