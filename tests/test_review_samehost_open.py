"""A same-host client's follower (cacheserver/client/follower.py) while it opens and while
the client closes. Real daemons on loopback.

Opening a follower asks the server (OPEN_FOLLOWER, a round trip with the request timeout):
before, it was asked with the follower's lock held, so every other thread's get on the
client waited for that answer, then waited its own request. A get racing close() caught up
on the closed follower and got rocksdict's DbClosedError, where the client's own closed
error belongs (and a follower closed under a get leaves its values to the server)."""
import hashlib
import os
import signal
import tempfile
import threading
import time

import pytest

from cacheserver import ops
from cacheserver.client.server_client import ServerClient
from procs import cacheserver, wait_until

ITEMS = [(hashlib.sha256(bytes([i])).digest(), bytes([i]) * 1000) for i in range(8)]
IDS = [k for k, _ in ITEMS]
VALUES = [v for _, v in ITEMS]
TIMEOUT_S = 2.5  # the client's request timeout


def _values(c: ServerClient) -> list:
    return [v if v is None else bytes(v) for v in c.get(IDS)]


def _flushed(address: str) -> None:
    """Until another same-host client's follower reads the values: the server flushed them
    (flusher.py), and answers them as on file (GET_LOCAL), no longer inline."""
    with ServerClient(address) as r:
        wait_until(lambda: _values(r) == VALUES and r._local is not None
                   and [v if v is None else bytes(v) for v in r._local.read(IDS)] == VALUES, "the values flushed")


def _follower_dropped_for_a_moment(c: ServerClient) -> None:
    """A losing window (readpath.py): the follower is dropped, to be reopened by the next get
    once the short hold is over."""
    wait_until(lambda: _values(c) == VALUES and c._local is not None, "the follower serves")
    c.paths._hold = 0.2
    c.paths.follower(1.0)  # it cost far more than it read
    c.paths.decide()
    assert _values(c) == VALUES and c._local is None
    wait_until(c.paths.use_local, "the hold over")


def test_gets_do_not_wait_behind_a_follower_open_the_server_has_not_answered(tmp_path):
    s = cacheserver(str(tmp_path / "d"), "256MB", 0).start()
    stopped = False
    try:
        with ServerClient(s.address, local_read=False) as w, ServerClient(s.address, timeout=TIMEOUT_S) as c:
            w.put(ITEMS)
            _follower_dropped_for_a_moment(c)
            os.kill(s.proc.pid, signal.SIGSTOP)  # hung: no answer to anything
            stopped = True
            def open_and_get() -> None:  # reopens the follower: OPEN_FOLLOWER, unanswered
                try:
                    c.get(IDS)  # then its get, answered once the server runs again
                except OSError:
                    pass

            opener = threading.Thread(target=open_and_get, daemon=True)
            opener.start()
            time.sleep(0.5)  # the opener is waiting for the server's answer
            t = time.monotonic()
            with pytest.raises(OSError):  # a timeout: this get's own request, unanswered
                c.get(IDS)
            waited = time.monotonic() - t
            # before: the rest of the opener's wait (~2 s), then its own request's (2.5 s)
            assert waited < TIMEOUT_S + 1.0, waited
            os.kill(s.proc.pid, signal.SIGCONT)
            stopped = False
            opener.join(3 * TIMEOUT_S)
            assert not opener.is_alive()
            # the refusal only put the open off (readpath.OpenRetry): the follower opens again
            wait_until(lambda: _values(c) == VALUES and c._local is not None and c.transport == "local",
                   "the follower reopened", 10)
            assert c.transport == "local"
    finally:
        if stopped:
            os.kill(s.proc.pid, signal.SIGCONT)
        assert s.stop() == 0


def test_a_get_racing_close_is_told_the_client_is_closed_not_rocksdbs_error(tmp_path):
    s = cacheserver(str(tmp_path / "d"), "256MB", 0).start()
    try:
        with ServerClient(s.address, local_read=False) as w:
            c = ServerClient(s.address)
            assert _values(c) == [None] * len(IDS)  # the follower opened, before the values came
            assert c.transport == "local"
            w.put(ITEMS)
            _flushed(s.address)
            time.sleep(1.1)  # a catch-up is due (localread.MAX_STALE_S)
            call = c.start(ops.GET, IDS)  # asked of the server, which holds the values now
            c.close()  # in another thread, say: the loader's end while a prefetch reads
            # before: DbClosedError ("DB instance already closed") from the closed follower's catch-up
            with pytest.raises(ValueError, match=f"client of cache server {s.address} is closed"):
                call.result()
            with pytest.raises(ValueError, match="is closed"):  # and no new connection after close
                c.get(IDS)
            assert c._pool.empty()
    finally:
        assert s.stop() == 0


def test_a_follower_closed_under_a_get_leaves_its_values_to_the_server(tmp_path):
    s = cacheserver(str(tmp_path / "d"), "256MB", 0).start()
    try:
        with ServerClient(s.address, local_read=False) as w, ServerClient(s.address) as c:
            assert _values(c) == [None] * len(IDS)
            local = c._local
            assert local is not None
            w.put(ITEMS)
            _flushed(s.address)
            time.sleep(1.1)  # a catch-up is due (localread.MAX_STALE_S)
            local.close()  # another thread's: the client itself stays open
            assert not local.catch_up()
            assert local.read(IDS) == [None] * len(IDS)
            assert _values(c) == VALUES  # read through the server
    finally:
        assert s.stop() == 0


def test_a_follower_whose_scratch_dir_cannot_be_made_now_is_opened_later(tmp_path, monkeypatch):
    """A follower's scratch dir (scratch.py) goes under the temp dir: one full, or gone for a
    moment, refused the open for now only. Before, it cost the client its follower for good."""
    s = cacheserver(str(tmp_path / "d"), "256MB", 0).start()
    try:
        with ServerClient(s.address, local_read=False) as w:
            w.put(ITEMS)
            monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-tmp"))  # mkdtemp: ENOENT
            with ServerClient(s.address) as c:
                assert _values(c) == VALUES and c._local is None and c.transport == "unix"
                monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
                wait_until(lambda: _values(c) == VALUES and c._local is not None and c.transport == "local",
                       "the follower opened", 10)
                assert c.transport == "local"
    finally:
        assert s.stop() == 0
