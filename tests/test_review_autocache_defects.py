"""Autocache defects found in review (second pass): real cache servers and managers on
loopback, real files."""
import math
import os
import sys
from contextlib import closing

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from autocache_steps import Slow, as_array, noise, shrink, total  # noqa: E402
from test_autocache_defects import index_of, plus1  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from preprocess import Pipeline, autocache, step  # noqa: E402
from procs import manager_with_server  # noqa: E402
from test_autocache import collect, make_items, wait_kept  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def test_a_fixed_transformed_loader_reports_its_pipeline_to_the_manager(tmp_path):
    """Before: only "auto" reported its pipeline (JobCoordinator.autocache_decision). A loader
    fixed at autocache="transformed" never did, so the manager knew no transformed set for
    it: status showed no pipeline, the set had no plan (GetPlan: unknown dataset, warned
    every epoch) and no allocation, and its benefit went uncounted."""
    from manager.manager_client import ManagerClient

    path = make_items(tmp_path / "ds", n=96, size=4096)
    p = Pipeline([as_array, Slow(0.01), shrink, autocache, step(noise, random=True), total])
    with manager_with_server(str(tmp_path)) as (m, _), \
            closing(CachedDataset(path, manager=m.address, job="job-t", transform=p)) as ds, \
            closing(ds.loader(8, num_workers=0, seed=3, autocache="transformed", epochs=3, cost_dir=False)) as loader:
        ac = loader.autocache
        assert ac.mode == "transformed" and ac.state == "fixed", ac.reason
        with ManagerClient(m.address, timeout=2) as mc:
            st = mc.status_dict()
        assert [x["decision"]["fingerprint"] for x in st.get("pipelines", [])] == [ac.key]
        d = st["pipelines"][0]["decision"]
        assert d["jobs"] == ["job-t"] and d["tag"] == ac.transformed().tag and d["fixed"] == ["job-t"]
        sets = {x["dataset"]: x for x in st["datasets"]}
        assert int(sets[d["tag"]]["allocated_bytes"]) > 0  # the set counts in allocation
        (_, s1), = collect(loader, 1)
        wait_kept(ds, loader, 96)
        (_, s2), = collect(loader, 1)  # put under the set's plan: every item found in epoch 2
        assert s2.transformed["hits"] == 96 and s2.store_bytes == 0
        assert "fixed by the loader's autocache='transformed'" in ac.reason


@pytest.mark.parametrize("workers", [0, 1])
def test_drop_last_epochs_shorter_than_a_batch_are_decided(tmp_path, server, monkeypatch, workers):
    """Before: with drop_last an epoch of fewer items than a batch yields no batch at all, so
    the loader's after_batch never ran and "auto" measured for ever (every epoch in its
    measuring mode, outputs put speculatively). Now the epoch's end decides, on what there
    is (here the profiled sample's step times), and the reason says why."""
    import manager.policy.autocache as policy

    monkeypatch.setattr(policy, "CLEAR", math.inf)  # measured, not decided on the estimate
    path = make_items(tmp_path / "ds", n=6, size=4096)
    p = Pipeline([as_array, Slow(0.005), shrink, autocache, step(noise, random=True), total])
    ds = CachedDataset(path, cache=server.address, transform=p)
    lo = ds.loader(8, num_workers=workers, seed=3, autocache="auto", epochs=3, cost_dir=False, drop_last=True)
    try:
        assert lo.autocache.state == "measuring"
        assert list(lo) == []  # 6 items, fewer than a batch, dropped
        ac = lo.autocache
        assert ac.state == "decided" and ac.mode in ("compute", "source", "transformed"), ac.reason
        assert not ac.shared.keep()  # no longer putting speculatively
        assert "no full batch" in ac.line(), ac.line()
        assert list(lo) == [] and ac.state == "decided"
    finally:
        lo.close()


def many_items_digest(root, n: int) -> tuple[str, list[bytes]]:
    """n 8-byte records in one TFRecord file (cheap to write and read, unlike n files):
    (the digest path, the items)."""
    import hashlib
    import struct

    from clients.digest import DigestBuilder
    from clients.tfrecord import encode_record

    os.makedirs(root, exist_ok=True)
    items = [struct.pack("<q", i) for i in range(n)]
    offsets, pos = [], 0
    with open(os.path.join(root, "all.tfrecord"), "wb") as f:
        for x in items:
            rec = encode_record(x)
            offsets.append(pos + 12)  # past the length and its CRC
            pos += len(rec)
            f.write(rec)
    b = DigestBuilder(str(root), "tfrecord")
    b.add_many("all.tfrecord", b"".join(hashlib.sha256(x).digest() for x in items), [8] * n, offsets)
    path = str(root) + ".digest"
    b.build().save(path)
    return path, items


def test_requests_past_the_servers_item_limit_are_split(tmp_path, server):
    """Before: the clients split a batch's gets by bytes only. A batch (or the sampler's
    look-ahead window) of more ids than a server's max_batch_items (100,000) went in one
    request, which the server refused whole: read() raised ValueError ("batch of 100050
    ids exceeds the limit"), and the sampler's look-ahead, whose failures are swallowed,
    saw no hits at all, every epoch."""
    from cacheserver.core import Limits
    from cacheserver.vocab import HIT

    n = Limits.max_batch_items + 50
    path, items = many_items_digest(tmp_path / "ds", n)
    ds = CachedDataset(path, cache=server.address)
    try:
        every = list(range(n))
        assert ds.lookup_codes(every) == [0] * n
        assert ds.read(every) == items  # misses: claimed, read from the store and put
        assert all(ds.lookup(every)) and ds.lookup_codes(every) == [HIT] * n
        assert ds.read(every) == items  # hits
        st = ds.counters.totals()
        assert st["hits"] == n and st["misses"] == n
    finally:
        ds.close()


def test_the_transformed_look_ahead_past_the_servers_item_limit_is_split(tmp_path, server):
    """The same in transformed mode: its look-ahead asks for the transformed ids of the window."""
    from cacheserver.core import Limits
    from cacheserver.vocab import HIT

    n = Limits.max_batch_items + 50
    path, _ = many_items_digest(tmp_path / "ds", n)
    ds = CachedDataset(path, cache=server.address, transform=Pipeline([index_of, plus1]))
    lo = ds.loader(8, num_workers=0, seed=1, autocache="transformed", cost_dir=False)
    try:
        t = lo.autocache.transformed()
        t.put([ds.digest.hashes[i].tobytes() for i in (0, n - 1)], [1, n])
        codes = lo.autocache.lookup_codes(range(n))
        assert codes[0] == codes[-1] == HIT and sum(codes) == 2 * HIT
    finally:
        lo.close()
        ds.close()


def test_a_transformed_loader_rekeyed_by_auto_order_reports_the_new_pipeline(tmp_path):
    """AutoOrder revises the order after the first epoch, and the kept items get a new key
    (Autocache.start_epoch). Before: the new key was never reported, so the manager knew
    no set under it: GetPlan was refused every epoch (the old set's plan kept, its chunks
    applied to the new set) and the new set had no allocation."""
    import random

    from manager.manager_client import ManagerClient
    from preprocess_steps import HalveBut, scale_values, with_values
    from test_preprocess_loader import indexed_items

    n, seed = 40, 5
    sampled = random.Random(f"{seed}/sample").sample(range(n), 16)  # as Scheduler._profile draws them
    pipe = Pipeline([index_of, with_values, scale_values, HalveBut(sampled)], auto_order=True)
    path = indexed_items(tmp_path / "ds", n)
    with manager_with_server(str(tmp_path)) as (m, _), \
            closing(CachedDataset(path, manager=m.address, job="job-r", transform=pipe)) as ds, \
            closing(ds.loader(8, num_workers=0, seed=seed, autocache="transformed", cost_dir=False)) as loader:
        first = loader.autocache.key
        assert sorted(i for b in loader for i, _ in b) == list(range(n))
        assert sorted(i for b in loader for i, _ in b) == list(range(n))  # epoch 2 starts rekeyed
        second = loader.autocache.key
        assert second and second != first and loader.autocache.mode == "transformed"
        with ManagerClient(m.address, timeout=2) as mc:
            st = mc.status_dict()
        reported = {p["decision"]["fingerprint"]: p["decision"]["jobs"] for p in st.get("pipelines", [])}
        assert reported.get(second) == ["job-r"], reported
