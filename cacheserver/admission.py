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
A get's answer (the values read to be sent back) is counted the same way, on
top of its request's body, as its values are read, a group at a time
(AnswerBudget, getbound.py), until it is sent: once the limit is reached the
rest of its ids are answered as misses, or the whole get busy where no value
fits (not counted as a get), unless its request is the only one in flight (so
a get larger than the limit is still served, alone). Connections past the cap
are answered the same way. Stalled and slow senders and readers are cut off by
the data plane (--request-timeout, dataplane.py's MIN_RATE)."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .sizes import format_size

_answering = threading.local()  # the AnswerBudget of the data-plane request this thread serves


class Busy(Exception):
    """No value of a get's answer fits the budget (the message says why): answered busy, not counted."""


class Admission:
    def __init__(self, max_bytes: int, max_conns: int) -> None:
        self.max_bytes = max_bytes
        self.max_conns = max_conns
        self._lock = threading.Lock()
        self.in_flight = 0
        self.conns = 0

    def admit(self, n: int, force: bool = False) -> str | None:
        """Reserve ``n`` bytes, or say why not (release them with release()). Admitted whenever
        nothing else is in flight, and always with ``force`` (a small answer of an operation
        already done)."""
        with self._lock:
            if not force and self.in_flight and self.in_flight + n > self.max_bytes:
                return self._busy()
            self.in_flight += n
            return None

    def admit_upto(self, n: int, held: int) -> tuple[int, str | None]:
        """Reserve up to ``n`` more bytes for a request holding ``held``: all of them where
        admit() would, else what room is left, with why not all (release them with release())."""
        with self._lock:
            if self.in_flight <= held or self.in_flight + n <= self.max_bytes:
                self.in_flight += n
                return n, None
            room = max(0, self.max_bytes - self.in_flight)
            why = self._busy()
            self.in_flight += room
            return room, why

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


class AnswerBudget:
    """One data-plane request's answer counted against the budget as its values are read
    (getbound.bounded_get calls take() once per group of values read: one lock per group,
    not per value), so gets read at once cannot hold more than the budget uncounted (at
    most the group each is reading)."""

    def __init__(self, admission: Admission, held: int) -> None:
        self.admission = admission
        self.held = held  # the request's body, admitted already
        self.taken = 0
        self.why: str | None = None  # why less was granted than asked, once it was

    def take(self, n: int) -> int:
        """Count ``n`` more bytes of values read; how many of them the budget grants."""
        granted, why = self.admission.admit_upto(n, self.held + self.taken)
        self.taken += granted
        if why:
            self.why = why
        return granted

    def release(self) -> None:
        self.admission.release(self.taken)
        self.taken = 0


@contextmanager
def answering(budget: AnswerBudget | None) -> Iterator[None]:
    """Count the values this thread reads meanwhile (CacheCore.get) against ``budget``."""
    _answering.budget = budget
    try:
        yield
    finally:
        _answering.budget = None


def answer_budget() -> AnswerBudget | None:
    """The budget the values this thread reads count against (None: none, as gRPC and in-process gets)."""
    return getattr(_answering, "budget", None)
