"""Content-addressed capabilities: what the cache stores and how clients check it.

For an item with K = SHA-256(item) (the value a digest holds):

* id    = SHA-256(b"mlcache/id/v1" || K)   the 32-byte key the servers see
* key   = SHA-256(b"mlcache/key/v1" || K)  the AES-256-GCM key
* value = version || u64 plaintext length || AES-256-GCM(key, nonce=0^96,
          item, aad = id || version || length) ciphertext || 16-byte tag

Convergent encryption: equal items give equal ids and values, so tenants
share cache entries, yet only holders of K can find or decrypt them.  The
fixed nonce is safe because a key only ever encrypts one plaintext (the one
whose hash it is derived from).  See docs/security.md for the threat model.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from concurrent.futures import Executor
from typing import NamedTuple

import blake3 as _blake3

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

ID_DOMAIN = b"mlcache/id/v1"
KEY_DOMAIN = b"mlcache/key/v1"
VALUE_VERSION = 1
NONCE = bytes(12)  # fixed: one plaintext per key (see module docstring)
TAG_SIZE = 16
_HEADER = struct.Struct("<BQ")  # version, plaintext length
OVERHEAD = _HEADER.size + TAG_SIZE  # stored bytes beyond the item itself

Buffer = bytes | bytearray | memoryview


class PoisonedValue(ValueError):
    """A cached value failed authentication or does not match the digest."""


class Sealed(NamedTuple):
    id: bytes  # what the cache servers index by
    K: bytes  # SHA-256 of the item: the capability, never sent to servers
    value: bytes  # what the cache servers store


def _check_k(K: bytes) -> None:
    if len(K) != 32:
        raise ValueError(f"K must be a 32-byte SHA-256, got {len(K)} bytes")


def item_id(K: bytes) -> bytes:
    """Cache id for content key K; one-way, so the id does not reveal K."""
    _check_k(K)
    return hashlib.sha256(ID_DOMAIN + K).digest()


def value_key(K: bytes) -> bytes:
    """AES-256 key for content key K (domain-separated from the id)."""
    _check_k(K)
    return hashlib.sha256(KEY_DOMAIN + K).digest()


def value_size(item_size: int) -> int:
    """Stored size of an item of ``item_size`` bytes."""
    return item_size + OVERHEAD


def seal(item: Buffer, K: bytes | None = None) -> Sealed:
    """Encrypt an item for the cache; deterministic in the item alone.

    Pass K only when the caller has just checked SHA-256(item) == K (a store
    read verified against the digest), to hash the item once, not twice."""
    if K is None:
        K = hashlib.sha256(item).digest()
    _check_k(K)
    ident = item_id(K)
    return Sealed(ident, K, seal_under(K, ident, item))


def stored(item: Buffer, K: bytes, plain: bool) -> tuple[bytes, Buffer]:
    """(id, value) to put for a checked item: sealed, or in a plain store (the embedded
    cache's own, cacheserver/datadir.py) the item itself."""
    if plain:
        return item_id(K), item
    sealed = seal(item, K)
    return sealed.id, sealed.value


def seal_under(K: bytes, ident: bytes, item: Buffer) -> bytes:
    """The stored value of `item` encrypted under value_key(K) and bound to the id it
    is stored at (source items: item_id(K); transformed items: derived.py)."""
    header = _HEADER.pack(VALUE_VERSION, len(item))
    return header + AESGCM(value_key(K)).encrypt(NONCE, item, ident + header)


def open_sealed(K: bytes, ident: bytes, value: Buffer, expected_size: int | None = None,
                max_size: int | None = None) -> bytes:
    """The plaintext of a value seal_under(K, ident, ...) made: PoisonedValue if it is
    malformed, of another version or size, or fails authentication (tampered, or
    stored under another id)."""
    mv = memoryview(value)
    if len(mv) < OVERHEAD:
        raise PoisonedValue(f"value too short ({len(mv)} bytes)")
    version, length = _HEADER.unpack_from(mv)
    if version != VALUE_VERSION:
        raise PoisonedValue(f"unsupported value version {version}")
    if expected_size is not None and length != expected_size:
        raise PoisonedValue(f"value is for {length} bytes, digest says {expected_size}")
    if max_size is not None and length > max_size:
        raise PoisonedValue(f"value is for {length} bytes, more than the {max_size} allowed")
    if len(mv) != value_size(length):
        raise PoisonedValue(f"value has {len(mv)} bytes, expected {value_size(length)}")
    aad = ident + bytes(mv[: _HEADER.size])
    try:
        return AESGCM(value_key(K)).decrypt(NONCE, mv[_HEADER.size:], aad)
    except InvalidTag:
        raise PoisonedValue("authentication failed (tampered value or wrong key)") from None


def open_value(K: bytes, value: Buffer, expected_size: int, verify_hash: bool = True) -> bytes:
    """Decrypt and check a value fetched from the cache for content key K.

    Raises PoisonedValue if the value is malformed, of another version, of
    the wrong size, fails authentication (tampered, or stored under the wrong
    id), or, with ``verify_hash``, if SHA-256(plaintext) != K.  The tag alone
    only proves the value was made by someone holding K; the hash check also
    stops a co-holder of K who stored different content (see docs/security.md),
    so skip it only when every holder of the digest is trusted.
    """
    _check_k(K)
    item = open_sealed(K, item_id(K), value, expected_size)
    if verify_hash and hashlib.sha256(item).digest() != K:
        raise PoisonedValue("content hash mismatch (value forged by a holder of the key)")
    return item


def open_values(keys: list[bytes], ids: list[bytes], values: list[Buffer | None], sizes: list[int]
                ) -> list[bytes | None]:
    """open_value(K, value, size, verify_hash=False) for a batch whose ids (item_id(K))
    the caller already holds: None for a missing value and for one that fails a
    check (PoisonedValue). The hash check (step 4) is the caller's, batched."""
    out: list[bytes | None] = []
    hsize, unpack, version = _HEADER.size, _HEADER.unpack_from, VALUE_VERSION
    for K, ident, value, size in zip(keys, ids, values, sizes):
        if value is None:
            out.append(None)
            continue
        mv = memoryview(value)
        if len(mv) != size + OVERHEAD or len(K) != 32 or unpack(mv)[:2] != (version, size):
            out.append(None)  # malformed, another version, or the wrong size
            continue
        try:
            out.append(AESGCM(hashlib.sha256(KEY_DOMAIN + K).digest()).decrypt(
                NONCE, mv[hsize:], ident + bytes(mv[:hsize])))
        except InvalidTag:
            out.append(None)
    return out


def open_plain(values: list[Buffer | None], sizes: list[int]) -> list[bytes | None]:
    """open_values for a plain store (the embedded cache's own, cacheserver/datadir.py):
    values are the items themselves, kept intact by RocksDB's checksums; None for a
    missing one and one of the wrong size. No hash check (step 4): the dir's writers,
    its owner's processes, checked each item against its digest before putting it."""
    out: list[bytes | None] = []
    for value, size in zip(values, sizes):
        if value is None or len(value) != size:
            out.append(None)
        else:  # in-process reads hand over the store's bytes; frames from the socket are copied out
            out.append(value if type(value) is bytes else bytes(value))
    return out


def sha256(item: Buffer) -> bytes:
    return hashlib.sha256(item).digest()


def blake3(item: Buffer) -> bytes:
    """BLAKE3-256 of an item: the digest's (version 3) fast check of a cached value.
    A cryptographic hash, so a value that passes is the item the digest describes."""
    return _blake3.blake3(item).digest()


def hashes_match(pairs: list[tuple[bytes, Buffer]], pool: Executor | None = None, threads: int = 1,
                 min_share_bytes: int = 1 << 20, hash_fn: Callable[[Buffer], bytes] = sha256) -> list[bool]:
    """hash_fn(item) == expected for each (expected, item); by default SHA-256 against K.
    With a pool, the batch is split into up to `threads` shares (this thread takes one)
    of at least `min_share_bytes`: hashlib and blake3 release the GIL while they hash,
    so the shares run on separate cores."""
    def check(share: list[tuple[bytes, Buffer]]) -> list[bool]:
        return [hash_fn(item) == expected for expected, item in share]

    total = sum(len(item) for _, item in pairs)
    n = 1 if pool is None else max(1, min(threads, total // min_share_bytes))
    if n == 1 or len(pairs) < 2:
        return check(pairs)
    bounds = [round(len(pairs) * k / n) for k in range(n + 1)]
    shares = [pairs[bounds[k]:bounds[k + 1]] for k in range(n)]
    futures = [pool.submit(check, share) for share in shares[1:]]
    out = check(shares[0])
    for f in futures:
        out += f.result()
    return out
