"""Capability encryption: round trips, poisoning, and what the id reveals."""

from __future__ import annotations

import hashlib
import os
import struct
import time

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from clients.capability import (
    ID_DOMAIN,
    KEY_DOMAIN,
    NONCE,
    OVERHEAD,
    PoisonedValue,
    Sealed,
    hashes_match,
    item_id,
    open_value,
    seal,
    value_key,
    value_size,
)


@pytest.mark.parametrize("n", [0, 1, 1000, 1 << 20])
def test_round_trip(n: int) -> None:
    item = os.urandom(n)
    s = seal(item)
    assert isinstance(s, Sealed) and len(s.id) == 32
    assert s.K == hashlib.sha256(item).digest()
    assert s.id == hashlib.sha256(ID_DOMAIN + s.K).digest() == item_id(s.K)
    assert len(s.value) == value_size(n) == n + OVERHEAD
    assert open_value(s.K, s.value, n) == item
    assert open_value(s.K, memoryview(bytearray(s.value)), n) == item  # any buffer


def test_convergent() -> None:
    a, b = seal(b"same bytes"), seal(b"same bytes")
    assert a == b  # different tenants, one cache entry
    c = seal(b"other bytes")
    assert c.id != a.id and c.value != a.value


def test_id_and_value_do_not_reveal_k_or_item() -> None:
    item = b"secret training sample " * 10
    s = seal(item)
    assert s.id != s.K and s.id != hashlib.sha256(s.K).digest()
    assert s.K not in s.value and s.K not in s.id and item[:16] not in s.value
    assert value_key(s.K) not in s.value and value_key(s.K) != s.id
    assert KEY_DOMAIN != ID_DOMAIN


def _flip(b: bytes, i: int) -> bytes:
    x = bytearray(b)
    x[i] ^= 1
    return bytes(x)


@pytest.mark.parametrize("where", [9, 100, -1, -16, -17])
def test_tampered_ciphertext_or_tag(where: int) -> None:
    s = seal(os.urandom(200))
    with pytest.raises(PoisonedValue, match="authentication failed"):
        open_value(s.K, _flip(s.value, where), 200)


def test_wrong_k_and_swapped_values() -> None:
    a, b = seal(b"a" * 50), seal(b"b" * 50)
    with pytest.raises(PoisonedValue, match="authentication failed"):
        open_value(b.K, a.value, 50)  # a server returning another entry's value
    with pytest.raises(PoisonedValue):
        open_value(hashlib.sha256(b"guess").digest(), a.value, 50)
    with pytest.raises(ValueError, match="32-byte"):
        open_value(b"short", a.value, 50)


def test_size_version_and_length_checks() -> None:
    s = seal(b"x" * 64)
    with pytest.raises(PoisonedValue, match="digest says 65"):
        open_value(s.K, s.value, 65)
    with pytest.raises(PoisonedValue, match="too short"):
        open_value(s.K, s.value[:10], 64)
    with pytest.raises(PoisonedValue, match="has 88 bytes"):
        open_value(s.K, s.value[:-1], 64)
    with pytest.raises(PoisonedValue, match="unsupported value version 2"):
        open_value(s.K, b"\x02" + s.value[1:], 64)
    # A rewritten length header is caught by the tag (it is authenticated).
    forged = struct.pack("<BQ", 1, 63) + s.value[9:-1]
    with pytest.raises(PoisonedValue, match="authentication failed"):
        open_value(s.K, forged, 63)


def test_hash_check_stops_a_co_holder_of_k() -> None:
    # Someone who holds K (so knows the key) can build a value that passes
    # the tag but carries other content; only the hash check catches it.
    s = seal(b"genuine item....")
    evil = b"poisoned item..."
    header = struct.pack("<BQ", 1, len(evil))
    forged = header + AESGCM(value_key(s.K)).encrypt(NONCE, evil, s.id + header)
    with pytest.raises(PoisonedValue, match="content hash mismatch"):
        open_value(s.K, forged, len(evil))
    assert open_value(s.K, forged, len(evil), verify_hash=False) == evil


def test_throughput() -> None:
    item = os.urandom(1 << 20)
    n, t0 = 0, time.perf_counter()
    while n < 64 and time.perf_counter() - t0 < 1.0:  # bounded in count and time
        s = seal(item)
        n += 1
    t_seal = (time.perf_counter() - t0) / n
    m, t0 = 0, time.perf_counter()
    while m < 64 and time.perf_counter() - t0 < 1.0:
        open_value(s.K, s.value, len(item))
        m += 1
    t_open = (time.perf_counter() - t0) / m
    t0 = time.perf_counter()
    for _ in range(m):
        open_value(s.K, s.value, len(item), verify_hash=False)
    t_fast = (time.perf_counter() - t0) / m
    mb = len(item) / 2**20
    print(f"\n1 MiB items: seal {mb / t_seal:.0f} MiB/s, open {mb / t_open:.0f} MiB/s, "
          f"open without hash check {mb / t_fast:.0f} MiB/s")
    assert open_value(s.K, s.value, len(item)) == item


def test_hashes_match_in_shares_keeps_order_and_finds_forgeries():
    from concurrent.futures import ThreadPoolExecutor

    items = [os.urandom(1000 + i) for i in range(50)]
    pairs = [(hashlib.sha256(x).digest(), x) for x in items]
    pairs[7] = (pairs[7][0], b"forged" + items[7][6:])  # right size, wrong bytes
    pairs[42] = (pairs[42][0], items[41])
    want = [i not in (7, 42) for i in range(50)]
    assert hashes_match(pairs) == want  # one thread
    with ThreadPoolExecutor(3) as pool:
        for threads in (1, 2, 4):  # split into up to 4 shares of >= 1 KB
            assert hashes_match(pairs, pool, threads, min_share_bytes=1000) == want
        assert hashes_match([], pool, 4) == []
        assert hashes_match(pairs[:1], pool, 4, min_share_bytes=1) == [True]
