"""Review of the miss path's large-item handling against real cache servers: transformed
items put and read in parts a server's --max-batch-size takes, a put past that limit
refused without the ring taking the server for failed, and the `inserted` counter
counting only the items a store took. Nothing here asserts on timing."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cacheserver.client.ring_client import RingClient  # noqa: E402
from cacheserver.client.server_client import ServerClient  # noqa: E402
from clients import inserts  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from clients.transformed import TransformedItems  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from procs import cacheserver  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def small_batches(tmp_path, monkeypatch):
    """A server that takes puts (and answers gets) of at most 1 MB, and a client that puts in
    parts of that much, as it does of 64 MiB against a server's default 256 MiB."""
    monkeypatch.setattr(inserts, "PUT_BYTES", 1_000_000)
    srv = cacheserver(str(tmp_path / "s"), "64MB", 0, "--max-batch-size", "1MB").start()
    yield srv
    srv.kill()


def test_split_by_bytes_at_the_limit_and_of_empty_items():
    assert inserts.split_by_bytes([0, 1, 2], [8, 0, 8], 8) == [[0, 1], [2]]  # exactly at the limit: one part
    assert inserts.split_by_bytes([0, 1, 2], [0, 0, 9], 8) == [[0, 1], [2]]  # over it: alone
    assert inserts.split_by_bytes([0], [9], 8) == [[0]]


def test_a_batch_of_transformed_items_over_the_servers_batch_limit_is_put_in_parts(small_batches):
    # 8 items of 300 kB in one put of 2.4 MB: refused whole, every item uncached every epoch
    with RingClient([small_batches.address]) as ring:
        t = TransformedItems(ring, "j", "ab" * 32, "fp")
        Ks, items = [os.urandom(32) for _ in range(8)], [os.urandom(300_000) for _ in range(8)]
        assert t.put(Ks, items) == 8
        assert (t.counts.inserted, t.counts.refused) == (8, 0)
        assert t.lookup(Ks) == [True] * 8


def test_a_get_of_transformed_items_cut_at_the_servers_batch_limit_finds_them_all(small_batches):
    # the server answers 3 of the 8 cached items (1 MB) and the rest as misses: they were
    # computed again every epoch although cached
    with RingClient([small_batches.address]) as ring:
        t = TransformedItems(ring, "j", "ab" * 32, "fp")
        Ks, items = [os.urandom(32) for _ in range(8)], [os.urandom(300_000) for _ in range(8)]
        for k in range(0, 8, 2):
            t.put(Ks[k:k + 2], items[k:k + 2])
        assert t.get(Ks) == items
        assert (t.counts.hits, t.counts.misses) == (8, 0)
        assert t.get([os.urandom(32)] + Ks[:1]) == [None, items[0]]  # a true miss stays one


@pytest.mark.parametrize("transport", [dict(), dict(prefer_unix=False), dict(use_dataplane=False)])
def test_a_put_over_the_servers_batch_limit_is_refused_without_marking_the_server_down(small_batches, transport):
    # 8 MB in one put: the server cut the frame off unread (a broken pipe; over gRPC
    # RESOURCE_EXHAUSTED), and the ring took the server for failed: all-miss for seconds
    with RingClient([small_batches.address], **transport) as ring:
        big, small = (os.urandom(32), os.urandom(8_000_000)), (os.urandom(32), b"x" * 1000)
        with pytest.raises(ValueError, match="exceeds the limit"):
            ring.put([big])
        assert ring.errors == 0
        assert ring.put([small]) == 1
        assert ring.get([small[0]]) == [small[1]]


def test_an_item_over_the_servers_batch_limit_leaves_the_rest_of_the_cache_usable(small_batches, tmp_path):
    blobs = [b"a" * 1000, os.urandom(8_000_000), b"b" * 1000]
    ds = CachedDataset(write_files_digest(tmp_path / "ds", blobs), cache=small_batches.address)
    try:
        assert ds.__getitems__([1]) == [blobs[1]]  # uncached, not an error
        assert ds._proc().ring.errors == 0
        assert ds.__getitems__([0, 2]) == [blobs[0], blobs[2]]
        assert ds.lookup([0, 1, 2]) == [True, False, True]
        assert ds.counters.totals()["inserted"] == 2
    finally:
        ds.close()


def test_inserted_counts_only_what_a_store_took(tmp_path):
    # items over the server's --max-item-size: the put is refused whole; they were counted inserted
    srv = cacheserver(str(tmp_path / "s"), "64MB", 0, "--max-item-size", "1KB").start()
    blobs = [os.urandom(3000) for _ in range(5)] + [b"c" * 100]
    ds = CachedDataset(write_files_digest(tmp_path / "ds", blobs), cache=srv.address)
    try:
        assert ds.__getitems__([0, 1, 2, 3, 4]) == blobs[:5]
        assert ds.counters.totals()["inserted"] == 0
        assert ds.lookup_codes([0, 1, 2, 3, 4]) == [0] * 5  # the claims were given up
        assert ds.__getitems__([5]) == blobs[5:]
        assert ds.counters.totals()["inserted"] == 1
        with ServerClient(srv.address) as c:
            assert c.stats().counters["claims_released"] == 5
    finally:
        ds.close()
        srv.kill()


def test_a_split_read_of_items_at_and_over_the_get_limit_reads_each_once(tmp_path, monkeypatch):
    import clients.dataset
    monkeypatch.setattr(clients.dataset, "GET_BYTES", 1_000_000)
    monkeypatch.setattr(inserts, "PUT_BYTES", 1_000_000)
    srv = cacheserver(str(tmp_path / "s"), "64MB", 0, "--max-batch-size", "4MB").start()
    blobs = [os.urandom(1_000_000), os.urandom(900_000), b"", os.urandom(999_999), os.urandom(1), os.urandom(10)]
    ds = CachedDataset(write_files_digest(tmp_path / "ds", blobs), cache=srv.address)
    idx = [0, 1, 2, 3, 4, 5, 1, 0]
    try:
        assert ds.__getitems__([]) == []
        assert ds.__getitems__(idx) == [blobs[i] for i in idx]
        assert ds.counters.totals()["inserted"] == 6  # the repeats in later parts were hits
        assert ds.__getitems__(idx) == [blobs[i] for i in idx]
        t = ds.counters.totals()
        assert (t["hits"], t["inserted"]) == (2 + 8, 6)
    finally:
        ds.close()
        srv.kill()
