"""Values this process has checked against its digest, known again without re-hashing.

A cache server is not trusted (docs/security.md): each value it returns is checked by step 4,
a BLAKE3 (or SHA-256) of the plaintext, ~30 µs per 110 KB value on the EPYC VM. A value read
again as the very same bytes needs no second check. To know that without keeping the value,
this process keeps, per value it checked, a GMAC of the value's stored bytes under a key of its
own (random, never leaving the process): AES-GCM of nothing with the value as associated data,
~8 µs per 110 KB, each under a fresh nonce (a counter). A server that does not hold the key
can make another value with the same tag only by chance (GMAC's bound, about 2^-128 per try
for values this size), whoever holds K. Entries are keyed by the value's id and the hash it
was checked against, so a digest that names one id under two hashes gets both checked. A
forked DataLoader worker inherits its parent's key and entries: its parent's own checks.
"""
from __future__ import annotations

import hmac
import itertools
from collections.abc import Sequence

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .capability import Buffer

LIMIT = 100_000  # entries (~25 MB): 11 GB of 110 KB values; past it, new values are checked every time


class CheckedValues:
    def __init__(self, limit: int = LIMIT) -> None:
        self._aead = AESGCM(AESGCM.generate_key(bit_length=256))
        self._nonces = itertools.count()
        self._seen: dict[bytes, tuple[bytes, bytes]] = {}  # id + expected hash -> (nonce, tag)
        self._limit = limit

    def _tag(self, nonce: bytes, value: Buffer) -> bytes:
        return self._aead.encrypt(nonce, b"", value)

    def known(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> list[bool]:
        """Whether each value is, byte for byte, one remembered under its key."""
        out = []
        for k, v in zip(keys, values):
            entry = self._seen.get(k)
            out.append(entry is not None and hmac.compare_digest(self._tag(entry[0], v), entry[1]))
        return out

    def remember(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> None:
        """These values passed step 4 under these keys."""
        for k, v in zip(keys, values):
            if len(self._seen) >= self._limit and k not in self._seen:
                continue
            nonce = next(self._nonces).to_bytes(12, "little")  # count's next is atomic: unique per call
            self._seen[k] = (nonce, self._tag(nonce, v))

    def __len__(self) -> int:
        return len(self._seen)


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
