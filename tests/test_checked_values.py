"""Values a process checked once are known again, byte for byte, by a MAC under a key of its
own (clients/checked.py): a cache server's hits skip step 4 the second time, and a value
changed since, even one sealed with a valid tag by a holder of K, is hashed and caught."""
import hashlib

import pytest

torch = pytest.importorskip("torch")

from cacheserver.client.server_client import ServerClient  # noqa: E402
from clients import capability  # noqa: E402
from clients.checked import CheckedValues, key, unknown  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from procs import cacheserver  # noqa: E402
from test_verify_blake3 import forge, make  # noqa: E402
from test_vouched import read_counts  # noqa: E402


@pytest.fixture
def server(tmp_path):
    d = cacheserver(str(tmp_path / "srv")).start()
    yield d
    d.kill()


def test_known_only_as_the_same_bytes_under_the_same_entry():
    m = CheckedValues()
    a, b = b"a" * 32, b"b" * 32
    v = bytes(range(256)) * 40
    assert m.known([key(a, b)], [v]) == [False]
    m.remember([key(a, b)], [v])
    flipped = bytearray(v)
    flipped[1000] ^= 1
    assert m.known([key(a, b), key(a, b), key(b, b), key(a, a)],
                   [memoryview(v), bytes(flipped), v, v]) == [True, False, False, False]
    assert CheckedValues().known([key(a, b)], [v]) == [False]  # another process: another key
    small = CheckedValues(limit=1)
    small.remember([key(a, b), key(b, b)], [v, v])
    assert len(small) == 1 and small.known([key(b, b)], [v]) == [False]
    todo, pairs, entries, n = unknown(m, [a, b], [v, v], [0, 1], [(b, v), (b, v)])
    assert (todo, n, entries) == ([1], 1, [key(b, b)])


@pytest.mark.parametrize("with_blake3", [True, False], ids=["blake3", "sha256"])
def test_server_hits_checked_once_then_known_and_changes_caught(tmp_path, server, with_blake3):
    path, items = make(tmp_path / "ds", with_blake3)
    n = len(items)
    ds = CachedDataset(path, cache=server.address)
    try:
        got, c = read_counts(ds, list(range(n)))  # fill: store reads, sealed, put
        assert got == items and c["hits"] == 0
        got, c = read_counts(ds, list(range(n)))  # first hits: each hashed once
        assert got == items and c == dict(hits=n, vouched=0, poisoned=0, store_bytes=0)
        got, c = read_counts(ds, list(range(n)))
        assert got == items and c == dict(hits=n, vouched=n, poisoned=0, store_bytes=0)
        k = hashlib.sha256(items[1]).digest()
        with ServerClient(server.address) as cl:  # a holder of K replaces the value, valid tag and all
            cl.put([(capability.item_id(k), forge(k, bytes(len(items[1]))))], replace=True)
        got, c = read_counts(ds, list(range(n)))
        assert got == items and c == dict(hits=n - 1, vouched=n - 1, poisoned=1, store_bytes=len(items[1]))
        # the repair sealed the item again: sealing is deterministic, so the very bytes checked before
        got, c = read_counts(ds, [1])
        assert got == items[1:2] and c == dict(hits=1, vouched=1, poisoned=0, store_bytes=0)
    finally:
        ds.close()
