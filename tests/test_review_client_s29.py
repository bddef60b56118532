"""Client failures that must not cost more than they have to (cacheserver/client/). Real
daemons on loopback.

A same-host follower whose RocksDB open failed for any reason but a refusal was given up for
the client's life, though a process out of fds (EMFILE) or a table file compacted away during
the open fails only for now. A fresh ring's first Info waited the whole request timeout
(30 s by default) for a server that does not answer, where a replacement client's waits the
2 s probe: a server hung at a job's start cost it the request timeout per server."""
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

from cacheserver.client import follower
from cacheserver.client.localread import LocalReader
from cacheserver.client.ring_client import PROBE_TIMEOUT_S, RingClient
from cacheserver.client.server_client import ServerClient
from procs import ROOT, cacheserver, sigstop

ITEMS = [(hashlib.sha256(bytes([i])).digest(), bytes([i]) * 1000) for i in range(16)]
IDS = [k for k, _ in ITEMS]
VALUES = [v for _, v in ITEMS]

# Run in a child process: RLIMIT_NOFILE is the whole process's. It opens a follower, has it
# dropped for a losing window (readpath.py), then reopens it with exactly two fds to spare:
# the scratch dir's lock (scratch.py) and rocksdict take them, and RocksDB's open of CURRENT fails.
EMFILE_CHILD = r"""
import gc, json, logging, os, resource, sys, time
from cacheserver.client.server_client import ServerClient
from cacheserver.client.readpath import RETRY_FIRST_S

address, ids = sys.argv[1], [bytes.fromhex(h) for h in sys.argv[2].split(",")]
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("cacheserver.client").addHandler(Keep())
logging.getLogger("cacheserver.client").setLevel(logging.INFO)

def until(cond, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for " + what)
        time.sleep(0.05)

def served(c):
    return all(v is not None for v in c.get(ids))

with ServerClient(address, timeout=5.0) as c:
    until(lambda: served(c) and c._local is not None, "the first follower")
    c.paths._hold = 0.2  # a short losing window
    c.paths.follower(1.0)
    c.paths.decide()
    assert served(c) and c._local is None, "the follower dropped"
    gc.collect()  # the dropped follower's fds closed
    until(c.paths.use_local, "the hold over")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(n) for n in os.listdir("/proc/self/fd"))
    fillers = []
    while True:  # fds 0..top all taken: the limit below then leaves exactly two free
        fd = os.open(os.devnull, os.O_RDONLY)
        if fd > top:
            os.close(fd)
            break
        fillers.append(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 3, hard))
    opening = c._fol.open_soon()  # what a get's current() starts, without the get's own fds
    done = opening is not None and opening.wait(10)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for fd in fillers:
        os.close(fd)
    failed_open = [m for m in said if "Too many open files" in m]
    t = time.monotonic()
    try:
        until(lambda: served(c) and c._local is not None, "the follower reopened", 4 * RETRY_FIRST_S + 5)
        reopened = time.monotonic() - t
    except SystemExit:
        reopened = None
    print(json.dumps({"done": done, "failed_open": failed_open, "reopened": reopened,
                      "transport": c.transport, "said": said}))
"""


def test_a_follower_open_that_ran_out_of_fds_is_tried_again(tmp_path):
    s = cacheserver(str(tmp_path / "d"), "256MB", 0).start()
    try:
        with ServerClient(s.address, local_read=False) as w:
            w.put(ITEMS)
        r = subprocess.run([sys.executable, "-c", EMFILE_CHILD, s.address, ",".join(i.hex() for i in IDS)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["done"], got
        # RocksDB's own open failed for want of an fd (not the scratch dir's, a refusal already)
        assert got["failed_open"] and "Exception: IO error" in got["failed_open"][0], got["said"]
        # before: "no follower of ..." and reads over the socket for the client's life
        assert got["reopened"] is not None, got["said"]
        assert got["transport"] == "local"
    finally:
        assert s.stop() == 0


# A follower open, the server's new table files unseen, then a get that catches up first
# (localread.MAX_STALE_S) with no fd to spare: RocksDB's catch-up fails (EMFILE).
CATCH_UP_CHILD = r"""
import json, os, resource, sys, time
from cacheserver.client.ring_client import RingClient
from cacheserver.client.server_client import ServerClient

address, db = sys.argv[1], sys.argv[2]
ids, new = ([bytes.fromhex(h) for h in a.split(",")] for a in sys.argv[3:5])

def until(cond, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for " + what)
        time.sleep(0.05)

def tables():
    return {n for n in os.listdir(db) if n.endswith(".sst")}

with RingClient([address], timeout=5.0) as ring:
    c = ring.clients[address]
    until(lambda: all(v is not None for v in ring.get(ids)) and c._local is not None, "the follower")
    first, before = c._local, tables()
    with ServerClient(address, local_read=False) as w:
        w.put([(k, k * 8) for k in new])
    until(lambda: tables() - before, "the new values flushed to a table file")
    time.sleep(1.1)  # the next read catches up first
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(n) for n in os.listdir("/proc/self/fd"))
    fillers = []
    while True:  # fds 0..top all taken, none to spare under the limit
        fd = os.open(os.devnull, os.O_RDONLY)
        if fd > top:
            os.close(fd)
            break
        fillers.append(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
    try:
        got = ring.get(ids + new)
        out = {"served": sum(v is not None for v in got), "failed": first.failed}
    except Exception as e:
        out = {"raised": f"{type(e).__name__}: {e}"}
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in fillers:
            os.close(fd)
    if "raised" not in out:  # a new follower, once its back-off is over, reads the new values
        until(lambda: all(v is not None for v in ring.get(ids + new)) and c._local not in (None, first)
              and c._local.read(new) == [k * 8 for k in new], "a new follower")
        out["transport"] = c.transport
    print(json.dumps(out))
"""


def test_a_follower_that_cannot_catch_up_leaves_the_get_to_the_server_and_is_replaced(tmp_path):
    """Before, RocksDB's error from the catch-up (a bare Exception) went up through the ring's
    get, which takes only transport errors for a failed server: the training loop got it."""
    s = cacheserver(str(tmp_path / "d"), "256MB", 0).start()
    new = [hashlib.sha256(b"new" + bytes([i])).digest() for i in range(16)]
    try:
        with ServerClient(s.address, local_read=False) as w:
            w.put(ITEMS)
        r = subprocess.run([sys.executable, "-c", CATCH_UP_CHILD, s.address, str(tmp_path / "d" / "db"),
                            ",".join(i.hex() for i in IDS), ",".join(i.hex() for i in new)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert "raised" not in got, got  # before: Exception: IO error: ... Too many open files
        assert got["served"] == len(IDS) + len(new), got  # from the server, over the socket
        assert "Too many open files" in got["failed"], got
        assert got["transport"] == "local"
    finally:
        assert s.stop() == 0


def _open_error(db_path: str) -> Exception:
    """What opening a follower (LocalReader, a RocksDB secondary) of `db_path` raises."""
    try:
        LocalReader(db_path).close()
    except Exception as e:
        return e
    raise AssertionError(f"a follower of {db_path} opened")


def test_which_open_failures_give_the_follower_up(tmp_path):
    """Real RocksDB errors, on a real server's store: a MANIFEST gone (rolled over while the
    open read it) is for now; a store this RocksDB cannot read, or the data dir gone, lasts."""
    s = cacheserver(str(tmp_path / "d"), "256MB", 0).start()
    try:
        with ServerClient(s.address, local_read=False) as w:
            w.put(ITEMS)
    finally:
        assert s.stop() == 0  # its values flushed to table files
    db = str(tmp_path / "d" / "db")
    with open(os.path.join(db, "CURRENT")) as f:
        current = f.read()
    # the primary rolled its MANIFEST over between the open's read of CURRENT and of the
    # MANIFEST it named (a table file compacted away meanwhile, RocksDB's secondary skips)
    with open(os.path.join(db, "CURRENT"), "w") as f:
        f.write("MANIFEST-999999\n")
    rolled = _open_error(db)
    assert str(rolled).startswith("Operation failed. Try again."), rolled  # RocksDB says so itself
    assert not follower.lasting(rolled, db)
    with open(os.path.join(db, "CURRENT"), "w") as f:
        f.write(current)
    LocalReader(db).close()  # whole again: it opens
    with open(os.path.join(db, "CURRENT"), "w") as f:
        f.write("MANIFEST-999999")  # no newline: not a CURRENT file this RocksDB reads
    unreadable = _open_error(db)
    assert follower.lasting(unreadable, db), unreadable
    shutil.rmtree(db)
    dir_gone = _open_error(db)
    assert follower.lasting(dir_gone, db), dir_gone
    assert follower.lasting(TypeError("a bug"), str(tmp_path))  # none of RocksDB's or the system's: for good


def test_a_server_hung_at_the_start_costs_a_fresh_ring_a_probe_not_the_request_timeout(tmp_path, caplog):
    timeout_s = 12.0  # the request timeout: far over the probe's
    servers = [cacheserver(str(tmp_path / f"s{i}"), "64MB", 0).start() for i in range(2)]
    addresses = [s.address for s in servers]
    hung = servers[1]
    try:
        with RingClient(addresses, timeout=timeout_s) as ring:
            ring.put(ITEMS)
            owner = ring.ring.route(IDS)
        live_share, hung_share = owner[servers[0].address], owner[hung.address]
        assert live_share and hung_share
        sigstop(hung.pid)
        caplog.set_level(logging.WARNING, "cacheserver.ring")
        with RingClient(addresses, timeout=timeout_s) as ring:
            t = time.monotonic()
            got = ring.get(IDS)  # its first call: each server's Info first
            waited = time.monotonic() - t
            # before: the hung server's Info waited the request timeout (12 s here, 30 s by default)
            assert waited < 2 * PROBE_TIMEOUT_S + 1.0, waited
            assert [bytes(got[i]) for i in live_share] == [VALUES[i] for i in live_share]
            assert [got[i] for i in hung_share] == [None] * len(hung_share)  # a miss, no error
            t = time.monotonic()
            assert ring.batch_limit() is not None  # the live server's; the hung one is down, not asked
            assert time.monotonic() - t < 1.0
        said = [r.getMessage() for r in caplog.records if r.name == "cacheserver.ring"]
        assert any(f"cache server {hung.address} unavailable" in m and "Deadline Exceeded" in m for m in said), said
    finally:
        os.kill(hung.pid, signal.SIGCONT)
        for s in servers:
            assert s.stop() == 0
