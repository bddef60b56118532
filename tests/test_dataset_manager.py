"""CachedDataset with a real cache manager: ring from the manager, job
registration, batch-time reports, and training through a manager outage."""
import time
from collections import Counter

import pytest

pytest.importorskip("torch")

from cacheserver.client.server_client import ServerClient  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from manager.manager_client import ManagerClient  # noqa: E402
from procs import cachemanager, cacheserver, wait_ring  # noqa: E402
from test_dataset import make_dataset  # noqa: E402


@pytest.fixture
def cluster(tmp_path):
    m = cachemanager(str(tmp_path / "mgr")).start()
    servers = [cacheserver(str(tmp_path / f"s{i}"), "256MB", 0, "--manager", m.address).start() for i in range(2)]
    wait_ring(m.address, 2)
    yield m, servers
    for s in servers:
        s.kill()
    m.kill()


def test_ring_registration_and_batch_reports(tmp_path, cluster):
    m, servers = cluster
    path, items = make_dataset(tmp_path / "ds", n=200)
    ds = CachedDataset(path, manager=m.address, job="job-a", n_gpus=2)
    try:
        assert sorted(ds.cache_spec.split(",")) == sorted(s.address for s in servers)
        loader = ds.loader(batch_size=10, seed=1)
        for _ in range(2):
            got = [x for b in loader for x in b]
            assert Counter(got) == Counter(items.values())
        # With no chunk work in its plan the coordinator reports every quiet_report_seconds (2 s).
        deadline = time.monotonic() + 3 * ds.coordinator.quiet_report_seconds
        with ManagerClient(m.address, timeout=2) as mc:
            while True:
                job = next(j for j in mc.status_dict()["jobs"] if j["job"] == "job-a")
                if int(job.get("batches", 0)) >= 30 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        assert job["dataset"] == ds.digest.fingerprint.hex() and job["n_gpus"] == 2
        assert job["batches"] >= 30  # 2 epochs x 20 batches reported (minus warm-up)
        inserted = 0
        for s in servers:
            with ServerClient(s.address) as c:
                inserted += sum(ch.items for ch in c.stats().chunks if ch.dataset == ds.dataset_tag)
        assert inserted > 0  # the plan allowed caching, tagged under the manager's dataset name
    finally:
        ds.close()


def test_training_continues_while_the_manager_is_down(tmp_path, cluster):
    m, servers = cluster
    path, items = make_dataset(tmp_path / "ds2", n=200, seed=5)
    ds = CachedDataset(path, manager=m.address, job="job-b")
    try:
        loader = ds.loader(batch_size=10, seed=2)
        seen = []
        t0 = time.monotonic()
        for b, batch in enumerate(loader):
            seen.extend(batch)
            if b == 2:
                m.proc.kill()  # SIGKILL the manager mid-epoch
        assert Counter(seen) == Counter(items.values())
        assert time.monotonic() - t0 < 60
        seen = [x for b in loader for x in b]  # a whole epoch with no manager at all
        assert Counter(seen) == Counter(items.values())
    finally:
        ds.close()


def test_a_failed_chunk_release_is_not_retried_after_every_batch(tmp_path):
    """Releases run in the training loop's thread: with the manager gone, a chunk read to
    its end is released again only after a back-off, not at every batch (each try can
    wait out the call's deadline)."""
    from manager.manager_client import Plan

    m = cachemanager(str(tmp_path / "mgr")).start()
    path, _ = make_dataset(tmp_path / "ds3", n=40, seed=7)
    ds = CachedDataset(path, cache=False, manager=m.address, job="job-r")
    try:
        m.kill()
        coord, tries = ds.coordinator, []
        release = coord.client.release_chunk
        coord.client.release_chunk = lambda *a: tries.append(a) or release(*a)
        coord._set_plan(Plan(ds.dataset_tag, "chunked", 2, 40, 20, 0, None, (0,), 99))
        for b in range(8):  # chunk 0 (half the items) is read after the second batch
            coord.consumed(list(range(5 * b, 5 * b + 5)))
        assert len(tries) == 1 and 0 not in coord._released
        coord._release_after = 0.0  # the back-off is over: the next batch tries again
        coord.consumed([39])
        assert len(tries) == 2
    finally:
        ds.close()


def test_a_job_registers_again_with_a_manager_restarted_on_an_empty_state_dir(tmp_path):
    from procs import free_port

    port = free_port()
    m = cachemanager(str(tmp_path / "m1"), port).start()
    path, _ = make_dataset(tmp_path / "ds4", n=20, seed=9)
    ds = CachedDataset(path, cache=False, manager=m.address, job="job-again")
    try:
        coord = ds.coordinator
        coord.report_seconds = coord.quiet_report_seconds = 0.2
        coord.start()
        m.kill()
        m = cachemanager(str(tmp_path / "m2"), port).start()  # it knows no job
        deadline = time.monotonic() + 30
        with ManagerClient(m.address, timeout=2) as mc:
            while not any(j["job"] == "job-again" for j in mc.status_dict()["jobs"]):  # told NOT_FOUND: registers
                assert time.monotonic() < deadline
                coord.batch_time(time.time(), 0.1)
                time.sleep(0.2)
    finally:
        ds.close()
        m.kill()


def test_a_registration_replaces_a_plan_of_a_higher_version(cluster):
    """Versions restart where the manager forgot the dataset (or its state): the plan a
    registration answers stands, though the client saw a higher version before."""
    import dataclasses

    m, _ = cluster
    ds = "ab" * 32
    with ManagerClient(m.address, timeout=5) as mc:
        mc.register_job("job-v", ds, 1000, 10)
        mc._cache.plans[(ds, "job-v")] = dataclasses.replace(mc.get_plan(ds, "job-v"), version=2**62, option="full")
        info = mc.register_job("job-v", ds, 1000, 10)
        assert info.plan.version < 2**62 and mc.get_plan(ds, "job-v") == info.plan


def test_a_registration_drops_the_jobs_other_cached_plans(cluster):
    """A manager restarted on an empty state dir counts versions afresh: plans cached
    before under the dataset-wide key or another tag of the job must not hide its plans."""
    import dataclasses

    m, _ = cluster
    ds, other = "cd" * 32, "ef" * 32
    with ManagerClient(m.address, timeout=5) as mc:
        mc.register_job("job-w", ds, 1000, 10)
        stale = dataclasses.replace(mc.get_plan(ds), version=2**62, option="full")
        mc._cache.plans[(ds, "")] = stale
        mc._cache.plans[(other, "job-w")] = dataclasses.replace(stale, dataset=other)
        mc.register_job("job-w", ds, 1000, 10)
        assert mc.get_plan(ds).version < 2**62
        assert (other, "job-w") not in mc._cache.plans


def test_shared_plan_decides_what_to_insert():
    from clients.coordination import SPARE, SharedPlan
    from manager.manager_client import Plan
    from manager.policy import chunk_of

    sp = SharedPlan()
    assert sp.insert_chunk(123) == 0  # no manager: everything, as chunk 0
    n, k = 1000, 10
    sp.publish(Plan("d", "chunked", k, n, 100, active=3, loading=4, chunks=(3,), version=7))
    for i in range(n):
        c = chunk_of(i, n, k)
        assert sp.insert_chunk(i) == (c if c in (3, 4) else SPARE)  # outside: spare room only
    assert sp.loading_first(next(i for i in range(n) if chunk_of(i, n, k) == 4), 4)
    sp.publish(Plan("d", "none", 1, n, 0, active=None, loading=None, chunks=(), version=8))
    assert sp.insert_chunk(5) is None  # the jobs gain nothing: insert nothing
    sp.publish(Plan("d", "none", 1, n, 0, active=None, loading=None, chunks=(), version=9, spare=True))
    assert {sp.insert_chunk(i) for i in range(n)} == {SPARE}  # no room of its own: share misses as spare
    sp.publish(Plan("d", "full", 1, n, 0, active=0, loading=None, chunks=(0,), version=10))
    assert sp.insert_chunk(999) == 0


def test_plan_messages_from_before_the_spare_flag():
    from cacheserver.proto import manager_pb2 as mpb
    from manager.manager_client import Plan

    assert Plan.from_message(mpb.Plan(option=mpb.CACHE_OPTION_CHUNKED, k=4)).spare  # they inserted spare
    assert not Plan.from_message(mpb.Plan(option=mpb.CACHE_OPTION_NONE)).spare
    assert Plan.from_message(mpb.Plan(option=mpb.CACHE_OPTION_NONE, spare=True)).spare


def test_prefetch_moves_spare_entries_into_the_loading_chunk(tmp_path):
    """A miss outside the plan goes in as a spare entry; once its chunk is loading, the
    prefetcher has the server adopt it into the chunk (no store read, no value sent),
    and only then do chunk-room lookups count it."""
    from clients.coordination import SPARE
    from manager.manager_client import Plan
    from manager.policy import chunk_of

    path, items = make_dataset(tmp_path / "ds", n=40)
    d = cacheserver(str(tmp_path / "s"), "64MB").start()
    ds = CachedDataset(path, cache=d.address, job="j")
    try:
        n, k = len(items), 4
        i = next(i for i in range(n) if chunk_of(i, n, k) == 2)
        ds.plan.publish(Plan("d", "chunked", k, n, 0, active=0, loading=None, chunks=(0,), version=1))
        assert ds.plan.insert_chunk(i) == SPARE
        assert ds[i] == items[i]  # a miss, inserted as spare
        assert ds.lookup([i]) == [True] and ds.lookup([i], not_spare=True) == [False]
        ds.plan.publish(Plan("d", "chunked", k, n, 0, active=0, loading=2, chunks=(0,), version=2))
        before = ds.counters.totals()["store_bytes"]
        with ServerClient(d.address) as c:
            put_bytes = c.stats().counters["put_bytes"]
        ds.prefetch([i])
        assert ds.counters.totals()["store_bytes"] == before  # moved in the cache, not refetched
        assert ds.lookup([i], not_spare=True) == [True]
        with ServerClient(d.address) as c:
            st = c.stats()
            assert st.counters["adopted"] == 1 and st.counters["put_bytes"] == put_bytes
            tags = {(ch.dataset, ch.chunk): ch.items for ch in st.chunks}
            assert tags.get((ds.dataset_tag, 2)) == 1 and not tags.get((ds.dataset_tag, -1))
        assert ds[i] == items[i]  # and it still opens
    finally:
        ds.close()
        d.kill()


@pytest.mark.parametrize("how", ["rank share", "resumed epoch"])
def test_chunks_released_when_this_epochs_items_of_them_are_consumed(tmp_path, how):
    """A chunk is released once this job consumed what it will read of it this epoch: under
    DDP a rank reads only its share of each chunk, and a resumed epoch only the items not yet
    delivered. Counting the whole chunk instead never released one, stalling the rotation."""
    from procs import free_port

    from manager.manager_client import Plan

    path, _ = make_dataset(tmp_path / "ds", n=101)
    ds = CachedDataset(path, cache=False, manager=f"127.0.0.1:{free_port()}", job="j")  # manager down
    coord = ds.coordinator
    plan = Plan(coord.dataset, "chunked", 4, 101, 26, active=0, loading=None, chunks=(0, 1, 2, 3), version=1)
    coord._set_plan(plan)
    released = []
    coord.client.release_chunk = lambda job, dataset, c: released.append(c) or plan  # the manager's reply
    try:
        if how == "rank share":
            loader = ds.loader(batch_size=8, rank=1, world_size=3)
        else:
            first = ds.loader(batch_size=8, seed=4)
            for k, _ in enumerate(first):
                if k == 5:
                    break
            released.clear()
            loader = ds.loader(batch_size=8, seed=4)
            loader.load_state_dict(first.state_dict())
        assert sum(len(b) for b in loader) == (34 if how == "rank share" else 101 - 48)
        assert sorted(released) == [0, 1, 2, 3]
    finally:
        ds.close()


def test_default_manager_measures_without_bypass_from_reported_hit_ratios(tmp_path, cluster):
    """The client sends each batch's hit fraction with its time; the default manager
    regresses on them and never switches the job to bypass (no probe)."""
    m, servers = cluster
    path, items = make_dataset(tmp_path / "ds3", n=200, seed=7)
    ds = CachedDataset(path, manager=m.address, job="job-p")
    sent = []
    coord = ds.coordinator
    real = coord.client.report_batches
    coord.client.report_batches = lambda job, batches: (sent.extend(batches), real(job, batches))[1]
    try:
        loader = ds.loader(batch_size=10, seed=3)
        for _ in range(2):
            assert Counter(x for b in loader for x in b) == Counter(items.values())
        deadline = time.monotonic() + 3 * coord.quiet_report_seconds  # reports come every 2 s here
        while sum(len(b) == 3 for b in sent) < 30 and time.monotonic() < deadline:
            time.sleep(0.1)
        with ManagerClient(m.address, timeout=2) as mc:
            st = mc.status_dict()
        job = next(j for j in st["jobs"] if j["job"] == "job-p")
        assert job.get("probes", 0) == 0 and job.get("phase") != "probe_bypass"
        hits = [b[2] for b in sent if len(b) == 3]
        assert len(hits) >= 30 and min(hits) < 0.5 and max(hits) > 0.5  # epoch 1 misses, epoch 2 hits
    finally:
        ds.close()


def test_reports_are_quiet_unless_chunk_work_or_a_probe_waits_on_them(tmp_path):
    """A plan with no chunks to load or release (none, with or without spare entries;
    full) waits on no report: the coordinator reports every quiet_report_seconds, and
    every report_seconds only while a chunked plan rotates or the job runs in bypass."""
    from procs import free_port

    from manager.manager_client import Plan

    path, _ = make_dataset(tmp_path / "ds", n=20)
    ds = CachedDataset(path, cache=False, manager=f"127.0.0.1:{free_port()}", job="q")  # manager down
    coord = ds.coordinator
    try:
        assert coord.quiet_report_seconds == 2.0 and coord.report_seconds == 0.5
        assert coord.period() == 2.0  # no plan yet (the manager is down): nothing waits
        for option, version in (("none", 1), ("full", 2)):
            coord._set_plan(Plan(coord.dataset, option, 1, 20, 0, None, None, (), version))
            assert coord.period() == 2.0, option
        coord._set_plan(Plan(coord.dataset, "chunked", 4, 20, 5, active=0, loading=1, chunks=(0,), version=3))
        assert coord.period() == 0.5
        coord._set_plan(Plan(coord.dataset, "none", 1, 20, 0, None, None, (), 4, spare=True))
        coord._mode = "bypass"  # as the manager's last reply said
        assert coord.period() == 0.5
    finally:
        ds.close()
