"""Which stored values the process running a server may take without hashing them.

A client in the process that runs a cache server (the embedded default,
inproc.py) checks each value it reads against the digest (step 4 of
docs/security.md) because anyone who can reach the server may have written it.
Two kinds of value need no such check there: one this process put itself (it
sealed it from a store read it had just checked against the digest), and one
it already checked once. WriteTrust remembers those ids, "vouched", for as long
as nobody else writes them: every write that did not come from this process
(data plane, gRPC) forgets its ids before it starts and again when it ends.

Reads and vouching are ordered against those writes by an epoch that every
such write bumps at both ends: a read takes its vouched flags and the epoch
before it reads (`begin`), and its flags stand only if the epoch has not moved
and no such write was in flight (`still`). So a vouched flag never covers a
value another writer stored after it was vouched. Nothing is kept on disk:
a new process checks each value once again.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

Since = int | None  # an epoch; None: a foreign write was in flight, nothing can be vouched


class WriteTrust:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._vouched: set[bytes] = set()
        self._epoch = 0
        self._foreign = 0  # foreign writes in flight

    def mark(self) -> Since:
        """The epoch now, to pass to vouch() or still() later."""
        with self._lock:
            return None if self._foreign else self._epoch

    def begin(self, ids: Sequence[bytes]) -> tuple[Since, list[bool]]:
        """Before a read: (mark, whether each id is vouched now)."""
        with self._lock:
            if self._foreign:
                return None, [False] * len(ids)
            vouched = self._vouched
            return self._epoch, [k in vouched for k in ids]

    def still(self, since: Since) -> bool:
        """Whether no foreign write started or ran since `since` was taken."""
        with self._lock:
            return since is not None and not self._foreign and self._epoch == since

    def vouch(self, ids: Sequence[bytes], since: Since) -> bool:
        """Vouch for ids whose values this process wrote or checked after `since`
        was taken; refused (False) if a foreign write may have come in between."""
        with self._lock:
            if since is None or self._foreign or self._epoch != since:
                return False
            self._vouched.update(ids)
            return True

    @contextmanager
    def foreign_write(self, ids: Sequence[bytes]) -> Iterator[None]:
        """Around a write that did not come from this process."""
        self._forget(ids, +1)
        try:
            yield
        finally:
            self._forget(ids, -1)

    def _forget(self, ids: Sequence[bytes], inflight: int) -> None:
        with self._lock:
            self._foreign += inflight
            self._epoch += 1
            self._vouched.difference_update(ids)

    def __len__(self) -> int:
        return len(self._vouched)
