"""CachedDataset end to end: real files, real cache servers, real loaders."""
import hashlib
import os
import random
import threading
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cacheserver.client.server_client import ServerClient  # noqa: E402
from clients import capability  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from clients.digest import DigestBuilder  # noqa: E402
from procs import cacheserver  # noqa: E402


def make_dataset(root, n=300, seed=0, lo=500, hi=6000):
    """Files of varied size, and their digest; returns (digest path, {index: bytes})."""
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    b = DigestBuilder(str(root), "files")
    items = {}
    for i in range(n):
        data = rng.randbytes(rng.randint(lo, hi))
        name = f"img{i:05d}.bin"
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
        b.add(hashlib.sha256(data).digest(), len(data), name)
        items[i] = data
    path = os.path.join(os.path.dirname(str(root)), f"{os.path.basename(str(root))}.digest")
    b.build().save(path)
    return path, items


@pytest.fixture
def data(tmp_path):
    return make_dataset(tmp_path / "ds")


@pytest.fixture
def ring3(tmp_path):
    servers = [cacheserver(str(tmp_path / f"s{i}"), "1GB").start() for i in range(3)]
    yield servers
    for s in servers:
        s.kill()


def epoch_items(loader):
    seen = []
    for batch in loader:
        seen.extend(batch)
    return seen


def check_exactly_once(loader, items):
    got = epoch_items(loader)
    assert Counter(got) == Counter(items.values())  # every item, each exactly once


def test_embedded_default_two_epochs(tmp_path, data):
    path, items = data
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"), capacity="64MB")
    try:
        loader = ds.loader(batch_size=32, seed=1)
        check_exactly_once(loader, items)
        check_exactly_once(loader, items)
        e1, e2 = loader.epoch_stats
        assert e1.misses == len(items) and e1.store_bytes == sum(map(len, items.values()))
        assert e2.hits == len(items) and e2.store_bytes == 0 and e2.poisoned == 0
        assert ds[5] == items[5]
    finally:
        ds.close()


@pytest.mark.parametrize("fraction", [0.0, 0.1, 1.0])
def test_exactly_once_with_partial_cache(tmp_path, data, ring3, fraction):
    path, items = data
    spec = ",".join(s.address for s in ring3)
    ds = CachedDataset(path, cache=spec, insert=False)
    warm = CachedDataset(path, cache=spec)
    try:
        n_cached = int(len(items) * fraction)
        warm.__getitems__(list(range(n_cached)))  # cache exactly this fraction
        loader = ds.loader(batch_size=25, seed=2)
        check_exactly_once(loader, items)
        st = loader.epoch_stats[0]
        assert st.hits == n_cached and st.misses == len(items) - n_cached
        if 0 < fraction < 1:
            # substitutable hits: the cached items come first, not scattered over the epoch
            assert loader.batch_sampler.stats.planned_hits == n_cached
            assert st.substituted > 0
    finally:
        ds.close()
        warm.close()


def test_server_stores_only_ciphertext_under_derived_ids(tmp_path, data):
    path, items = data
    d = cacheserver(str(tmp_path / "enc")).start()
    try:
        ds = CachedDataset(path, cache=d.address)
        ds.__getitems__(list(range(20)))
        with ServerClient(d.address) as c:
            for i in range(20):
                key = hashlib.sha256(items[i]).digest()
                assert c.lookup([key]) == b"\0"  # the server never sees K itself
                v = bytes(c.get([capability.item_id(key)])[0])
                assert items[i][:64] not in v and len(v) >= len(items[i])
        for root, _, files in os.walk(str(tmp_path / "enc")):
            for name in files:
                if not os.path.isfile(os.path.join(root, name)) or name.endswith(".sock"):
                    continue
                with open(os.path.join(root, name), "rb") as f:
                    blob = f.read()
                assert items[3][100:164] not in blob  # not on disk either
        ds.close()
    finally:
        d.kill()


def test_poisoned_entry_is_a_miss_repaired_and_counted(tmp_path, data):
    path, items = data
    d = cacheserver(str(tmp_path / "p")).start()
    try:
        ds = CachedDataset(path, cache=d.address)
        ds.__getitems__([0, 1, 2])
        key = hashlib.sha256(items[1]).digest()
        with ServerClient(d.address) as c:
            good = bytes(c.get([capability.item_id(key)])[0])
            bad = bytearray(good)
            bad[len(bad) // 2] ^= 0xFF
            c.put([(capability.item_id(key), bytes(bad))], replace=True)
        before = ds.counters.totals()
        assert ds.__getitems__([0, 1, 2]) == [items[0], items[1], items[2]]
        after = ds.counters.totals()
        assert after["poisoned"] - before["poisoned"] == 1
        assert after["hits"] - before["hits"] == 2
        with ServerClient(d.address) as c:  # overwritten with the good value
            assert bytes(c.get([capability.item_id(key)])[0]) == good
            # A holder of the key forges other bytes of the same size: the tag is
            # valid, only the SHA-256 check (done in shares over threads) finds it.
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            forged = bytes(len(items[1]))
            ident = capability.item_id(key)
            header = good[:9]
            value = header + AESGCM(capability.value_key(key)).encrypt(capability.NONCE, forged, ident + header)
            c.put([(ident, value)], replace=True)
        before = ds.counters.totals()
        assert ds.__getitems__([0, 1, 2]) == [items[0], items[1], items[2]]
        after = ds.counters.totals()
        assert after["poisoned"] - before["poisoned"] == 1 and after["hits"] - before["hits"] == 2
        with ServerClient(d.address) as c:
            assert bytes(c.get([capability.item_id(key)])[0]) == good
        ds.close()
    finally:
        d.kill()


def test_server_killed_mid_epoch_no_error_exactly_once(tmp_path, data, ring3):
    path, items = data
    spec = ",".join(s.address for s in ring3)
    ds = CachedDataset(path, cache=spec)
    try:
        loader = ds.loader(batch_size=20, seed=3)
        check_exactly_once(loader, items)  # epoch 1 fills the cache
        seen = []
        for b, batch in enumerate(loader):
            seen.extend(batch)
            if b == 3:
                ring3[1].proc.kill()  # SIGKILL a server mid-epoch
        assert Counter(seen) == Counter(items.values())
        st = loader.epoch_stats[-1]
        assert st.misses > 0 and st.hits > 0  # its items became misses, the rest still hit
    finally:
        ds.close()


def test_single_dead_cache_address_trains_from_the_store(tmp_path, data):
    """One address whose server is down: no peers to expand to, every read a miss, no error."""
    path, items = data
    dead = cacheserver(str(tmp_path / "dead"), "64MB").start()
    addr = dead.address
    dead.kill()
    ds = CachedDataset(path, cache=addr, down_backoff=60)
    try:
        assert ds[5] == items[5]
        loader = ds.loader(batch_size=25, seed=1)
        check_exactly_once(loader, items)
        st = loader.epoch_stats[-1]
        assert st.hits == 0 and st.misses == len(items)
    finally:
        ds.close()


@pytest.mark.parametrize("cache,why", [
    ("host:notaport", "expected HOST:PORT, got 'host:notaport'"),
    ("localhost", "expected HOST:PORT, got 'localhost'"),  # gRPC would dial port 443
    ("127.0.0.1:7000,host:x", "got 'host:x'"),
    ("127.0.0.1:70000", "port out of range in '127.0.0.1:70000'"),
    (" , ", "names no server: pass 'host:port"),
    ("", "cache=None for the embedded cache or cache=False for none"),
])
def test_malformed_cache_address_fails_at_construction(data, cache, why):
    with pytest.raises(ValueError, match=why):
        CachedDataset(data[0], cache=cache)


def test_unreachable_manager_without_cache_says_so(data):
    from procs import free_port

    with pytest.raises(ValueError, match="cannot be reached"):
        CachedDataset(data[0], manager=f"127.0.0.1:{free_port()}")
    with pytest.raises(ValueError, match="cache manager address"):
        CachedDataset(data[0], manager="nohost")


def test_store_changed_since_digest_is_refused(tmp_path, data):
    path, items = data
    with open(tmp_path / "ds" / "img00007.bin", "wb") as f:
        f.write(b"tampered")
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb2"), capacity="16MB")
    try:
        with pytest.raises(ValueError, match="item 7"):
            ds[7]
    finally:
        ds.close()


def test_two_jobs_share_misses(tmp_path, data):
    path, items = data
    ds_a = CachedDataset(path, cache_dir=str(tmp_path / "shared"), capacity="64MB", job="a")
    ds_b = CachedDataset(path, cache=ds_a.cache_spec, job="b")
    try:
        results = {}

        def run(name, ds, seed):
            loader = ds.loader(batch_size=10, seed=seed)
            results[name] = (epoch_items(loader), loader.epoch_stats[0])

        ts = [threading.Thread(target=run, args=("a", ds_a, 1)), threading.Thread(target=run, args=("b", ds_b, 2))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        total = sum(map(len, items.values()))
        for name in "ab":
            assert Counter(results[name][0]) == Counter(items.values())
        store = results["a"][1].store_bytes + results["b"][1].store_bytes
        assert store < 1.6 * total, (store, total)  # alone each would read the whole dataset
    finally:
        ds_b.close()
        ds_a.close()


def test_loader_with_spawned_workers(tmp_path, data):
    path, items = data
    ds = CachedDataset(path, cache_dir=str(tmp_path / "w"), capacity="64MB")
    try:
        loader = ds.loader(batch_size=16, num_workers=2, seed=4)
        check_exactly_once(loader, items)
        check_exactly_once(loader, items)
        assert loader.epoch_stats[1].hits == len(items)
    finally:
        ds.close()


@pytest.mark.parametrize("client_kw", [{}, {"use_dataplane": False}], ids=["dataplane", "grpc"])
def test_ring_client_fans_out_over_either_transport(ring3, client_kw):
    # Data-plane servers get their requests pipelined from one thread; servers on
    # gRPC only get a pool thread each. Either way every op answers per id, in order.
    import random

    from cacheserver.client.ring_client import RingClient

    rng = random.Random(5)
    ids = [rng.randbytes(32) for _ in range(60)]
    vals = [rng.randbytes(rng.randint(1, 5000)) for _ in range(60)]
    with RingClient([s.address for s in ring3], **client_kw) as ring:
        assert len(ring.ring.route(ids)) == 3  # every server has a share
        assert ring.put(list(zip(ids[:40], vals[:40])), job="j") == 40
        assert ring.lookup(ids, "j") == [True] * 40 + [False] * 20
        assert ring.lookup_pending(ids, "j") == [1] * 40 + [0] * 20
        got = ring.get(ids, "j")
        assert [bytes(v) for v in got[:40]] == vals[:40] and got[40:] == [None] * 20
        assert ring.claim(ids, "j") == [3] * 40 + [1] * 20  # PRESENT, then FETCH
        assert ring.claim(ids[40:], "k") == [2] * 20  # claimed by j: WAIT
        assert ring.errors == 0


def test_bad_index_and_failing_decode_name_the_item(tmp_path, data):
    path, items = data

    def decode(b: bytes) -> bytes:
        if b == items[3]:
            raise ValueError("cannot decode image")
        return b

    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"), capacity="16MB", decode=decode)
    try:
        assert ds[-1] == items[len(items) - 1] and ds[2] == items[2]
        # a batch of plain ints in range takes one check; others (negative, numpy) one by one
        assert ds.__getitems__([0, 2]) == [items[0], items[2]]
        assert ds.__getitems__([0, -1, np.int64(2)]) == [items[0], items[len(items) - 1], items[2]]
        assert ds.read(i for i in (1, -2)) == [items[1], items[len(items) - 2]]
        with pytest.raises(IndexError, match=f"item {len(items)} out of range for digest of {len(items)} items"):
            ds[len(items)]
        with pytest.raises(TypeError, match="item index must be an integer, got str 'a'"):
            ds["a"]
        with pytest.raises(ValueError, match="cannot decode image") as e:
            ds.__getitems__([1, 3])
        assert any("while decoding item 3 of" in n and "img00003.bin" in n for n in e.value.__notes__)
    finally:
        ds.close()


def test_cached_dataset_is_exported_by_the_package_lazily():
    """`from clients import CachedDataset` as documented; `import clients` alone loads no torch."""
    import subprocess
    import sys

    code = ("import sys, clients; assert 'torch' not in sys.modules, 'torch imported early'; "
            "from clients import CachedDataset; from clients.dataset import CachedDataset as C; "
            "assert CachedDataset is C and 'CachedDataset' in clients.__all__")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert r.returncode == 0, r.stderr


def test_datasets_sharing_the_embedded_cache_close_it_with_the_last(tmp_path):
    (p1, it1), (p2, _) = make_dataset(tmp_path / "train", n=20, seed=1), make_dataset(tmp_path / "val", n=20, seed=2)
    cache_dir = str(tmp_path / "cache")
    train, val = CachedDataset(p1, cache_dir=cache_dir), CachedDataset(p2, cache_dir=cache_dir)
    shared = train.embedded
    try:
        assert val.embedded is shared
        with pytest.raises(ValueError, match="with a capacity of 10737418240 bytes, and this dataset asks for 1000000"):
            CachedDataset(p1, cache_dir=cache_dir, capacity="1MB")
        assert sorted(x for b in train.loader(batch_size=5) for x in b) == sorted(it1.values())
        val.close()
        assert sorted(x for b in train.loader(batch_size=5) for x in b) == sorted(it1.values())
        assert train.counters.totals()["hits"] == 20  # the second epoch's, from the cache still open
    finally:
        train.close()
    from cacheserver import inproc
    assert inproc.core_for(shared.address) is None and cache_dir not in type(shared)._open  # closed by the last


def test_a_worker_refuses_a_digest_file_replaced_under_it(tmp_path):
    import shutil

    (pa, _), (pb, _) = make_dataset(tmp_path / "a", n=20, seed=1), make_dataset(tmp_path / "b", n=20, seed=2)
    path = str(tmp_path / "train.digest")
    shutil.copy(pa, path)
    ds = CachedDataset(os.path.relpath(path), cache=False)
    shutil.copy(pb, path)  # refreshed while the job runs
    with pytest.raises(ValueError, match=f"digest file {path} changed since this dataset was made"):
        list(ds.loader(batch_size=5, num_workers=1))


def test_a_cache_argument_of_the_wrong_type_is_named(tmp_path):
    """Before: cache=123 raised AttributeError ('int' object has no attribute 'split')."""
    digest, _ = make_dataset(tmp_path / "ds", n=2)
    with pytest.raises(TypeError, match="cache must be None .* got int 123"):
        CachedDataset(digest, cache=123)
    with pytest.raises(ValueError, match="cache=True names no cache"):
        CachedDataset(digest, cache=True)
