"""A same-host client against a server that does not answer (SIGSTOPped): opening its
follower (follower.py) must not add a wait to the get that needs it, nor hold up the ring's
requests to its other servers. Real daemons on loopback.

Before, the follower was opened inside ServerClient.start(): OPEN_FOLLOWER waited out the
request timeout, was taken for a refusal, and the get then sent its request over the socket,
which waited out a second timeout, while the ring's other servers had not been sent theirs."""
import hashlib
import os
import signal
import time

import pytest

from cacheserver import ops
from cacheserver.client import readpath
from cacheserver.client.ring_client import RingClient
from cacheserver.client.server_client import ServerClient
from procs import cacheserver, sigstop, wait_until

ITEMS = [(hashlib.sha256(i.to_bytes(2, "big")).digest(), bytes([i]) * 1000) for i in range(64)]
IDS = [k for k, _ in ITEMS]
VALUES = [v for _, v in ITEMS]
TIMEOUT_S = 2.5  # the clients' request timeout
SLACK_S = 1.0  # a loaded 2-core host's scheduling, far below a second timeout


def _values(c, ids=IDS) -> list:
    return [v if v is None else bytes(v) for v in c.get(ids)]


def _drop_follower_for_a_moment(c: ServerClient, ids: list[bytes], values: list[bytes]) -> None:
    """A losing window (readpath.py): the follower is dropped, so the first get once the
    short hold is over reopens it (OPEN_FOLLOWER first)."""
    wait_until(lambda: _values(c, ids) == values and c._local is not None, "the follower serves")
    c.paths._hold = 0.3
    c.paths.follower(1.0)  # it cost far more than it read
    assert c.paths.decide() == readpath.REMOTE
    assert _values(c, ids) == values and c._local is None


class Stopped:
    """A real server SIGSTOPped (no answer to anything) until the block ends."""

    def __init__(self, server) -> None:
        self.server = server

    def __enter__(self) -> "Stopped":
        sigstop(self.server.proc.pid)
        return self

    def __exit__(self, *exc) -> None:
        os.kill(self.server.proc.pid, signal.SIGCONT)


def test_a_get_that_reopens_the_follower_of_a_hung_server_waits_one_timeout(tmp_path):
    s = cacheserver(str(tmp_path / "d"), "256MB", 0).start()
    try:
        with ServerClient(s.address, local_read=False) as w, ServerClient(s.address, timeout=TIMEOUT_S) as c:
            w.put(ITEMS)
            _drop_follower_for_a_moment(c, IDS, VALUES)
            with Stopped(s):
                wait_until(c.paths.use_local, "the hold over")  # the next get reopens the follower
                t = time.monotonic()
                call = c.start(ops.GET, IDS)
                sent = time.monotonic() - t
                with pytest.raises(OSError):  # its own request's timeout
                    call.result()
                waited = time.monotonic() - t
            # before: start() waited out OPEN_FOLLOWER (2.5 s), then result() its GET (2.5 s)
            assert sent < SLACK_S, sent
            assert waited < TIMEOUT_S + SLACK_S, waited
            # the unanswered open only put the follower off (readpath.OpenRetry)
            wait_until(lambda: _values(c) == VALUES and c._local is not None and c.transport == "local",
                   "the follower reopened", 15)
            assert c.transport == "local"
    finally:
        assert s.stop() == 0


def test_a_hung_server_reopening_its_follower_does_not_hold_up_the_ring(tmp_path):
    a = cacheserver(str(tmp_path / "a"), "256MB", 0).start()
    b = cacheserver(str(tmp_path / "b"), "256MB", 0).start()
    try:
        with RingClient([a.address, b.address], timeout=TIMEOUT_S, down_backoff=0.5) as ring:
            assert ring.put(ITEMS) == len(ITEMS)
            on_a = [i for i, k in enumerate(IDS) if ring.ring.route([k]).keys() == {a.address}]
            assert 0 < len(on_a) < len(IDS)
            wait_until(lambda: _values(ring) == VALUES, "the values served")
            _drop_follower_for_a_moment(ring.clients[a.address], [IDS[i] for i in on_a],
                                        [VALUES[i] for i in on_a])
            with Stopped(a):
                wait_until(ring.clients[a.address].paths.use_local, "the hold over")
                t = time.monotonic()
                got = _values(ring)  # a's share reopens a's follower
                waited = time.monotonic() - t
            # a's share is a miss, b's served; before: 2 timeouts, b's request sent after the first
            assert got == [None if i in on_a else v for i, v in enumerate(VALUES)]
            assert waited < TIMEOUT_S + SLACK_S, waited
            wait_until(lambda: _values(ring) == VALUES, "a back after its back-off", 15)
    finally:
        assert a.stop() == 0 and b.stop() == 0


def test_the_first_open_waits_for_a_hung_server_no_longer_than_its_probe(tmp_path, monkeypatch):
    """A server that answers the ping and then nothing: the first follower's open (at the
    client's resolution, inside start()) waits at most the probe timeout, not a whole request
    timeout before the get's own."""
    s = cacheserver(str(tmp_path / "d"), "256MB", 0).start()
    timeout, probe = 5.0, 1.0
    stopped = []
    try:
        with ServerClient(s.address, local_read=False) as w:
            w.put(ITEMS)
        real_ping = ServerClient._ping

        def ping_then_hang(self, sock):
            instance = real_ping(self, sock)
            if not stopped:
                sigstop(s.proc.pid)
                stopped.append(True)
            return instance

        monkeypatch.setattr(ServerClient, "_ping", ping_then_hang)
        with ServerClient(s.address, timeout=timeout, probe_timeout=probe) as c:
            t = time.monotonic()
            with pytest.raises(OSError):
                c.get(IDS)
            waited = time.monotonic() - t
            os.kill(s.proc.pid, signal.SIGCONT)
            stopped.append(False)
            # before: OPEN_FOLLOWER's 5 s, then the get's 5 s; the resolution's Info and ping
            # add their scheduling on a loaded host
            assert waited < timeout + probe + 2 * SLACK_S, waited
            wait_until(lambda: _values(c) == VALUES and c._local is not None and c.transport == "local",
                   "the follower opened", 15)
            assert c.transport == "local"
    finally:
        if stopped and stopped[-1]:
            os.kill(s.proc.pid, signal.SIGCONT)
        assert s.stop() == 0
