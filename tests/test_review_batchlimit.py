"""The PyTorch client against cache servers started with a --max-batch-size below the
client's own 64 MiB parts (an operator on a small host): puts and gets are split by the
smallest limit the ring's servers announce in their Info (RingClient.batch_limit), so
batches of misses are cached and cached items read as hits. Real server processes; the
client's part sizes are left at their defaults."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cacheserver.client.ring_client import RingClient  # noqa: E402
from cacheserver.client.server_client import ServerClient  # noqa: E402
from clients import inserts  # noqa: E402
from clients.dataset import GET_BYTES, CachedDataset  # noqa: E402
from clients.transformed import TransformedItems  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from procs import cacheserver, free_port  # noqa: E402

pytestmark = pytest.mark.timeout(180)
ITEM = 300_000  # 8 of them (2.4 MB) pass a server's 1 MB limit, far below the client's 64 MiB parts


@pytest.fixture
def small_server(tmp_path):
    srv = cacheserver(str(tmp_path / "s"), "64MB", 0, "--max-batch-size", "1MB").start()
    yield srv
    srv.kill()


def _stored(srv) -> int:
    with ServerClient(srv.address) as c:
        return c.stats().items


def test_batches_of_misses_over_the_servers_limit_are_cached_and_then_hit(small_server, tmp_path):
    # every put of a batch was refused whole (2.4 MB against 1 MB): nothing stored, every
    # item a miss read from the store every epoch
    blobs = [os.urandom(ITEM) for _ in range(16)]
    ds = CachedDataset(write_files_digest(tmp_path / "ds", blobs), cache=small_server.address)
    try:
        for epoch in range(2):
            for b in (range(0, 8), range(8, 16)):
                assert ds.__getitems__(list(b)) == blobs[b.start:b.stop]
            if epoch == 0:
                assert ds.counters.totals()["inserted"] == 16
                assert _stored(small_server) == 16
        t = ds.counters.totals()
        assert (t["hits"], t["misses"], t["inserted"]) == (16, 16, 16)
        assert ds._proc().ring.errors == 0
    finally:
        ds.close()


def test_cached_items_in_a_batch_over_the_servers_limit_read_as_hits(small_server, tmp_path):
    # cached by batches of 2; a get of 8 was cut at 1 MB and the rest read as misses every epoch
    blobs = [os.urandom(ITEM) for _ in range(8)]
    ds = CachedDataset(write_files_digest(tmp_path / "ds", blobs), cache=small_server.address)
    try:
        for k in range(0, 8, 2):
            ds.__getitems__([k, k + 1])
        before = ds.counters.totals()
        for _ in range(2):
            assert ds.__getitems__(list(range(8))) == blobs
        t = ds.counters.totals()
        assert (t["hits"] - before["hits"], t["misses"] - before["misses"]) == (16, 0)
    finally:
        ds.close()
    # a process's first batch (a DataLoader worker's, each epoch): the limit is heard before it
    ds = CachedDataset(write_files_digest(tmp_path / "ds", blobs), cache=small_server.address)
    try:
        assert ds.__getitems__(list(range(8))) == blobs
        assert (ds.counters.totals()["hits"], ds.counters.totals()["misses"]) == (8, 0)
    finally:
        ds.close()


def test_transformed_items_are_put_and_read_within_the_servers_limit(small_server):
    with RingClient([small_server.address]) as ring:
        t = TransformedItems(ring, "j", "ab" * 32, "fp")
        Ks, items = [os.urandom(32) for _ in range(8)], [os.urandom(ITEM) for _ in range(8)]
        assert t.put(Ks, items) == 8
        assert (t.counts.inserted, t.counts.refused) == (8, 0)
        assert t.get(Ks) == items
        assert (t.counts.hits, t.counts.misses) == (8, 0)


def test_an_item_over_the_servers_limit_stays_uncached_and_the_rest_are_cached(small_server, tmp_path):
    blobs = [b"a" * 1000, os.urandom(3_000_000), b"b" * 1000, os.urandom(ITEM)]
    ds = CachedDataset(write_files_digest(tmp_path / "ds", blobs), cache=small_server.address)
    try:
        assert ds.__getitems__([0, 1, 2, 3]) == blobs  # uncached, not an error
        assert ds.lookup([0, 1, 2, 3]) == [True, False, True, True]
        assert ds._proc().ring.errors == 0
    finally:
        ds.close()


def test_the_ring_exposes_the_smallest_limit_its_servers_announce(tmp_path):
    small = cacheserver(str(tmp_path / "a"), "64MB", 0, "--max-batch-size", "1MB").start()
    large = cacheserver(str(tmp_path / "b"), "64MB", 0, "--max-batch-size", "4MB").start()
    try:
        with RingClient([small.address, large.address]) as ring:
            assert ring.batch_limit() == 1_000_000  # both heard from before any call
            assert all(c.transport != "unresolved" for c in ring.clients.values())
            assert inserts.batch_bytes(ring, GET_BYTES) == 1_000_000
            assert inserts.batch_bytes(None, GET_BYTES) == GET_BYTES
        small.kill()
        with RingClient([small.address, large.address], timeout=5.0) as ring:  # one down: the other's
            assert ring.batch_limit() == 4_000_000
            assert ring.errors == 1
            assert ring.batch_limit() == 4_000_000 and ring.errors == 1  # down: not asked again now
    finally:
        small.kill()
        large.kill()


def test_a_ring_of_no_answering_server_leaves_the_clients_parts_as_they_are():
    with RingClient([f"127.0.0.1:{free_port()}"], timeout=5.0) as ring:
        assert ring.batch_limit() is None
        assert inserts.batch_bytes(ring, GET_BYTES) == GET_BYTES


def test_the_embedded_cache_keeps_its_own_limit(tmp_path):
    blobs = [os.urandom(ITEM) for _ in range(8)]
    ds = CachedDataset(write_files_digest(tmp_path / "ds", blobs), cache_dir=str(tmp_path / "cache"))
    try:
        st = ds._proc()
        assert st.core is not None
        assert inserts.batch_bytes(st.ring, GET_BYTES, st.core) == min(GET_BYTES, st.core.limits.max_batch_bytes)
        for _ in range(2):
            assert ds.__getitems__(list(range(8))) == blobs
        assert ds.counters.totals()["hits"] == 8
        # a DataLoader worker reaches it through a ring client (its Unix socket)
        with RingClient([ds.cache_spec], plain=True) as ring:
            assert ring.batch_limit() == st.core.limits.max_batch_bytes
    finally:
        ds.close()
