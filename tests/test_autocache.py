"""Autocache in the PyTorch loader: real cache servers, real files, real spawned workers."""
import hashlib
import math
import os
import sys
import time
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from autocache_steps import (Scale, Slow, as_array, as_object, blow_up, double_in_place, head,  # noqa: E402
                             jitter, noise, pick_x, scale_two, scale_two_v2, shrink, total)
from clients.capability import PoisonedValue  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from clients.derived import derived_id, derived_key, open_derived  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from preprocess import Pipeline, autocache, step  # noqa: E402
from preprocess.remote.spec import default_key  # noqa: E402

pytestmark = pytest.mark.timeout(240)
N, B = 64, 8


def make_items(root, n=N, size=256, salt=b""):
    """n files of `size` random bytes; returns the digest path."""
    blobs = (hashlib.sha256(salt + i.to_bytes(4, "little")).digest() * (size // 32) for i in range(n))
    return write_files_digest(root, blobs)


def pipe(*middle, last=total):
    return Pipeline([as_array, *middle, autocache, step(noise, random=True), last])


def wait_kept(ds, loader, n=N, limit=20.0):
    """Puts are asynchronous: wait (bounded) until every transformed item is stored."""
    t = loader.autocache.transformed()
    Ks = [ds.digest.hashes[i].tobytes() for i in range(n)]
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not all(t.lookup(Ks)):
        time.sleep(0.05)
    assert all(t.lookup(Ks)), "transformed items were not all stored"


def one_epoch(path, server, transform, wait=True):
    """A job that runs one epoch in transformed mode (and waits for its puts):
    (its dataset, its loader, closed)."""
    ds = CachedDataset(path, cache=server.address, transform=transform)
    loader = ds.loader(B, num_workers=0, seed=1, autocache="transformed", cost_dir=False)
    try:
        list(loader)
        if wait:
            wait_kept(ds, loader)
    finally:
        loader.close()
    return ds, loader


def collect(loader, epochs):
    """Per epoch, the multiset of outputs (floats, rounded) and the epoch stats."""
    out = []
    for _ in range(epochs):
        items = [x for batch in loader for x in batch]
        out.append((Counter(round(float(x), 3) for x in items), loader.epoch_stats[-1]))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_transformed_items_hit_in_epoch_two_and_match_compute(tmp_path, server, workers):
    path = make_items(tmp_path / "ds")
    p = pipe(Scale(2.0))
    ds = CachedDataset(path, cache=server.address, transform=p)
    loader = ds.loader(B, num_workers=workers, seed=5, autocache="transformed", cost_dir=False)
    ref = CachedDataset(path, cache=False, transform=p).loader(B, num_workers=workers, seed=5,
                                                                autocache="compute", cost_dir=False)
    try:
        (e1, s1), = collect(loader, 1)
        assert (s1.transformed["misses"], s1.transformed["hits"]) == (N, 0)
        assert s1.store_bytes == N * 256 and s1.inserted == 0  # sources are not kept in this mode
        assert s1.transformed["puts"] == N if workers == 0 else s1.transformed["puts"] <= N  # workers: async
        wait_kept(ds, loader)
        (e2, s2), = collect(loader, 1)
        assert (s2.transformed["hits"], s2.transformed["misses"]) == (N, 0)
        assert s2.store_bytes == 0 and s2.cache_bytes == 0 and s2.misses == 0  # no source read at all
        prefix = [s.items for j, s in s2.preprocess.steps.items() if j < 2]
        assert prefix == [0, 0] and s2.preprocess.steps[3].items == N  # the prefix never ran; noise did
        assert "autocache transformed (fixed)" in s2.line() and f"{N} hits" in s2.line()
        (r1, _), (r2, _) = collect(ref, 2)
        assert (e1, e2) == (r1, r2)  # the same outputs as computing everything (noise seeded per epoch)
        assert e1 != e2  # the random step after the point still draws anew each epoch
    finally:
        loader.close()
        ref.close()


def test_compute_reads_the_store_and_puts_nothing(tmp_path, server):
    path = make_items(tmp_path / "ds")
    ds = CachedDataset(path, cache=server.address, transform=pipe(Scale(2.0)))
    loader = ds.loader(B, num_workers=1, seed=1, autocache="compute", cost_dir=False)
    try:
        for _ in range(2):
            assert sum(len(b) for b in loader) == N
            st = loader.epoch_stats[-1]
            assert (st.hits, st.inserted, st.store_bytes) == (0, 0, N * 256)
            assert st.transformed == {"hits": 0, "misses": 0, "puts": 0, "poisoned": 0, "uncacheable": 0}
        assert not any(ds.lookup(range(N)))  # nothing in the cache, not even the profiled sample
    finally:
        loader.close()


def test_changed_transform_misses(tmp_path, server):
    path = make_items(tmp_path / "ds")
    one_epoch(path, server, pipe(Scale(2.0)))
    # a parameter; a function for the class; the same function with other code: each misses
    for changed in (Scale(3.0), scale_two, scale_two_v2):
        _, lo = one_epoch(path, server, pipe(changed), wait=False)
        assert lo.epoch_stats[-1].transformed["hits"] == 0
    _, lo = one_epoch(path, server, pipe(Scale(2.0)), wait=False)
    assert lo.epoch_stats[-1].transformed["hits"] == N  # the same transform: every item found


def test_random_steps_are_never_cached(tmp_path, server):
    path = make_items(tmp_path / "ds")
    first_random = Pipeline([step(noise, random=True), total])
    ds = CachedDataset(path, cache=server.address, decode=as_array, transform=first_random)
    with pytest.raises(ValueError, match="is random and runs first"):
        ds.loader(B, num_workers=0, autocache="transformed", cost_dir=False)
    marked = Pipeline([as_array, step(noise, random=True), autocache, total])
    with pytest.raises(ValueError, match="comes after random step 1"):
        CachedDataset(path, cache=server.address, transform=marked).loader(
            B, num_workers=0, autocache="transformed", cost_dir=False)
    # a step that draws random numbers without saying so is caught, and the point moves before it
    caught = Pipeline([as_array, jitter, total])
    ds = CachedDataset(path, cache=server.address, transform=caught)
    with pytest.warns(UserWarning, match="not declared random"):
        loader = ds.loader(B, num_workers=1, seed=2, autocache="transformed", cost_dir=False)
    try:
        assert loader.autocache.cut == 1
        epochs = collect(loader, 1)
        wait_kept(ds, loader)
        epochs += collect(loader, 1)
        (e1, _), (e2, s2) = epochs
        assert s2.transformed["hits"] == N and s2.preprocess.steps[1].items == N  # jitter ran again
        assert e1 != e2
    finally:
        loader.close()


def test_two_jobs_share_transformed_items(tmp_path, server):
    path = make_items(tmp_path / "ds")
    p = pipe(Scale(2.0), Slow(0.002))
    a = CachedDataset(path, cache=server.address, job="job-a", transform=p)
    la = a.loader(B, num_workers=2, seed=1, autocache="transformed", cost_dir=False)
    (ea, _), = collect(la, 1)
    wait_kept(a, la)
    la.close()
    b = CachedDataset(path, cache=server.address, job="job-b", transform=pipe(Scale(2.0), Slow(0.002)))
    lb = b.loader(B, num_workers=2, seed=1, autocache="auto", cost_dir=False)
    try:
        assert (lb.autocache.mode, lb.autocache.state) == ("transformed", "found")
        (eb, sb), = collect(lb, 1)
        assert sb.transformed["hits"] == N and sb.store_bytes == 0
        assert all(s.items == 0 for j, s in sb.preprocess.steps.items() if j < 3)  # no prefix computed
        assert ea == eb
    finally:
        lb.close()


def test_a_holder_of_another_dataset_cannot_read_them(tmp_path, server):
    path = make_items(tmp_path / "ds")
    ds, loader = one_epoch(path, server, pipe(Scale(2.0)))
    key = loader.autocache.key
    theirs = [derived_id(derived_key(ds.digest.hashes[i].tobytes(), key)) for i in range(N)]
    values = ds._proc().ring.get(theirs)
    assert all(v is not None for v in values)
    other_path = make_items(tmp_path / "other", salt=b"other")  # other content, the same pipeline
    other, lo = one_epoch(other_path, server, pipe(Scale(2.0)), wait=False)
    assert lo.epoch_stats[-1].transformed["hits"] == 0
    for i, v in enumerate(values[:8]):  # what its own keys derive cannot open them
        with pytest.raises(PoisonedValue):
            open_derived(derived_key(other.digest.hashes[i].tobytes(), key), v)


def test_kept_item_is_the_one_at_the_point_even_if_later_steps_change_it(tmp_path, server):
    path = make_items(tmp_path / "ds")
    p = Pipeline([as_array, Scale(2.0), autocache, double_in_place, total])
    ds = CachedDataset(path, cache=server.address, transform=p)
    loader = ds.loader(B, num_workers=2, seed=1, autocache="transformed", cost_dir=False)
    ref = CachedDataset(path, cache=False, transform=p).loader(B, num_workers=0, seed=1, cost_dir=False)
    try:
        first = collect(loader, 1)
        wait_kept(ds, loader)
        second = collect(loader, 1)
        expected = collect(ref, 1)[0][0]
        assert first[0][0] == expected and second[0][0] == expected
        assert second[0][1].transformed["hits"] == N
    finally:
        loader.close()


def slow_prefix(tmp_path, server, epochs: int):
    """(items path, pipeline, dataset, auto loader) of a 10 ms step before the caching point."""
    path = make_items(tmp_path / "ds", n=96, size=4096)
    p = Pipeline([as_array, Slow(0.01), shrink, autocache, step(noise, random=True), total])
    ds = CachedDataset(path, cache=server.address, transform=p)
    return path, p, ds, ds.loader(B, num_workers=1, seed=3, autocache="auto", epochs=epochs, cost_dir=False)


def test_auto_decides_transformed_for_a_slow_prefix_and_reports(tmp_path, server, monkeypatch):
    import manager.policy.autocache as policy

    monkeypatch.setattr(policy, "CLEAR", math.inf)  # never clear enough: the first epoch is measured
    path, p, ds, loader = slow_prefix(tmp_path, server, 5)
    ref = CachedDataset(path, cache=False, transform=p).loader(B, num_workers=0, seed=3, cost_dir=False)
    try:
        assert loader.autocache.state == "measuring" and "measuring" in loader.autocache.reason
        # probed before the workers started: the sample's 10 ms step makes transformed clearly the
        # cheapest, so the measured part runs as transformed
        assert loader.autocache.estimate.mode == "transformed" and loader.autocache.mode == "transformed"
        assert "running as transformed; estimated transformed" in loader.autocache.reason
        (e1, s1), = collect(loader, 1)
        ac = loader.autocache
        assert (ac.mode, ac.state) == ("transformed", "decided"), ac.reason
        c = ac.costs
        assert c.cacheable and c.items == 96 and c.epochs_left == 4 and c.workers == 1
        assert c.prefix_s >= 0.008 and c.marker_bytes < c.source_bytes * 4  # float32 of 16 of 4096 bytes
        assert c.store_read_s > 0 and c.cache_read_source_s > 0 and c.cache_read_marker_s > 0
        assert set(ac.decision.costs) >= {"compute", "source", "transformed"} and ac.decision.reason
        assert "autocache transformed (decided)" in s1.line()
        # the measured part put its outputs as made: nothing is made twice (the 16 sample items'
        # outputs were put by the probe: hits)
        t1 = s1.transformed
        assert t1["hits"] <= 16 and t1["hits"] + t1["misses"] == 96 and t1["puts"] > 0
        wait_kept(ds, loader, 96)
        n, put_s = ac.feed.put_times.totals()  # the workers' put threads timed their puts
        assert n > 0 and put_s > 0
        (e2, s2), (e3, s3) = collect(loader, 2)
        for st in (s2, s3):
            assert st.transformed["hits"] == 96 and st.store_bytes == 0 and st.cache_bytes == 0
        assert [e1, e2, e3] == [e for e, _ in collect(ref, 3)]
    finally:
        loader.close()


def test_auto_decides_before_the_first_epoch_where_the_estimate_is_clear(tmp_path, server):
    # the sample's 10 ms step makes transformed far the cheapest: decided as the loader is made,
    # so the whole first epoch runs as transformed and puts every output once, under the plan
    _, _, ds, loader = slow_prefix(tmp_path, server, 5)
    try:
        ac = loader.autocache
        assert (ac.mode, ac.state) == ("transformed", "estimated"), ac.reason
        assert ac.decision.mode == ac.estimate.mode == "transformed" and ac.reason == ac.decision.reason
        assert ac.costs.epoch_done == 0 and ac.costs.prefix_s >= 0.008 and ac.costs.epochs_left == 4
        assert not ac.shared.keep()  # nothing speculative: the set is decided
        (_, s1), = collect(loader, 1)
        assert ac.state == "estimated" and "autocache transformed (estimated)" in s1.line()
        t1 = s1.transformed  # the probe's 16 sample outputs hit; every other item is made and put once
        assert t1["hits"] <= 16 and t1["hits"] + t1["misses"] == 96 and 0 < t1["puts"] <= t1["misses"]
        wait_kept(ds, loader, 96)
        (_, s2), = collect(loader, 1)
        assert s2.transformed["hits"] == 96 and s2.store_bytes == 0 and s2.cache_bytes == 0
    finally:
        loader.close()


def test_a_transformed_measured_part_caches_its_sources_too(tmp_path, server, monkeypatch):
    # measured as transformed, then source chosen: the measured part's sources were inserted
    # as they were read, so the second epoch reads none of them from the store
    import clients.autocache as acmod
    import manager.policy.autocache as policy
    from manager.policy.autocache import Decision

    monkeypatch.setattr(policy, "CLEAR", math.inf)
    monkeypatch.setattr(acmod, "choose", lambda costs, *a: Decision("source", {}, "source: forced by the test"))
    _, _, ds, loader = slow_prefix(tmp_path, server, 3)
    try:
        ac = loader.autocache
        assert (ac.mode, ac.state) == ("transformed", "measuring"), ac.reason
        collect(loader, 1)
        assert (ac.mode, ac.state) == ("source", "decided"), ac.reason
        # inserts are asynchronous: wait (bounded) until every source item is cached
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(ds.lookup(range(96))):
            time.sleep(0.05)
        assert all(ds.lookup(range(96))), [i for i, p in enumerate(ds.lookup(range(96))) if not p]
        (_, s2), = collect(loader, 1)
        assert s2.store_bytes == 0 and s2.hits == 96, s2.line()
    finally:
        loader.close()


def test_auto_keeps_nothing_while_measuring_where_transformed_is_clearly_dearer(tmp_path, server, monkeypatch):
    import manager.policy.autocache as policy

    monkeypatch.setattr(policy, "CLEAR", math.inf)  # the first epoch is measured (not decided at once)
    # 2 MiB outputs of 4 KiB items at almost no CPU, cut down after the caching point: putting
    # and reading them back costs far more than remaking them
    path = make_items(tmp_path / "ds", n=96, size=4096)
    ds = CachedDataset(path, cache=server.address, transform=Pipeline([as_array, blow_up, autocache, head]))
    loader = ds.loader(B, num_workers=1, seed=3, autocache="auto", epochs=3, cost_dir=False)
    try:
        ac = loader.autocache
        assert ac.state == "measuring" and ac.estimate.mode != "transformed" and not ac.keep, ac.estimate.reason
        assert ac.mode == "source" and "outputs kept" not in ac.reason
        assert f"running as source; estimated {ac.estimate.mode}" in ac.reason
        assert ac.probes["marker_bytes"] > 1 << 21 and ac.probes["cache_read_marker_s"] > 0
        (_, s1), = collect(loader, 1)
        assert ac.state == "decided"
        if ac.mode != "transformed":  # nothing of epoch 1 was put (the sample's probe items aside)
            assert s1.transformed["puts"] == 0, ac.reason
    finally:
        loader.close()


def test_auto_with_nothing_to_keep_chooses_between_compute_and_source(tmp_path, server):
    path = make_items(tmp_path / "ds")
    p = Pipeline([as_array, as_object, autocache, pick_x, total])
    ds = CachedDataset(path, cache=server.address, transform=p)
    loader = ds.loader(B, num_workers=0, seed=1, autocache="auto", cost_dir=False)
    try:
        assert "cannot be stored" in loader.autocache.why_not
        collect(loader, 2)
        ac = loader.autocache
        assert ac.state in ("decided", "estimated") and ac.mode in ("compute", "source") and not ac.costs.cacheable
        assert "cannot be stored" in ac.costs.why_not and "transformed" not in ac.decision.costs
        assert sum(st.transformed["puts"] for st in loader.epoch_stats) == 0
    finally:
        loader.close()


def test_loader_refuses_bad_autocache_arguments(tmp_path, server):
    path = make_items(tmp_path / "ds", n=8)
    with pytest.raises(ValueError, match="autocache must be one of"):
        CachedDataset(path, cache=server.address, transform=pipe()).loader(4, autocache="sometimes")
    with pytest.raises(ValueError, match="need a transform"):
        CachedDataset(path, cache=server.address).loader(4, autocache="transformed")
    with pytest.raises(ValueError, match="cache=False"):
        CachedDataset(path, cache=False, transform=pipe()).loader(4, autocache="auto", cost_dir=False)
    with pytest.raises(ValueError, match="cannot be stored"):
        CachedDataset(path, cache=server.address, transform=Pipeline([as_array, as_object])).loader(
            4, autocache="transformed", cost_dir=False)


def test_targets_pass_through_hits(tmp_path, server):
    from preprocess_steps import index_mod3

    path = make_items(tmp_path / "ds")
    p = pipe(Scale(2.0))
    ds = CachedDataset(path, cache=server.address, target=index_mod3, transform=p)
    loader = ds.loader(B, num_workers=1, seed=1, autocache="transformed", cost_dir=False)
    ref = CachedDataset(path, cache=False, target=index_mod3, transform=p).loader(B, seed=1, cost_dir=False)
    try:
        expected = [Counter((round(x, 3), t) for b in ref for x, t in b) for _ in range(2)]
        got = [Counter((round(x, 3), t) for b in loader for x, t in b)]
        wait_kept(ds, loader)
        got.append(Counter((round(x, 3), t) for b in loader for x, t in b))
        assert loader.epoch_stats[-1].transformed["hits"] == N and got == expected
    finally:
        loader.close()


def test_a_poisoned_transformed_item_is_recomputed_and_replaced(tmp_path, server):
    from clients.derived import seal_derived
    from preprocess.codec import encode

    path = make_items(tmp_path / "ds")
    ds = CachedDataset(path, cache=server.address, transform=pipe(Scale(2.0)))
    loader = ds.loader(B, num_workers=0, seed=1, autocache="transformed", cost_dir=False)
    try:
        list(loader)
        t = loader.autocache.transformed()
        K = ds.digest.hashes[5].tobytes()
        forged = seal_derived(derived_key(K, "another transform"), encode(np.zeros(256, np.float32)))
        ds._proc().ring.put([(t.ids([K])[0], forged.value)], "evil", "x", 0, replace=True)
        list(loader)
        st = loader.epoch_stats[-1].transformed
        assert (st["poisoned"], st["misses"], st["hits"], st["puts"]) == (1, 1, N - 1, 1)
        list(loader)
        assert loader.epoch_stats[-1].transformed["hits"] == N  # replaced by a good one
    finally:
        loader.close()


def test_shared_mode_reads_mode_and_keep_of_one_publication():
    from clients.autocache import SharedMode

    m = SharedMode()
    m.publish("transformed", 2, "k" * 64, None, direct=True, keep=True)
    assert m.snapshot() == ("transformed", 2, "k" * 64, None, True) and m.read() == m.snapshot()[:4]
    m.publish("source", 2, "k" * 64, 7, keep=False)  # the decision: keep is cleared with the mode
    assert m.snapshot() == ("source", 2, "k" * 64, 7, False) and not m.keep()


def test_caching_point_marker():
    p = Pipeline([as_array, Scale(2.0), autocache, step(noise, random=True), total])
    assert (len(p), p.cache_at, p.caching_point(), p.cacheable_prefix()) == (4, 2, 2, 2)
    assert "Scale -> [autocache] -> noise*" in p.describe()
    assert Pipeline([as_array, Scale(2.0), total], cache_at=1).caching_point() == 1
    assert Pipeline([as_array, Scale(2.0), step(noise, random=True)]).caching_point() == 2  # no marker
    assert p.barriers() == {1}  # AutoOrder moves nothing across the point
    with pytest.raises(ValueError, match="moves a step across the caching point"):
        p.set_order([0, 3, 2, 1])
    p.set_order([1, 0, 2, 3])  # within the prefix: allowed
    for bad in ([autocache, as_array], [as_array, autocache, total, autocache]):
        with pytest.raises(ValueError, match="caching point"):
            Pipeline(bad)
    with pytest.raises(ValueError, match="caching point"):
        Pipeline([as_array], cache_at=2)
    with pytest.raises(ValueError, match="comes after random step 1"):
        Pipeline([as_array, step(noise, random=True), total], cache_at=3).caching_point()


def test_a_random_step_seeded_alike_every_epoch_is_kept_under_the_seed(tmp_path, server):
    from autocache_steps import urandom_noise

    path = make_items(tmp_path / "ds")
    p = Pipeline([as_array, step(noise, random=True, per_epoch=False), total])
    assert p.cacheable_prefix() == 3 and p.seeded(3) and not p.seeded(1)
    ds = CachedDataset(path, cache=server.address, transform=p)
    loader = ds.loader(B, num_workers=1, seed=4, autocache="transformed", cost_dir=False)
    ref = CachedDataset(path, cache=False, transform=p).loader(B, seed=4, cost_dir=False)
    try:
        assert loader.autocache.seed == 4
        (e1, _), = collect(loader, 1)
        wait_kept(ds, loader)
        (e2, s2), = collect(loader, 1)
        assert s2.transformed["hits"] == N and e1 == e2 == collect(ref, 1)[0][0]  # the same draws each epoch
        key4 = loader.autocache.key
        assert default_key(ds, p, 3, 4) == (key4, 4)  # remote workers find the loader's items
    finally:
        loader.close()
    _, lo = one_epoch(path, server, p, wait=False)  # another seed, other draws: another key
    assert lo.epoch_stats[-1].transformed["hits"] == 0
    # and another set for the manager (sized and decided apart), not one with twice the items
    assert lo.autocache.seed != 4 and lo.autocache.key not in ("", key4)
    # declared per_epoch=False, but it draws from the OS: caught, and the point moves before it
    q = Pipeline([as_array, step(urandom_noise, random=True, per_epoch=False), total])
    with pytest.warns(UserWarning, match="per_epoch=False but gave different outputs"):
        lo = CachedDataset(path, cache=server.address, transform=q).loader(B, autocache="transformed",
                                                                          cost_dir=False)
    assert lo.autocache.cut == 1 and lo.autocache.seed is None
    lo.close()


def test_auto_with_a_manager_takes_its_decision(tmp_path):
    from manager.manager_client import ManagerClient
    from procs import cachemanager, cacheserver, wait_ring

    m = cachemanager(str(tmp_path / "mgr")).start()
    srv = cacheserver(str(tmp_path / "s0"), "1GB", 0, "--manager", m.address).start()
    path = make_items(tmp_path / "ds", n=96, size=4096)
    p = Pipeline([as_array, Slow(0.01), shrink, autocache, step(noise, random=True), total])
    ds = loader = None
    try:
        wait_ring(m.address, 1)
        ds = CachedDataset(path, manager=m.address, job="job-m", transform=p)
        loader = ds.loader(B, num_workers=1, seed=3, autocache="auto", epochs=5, cost_dir=False)
        ac = loader.autocache
        assert ac.state == "estimated"  # the sample's 10 ms step: clearly transformed, decided at once
        (_, s1), = collect(loader, 1)
        with ManagerClient(m.address, timeout=2) as mc:
            st = mc.status_dict()
        d = st["pipelines"][0]["decision"]
        assert d["fingerprint"] == ac.key and d["mode"] == ac.mode == "transformed"
        assert d["reason"] == ac.reason and d["jobs"] == ["job-m"] and d["tag"] == ac.transformed().tag
        # put under the set's plan as the manager allocated it from the start: every item is
        # found in epoch 2
        wait_kept(ds, loader, 96)
        (_, s2), = collect(loader, 1)
        assert s2.transformed["hits"] == 96 and s2.store_bytes == 0
    finally:
        if loader is not None:
            loader.close()
        if ds is not None:
            ds.close()
        srv.kill()
        m.kill()


def test_hits_with_no_step_after_the_point_need_no_worker(tmp_path, server):
    from preprocess_steps import index_mod3

    path = make_items(tmp_path / "ds")
    p = Pipeline([as_array, Scale(2.0), total])
    ds = CachedDataset(path, cache=server.address, target=index_mod3, transform=p)
    loader = ds.loader(B, num_workers=2, seed=1, autocache="transformed", cost_dir=False)
    try:
        first = Counter(x for b in loader for x in b)
        assert len(loader.preprocess.last_run.measured) == N  # epoch 1: every item ran in a worker
        wait_kept(ds, loader)
        second = Counter(x for b in loader for x in b)
        st = loader.epoch_stats[-1]
        assert first == second and sum(second.values()) == N and st.transformed["hits"] == N
        assert loader.preprocess.last_run.measured == [] and st.preprocess.items == N  # taken in this process
    finally:
        loader.close()


@pytest.mark.parametrize("mode", ["transformed", "auto"])
def test_transformed_items_a_server_refuses_for_their_size_leave_the_epoch_whole(tmp_path, mode):
    """2 MiB transformed items against a server whose --max-item-size is 1 MB: its refusal
    (INVALID_ARGUMENT, the whole put) raised out of TransformedItems.put_payloads: autocache
    "auto" failed as it measured its put probe. Now those items stay uncached, as by a full
    cache, said once, and every item is delivered."""
    from procs import cacheserver
    srv = cacheserver(str(tmp_path / "srv"), "256MB", 0, "--max-item-size", "1MB").start()
    try:
        path = make_items(tmp_path / "ds", n=16)
        ds = CachedDataset(path, cache=srv.address, transform=Pipeline([as_array, blow_up, autocache, head]))
        loader = ds.loader(4, num_workers=0, seed=1, autocache=mode, cost_dir=False)
        try:
            got = [x for batch in loader for x in batch]
            assert len(got) == 16
            t = loader.autocache.transformed()
            assert not any(t.lookup([ds.digest.hashes[i].tobytes() for i in range(16)]))
        finally:
            loader.close()
    finally:
        srv.kill()
