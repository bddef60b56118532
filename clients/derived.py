"""Transformed items: keys derived from the source capability and the transform.

For a source item with content key K (its SHA-256, the capability a digest holds),
a transform prefix with fingerprint F (preprocess.Pipeline.fingerprint) and, where
the prefix is random but seeded reproducibly, its seed S:

* Kt    = SHA-256(b"mlcache/derived/v1" || K || len(F) || F || seed field)
* id    = SHA-256(b"mlcache/derived-id/v1" || Kt)
* key   = SHA-256(b"mlcache/key/v1" || Kt)   (capability.value_key)
* value = version || u64 length || AES-256-GCM(key, nonce=0^96, payload,
          aad = id || version || length) ciphertext || tag

Kt is computable only from K, so whoever cannot read the source cannot find or
decrypt what was made from it, and a server sees one more opaque id and
ciphertext. Same source and same transform give the same Kt across jobs and
users (a sweep computes once); a changed transform changes F and so every key.

Unlike a source item, a transformed payload has no digest to check it against:
the tag proves the value was made by a holder of K and F, not that the transform
was run honestly. docs/security.md states this trust: every holder of the
source's capability (nothing here recomputes a transform to check it).
"""
from __future__ import annotations

import hashlib
import struct

from .capability import Buffer, PoisonedValue, Sealed, open_sealed, seal_under

DERIVED_DOMAIN = b"mlcache/derived/v1"
DERIVED_ID_DOMAIN = b"mlcache/derived-id/v1"
_SEED = struct.Struct("<Bq")  # has seed, seed
MAX_FINGERPRINT = 1024


def derived_key(K: bytes, fingerprint: str, seed: int | None = None) -> bytes:
    """Kt: the capability of the item that the transform prefix `fingerprint` (seeded
    with `seed`, None for a deterministic prefix) makes from the item whose SHA-256 is K."""
    if len(K) != 32:
        raise ValueError(f"K must be a 32-byte SHA-256, got {len(K)} bytes")
    fp = fingerprint.encode()
    if not fp or len(fp) > MAX_FINGERPRINT:
        raise ValueError(f"a transform fingerprint must have 1 to {MAX_FINGERPRINT} bytes, got {len(fp)}")
    if seed is not None and not -(1 << 63) <= seed < (1 << 63):
        raise ValueError(f"seed {seed} does not fit in 64 bits")
    seed_field = _SEED.pack(seed is not None, 0 if seed is None else seed)
    return hashlib.sha256(DERIVED_DOMAIN + K + struct.pack("<H", len(fp)) + fp + seed_field).digest()


def derived_id(Kt: bytes) -> bytes:
    """Cache id of a transformed item (domain-separated from source ids)."""
    if len(Kt) != 32:
        raise ValueError(f"Kt must be 32 bytes, got {len(Kt)}")
    return hashlib.sha256(DERIVED_ID_DOMAIN + Kt).digest()


def seal_derived(Kt: bytes, payload: Buffer) -> Sealed:
    """Encrypt a transformed item's encoded payload (preprocess.codec) under Kt."""
    ident = derived_id(Kt)
    return Sealed(ident, Kt, seal_under(Kt, ident, bytes(payload)))


def open_derived(Kt: bytes, value: Buffer, max_size: int | None = None) -> bytes:
    """Decrypt a transformed item fetched from the cache; raises PoisonedValue when it is
    malformed, of another version or size, or fails authentication."""
    return open_sealed(Kt, derived_id(Kt), value, max_size=max_size)


def plain_derived(Kt: bytes, payload: Buffer) -> Sealed:
    """seal_derived for a plain store (cacheserver/datadir.py): the payload as it is."""
    return Sealed(derived_id(Kt), Kt, bytes(payload))


def open_plain_derived(Kt: bytes, value: Buffer, max_size: int | None = None) -> bytes:
    """open_derived for a plain store: the payload itself (Kt unused); PoisonedValue if
    it is larger than max_size (the codec checks the rest as it decodes)."""
    if max_size is not None and len(value) > max_size:
        raise PoisonedValue(f"transformed item of {len(value)} bytes, over {max_size}")
    return value if type(value) is bytes else bytes(value)
