"""The gRPC server's bounds on what callers can make it hold (issue 12 item 2).

A gRPC call's request message is received whole before it is served, up to
--max-batch-size plus 8 MiB. So: calls served at once are capped
(--max-grpc-calls; a call past it is refused at once with RESOURCE_EXHAUSTED
and its message is not read); calls that carry ids or values are admitted by
their declared size against --max-inflight-bytes, shared with the data plane
(grpcadmit.py), so bodies held stay within it; a caller that lies about its
size is still bounded by N x (--max-batch-size + 8 MiB); a connection lives at most CONNECTION_AGE_X x
--request-timeout, then its calls get --request-timeout to finish and it is
closed (clients reconnect), so a sender that stalls mid-message is cut off
too; and idle connections are pinged so that dead peers' are closed."""
from __future__ import annotations

from .core import Limits

GRPC_MESSAGE_SLACK = 8 << 20  # the fields around a batch's values
CONNECTION_AGE_X = 10
KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS = 60_000, 20_000


def grpc_max_message(limits: Limits) -> int:
    """The largest request message the gRPC server reads."""
    return limits.max_batch_bytes + GRPC_MESSAGE_SLACK


def grpc_server_options(limits: Limits) -> list[tuple[str, int]]:
    timeout_ms = int(limits.request_timeout_s * 1000)
    return [("grpc.max_receive_message_length", grpc_max_message(limits)),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),
            ("grpc.max_connection_age_ms", CONNECTION_AGE_X * timeout_ms),
            ("grpc.max_connection_age_grace_ms", timeout_ms),
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS)]
