"""Remote preprocessing workers on a real Ray head (loopback), a real cacheserver and
real files: workers put transformed items, the trainer side reads them as hits; a
worker killed with SIGKILL mid-epoch loses and doubles nothing; a step stuck on an item
is logged by its worker, which past step_timeout ends itself (Ray cannot cancel a running
actor task): its items are made on the trainer's side long before the feeder's wait_limit."""
import glob
import os
import signal
import sys
import time
from collections import Counter

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")

from clients.dataset import CachedDataset  # noqa: E402
from clients.sampler import SubstitutableBatchSampler  # noqa: E402
from clients.transformed import TransformedItems  # noqa: E402
from manager.policy.autoscale import AutoscaleConfig  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess.items import item_digest  # noqa: E402
from preprocess.remote.managed import ManagedPolicy  # noqa: E402
from procs import manager_with_server  # noqa: E402
from rayhead import started  # noqa: E402
from remote_steps import HangElsewhere, Jitter, Slow, decode  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest)


@pytest.fixture
def head(shared_head):
    """The pytest process's shared Ray head (conftest), this process joined to it as the user
    (the pools use that connection) from the module's first test on, and again where a test
    found the head dead (the dead one's connection is dropped with it)."""
    if not ray.is_initialized():
        shared_head.connect()
    return shared_head, ray


def trainer_epoch(ds, pipe, rw, feed, n, B, seed, epoch=0):
    """The trainer's side until the loader's transformed mode does it: per batch, the
    transformed items (under the remote workers' key) as hits; a miss is read and its
    prefix run here, then put."""
    items = TransformedItems(ds._proc().ring, ds.job, ds.dataset_tag, rw.key, rw.key_seed)
    sampler = SubstitutableBatchSampler(n, B, None, seed=seed)
    sampler.set_epoch(epoch)
    seen, out, computed = [], {}, 0
    for batch in feed(sampler, epoch):
        Ks = [item_digest(ds, i) for i in batch]
        got = items.get(Ks)
        miss = [p for p, g in enumerate(got) if g is None]
        if miss:
            raw = ds.read([batch[p] for p in miss])
            made = [_prefix(pipe, x) for x in raw]
            items.put([Ks[p] for p in miss], made)
            for p, y in zip(miss, made):
                got[p] = y
            computed += len(miss)
        seen += batch
        out.update(zip(batch, got))
    return seen, out, items.counts, computed


def _prefix(pipe, x):
    for pos in range(pipe.cacheable_prefix()):
        x = pipe.call_step(pipe.order[pos], x, None)
    return x


def expected(ds, pipe, n):
    return {i: _prefix(pipe, x) for i, x in zip(range(n), ds.read(list(range(n))))}


def test_remote_workers_put_what_the_trainer_reads_as_hits(head, module_server, tmp_path):
    n, B = 48, 8
    path = indexed_items(tmp_path / "ds", n)
    pipe = Pipeline([decode, Slow(0.0), Jitter()])
    ds = CachedDataset(path, cache=module_server.address, job="remote-hits", transform=pipe)
    rw = started(ds, pipe, head[0].address, autoscale=AutoscaleConfig(min_workers=2, max_workers=2),
               wait_limit=60.0, task_items=4)
    try:
        assert rw is not None and rw.pool.size == 2
        seen, out, counts, computed = trainer_epoch(ds, pipe, rw, rw.batches, n, B, seed=1)
        assert Counter(seen) == Counter(range(n))            # the sampler's items, exactly once
        want = expected(ds, pipe, n)
        assert all(np.array_equal(out[i], want[i]) for i in range(n))
        # what went remote was made there and read here as hits; the rest (sent while the
        # workers were starting: one task each until they answer) was made here
        fs, c = rw.feeder.stats, rw.pool.counts
        assert c.made == fs.remote_items == counts.hits > 0 and computed == fs.local_items
        assert c.lost == 0 and c.failed == 0 and fs.remote_items + fs.local_items == n
        # another epoch: the cache has them all, the workers make nothing again
        seen2, _, counts2, computed2 = trainer_epoch(ds, pipe, rw, rw.batches, n, B, seed=1, epoch=1)
        assert Counter(seen2) == Counter(range(n)) and counts2.hits == n and computed2 == 0
        assert c.made == counts.hits and c.present == fs.remote_items - c.made > 0
    finally:
        if rw is not None:
            rw.close()
        ds.close()


def test_worker_killed_mid_epoch_loses_and_doubles_nothing(head, module_server, tmp_path):
    n, B = 96, 8
    path = indexed_items(tmp_path / "ds", n)
    pipe = Pipeline([decode, Slow(0.03), Jitter()])
    ds = CachedDataset(path, cache=module_server.address, job="remote-kill", transform=pipe)
    rw = started(ds, pipe, head[0].address, autoscale=AutoscaleConfig(min_workers=2, max_workers=2),
               wait_limit=60.0, task_items=4, window=4)
    killed = []

    def feed(sampler, epoch):
        for k, batch in enumerate(rw.batches(sampler, epoch)):
            if k == 2:  # mid-epoch, with tasks queued on every worker
                w = max(rw.pool.workers.values(), key=lambda w: w.queued)
                pid = ray.get(w.handle.pid.remote(), timeout=30)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            yield batch

    try:
        seen, out, counts, computed = trainer_epoch(ds, pipe, rw, feed, n, B, seed=2)
        assert Counter(seen) == Counter(range(n))            # nothing lost, nothing doubled
        want = expected(ds, pipe, n)
        assert all(np.array_equal(out[i], want[i]) for i in range(n))
        c = rw.pool.counts
        assert killed and c.deaths == 1 and c.lost > 0
        assert computed > 0 and counts.hits + computed == n   # the trainer made the dead worker's items
        assert rw.pool.size == 2 and rw.pool.broken is None    # replaced, still remote
    finally:
        rw.close()
        ds.close()


def test_a_removed_worker_drains_its_queued_tasks_first(head, module_server, tmp_path):
    n = 32
    path = indexed_items(tmp_path / "ds", n)
    pipe = Pipeline([decode, Slow(0.02), Jitter()])
    ds = CachedDataset(path, cache=module_server.address, job="remote-drain", transform=pipe)
    rw = started(ds, pipe, head[0].address, autoscale=AutoscaleConfig(min_workers=2, max_workers=2))
    pool = rw.pool
    try:
        warm = [pool.submit(0, [i]) for i in range(2)]          # one task each, until they answer
        assert all(warm) and pool.submit(0, [2]) is None       # both on probation: none takes another
        assert pool.wait(warm, 60.0) == []
        refs = [pool.submit(0, list(range(k, k + 4))) for k in range(0, n, 4)]
        busy = {t.wid for t in pool.tasks.values()}
        assert len(busy) == 2 and all(refs)
        pool.resize(1)                                       # one goes: it takes no new task...
        draining = [w for w in pool.workers.values() if w.draining]
        assert pool.size == 1 and len(draining) == 1 and draining[0].queued > 0
        assert pool.wait(refs, 60.0) == []                    # ...but finishes what it holds
        assert pool.counts.made == n and pool.counts.present == 2 and pool.counts.lost == 0
        assert len(pool.workers) == 1 and not any(w.draining for w in pool.workers.values())  # then stops
        items = TransformedItems(ds._proc().ring, ds.job, ds.dataset_tag, rw.key, rw.key_seed)
        assert all(v is not None for v in items.get([item_digest(ds, i) for i in range(n)]))
    finally:
        rw.close()
        ds.close()


def test_loader_remote_option_reads_what_remote_workers_made(head, module_server, tmp_path):
    """ds.loader(remote=...): the loader's own workers find what the remote workers made as
    transformed hits (no source read, no prefix step here) and make the rest; every item
    once, the same outputs as computing everything locally."""
    n, B = 48, 8
    path = indexed_items(tmp_path / "ds", n)
    pipe = Pipeline([decode, Slow(0.0), Jitter()])
    ds = CachedDataset(path, cache=module_server.address, job="remote-loader", transform=pipe)
    opts = dict(autoscale=AutoscaleConfig(min_workers=2, max_workers=2), wait_limit=60.0, task_items=4)
    loader = ds.loader(B, num_workers=1, seed=4, cost_dir=False, remote=head[0].address, remote_options=opts)
    ref = CachedDataset(path, cache=False, transform=pipe).loader(B, num_workers=1, seed=4, cost_dir=False,
                                                                  autocache="compute")
    try:
        assert loader.remote is not None and loader.autocache.mode == "transformed"
        got = Counter(x.tobytes() for b in loader for x in b)
        assert sorted(loader.preprocess.yielded()) == list(range(n))   # exactly once
        st, rw = loader.epoch_stats[-1], loader.remote
        hits, misses = st.transformed["hits"], st.transformed["misses"]
        assert hits == rw.pool.counts.made == rw.feeder.stats.remote_items > 0 and hits + misses == n
        assert st.preprocess.steps[0].items == misses                   # the prefix ran here only for those
        assert got == Counter(x.tobytes() for b in ref for x in b)      # as computing it all here
    finally:
        loader.close()
        ref.close()
        ds.close()


def test_loader_remote_auto_takes_the_cluster_and_the_counts_from_the_manager(head, tmp_path, monkeypatch):
    """cachemanager --ray: remote='auto' finds the cluster through the manager, which
    runs the job's autoscaling (its --policy-config) on the measurements the job sends."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = tmp_path / "policy.json"
    cfg.write_text('{"autoscale": {"max_workers": 2, "settle": 0}}')
    n, B = 48, 8
    pipe = Pipeline([decode, Slow(0.0), Jitter()])
    with manager_with_server(str(tmp_path), "--ray", head[0].address, "--policy-config", str(cfg)) as (m, _):
        ds = CachedDataset(indexed_items(tmp_path / "ds", n), manager=m.address, job="remote-auto", transform=pipe)
        loader = ds.loader(B, num_workers=1, seed=4, cost_dir=False, remote="auto",
                           remote_options=dict(every=1, wait_limit=60.0, task_items=4))
        try:
            rw = loader.remote
            assert rw is not None and isinstance(rw.controller.policy, ManagedPolicy)
            assert sum(len(b) for b in loader) == n and sorted(loader.preprocess.yielded()) == list(range(n))
            # every item a remote worker made is a hit; so may be ones it found made already (a task
            # sent again after a worker's report was lost; a loaded host's local worker first)
            c = rw.pool.counts
            assert 0 < c.made <= loader.epoch_stats[-1].transformed["hits"] <= c.made + c.present, c
            first = rw.controller.decisions[0].change
            assert (first.remote, first.reason) == (2, "first measurement: try one more worker")  # the manager's
            assert rw.pool.size <= 2                                                            # its max_workers
        finally:
            loader.close()
            ds.close()
    with open(m.log_path) as f:
        assert "job remote-auto workers: remote 2, local 0" in f.read()


def test_loader_remote_option_errors(module_server, tmp_path):
    path = indexed_items(tmp_path / "ds", 8)
    ds = CachedDataset(path, cache=module_server.address, transform=Pipeline([decode, Jitter()]))
    with pytest.raises(ValueError, match="autocache='transformed'"):
        ds.loader(4, remote="ray://127.0.0.1:1", autocache="compute")
    with pytest.raises(ValueError, match="ray://HOST:PORT"):
        ds.loader(4, remote="127.0.0.1:1")
    with pytest.raises(ValueError, match="transform="):
        CachedDataset(path, cache=module_server.address).loader(4, remote="ray://127.0.0.1:1")
    ds.close()


HANG_S = 300.0   # the stuck step: never waited out
WAIT_LIMIT = 120.0  # the feeder's: a batch handed on sooner was freed by the timeout


def worker_logs(h, needle, seconds=30.0):
    """Lines of the Ray workers' log files containing needle (they are written as they come)."""
    deadline = time.monotonic() + seconds
    while True:
        lines = []
        for path in glob.glob(os.path.join(h.tmp, "**", "worker-*"), recursive=True):
            with open(path, errors="replace") as f:
                lines += [line for line in f if needle in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def test_a_stuck_remote_step_is_logged_and_its_worker_ends_itself_past_step_timeout(head, module_server,
                                                                                     tmp_path):
    n, B, seed = 16, 4, 1
    sampler = SubstitutableBatchSampler(n, B, None, seed=seed)
    sampler.set_epoch(0)
    stuck = next(iter(sampler))[0]  # in the first task: a worker takes one until it answers one
    path = indexed_items(tmp_path / "ds", n)
    pipe = Pipeline([decode, HangElsewhere({2 * stuck}, HANG_S, os.getpid()), Jitter()])
    ds = CachedDataset(path, cache=module_server.address, job="remote-stall", transform=pipe)
    rw = started(ds, pipe, head[0].address, autoscale=AutoscaleConfig(min_workers=1, max_workers=1),
               wait_limit=WAIT_LIMIT, task_items=n, window=4, step_warning=0.5, step_timeout=3.0)
    try:
        assert rw is not None
        rw.feeder.local_share = 0.0
        t0 = time.monotonic()
        seen, out, counts, computed = trainer_epoch(ds, pipe, rw, rw.batches, n, B, seed=seed)
        took = time.monotonic() - t0
        assert Counter(seen) == Counter(range(n))                      # nothing lost, nothing doubled
        want = expected(ds, pipe, n)
        assert all(np.array_equal(out[i], want[i]) for i in range(n))
        assert took < WAIT_LIMIT / 2, took                              # freed by the timeout
        assert rw.pool.counts.deaths >= 1 and computed > 0              # it ended itself; made here
        what = f"item {stuck} ({stuck:05d} @ 0+32): step 1 (HangElsewhere)"
        warned = worker_logs(head[0], what + " has run for")
        assert warned and "remote worker, pid" in warned[0], warned
        ended = worker_logs(head[0], what + " ran for")
        assert ended and "over step_timeout=3 s" in ended[0] and "ends itself" in ended[0], ended
    finally:
        if rw is not None:
            rw.close()
        ds.close()
