"""Issue 12 items 1-3: what one request or many connections can make a server
hold, and how its accept loop meets a lack of file descriptors; real daemons."""
import hashlib
import os

import pytest

from cacheserver.client.server_client import ServerClient
from procs import cacheserver, rss_bytes


@pytest.mark.parametrize("plane", ["dataplane", "grpc"])
def test_get_naming_one_large_id_many_times_is_bounded(tmp_path, plane):
    s = cacheserver(str(tmp_path / "d"), "256MB", 0, "--max-batch-size", "8MiB", "--unix-socket", "off").start()
    try:
        value = os.urandom(1 << 20)
        key = hashlib.sha256(value).digest()
        opts = {"use_dataplane": plane == "dataplane", "local_read": False}
        with ServerClient(s.address, **opts) as c:
            assert c.put([(key, value)])[0] == 1
            base = rss_bytes(s.pid)
            got = c.get([key] * 400)  # 400 MiB if answered in full
            peak = rss_bytes(s.pid)
            st = c.stats()
        held = [g for g in got if g is not None]
        assert 1 <= len(held) <= 8 and all(bytes(g) == value for g in held)
        assert all(g is None for g in got[len(held):])
        assert st.counters["get_cut_for_size"] == 400 - len(held)
        assert peak - base < 100 << 20, (base, peak)
    finally:
        assert s.stop() == 0
