"""Fetch claims: "job J is reading item X from the store right now".

Co-operative misses across hosts: two jobs that miss the same item at about
the same time would both read it from the slow store (same-host processes
coalesce through flock, clients/coalesce.py; jobs on different hosts cannot).
Before reading misses, a client claims them on the item's cache server. The
first claimant reads and inserts (the insert releases the claim); a later one
is told to wait for that insert instead, and its sampler, whose look-ups see
claimed items as PENDING, prefers other misses in the first place.

A claim expires after `ttl` seconds, so a claimant that died or stalled
delays the others by at most that long. A claimant that will not insert an
item (its store read failed, its put was refused before it reached the store,
it skipped the put) gives its claim up (`give_up`), so the others go on at once
instead of waiting. Either way the waiters, seeing the item neither present nor
pending, claim it anew: one of them reads it, the rest wait for its insert.
The table is bounded: at `max_entries` expired claims are swept, and if none
have expired new claims are granted without being recorded (duplicate reads
are the worst case; correctness never depends on claims).

Claim answers, per id: FETCH, WAIT or PRESENT; look-ups that ask for it
answer PENDING for absent ids another job has claimed (vocab.py).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from .vocab import FETCH, PENDING, PRESENT, WAIT

DEFAULT_TTL = 10.0
MAX_ENTRIES = 1_000_000


class ClaimTable:
    def __init__(self, ttl: float = DEFAULT_TTL, max_entries: int = MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl <= 0:
            raise ValueError(f"claim ttl must be positive, got {ttl}")
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._claims: dict[bytes, tuple[float, str]] = {}  # id -> (expiry, job)

    def __len__(self) -> int:
        return len(self._claims)

    def claim(self, job: str, ids: Sequence[bytes], present: Sequence[int]) -> bytes:
        """FETCH/WAIT/PRESENT per id; `present` is the store's answer (1 = cached).
        A job's own live claim is renewed (it retries a read), not refused."""
        now = self._clock()
        out = bytearray(len(ids))
        with self._lock:
            claims = self._claims
            for n, (k, p) in enumerate(zip(ids, present)):
                if p:
                    out[n] = PRESENT
                    continue
                held = claims.get(k)
                if held is not None and held[0] > now and held[1] != job:
                    out[n] = WAIT
                    continue
                out[n] = FETCH
                if held is not None or len(claims) < self.max_entries or self._sweep(now):
                    claims[k] = (now + self.ttl, job)
        return bytes(out)

    def pending(self, job: str, ids: Sequence[bytes], present: bytes) -> bytes:
        """A look-up's answer with PENDING for absent ids another job holds a live claim on."""
        claims = self._claims
        if not claims:
            return present
        now = self._clock()
        out = bytearray(present)
        with self._lock:
            for n, k in enumerate(ids):
                if not out[n]:
                    held = claims.get(k)
                    if held is not None and held[0] > now and held[1] != job:
                        out[n] = PENDING
        return bytes(out)

    def release(self, ids: Sequence[bytes]) -> None:
        """The items were inserted (or the claimant gave up): nobody is reading them."""
        if not self._claims:
            return
        with self._lock:
            for k in ids:
                self._claims.pop(k, None)

    def give_up(self, job: str, ids: Sequence[bytes]) -> bytes:
        """The claimant `job` will not insert these items: drop its claims on them, and
        only its own (another job's claim on an id is kept). 1 per id whose claim was dropped."""
        out = bytearray(len(ids))
        if not self._claims:
            return bytes(out)
        with self._lock:
            claims = self._claims
            for n, k in enumerate(ids):
                held = claims.get(k)
                if held is not None and held[1] == job:
                    del claims[k]
                    out[n] = 1
        return bytes(out)

    def _sweep(self, now: float) -> bool:
        """Drop expired claims (lock held); True if there is room afterwards."""
        expired = [k for k, (t, _) in self._claims.items() if t <= now]
        for k in expired:
            del self._claims[k]
        return len(self._claims) < self.max_entries
