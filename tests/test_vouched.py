"""In an embedded dir of sealed records (one made before plain records), values the
server's own process put or checked skip the hash check there (cacheserver/trust.py), and
only those: a write from anyone else, over the socket from another process or through a
plain put in this one, is checked again (issue 13). A plain dir's values are not hashed
at all: tests/test_plain_trust.py."""
import hashlib
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from cacheserver import inproc  # noqa: E402
from cacheserver.client.server_client import ServerClient  # noqa: E402
from cacheserver.trust import WriteTrust  # noqa: E402
from clients import capability  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from test_inproc_get import sealed_dir  # noqa: E402
from test_verify_blake3 import forge, make  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_counts(ds, indices):
    before = ds.counters.totals()
    got = ds.__getitems__(indices)
    after = ds.counters.totals()
    return got, {k: after[k] - before[k] for k in ("hits", "vouched", "poisoned", "store_bytes")}


def put_from_another_process(address: str, ident: bytes, value: bytes, plain: bool = False) -> None:
    """A put over the embedded server's socket from a separate process, as another local
    holder of the digest would make it."""
    code = ("import sys; from cacheserver.client.server_client import ServerClient\n"
            f"with ServerClient(sys.argv[1], plain={plain}) as c:\n"
            "    assert c.put([(bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3]))], replace=True)[0] == 1\n"
            "    assert c.transport in ('unix', 'local'), c.transport\n")
    subprocess.run([sys.executable, "-c", code, address, ident.hex(), value.hex()], check=True, timeout=60,
                   cwd=REPO)


@pytest.mark.parametrize("with_blake3", [True, False], ids=["blake3", "sha256"])
def test_own_inserts_are_vouched_foreign_writes_checked_again(tmp_path, with_blake3):
    path, items = make(tmp_path / "ds", with_blake3)
    n = len(items)
    ds = CachedDataset(path, cache_dir=sealed_dir(tmp_path / "emb"))
    try:
        got, c = read_counts(ds, list(range(n)))  # fill: read from the store, sealed, put vouched
        assert got == items and c["hits"] == 0 and c["vouched"] == 0
        got, c = read_counts(ds, list(range(n)))
        assert got == items and c == dict(hits=n, vouched=n, poisoned=0, store_bytes=0)
        k = hashlib.sha256(items[1]).digest()
        ident = capability.item_id(k)
        forged = forge(k, bytes(len(items[1])))  # other content (sealed: with a valid tag)
        put_from_another_process(ds.embedded.address, ident, forged)
        got, c = read_counts(ds, list(range(n)))
        assert got == items and c["poisoned"] == 1 and c["vouched"] == n - 1 and c["store_bytes"] == len(items[1])
        got, c = read_counts(ds, list(range(n)))  # the repair was our own put: vouched again
        assert got == items and c == dict(hits=n, vouched=n, poisoned=0, store_bytes=0)
        # a plain put in this very process is no voucher either
        with ServerClient(ds.embedded.address) as cl:
            cl.put([(ident, forged)], replace=True)
        got, c = read_counts(ds, [0, 1, 2])
        assert got == items[:3] and c["poisoned"] == 1 and c["vouched"] == 2
        # the genuine value written by someone else: checked once, then vouched for
        put_from_another_process(ds.embedded.address, ident, forge(k, items[1]))
        got, c = read_counts(ds, [1])
        assert got == items[1:2] and c == dict(hits=1, vouched=0, poisoned=0, store_bytes=0)
        got, c = read_counts(ds, [1])
        assert c == dict(hits=1, vouched=1, poisoned=0, store_bytes=0)
    finally:
        ds.close()


def test_a_new_process_checks_each_value_once(tmp_path):
    """Vouching is not kept on disk: a cache dir opened again is checked value by value once."""
    path, items = make(tmp_path / "ds", True)
    n = len(items)
    ds = CachedDataset(path, cache_dir=sealed_dir(tmp_path / "emb"))
    try:
        ds.__getitems__(list(range(n)))
    finally:
        ds.close()
    k = hashlib.sha256(items[2]).digest()
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"))
    try:
        # written while no vouching process held the dir: a forged value from before
        put_from_another_process(ds.embedded.address, capability.item_id(k), forge(k, bytes(len(items[2]))))
        got, c = read_counts(ds, list(range(n)))
        assert got == items and c == dict(hits=n - 1, vouched=0, poisoned=1, store_bytes=len(items[2]))
        got, c = read_counts(ds, list(range(n)))
        assert got == items and c == dict(hits=n, vouched=n, poisoned=0, store_bytes=0)
    finally:
        ds.close()


def test_workers_check_what_they_read(tmp_path):
    """DataLoader workers read through the socket: nothing vouches for their values."""
    path, items = make(tmp_path / "ds", True)
    ds = CachedDataset(path, cache_dir=sealed_dir(tmp_path / "emb"))
    try:
        ds.__getitems__(list(range(len(items))))
        # a forged value the in-process server is told to vouch for: the workers still hash it
        k = hashlib.sha256(items[1]).digest()
        inproc.put(ds.embedded.server.core, ds.job, [(capability.item_id(k), forge(k, bytes(len(items[1]))))],
                   replace=True, vouch=True)
        before = ds.counters.totals()
        # Forked workers inherit the server's gRPC threads' state: kept alive past the epoch
        # (persistent, the loader's default) they crashed (SIGSEGV) when ds.close() stopped the
        # server under them, once in CI; torch ends non-persistent ones with the epoch.
        loader = ds.loader(batch_size=8, num_workers=2, seed=0, multiprocessing_context="fork",
                           persistent_workers=False)
        assert sorted(x for b in loader for x in b) == sorted(items)
        after = ds.counters.totals()
        assert after["hits"] - before["hits"] == len(items) - 1 and after["vouched"] == before["vouched"]
        assert after["poisoned"] - before["poisoned"] == 1
    finally:
        ds.close()


def test_write_trust_orders_vouching_against_foreign_writes():
    t, a, b = WriteTrust(), b"a" * 32, b"b" * 32
    since = t.mark()
    assert t.vouch([a], since) and t.begin([a, b])[1] == [True, False]
    since, flags = t.begin([a])
    with t.foreign_write([b]):  # another id, but the epoch moves: a read across it vouches for nothing
        assert t.mark() is None and t.begin([a]) == (None, [False])
        assert not t.vouch([b], t.mark())
    assert flags == [True] and not t.still(since)
    assert not t.vouch([b], since)  # checked before that write: not vouched for
    since = t.mark()
    with t.foreign_write([a]):
        pass
    assert t.begin([a])[1] == [False] and not t.vouch([a], since)
    # a put vouched for while a foreign write of the same id is in flight is refused
    since = t.mark()
    with t.foreign_write([a]):
        assert not t.vouch([a], since)
    assert t.begin([a])[1] == [False]
    since = t.mark()
    assert t.vouch([a, b], since) and len(t) == 2
