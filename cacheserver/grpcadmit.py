"""Byte admission of gRPC calls (issue 12 item 2): gRPC request messages share
the data plane's budget of request bytes in flight (--max-inflight-bytes,
admission.py), so a server holds at most that much of request bodies across
both transports, whichever way callers arrive.

gRPC reads a request message whole before its handler runs, and its size is
known only once it has arrived. So each call is admitted when it starts,
before its message is read: its handler is served as a request-streaming one
(the same on the wire), which runs before the message is received. The call
counts as the size its caller declares in the metadata BODY_BYTES_HEADER (our
clients send it: ops.py); a call that would pass the budget is refused at once
with RESOURCE_EXHAUSTED and a "server busy" message, and its message is never
read. Undeclared calls of the methods that carry ids or values (BULK) count as
the largest message the server accepts. Control calls (modes, chunks, Stats,
Info) are small and not admitted, so the manager is never refused busy; the
health service is left as it is.

A message larger than its caller declared (or, for a Cache control call, larger
than CONTROL_BYTES) is refused with INVALID_ARGUMENT once read, counted
(grpc_overdeclared) and logged with the caller's identity. That is after it was
held: a caller that lies about its size is bounded only by --max-grpc-calls
messages of --max-batch-size + 8 MiB each and the connection age (grpcopts.py);
docs/operations.md says so."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from .admission import Admission
from .counters import Counters
from .identity import grpc_identity
from .sizes import format_size
from .vocab import BODY_BYTES_HEADER

log = logging.getLogger("cacheserver.grpc")
SERVICE = "/mlcache.v1.Cache/"  # the calls admitted here; health keeps its own handlers
BULK = frozenset(f"{SERVICE}{m}" for m in ("Put", "Lookup", "Claim", "ReleaseClaims", "Adopt", "Get"))
CONTROL_BYTES = 1 << 20


def declared_bytes(metadata: Any) -> int | None:
    """The request size a caller declared, or None (absent or not a number)."""
    value = dict(metadata or ()).get(BODY_BYTES_HEADER)
    try:
        n = int(value) if value is not None else None
    except ValueError:
        return None
    return n if n is not None and n >= 0 else None


class ByteAdmission(grpc.ServerInterceptor):
    def __init__(self, admission: Admission, max_message: int, counters: Counters) -> None:
        self.admission = admission
        self.max_message = max_message
        self.counters = counters

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_streaming or not details.method.startswith(SERVICE):
            # Health is not wrapped: its Watch is non-blocking (no thread, no --max-grpc-calls
            # slot while it waits); served as a blocking stream it would hold both.
            return handler
        declared = declared_bytes(details.invocation_metadata)
        if details.method in BULK:
            reserve = min(declared, self.max_message) if declared is not None else self.max_message
            allowed = declared if declared is not None else self.max_message
        else:
            reserve, allowed = 0, CONTROL_BYTES if declared is None else min(declared, CONTROL_BYTES)
        call = _Call(self, details.method, reserve, allowed)
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                call.streamed(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(
            call.unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)


class _Call:
    """One call's admission: reserve before its message is read, release when served."""

    def __init__(self, gate: ByteAdmission, method: str, reserve: int, allowed: int) -> None:
        self.gate, self.method, self.reserve, self.allowed = gate, method, reserve, allowed

    def _admit(self, context: grpc.ServicerContext) -> None:
        why = self.gate.admission.admit(self.reserve) if self.reserve else None
        if why:
            self.gate.counters.add("busy_refused")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)

    def _receive(self, requests: Iterator, context: grpc.ServicerContext) -> Any:
        request = next(requests, None)
        if request is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.method}: no request message")
        size = request.ByteSize()
        if size > self.allowed:
            self.gate.counters.add("grpc_overdeclared")
            who = grpc_identity(context)
            log.warning("refused a %s message of %s from %s: larger than the %s it may be", self.method,
                        format_size(size), who, format_size(self.allowed))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{self.method}: the request message has {size} bytes, more than the {self.allowed} "
                          f"declared in {BODY_BYTES_HEADER} (or allowed for the method)")
        return request

    def unary(self, behavior: Callable) -> Callable:
        def served(requests: Iterator, context: grpc.ServicerContext) -> Any:
            self._admit(context)
            try:
                return behavior(self._receive(requests, context), context)
            finally:
                if self.reserve:
                    self.gate.admission.release(self.reserve)
        return served

    def streamed(self, behavior: Callable) -> Callable:
        def served(requests: Iterator, context: grpc.ServicerContext) -> Iterator:
            self._admit(context)
            try:
                yield from behavior(self._receive(requests, context), context)
            finally:
                if self.reserve:
                    self.gate.admission.release(self.reserve)
        return served
