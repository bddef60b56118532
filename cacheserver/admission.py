"""Admission control for the data plane: request-body bytes held at once across
all connections, and open connections.

Each connection reads a request's body whole before serving it, so N stalled
senders would hold N bodies (up to --max-batch-size each), and the kept-freed
memory setting (malloc.py) would keep that peak after they close. A body is
admitted only while the bytes in flight stay within the limit (one request
is always admitted, so a limit below one batch cannot starve everyone);
otherwise the request is answered UNAVAILABLE with a clear "server busy"
message once its body has been read into nothing (dataplane.py: held, it would
cost memory; left unread, the connection is reset under the sending client). Connections past
the cap are answered the same way. Stalled senders are timed out by the
data plane (--request-timeout)."""
from __future__ import annotations

import threading

from .sizes import format_size


class Admission:
    def __init__(self, max_bytes: int, max_conns: int) -> None:
        self.max_bytes = max_bytes
        self.max_conns = max_conns
        self._lock = threading.Lock()
        self.in_flight = 0
        self.conns = 0

    def admit(self, n: int) -> str | None:
        """Reserve ``n`` body bytes, or say why not (release them with release())."""
        with self._lock:
            if self.in_flight and self.in_flight + n > self.max_bytes:
                return (f"server busy: {format_size(self.in_flight)} of request bodies in flight across "
                        f"connections, limit {format_size(self.max_bytes)} (--max-inflight-bytes); retry later")
            self.in_flight += n
            return None

    def release(self, n: int) -> None:
        with self._lock:
            self.in_flight -= n

    def open_conn(self) -> str | None:
        with self._lock:
            if self.conns >= self.max_conns:
                return (f"server busy: {self.conns} data-plane connections open, limit {self.max_conns} "
                        "(--max-connections); retry later")
            self.conns += 1
            return None

    def close_conn(self) -> None:
        with self._lock:
            self.conns -= 1
