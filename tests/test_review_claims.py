"""A claimant that will not insert what it claimed gives its claims up (ops.RELEASE,
ClaimTable.give_up), so the jobs told WAIT read those items at once instead of waiting
out the claims' ttl. Real cache servers and real CachedDataset jobs on loopback; the
servers run with a long --claim-ttl so that a wait for the ttl cannot pass for prompt."""
import contextlib
import os
import shutil
import socket
import sys
import threading
import time

import pytest
from procs import cacheserver, raised, wait_until, without_features

from cacheserver import ops, wire
from cacheserver.claims import ClaimTable
from cacheserver.client.server_client import ServerClient
from cacheserver.vocab import FETCH, PENDING, WAIT

pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import objstore  # noqa: E402
from test_dataset import make_dataset  # noqa: E402

from clients.dataset import CachedDataset  # noqa: E402
from clients.digest import Digest  # noqa: E402

TTL = 20.0  # seconds a claim holds its waiters when nobody releases it
PROMPT = 6.0  # a waiter that took longer waited for the ttl, not for the claimant
A, B = b"a" * 32, b"b" * 32


def test_a_job_gives_up_only_its_own_claims():
    t = ClaimTable(ttl=100)
    t.claim("j1", [A, B], [0, 0])
    assert t.give_up("j2", [A, B]) == bytes([0, 0])  # not j2's: kept
    assert t.claim("j2", [A, B], [0, 0]) == bytes([WAIT, WAIT])
    assert t.give_up("j1", [A]) == bytes([1])
    assert t.claim("j2", [A, B], [0, 0]) == bytes([FETCH, WAIT])
    assert t.give_up("j1", [A]) == bytes([0])  # j2's now: j1 cannot drop it
    assert t.pending("j3", [A], bytes([0])) == bytes([PENDING])


@pytest.fixture
def server(tmp_path):
    d = cacheserver(str(tmp_path / "s"), "64MB", 0, "--claim-ttl", str(TTL)).start()
    yield d
    d.kill()


@pytest.mark.parametrize("transport", [dict(), dict(prefer_unix=False), dict(use_dataplane=False)])
def test_release_over_each_transport_drops_the_callers_claims_only(server, transport):
    ids = [bytes([i]) * 32 for i in range(1, 4)]
    with ServerClient(server.address, **transport) as one, ServerClient(server.address, **transport) as two:
        assert one.claim(ids[:2], "j1") == bytes([FETCH, FETCH])
        assert two.release(ids, "j2") == bytes(3)  # j2 holds none of them
        assert two.claim(ids, "j2") == bytes([WAIT, WAIT, FETCH])
        assert one.release(ids, "j1") == bytes([1, 1, 0])  # ids[2] is j2's: kept
        assert two.claim(ids, "j2") == bytes([FETCH, FETCH, FETCH])
        assert one.claim(ids, "j1") == bytes([WAIT] * 3)
        assert one.stats().counters["claims_released"] == 2


def test_a_server_from_before_release_is_not_asked_and_keeps_the_claims(server):
    ids = [bytes([7]) * 32]
    for dataplane in (True, False):
        with without_features(ServerClient(server.address, use_dataplane=dataplane), ops.RELEASE.feature) as c:
            assert c.claim(ids, f"old{dataplane}") == bytes([FETCH])
            assert c.release(ids, f"old{dataplane}") == bytes([0])  # not sent: nothing to break
            assert c.claim(ids, "other") == bytes([WAIT])  # the claim lapses by its ttl, as before
            assert c.stats().counters["claims_released"] == 0
            ids = [bytes([8]) * 32]


def _damaged_copy(tmp_path, digest_path: str, item: int) -> str:
    """A digest of the same items whose store holds item `item` damaged: its reader's
    store read fails (ItemMismatch), a source error."""
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "ds", bad)
    with open(bad / f"img{item:05d}.bin", "r+b") as f:
        f.write(b"XXXX")
    d = Digest.load(digest_path)
    d.root = str(bad)
    out = str(tmp_path / "bad.digest")
    d.save(out)
    return out


def _claims_granted(address: str) -> int:
    with ServerClient(address) as c:
        return c.stats().counters["claims_granted"]


@contextlib.contextmanager
def jobs_a_and_b(server_address: str, digest_a: str, digest_b: str):
    """Jobs A and B on one server (no same-host coalescing: only the server's claims join them)."""
    a = CachedDataset(digest_a, cache=server_address, job="A", coalesce=False)
    b = CachedDataset(digest_b, cache=server_address, job="B", coalesce=False)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _read_timed(ds, idx):
    t = time.monotonic()
    got = ds.__getitems__(idx)
    return got, time.monotonic() - t


def test_a_claimant_whose_store_read_fails_lets_the_waiting_job_read_at_once(tmp_path, server):
    """Job A claims five misses and reads them from a slow store where one is damaged:
    its read raises. Job B, told WAIT meanwhile, must not wait out A's claims (20 s)."""
    digest, items = make_dataset(tmp_path / "ds", n=10)
    bad = _damaged_copy(tmp_path, digest, 2)
    with objstore.ObjectStore(tmp_path / "bad", latency="1s") as store:
        d = Digest.load(bad)
        d.root = store.url  # A reads the damaged copy slowly, so that B waits on A's claims
        d.save(bad)
        with jobs_a_and_b(server.address, bad, digest) as (a, b):
            idx, failed = [0, 1, 2, 3, 4], []
            t = threading.Thread(target=lambda: failed.append(raised(a.__getitems__, idx)))
            t.start()
            wait_until(lambda: _claims_granted(server.address) >= 5, "job A's claims", timeout=20)
            got, waited = _read_timed(b, idx)
            t.join(30)
            assert failed == ["ItemMismatch"]
            assert got == [items[i] for i in idx]
            assert waited < PROMPT, f"job B waited {waited:.1f} s for claims job A gave up (ttl {TTL} s)"
            with ServerClient(server.address) as c:
                assert c.stats().counters["claims_waited"] >= 1  # B did wait on A's claims


def test_a_put_refused_for_its_size_neither_fails_training_nor_holds_the_waiters(tmp_path):
    """Items over the server's --max-item-size: the put is refused whole. The claimant trains
    on (its items stay uncached) and releases its claims; the next job reads at once."""
    digest, items = make_dataset(tmp_path / "ds", n=10, lo=2000, hi=4000)
    srv = cacheserver(str(tmp_path / "s"), "64MB", 0, "--claim-ttl", str(TTL), "--max-item-size", "1KB").start()
    try:
        with jobs_a_and_b(srv.address, digest, digest) as (a, b):
            idx = [0, 1, 2, 3, 4]
            assert a.__getitems__(idx) == [items[i] for i in idx]  # not a ValueError
            assert _claims_granted(srv.address) == 5
            assert b.lookup_codes(idx) == [0] * 5  # not PENDING: the sampler may pick them
            got, waited = _read_timed(b, idx)
            assert got == [items[i] for i in idx] and waited < PROMPT, waited
    finally:
        srv.kill()


def test_a_put_refused_busy_releases_the_claims_on_that_server(tmp_path):
    """The claimant's put is refused by the data plane's admission (server busy: another
    request's body holds the in-flight budget), before it reaches the store."""
    digest, items = make_dataset(tmp_path / "ds", n=10)
    srv = cacheserver(str(tmp_path / "s"), "64MB", 0, "--claim-ttl", str(TTL),
                      "--max-inflight-bytes", "64KB").start()
    try:
        with jobs_a_and_b(srv.address, digest, digest) as (a, b):
            with ServerClient(srv.address) as c:
                host, port = c.info().data_address.rsplit(":", 1)
            with socket.create_connection((host, int(port))) as stall:
                stall.sendall(wire.pack_header(ops.LOOKUP.code, 0, 0, 60_000))  # a body that never comes
                time.sleep(0.3)  # admitted: 60 KB in flight, room for a claim, not for a put
                idx = [0, 1, 2, 3, 4]
                assert a.__getitems__(idx) == [items[i] for i in idx]
            with ServerClient(srv.address) as c:
                s = c.stats().counters
                assert s["busy_refused"] >= 1 and s["claims_granted"] == 5, s  # claims taken, the put refused
                # once the staller's bytes are let go (a look-up is admitted): none of A's claims is left
                codes = wait_until(lambda: _admitted(c, a.ids_for(idx)), "a look-up admitted")
                assert codes == bytes(5), codes
            got, waited = _read_timed(b, idx)
            assert got == [items[i] for i in idx] and waited < PROMPT, waited
    finally:
        srv.kill()


def _admitted(c: ServerClient, ids: list[bytes]) -> bytes | None:
    """A look-up with PENDING by a job that holds no claims, or None while the server is busy."""
    try:
        return c.lookup(ids, "probe", pending=True)
    except wire.RemoteError:
        return None


def test_a_waiter_reads_itself_promptly_when_the_store_refuses_the_claimants_put(tmp_path):
    """The claimant's put reaches the store and is refused there (no room: --capacity below
    one item): the core drops the claims, and the waiting job reads the items itself."""
    digest, items = make_dataset(tmp_path / "ds", n=10)
    srv = cacheserver(str(tmp_path / "s"), "1KB", 0, "--claim-ttl", str(TTL)).start()
    with objstore.ObjectStore(tmp_path / "ds", latency="1s") as store:
        slow = Digest.load(digest)
        slow.root = store.url
        slow_digest = str(tmp_path / "slow.digest")
        slow.save(slow_digest)
        try:
            with jobs_a_and_b(srv.address, slow_digest, digest) as (a, b):
                idx = [0, 1, 2]
                t = threading.Thread(target=a.__getitems__, args=(idx,))
                t.start()
                wait_until(lambda: _claims_granted(srv.address) >= 3, "job A's claims", timeout=20)
                got, waited = _read_timed(b, idx)
                t.join(30)
                assert got == [items[i] for i in idx] and waited < PROMPT, waited
                with ServerClient(srv.address) as c:
                    s = c.stats().counters
                    assert s["claims_waited"] >= 1 and s["rejected_full"] >= 3, s
        finally:
            srv.kill()
