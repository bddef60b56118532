"""The miss path's puts (clients/inserts.py) against real servers and the embedded cache:
a batch of large items is put in parts a server's --max-batch-size takes, and an item over
the embedded cache's item limit stays uncached instead of failing the read."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from clients import inserts  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from procs import cacheserver  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_split_by_bytes_keeps_each_put_under_the_limit_and_a_larger_item_alone():
    sizes = [4, 4, 3, 10, 1, 1]
    assert inserts.split_by_bytes(list(range(6)), sizes, 8) == [[0, 1], [2], [3], [4, 5]]
    assert inserts.split_by_bytes([1, 3], sizes, 8) == [[1], [3]]
    assert inserts.split_by_bytes([], sizes, 8) == []


def test_a_batch_over_the_servers_batch_limit_is_put_in_parts(tmp_path, monkeypatch):
    # 8 items of 300 kB: 2.4 MB in one put, which a server with --max-batch-size 1MB refused
    # whole (every item uncached, every epoch); in puts of at most 1 MB all are stored.
    monkeypatch.setattr(inserts, "PUT_BYTES", 1_000_000)
    srv = cacheserver(str(tmp_path / "s"), "64MB", 0, "--max-batch-size", "1MB").start()
    path = write_files_digest(tmp_path / "ds", (os.urandom(300_000) for _ in range(8)))
    ds = CachedDataset(path, cache=srv.address)
    try:
        assert [len(x) for x in ds.__getitems__(list(range(8)))] == [300_000] * 8
        assert ds.lookup(list(range(8))) == [True] * 8
    finally:
        ds.close()
        srv.kill()


def test_an_item_over_the_embedded_caches_item_limit_stays_uncached(tmp_path):
    # 70 MB against the embedded server's 64 MiB item limit: the read raised BadRequest
    big = os.urandom(70 << 20)
    path = write_files_digest(tmp_path / "ds", [b"a" * 1000, big, b"b" * 1000])
    ds = CachedDataset(path, cache_dir=str(tmp_path / "cache"))
    try:
        got = ds.__getitems__([0, 1, 2])
        assert got[1] == big and got[0] == b"a" * 1000
        assert ds.lookup([0, 1, 2]) == [True, False, True]
    finally:
        ds.close()


def test_a_batch_over_the_servers_batch_limit_is_read_in_parts(tmp_path, monkeypatch):
    # All 8 items of 300 kB cached: a get of the batch (2.4 MB) from a server with
    # --max-batch-size 1MB was cut after 3 items, and the other 5 were misses every epoch.
    import clients.dataset
    from cacheserver.client.server_client import ServerClient
    monkeypatch.setattr(inserts, "PUT_BYTES", 1_000_000)
    monkeypatch.setattr(clients.dataset, "GET_BYTES", 1_000_000)
    srv = cacheserver(str(tmp_path / "s"), "64MB", 0, "--max-batch-size", "1MB").start()
    path = write_files_digest(tmp_path / "ds", (os.urandom(300_000) for _ in range(8)))
    ds = CachedDataset(path, cache=srv.address)
    try:
        first = ds.__getitems__(list(range(8)))
        with ServerClient(srv.address) as c:
            puts = c.stats().counters["puts"]
            assert ds.__getitems__(list(range(8))) == first
            counters = c.stats().counters
        assert counters["get_cut_for_size"] == 0 and counters["puts"] == puts, counters  # all hits
    finally:
        ds.close()
        srv.kill()
