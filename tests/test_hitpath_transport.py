"""The hit path's transports (issue 13): a same-host get reads the follower while the
server answers which ids it holds, and takes only what the server granted; the
embedded default's own operations reach its core without a socket."""
import os
import time

import pytest

from cacheserver import inproc, wire
from cacheserver.client.server_client import ServerClient
from cacheserver.vocab import CacheMode

VALUES = {bytes([i]) * 32: os.urandom(100_000 + i) for i in range(1, 41)}


def test_same_host_read_ahead_serves_only_what_the_server_grants(server):
    ids = list(VALUES)
    with ServerClient(server.address, local_read=False) as w:
        assert w.put([(k, VALUES[k]) for k in ids[:30]])[0] == 30
    with ServerClient(server.address) as c, ServerClient(server.address, local_read=False) as ctl:
        deadline = time.monotonic() + 30
        while [bytes(v) for v in c.get(ids[:30])] != [VALUES[k] for k in ids[:30]]:  # the follower catches up
            assert time.monotonic() < deadline
        assert c.transport == "local"
        got = c.get(ids, "job")  # 30 present, 10 absent
        assert [None if v is None else bytes(v) for v in got] == [VALUES[k] for k in ids[:30]] + [None] * 10
        # A bypassed job is answered all-miss, though the follower holds every value it reads ahead.
        ctl.set_job_mode("probe", CacheMode.BYPASS.code)
        before = ctl.stats().counters
        assert c.get(ids[:30], "probe") == [None] * 30
        after = ctl.stats().counters
        assert after["bypassed"] - before["bypassed"] == 30 and after["get_hits"] == before["get_hits"]
        ctl.set_job_mode("probe", CacheMode.NORMAL.code)
        got = c.get(ids[:30], "probe")  # mostly misses last time: read after the answer, as before
        assert [bytes(v) for v in got] == [VALUES[k] for k in ids[:30]]
        assert [bytes(v) for v in c.get(ids[:30], "probe")] == [VALUES[k] for k in ids[:30]]


def test_large_frames_arrive_whole_over_tcp(server):
    """Answers above one receive are read in parts into one buffer (wire.recv_exact)."""
    ids = list(VALUES)
    with ServerClient(server.address, prefer_unix=False) as c:
        c.put([(k, VALUES[k]) for k in ids])
        assert c.transport == "tcp"
        got = c.get(ids * 3)
        assert sum(len(v) for v in got) > 4 * wire._SMALL
        assert [bytes(v) for v in got] == [VALUES[k] for k in ids * 3]


def test_embedded_operations_reach_the_core_without_a_socket(tmp_path):
    torch = pytest.importorskip("torch")  # noqa: F841
    from clients.dataset import CachedDataset
    from test_verify_blake3 import make

    path, items = make(tmp_path / "ds", True)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"))
    try:
        core = inproc.core_for(ds.embedded.address)
        loader = ds.loader(batch_size=4, num_workers=0, seed=0)
        assert sorted(x for b in loader for x in b) == sorted(items)  # fill: lookups, claims, puts
        before = core.counters.snapshot()
        assert sorted(x for b in loader for x in b) == sorted(items)
        after = core.counters.snapshot()
        assert after["lookups"] > before["lookups"] and after["get_hits"] - before["get_hits"] == len(items)
        assert after.get("dataplane_requests", 0) == before.get("dataplane_requests", 0)  # no frame served
        # refused as over the wire: a RemoteError that says why (the ring turns it into a ValueError)
        with ServerClient(ds.embedded.address, plain=True) as c:
            with pytest.raises(wire.RemoteError, match="exceeds the limit") as err:
                c.lookup([b"x" * 32] * (core.limits.max_batch_items + 1))
            assert err.value.status == wire.BAD_REQUEST
    finally:
        ds.close()


def test_a_failure_in_another_thread_does_not_break_a_same_host_get_under_way(server):
    """The ring replaces a failed server's client while another thread (a prefetch beside
    the loader) may be reading its follower: that get still finishes, values intact."""
    from cacheserver.client import localread
    from cacheserver.client.ring_client import RingClient

    ids = list(VALUES)[:8]
    with RingClient([server.address]) as ring:
        assert ring.put([(k, VALUES[k]) for k in ids]) == 8
        deadline = time.monotonic() + 30
        while [None if v is None else bytes(v) for v in ring.get(ids)] != [VALUES[k] for k in ids]:
            assert time.monotonic() < deadline  # the follower catches up
        client = ring.clients[server.address]
        assert client.transport == "local"
        read = client._local.read

        def fail_meanwhile(keys):
            ring._failed(server.address, ConnectionError("another thread's call failed"))
            return read(keys)

        client._local.read = fail_meanwhile
        time.sleep(localread.MAX_CATCH_UP_INTERVAL)  # the get may catch its follower up
        assert [bytes(v) for v in ring.get(ids)] == [VALUES[k] for k in ids]
        assert ring.clients[server.address] is not client
