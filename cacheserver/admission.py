"""Admission control for the data plane: bytes of request bodies and answers held
at once across all connections, and open connections.

Each connection reads a request's body whole before serving it, so N stalled
senders would hold N bodies (up to --max-batch-size each), and the kept-freed
memory setting (malloc.py) would keep that peak after they close. A body is
admitted only while the bytes in flight stay within the limit (one request
is always admitted, so a limit below one batch cannot starve everyone);
otherwise the request is answered UNAVAILABLE with a clear "server busy"
message once its body has been read into nothing (dataplane.py: held, it would
cost memory; left unread, the connection is reset under the sending client).
A get's answer (the values read to be sent back) is counted the same way while
it is sent, on top of its request's body; one that would pass the limit is
dropped and answered busy, unless its request is the only one in flight (so a
get larger than the limit is still served, alone). Connections past the cap
are answered the same way. Stalled and slow senders and readers are cut off by
the data plane (--request-timeout, dataplane.py's MIN_RATE)."""
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

    def admit(self, n: int, held: int = 0, force: bool = False) -> str | None:
        """Reserve ``n`` more bytes for a request already holding ``held``, or say why not
        (release them with release()). Admitted whenever nothing else is in flight, and
        always with ``force`` (a small answer of an operation already done)."""
        with self._lock:
            if not force and self.in_flight > held and self.in_flight + n > self.max_bytes:
                return self._busy()
            self.in_flight += n
            return None

    def full(self, held: int = 0) -> str | None:
        """Why a request holding ``held`` would be refused even a few bytes more (None: not full)."""
        with self._lock:
            return self._busy() if self.in_flight > held and self.in_flight >= self.max_bytes else None

    def _busy(self) -> str:
        return (f"server busy: {format_size(self.in_flight)} of request bodies and answers in flight across "
                f"connections, limit {format_size(self.max_bytes)} (--max-inflight-bytes); retry later")

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
