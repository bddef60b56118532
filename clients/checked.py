"""Values checked against their digest, known again without re-hashing, by every process
of a loader.

A cache server is not trusted (docs/security.md): each value it returns is checked by step 4,
a BLAKE3 (or SHA-256) of the plaintext, ~28 µs per 110 KB value on the EPYC VM. A value read
again as the very same bytes needs no second check. To know that without keeping the value,
a table keeps, per value checked, a GMAC of the value's stored bytes under a key of its own
(random, written in the table's header): AES-GCM of the entry (the value's id and the hash it
was checked against) with the value as associated data, ~6 µs per 110 KB, each under a fresh
random nonce. A server that does not hold the key can make another value with the same tag
only by chance (GMAC's bound, about 2^-115 per try for 110 KB values), whoever holds K.

The table is shared memory that a dataset hands the workers its loader spawns as they start
(new_table(shared=True); like its counters it cannot be pickled for anything else), so a value
one worker checked is known to all of them: workers meet different items each epoch. The table
never leaves the machine and, like the processes' memory, is the user's alone. Slots are
written without a lock: a reader that meets a slot half written finds a tag that does not
match and hashes the value, never the other way round. Buckets of four slots; a full one
gives up a slot at random, and an entry that lost its slot is hashed again.
"""
from __future__ import annotations

import hmac
import multiprocessing
import os
from collections.abc import Sequence
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .capability import Buffer

HEADER = 64  # the table's key (32 bytes), then reserved
SLOT = 32  # nonce 12 | tag 16 | the entry's fingerprint 4
NONCE, TAG, FP = 12, 16, 4
WAYS = 4
MIN_SLOTS, MAX_SLOTS = 1 << 10, 1 << 18  # 32 KB .. 8 MB: past ~65,000 values (7 GB of 110 KB ones) some are lost
EMPTY = bytes(NONCE)


def table_slots(items: int) -> int:
    """Slots for a dataset of `items` values: four times as many (one in 200 finds its
    bucket full), within the bounds."""
    n = MIN_SLOTS
    while n < 4 * items and n < MAX_SLOTS:
        n <<= 1
    return n


def new_table(items: int, shared: bool = False) -> Any:
    """A zeroed table with a fresh key: shared memory for a dataset's spawned workers, or
    this process's own."""
    size = HEADER + table_slots(items) * SLOT
    table = multiprocessing.get_context("spawn").RawArray("B", size) if shared else bytearray(size)
    memoryview(table).cast("B")[:32] = AESGCM.generate_key(bit_length=256)
    return table


class CheckedValues:
    """Entries of one table (new_table): `known` and `remember` in any process that has it."""

    def __init__(self, table: Any = None, items: int = 0) -> None:
        self._mem = memoryview(new_table(items) if table is None else table).cast("B")
        self._aead = AESGCM(bytes(self._mem[:32]))
        self._buckets = (len(self._mem) - HEADER) // (SLOT * WAYS)

    def _tag(self, nonce: bytes, entry: bytes, value: Buffer) -> bytes:
        return self._aead.encrypt(nonce, entry, value)[-TAG:]  # binds the entry and the value

    def _bucket(self, entry: bytes) -> int:
        return HEADER + int.from_bytes(entry[:8], "little") % self._buckets * SLOT * WAYS

    def _find(self, entry: bytes) -> tuple[int, bytes, int | None]:
        """The entry's bucket (its offset and a copy of its slots) and its slot's offset in
        the bucket, None if none holds it."""
        base = self._bucket(entry)
        bucket, fp = bytes(self._mem[base:base + SLOT * WAYS]), entry[8:8 + FP]
        for s in range(0, SLOT * WAYS, SLOT):
            if bucket[s + NONCE + TAG:s + SLOT] == fp and bucket[s:s + NONCE] != EMPTY:
                return base, bucket, s
        return base, bucket, None

    def known(self, entries: Sequence[bytes], values: Sequence[Buffer]) -> list[bool]:
        """Whether each value is, byte for byte, one remembered under its entry (key())."""
        out = []
        for e, v in zip(entries, values):
            _, bucket, s = self._find(e)
            out.append(s is not None and hmac.compare_digest(
                self._tag(bucket[s:s + NONCE], e, v), bucket[s + NONCE:s + NONCE + TAG]))
        return out

    def remember(self, entries: Sequence[bytes], values: Sequence[Buffer]) -> None:
        """These values passed step 4 under these entries."""
        nonces = os.urandom(NONCE * len(entries))
        for i, (e, v) in enumerate(zip(entries, values)):
            nonce = nonces[i * NONCE:(i + 1) * NONCE]
            base, bucket, s = self._find(e)
            if s is None:  # an empty slot of the bucket, else one of them at random
                empty = [b for b in range(0, SLOT * WAYS, SLOT) if bucket[b:b + NONCE] == EMPTY]
                s = empty[0] if empty else nonce[0] % WAYS * SLOT
            self._mem[base + s:base + s + SLOT] = nonce + self._tag(nonce, e, v) + e[8:8 + FP]

    def __len__(self) -> int:
        """Entries held (a scan of the table)."""
        mem = self._mem
        return sum(1 for s in range(HEADER, len(mem), SLOT) if mem[s:s + NONCE] != EMPTY)


def key(ident: bytes, expected: bytes) -> bytes:
    """The entry of a value stored under `ident` and checked against hash `expected`."""
    return ident + expected


def unknown(memo: CheckedValues | None, ids: Sequence[bytes], values: Sequence[Buffer], todo: list[int],
            pairs: list[tuple[bytes, Buffer]]) -> tuple[list[int], list, list[bytes], int]:
    """Of the values at positions `todo` (their (expected hash, item) pairs alike), those
    `memo` does not know as these very bytes; their entries for remember() once they pass;
    how many it knew."""
    if memo is None or not todo:
        return todo, pairs, [], 0
    entries = [key(ids[j], expected) for j, (expected, _) in zip(todo, pairs)]
    seen = memo.known(entries, [values[j] for j in todo])
    keep = [p for p, s in enumerate(seen) if not s]
    if len(keep) == len(todo):
        return todo, pairs, entries, 0
    return [todo[p] for p in keep], [pairs[p] for p in keep], [entries[p] for p in keep], len(todo) - len(keep)
