"""The gRPC health service, without grpc_health's deadlock at shutdown.

grpc_health's non-blocking HealthServicer sends a status change to the watchers
while it holds its lock; a Watch whose call is ending runs its close callback in
gRPC's serving thread, holding the call's state, and that callback takes the same
lock. A `set()` (NOT_SERVING at SIGTERM) racing a watcher that just went away then
deadlocks the drain: seen as a cacheserver that never exited, 1 time in 3-6, after
health watchers were cancelled just before its SIGTERM
(tests/test_hardening_grpc_admission.py). Here `set` records the status under the
lock and sends outside it; a send to a call already ended is a no-op in gRPC."""
from __future__ import annotations

from grpc_health.v1 import health, health_pb2


class HealthServicer(health.HealthServicer):
    """grpc_health's servicer (non-blocking Watch), sending status changes outside its lock."""

    def set(self, service: str, status: int) -> None:
        with self._lock:
            if self._gracefully_shutting_down:
                return
            self._server_status[service] = status
            callbacks = list(self._send_response_callbacks.get(service, ()))
        for send in callbacks:
            send(health_pb2.HealthCheckResponse(status=status))
