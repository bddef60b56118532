"""A hung ring member (SIGSTOP: a frozen VM, a black hole) fails only by timing out.
Each try of it costs the caller a wait, so the ring tries it again less and less often
(the back-off doubles with each failure in a row) and, when it does, gives it a short
probe instead of the whole request timeout; it is used again once it answers. Real
daemons on loopback."""
import os
import signal
import time

from cacheserver.client.ring_client import MAX_DOWN_S, PROBE_TIMEOUT_S, RingClient
from procs import cacheserver, sigstop

TIMEOUT_S = 4.0  # the client's request timeout: well over PROBE_TIMEOUT_S


def test_backoff_doubles_to_its_cap():
    ring = RingClient.__new__(RingClient)
    ring.down_backoff = 2.0
    assert [ring.backoff(n) for n in (1, 2, 3, 4, 5, 6, 7, 100)] == [2, 4, 8, 16, 32, MAX_DOWN_S, MAX_DOWN_S,
                                                                     MAX_DOWN_S]
    ring.down_backoff = 90.0  # a longer back-off asked for is kept
    assert ring.backoff(1) == ring.backoff(5) == 90.0


def test_a_hung_server_costs_a_short_probe_per_try_and_is_used_again(tmp_path):
    servers = [cacheserver(str(tmp_path / f"s{i}"), "64MB", 0, "--unix-socket", "off").start() for i in range(2)]
    ids = [bytes([i]) * 32 for i in range(64)]
    try:
        with RingClient([s.address for s in servers], timeout=TIMEOUT_S, down_backoff=0.5) as ring:
            ring.put([(i, i[:4] * 4) for i in ids])
            owner = ring.ring.route(ids)
            hung = servers[1].address
            mine = owner[hung]
            assert mine and len(mine) < len(ids)
            sigstop(servers[1].proc.pid)
            waits = []
            deadline = time.monotonic() + 3 * TIMEOUT_S
            for _ in range(400):  # bounded in count and time
                if time.monotonic() > deadline:
                    break
                t = time.monotonic()
                got = ring.get(ids)
                waits.append(time.monotonic() - t)
                served = [k for k in mine if got[k] is not None]
                assert not served, (len(waits), served, len(mine))  # its share a miss, the rest hits
                assert all(got[k] is not None for k in range(len(ids)) if k not in set(mine))
                time.sleep(0.05)
            stalls = [w for w in waits if w > 1.0]
            # The first try waits the request timeout; every later one a probe at most.
            assert TIMEOUT_S - 0.5 <= stalls[0] < TIMEOUT_S + 3, waits
            assert all(w < PROBE_TIMEOUT_S + 1.5 for w in stalls[1:]), stalls
            # Tried again after 0.5, 1, 2, 4, ... s: a few tries in 2 x TIMEOUT_S, where a fixed
            # 0.5 s back-off would have tried about every 0.5 s + the wait.
            assert 1 <= len(stalls[1:]) <= 3, stalls
            assert ring._fails[hung] >= 2
            os.kill(servers[1].proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + MAX_DOWN_S + 10
            while time.monotonic() < deadline and ring.get(ids)[mine[0]] is None:
                time.sleep(0.2)
            assert ring.get(ids)[mine[0]] is not None  # used again once it answers
            assert not ring._fails.get(hung)  # and its run of failures is over
    finally:
        for s in servers:
            os.kill(s.proc.pid, signal.SIGCONT)
            s.kill()


def test_a_busy_server_keeps_the_short_backoff(tmp_path):
    """A server that answers "busy" is alive: its back-off stays down_backoff, not doubled
    per refusal as a hung one's (a loaded server would be all-miss for up to a minute)."""
    from cacheserver import wire
    s = cacheserver(str(tmp_path / "s"), "64MB", 0).start()
    try:
        with RingClient([s.address], down_backoff=0.5) as ring:
            for _ in range(5):
                ring._failed(s.address, wire.RemoteError(wire.UNAVAILABLE, "server busy: test"))
                ring._down_until[s.address] = 0.0  # as if its back-off had passed
            assert ring._fails[s.address] == 1
            ring._failed(s.address, TimeoutError("timed out"))
            ring._down_until[s.address] = 0.0
            ring._failed(s.address, TimeoutError("timed out"))
            assert ring._fails[s.address] == 3 and ring.backoff(3) == 2.0
    finally:
        s.kill()


def test_hung_servers_cost_one_timeout_together_not_one_each(tmp_path):
    """Every server is sent its request before any answer is read; before, each answer was
    then waited for a whole timeout from when its wait began: two hung servers cost two."""
    servers = [cacheserver(str(tmp_path / f"s{i}"), "64MB", 0, "--unix-socket", "off").start() for i in range(3)]
    ids = [bytes([i]) * 32 for i in range(96)]
    hung = servers[1:]
    try:
        with RingClient([s.address for s in servers], timeout=TIMEOUT_S, down_backoff=60.0) as ring:
            ring.put([(i, i[:4] * 4) for i in ids])
            owner = ring.ring.route(ids)
            assert all(owner.get(s.address) for s in servers)
            for s in hung:
                sigstop(s.proc.pid)
            t = time.monotonic()
            got = ring.get(ids)
            waited = time.monotonic() - t
            served = set(owner[servers[0].address])
            assert [g is not None for g in got] == [k in served for k in range(len(ids))]
            assert TIMEOUT_S - 0.5 <= waited < TIMEOUT_S + 1.5, waited
            assert ring.get(ids)[min(served)] is not None  # the live one still served at once
    finally:
        for s in hung:
            os.kill(s.proc.pid, signal.SIGCONT)
        for s in servers:
            s.kill()
