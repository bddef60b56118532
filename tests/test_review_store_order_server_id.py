"""Review of the server id a cache server keeps in its data dir (cacheserver/server.py): a
saved id that cannot be read (not UTF-8, empty) stopped the server from starting (a
UnicodeDecodeError, or an empty id for the manager). It is replaced, with a warning, by a
new one that the next start keeps; the manager takes the server as a new one."""
import os
import signal

import pytest

from cacheserver.client.server_client import ServerClient
from procs import cacheserver
from test_review_store_reopen import set_server_state


def server_id(srv) -> str:
    with ServerClient(srv.address) as c:
        return c.info().server_id


@pytest.mark.parametrize("raw", [b"\xff\xfe\x00", b""], ids=["not-utf8", "empty"])
def test_an_unreadable_saved_server_id_is_replaced_and_kept(tmp_path, raw):
    data = str(tmp_path / "d")
    srv = cacheserver(data, "64MB").start()
    try:
        old = server_id(srv)
        with ServerClient(srv.address) as c:
            assert c.put([(os.urandom(32), b"x" * 1000)])[0] == 1
    finally:
        assert srv.stop() == 0
    set_server_state(os.path.join(data, "db"), b"server_id", raw)
    srv = cacheserver(data, "64MB").start()  # did not become ready before
    try:
        new = server_id(srv)
        assert new and new != old and len(new) == 32 and int(new, 16) >= 0
        with ServerClient(srv.address) as c:
            assert c.stats().items == 1  # the store's items are kept
        os.kill(srv.pid, signal.SIGKILL)  # the new id was saved, logged
        srv.proc.wait(10)
    finally:
        srv.kill()
    srv = cacheserver(data, "64MB").start()
    try:
        assert server_id(srv) == new
    finally:
        assert srv.stop() == 0
    with open(srv.log_path) as f:
        warned = [line for line in f if "saved server id" in line]
    assert len(warned) == 1 and new in warned[0] and "new one" in warned[0], warned
