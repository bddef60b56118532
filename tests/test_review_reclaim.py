"""Jobs that wait on a claim whose claimant gave it up (ops.RELEASE) or let it lapse (a
server from before the release, a claimant that died) claim the item anew: exactly one
of them reads it from the store and the others keep waiting for its put, instead of all
of them reading it. Real cache servers, real CachedDataset jobs and a real (slow) HTTP
object store on loopback, which counts the reads of each item. Nothing here asserts on
timing: a waiter that started late finds the item claimed or inserted, which gives the
same count."""
import os
import shutil
import sys
import threading

import pytest
from procs import cacheserver, raised, wait_until

from cacheserver.client.server_client import ServerClient
from cacheserver.vocab import FETCH

pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import objstore  # noqa: E402
from test_dataset import make_dataset  # noqa: E402

from clients.dataset import CachedDataset  # noqa: E402
from clients.digest import Digest  # noqa: E402

TTL = 20.0  # longer than any wait here: only a release or the lapse test ends a claim
IDX = [0, 1, 2, 3, 4]


def _served(tmp_path, name: str, latency: str, damaged: int | None = None):
    """A slow object store over a copy of the dataset (with one item damaged: its reader's
    store read fails), and a digest that reads from it. Yields (store, digest path, items)."""
    digest, items = make_dataset(tmp_path / "ds", n=10)
    root = tmp_path / name
    shutil.copytree(tmp_path / "ds", root)
    if damaged is not None:
        with open(root / f"img{damaged:05d}.bin", "r+b") as f:
            f.write(b"XXXX")
    store = objstore.ObjectStore(root, latency=latency).start()  # closed by the caller's `with`
    d = Digest.load(digest)
    d.root = store.url
    out = str(tmp_path / f"{name}.digest")
    d.save(out)
    return store, out, items


def _reads_per_item(store) -> list[int]:
    by_path = store.stats()["by_path"]
    return [sum(e["requests"] for p, e in by_path.items() if p.endswith(f"img{i:05d}.bin")) for i in IDX]


def _counter(address: str, name: str) -> int:
    with ServerClient(address) as c:
        return c.stats().counters[name]


def _waiters(address: str, digest: str, n: int) -> list[CachedDataset]:
    return [CachedDataset(digest, cache=address, job=f"W{k}", coalesce=False) for k in range(n)]


def _read_in_threads(jobs: list[CachedDataset], idx: list[int]) -> tuple[list[threading.Thread], dict]:
    out: dict = {}

    def run(k: int, ds: CachedDataset) -> None:
        try:
            out[k] = ds.__getitems__(idx)
        except Exception as e:  # reported by the test, not lost in the thread
            out[k] = e

    ts = [threading.Thread(target=run, args=(k, ds), daemon=True) for k, ds in enumerate(jobs)]
    for t in ts:
        t.start()
    return ts, out


def _join(ts: list[threading.Thread], out: dict, expected: list[bytes]) -> None:
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts), "a waiting job never finished"
    for k in range(len(ts)):
        assert out[k] == expected, f"job W{k}: {out[k]!r:.200}"


@pytest.fixture
def server(tmp_path):
    d = cacheserver(str(tmp_path / "s"), "64MB", 0, "--claim-ttl", str(TTL)).start()
    yield d
    d.kill()


def test_after_a_release_one_waiter_reads_each_item_and_the_others_wait_for_its_put(tmp_path, server):
    """A client claims five misses; three jobs miss them too and are told WAIT; the
    claimant then releases its claims. Each item is read from the store once, not thrice."""
    store, digest, items = _served(tmp_path, "good", "300ms")
    with store:
        jobs = _waiters(server.address, digest, 3)
        try:
            ids = jobs[0].ids_for(IDX)
            with ServerClient(server.address) as claimant:
                assert claimant.claim(ids, "A") == bytes([FETCH] * 5)
                ts, out = _read_in_threads(jobs, IDX)
                wait_until(lambda: _counter(server.address, "claims_waited") >= 15, "the jobs told WAIT", 60)
                assert claimant.release(ids, "A") == bytes([1] * 5)
                _join(ts, out, [items[i] for i in IDX])
            assert _reads_per_item(store) == [1] * 5
        finally:
            for ds in jobs:
                ds.close()


def test_after_a_claimant_job_fails_its_store_read_the_waiting_jobs_read_each_item_once(tmp_path, server):
    """Job A claims the misses and its store read fails (a damaged item): it releases its
    claims. Three jobs that wait on them read each item from their store once in all."""
    bad_store, bad_digest, _ = _served(tmp_path, "bad", "1s", damaged=2)
    store, digest, items = _served(tmp_path, "good", "300ms")
    with bad_store, store:
        a = CachedDataset(bad_digest, cache=server.address, job="A", coalesce=False)
        jobs = _waiters(server.address, digest, 3)
        try:
            failed: list[str] = []
            t = threading.Thread(target=lambda: failed.append(raised(a.__getitems__, IDX)), daemon=True)
            t.start()
            wait_until(lambda: _counter(server.address, "claims_granted") >= 5, "job A's claims", 60)
            ts, out = _read_in_threads(jobs, IDX)
            t.join(120)
            _join(ts, out, [items[i] for i in IDX])
            assert failed == ["ItemMismatch"]
            assert _reads_per_item(store) == [1] * 5
        finally:
            for ds in [a, *jobs]:
                ds.close()


def test_after_a_claim_lapses_on_a_server_without_release_one_waiter_reads_each_item(tmp_path):
    """A claimant that never puts nor releases (it died, or its server is from before
    ops.RELEASE): its claims lapse after the ttl, then one waiter reads each item."""
    store, digest, items = _served(tmp_path, "good", "300ms")
    srv = cacheserver(str(tmp_path / "s"), "64MB", 0, "--claim-ttl", "5").start()
    with store:
        jobs = _waiters(srv.address, digest, 3)
        try:
            with ServerClient(srv.address) as ghost:
                assert ghost.claim(jobs[0].ids_for(IDX), "ghost") == bytes([FETCH] * 5)
            ts, out = _read_in_threads(jobs, IDX)
            _join(ts, out, [items[i] for i in IDX])
            assert _reads_per_item(store) == [1] * 5
        finally:
            for ds in jobs:
                ds.close()
            srv.kill()
