"""A replace (a client found the stored value poisoned) that a kill -9 cuts short, through a
real daemon: with durability "cache" the new value had not reached a table file; after the
restart the id is a miss, never the poisoned value it replaced back under the new index record."""
import os
import signal
import time

import pytest

from cacheserver.client.server_client import ServerClient
from cacheserver.diskbudget import BLOB_MIN
from procs import cacheserver


@pytest.mark.parametrize("size", [4000, BLOB_MIN], ids=["small", "large"])
def test_a_replace_cut_by_a_kill_never_brings_the_poisoned_value_back(tmp_path, size):
    data = str(tmp_path / "d")
    k, poisoned, good = os.urandom(32), os.urandom(size), os.urandom(size + 100)
    s = cacheserver(data, "200MB").start()
    try:
        with ServerClient(s.address) as c:
            assert c.put([(k, poisoned)])[0] == 1
            time.sleep(2.0)  # the flusher writes it to a table file (flusher.QUIET_S after writes pause)
            assert c.put([(k, good)], replace=True)[0] == 1
            assert bytes(c.get([k])[0]) == good
        os.kill(s.pid, signal.SIGKILL)  # at once: the new value is only in the memtable
        s.proc.wait(10)
    finally:
        s.kill()
    s = cacheserver(data, "200MB").start()
    try:
        with ServerClient(s.address) as c:
            got = c.get([k])[0]
            assert got is None or bytes(got) == good, "the poisoned value came back after a restart"
            st = c.stats()
            assert st.used_bytes == (0 if got is None else size + 100 + 128)
    finally:
        assert s.stop() == 0
