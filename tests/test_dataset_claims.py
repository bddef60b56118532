"""Co-operative misses across hosts: fetch claims on the cache servers
(cacheserver/claims.py) through CachedDataset. The jobs run with coalesce=False,
so nothing but the servers' claims can keep them from reading an item twice."""
import os
import sys
import threading
import time

import pytest

pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import objstore  # noqa: E402
from procs import cacheserver  # noqa: E402
from test_dataset import make_dataset  # noqa: E402

from clients.dataset import CachedDataset  # noqa: E402
from clients.digest import Digest  # noqa: E402


@pytest.fixture
def slow_store(tmp_path):
    path, items = make_dataset(tmp_path / "ds", n=40)
    with objstore.ObjectStore(tmp_path / "ds", latency="300ms") as store:
        d = Digest.load(path)
        d.root = store.url  # the same files, served slowly over HTTP
        url_digest = str(tmp_path / "http.digest")
        d.save(url_digest)
        yield store, url_digest, items


@pytest.fixture
def ring(tmp_path):
    servers = [cacheserver(str(tmp_path / f"s{i}"), "64MB", 0, "--claim-ttl", "2").start() for i in range(2)]
    yield ",".join(s.address for s in servers)
    for s in servers:
        s.kill()


def read_together(datasets, indices):
    """Every dataset reads the same misses at the same moment."""
    out, barrier = {}, threading.Barrier(len(datasets))

    def run(k, ds):
        barrier.wait()
        out[k] = ds.__getitems__(indices)

    ts = [threading.Thread(target=run, args=(k, ds)) for k, ds in enumerate(datasets)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return [out[k] for k in range(len(datasets))]


@pytest.mark.parametrize("claims,coalesce,reads", [
    (True, False, 20),   # server claims: one job reads each item, the other waits for its insert
    (False, True, 20),   # claims off: same-host flock coalescing does the same on one host
    (False, False, 40),  # the baseline this guards against: both read everything
])
def test_concurrent_misses_of_two_jobs_are_read_from_the_store_once(slow_store, ring, claims, coalesce, reads):
    store, digest, items = slow_store
    jobs = [CachedDataset(digest, cache=ring, job=f"j{k}", coalesce=coalesce, claims=claims) for k in range(2)]
    try:
        store.reset_stats()
        idx = list(range(20))
        for got in read_together(jobs, idx):
            assert got == [items[i] for i in idx]
        assert store.stats()["requests"] == reads
        if reads == 20:  # the other job's 20: waited for the reader's inserts, or (on a loaded
            # machine, where it started late) found them inserted already
            assert sum(ds.counters.totals()["coalesced"] + ds.counters.totals()["hits"] for ds in jobs) == 20
    finally:
        for ds in jobs:
            ds.close()


def test_a_claimant_that_never_inserts_delays_others_only_until_its_claim_expires(slow_store, ring):
    store, digest, items = slow_store
    ds = CachedDataset(digest, cache=ring, job="alive", coalesce=False)
    try:
        idx = [1, 2, 3]
        ghost = ds._proc().ring
        t = time.monotonic()
        assert ghost.claim(ds.ids_for(idx), "ghost") == [1, 1, 1]  # FETCH: the ghost "reads" them
        assert ds.lookup_codes(idx) == [2, 2, 2]  # the sampler sees them as PENDING
        assert ds.lookup(idx) == [False] * 3
        assert ds.__getitems__(idx) == [items[i] for i in idx]
        waited = time.monotonic() - t
        assert 2.0 <= waited < 15, waited  # not before the claim lapsed (--claim-ttl 2), then read here
        assert ds.lookup(idx) == [True] * 3  # and inserted
    finally:
        ds.close()


def _garbage_for(ds, i: int) -> bytes:
    """A value of the right length that fails the tag check: what a bad server could hand out."""
    from clients import capability

    return os.urandom(int(ds.digest.size(i)) + capability.OVERHEAD)


@pytest.mark.parametrize("claims", [True, False])
def test_a_poisoned_value_met_while_waiting_is_replaced_and_counted(slow_store, ring, claims):
    """Another reader holds the item (a server claim, or the same-host lock with claims
    off) and then leaves garbage in the cache: the waiter reads the store, overwrites
    the garbage and counts it as poisoned."""
    from clients import capability

    store, digest, items = slow_store
    ds = CachedDataset(digest, cache=ring, job="waiter", coalesce=not claims, claims=claims)
    try:
        i = 6
        ident, r = ds.ids_for([i])[0], ds._proc().ring
        if claims:
            assert r.claim([ident], "ghost") == [1]
        else:
            lock = ds._proc().coalescer.claim(ident)
            assert lock.first
        poison = threading.Timer(0.5, lambda: (r.put([(ident, _garbage_for(ds, i))], "ghost"),
                                               None if claims else lock.release()))
        poison.start()
        before = ds.counters.totals()
        assert ds.__getitems__([i]) == [items[i]]
        poison.join()
        after = ds.counters.totals()
        assert after["poisoned"] - before["poisoned"] == 1 and after["coalesced"] == before["coalesced"]
        key = ds.digest.sha256(i)
        assert capability.open_value(key, r.get([ident])[0], len(items[i])) == items[i]  # repaired
    finally:
        ds.close()
