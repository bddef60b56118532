"""The remote-worker pieces that need no cluster: the feeder's order, window and
local share (against an in-process pool that records what it is sent), the
controller's use of the policies, what remote= accepts and the workers' default key."""
import os
import sys
from collections import Counter

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from clients.derived import derived_key  # noqa: E402
from preprocess import Pipeline, Uncacheable  # noqa: E402
from preprocess.items import item_digest  # noqa: E402
from preprocess.remote.spec import make_spec  # noqa: E402
from remote_steps import Jitter, Slow, Tint, decode, decode_entry, decode_wide  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402
from manager.policy.autoscale import AutoscaleConfig, Autoscaler  # noqa: E402
from manager.policy.placement import Placement, PlacementConfig  # noqa: E402
from manager.policy.scaling import Measurement  # noqa: E402
from preprocess.remote.cluster import resolve  # noqa: E402
from preprocess.remote.control import Controller  # noqa: E402
from preprocess.remote.feeder import Feeder  # noqa: E402


class RecordingPool:
    """The pool's interface: tasks finish when the test says so."""

    def __init__(self, workers=1):
        self.size, self.broken, self.target = workers, None, workers
        self.sent, self.tasks, self.waits, self._n = [], {}, [], 0

    def submit(self, epoch, indices):
        if not self.size or self.broken:
            return None
        self._n += 1
        self.tasks[self._n] = list(indices)
        self.sent.append((epoch, list(indices)))
        return self._n

    def wait(self, refs, timeout, stop=None):
        self.waits.append(list(refs))
        for r in refs:
            self.tasks.pop(r, None)
        return []

    def poll(self):
        pass

    def resize(self, n):
        self.size = self.target = n

    def stop_draining(self):
        pass


def batches(n, B):
    return [list(range(k, min(n, k + B))) for k in range(0, n, B)]


def test_feeder_hands_on_the_sampler_batches_unchanged_a_bounded_window_ahead():
    pool = RecordingPool()
    src = batches(50, 8)
    pulled = []

    def source():
        for b in src:
            pulled.append(b)
            yield b

    f = Feeder(pool, window=3, task_items=3)
    out = []
    for b in f.batches(source(), epoch=5):
        out.append(b)
        assert len(pulled) - len(out) <= 3 - 1 or len(pulled) == len(src)  # never more than the window ahead
    assert out == src                                          # same batches, same order
    sent = [i for _, idx in pool.sent for i in idx]
    assert Counter(sent) == Counter(range(50))                # every item sent once
    assert all(e == 5 for e, _ in pool.sent) and max(len(i) for _, i in pool.sent) == 3
    assert f.stats.batches == len(src) and f.stats.remote_items == 50 and f.stats.local_items == 0


def test_feeder_leaves_the_local_share_and_everything_when_no_worker():
    pool = RecordingPool()
    f = Feeder(pool, window=2, task_items=4)
    f.local_share = 0.25
    out = list(f.batches(iter(batches(32, 8)), 0))
    assert out == batches(32, 8)
    assert f.stats.local_items == 8 and f.stats.remote_items == 24
    assert all(i % 8 >= 2 for _, idx in pool.sent for i in idx)   # the first quarter of each batch stays local
    none = Feeder(RecordingPool(workers=0), window=2)
    assert list(none.batches(iter(batches(16, 8)), 0)) == batches(16, 8)
    assert none.stats.local_items == 16 and none.stats.remote_items == 0


def test_feeder_refuses_bad_settings():
    with pytest.raises(ValueError, match="window"):
        Feeder(RecordingPool(), window=0)


def test_controller_applies_the_autoscaler_every_window_of_batches():
    pool = RecordingPool(workers=0)
    ctl = Controller(pool, Autoscaler.start(AutoscaleConfig(settle=0)), every=2)
    assert pool.target == 1                                    # Cachew: start with one
    f = Feeder(pool, window=1, on_batch=ctl)
    f.stats.batch_times += [0.2, 0.2]
    f.stats.queues += [0.0, 0.0]
    ctl(f)                                                     # first measurement: try one more
    assert pool.target == 2 and ctl.decisions[-1].change.remote == 2
    f.stats.batch_times += [0.1, 0.1]
    f.stats.queues += [0.0, 0.0]
    ctl(f)                                                     # halved (linear): double
    assert pool.target == 4 and f.local_share == 0.0


def held_controller(settle: int):
    """A controller over a pool whose started workers answer when the test says (hold_limit 2),
    and a function that feeds it one window of two batches of batch time `bt`."""
    pool = RecordingPool(workers=0)
    pool.starting = 0
    ctl = Controller(pool, Autoscaler.start(AutoscaleConfig(settle=settle)), every=2, hold_limit=2)
    f = Feeder(pool, window=1, on_batch=ctl)

    def window(bt):
        f.stats.batch_times += [bt, bt]
        f.stats.queues += [0.0, 0.0]
        ctl(f)
    return pool, ctl, window


def test_controller_holds_a_window_while_started_workers_have_not_answered():
    pool, ctl, window = held_controller(settle=0)
    window(0.2)
    assert pool.target == 2                                    # first measurement: one more
    pool.starting = 1                                          # the new worker has not answered:
    window(0.2)                                                # its windows would say it brings
    window(0.2)                                                # nothing; they are held
    assert pool.target == 2 and len(ctl.decisions) == 1
    pool.starting = 0
    window(0.1)                                                # in effect: halved, so double
    assert pool.target == 4 and ctl.decisions[-1].change.reason == "linear gain: try 2 more"
    pool.starting = 2                                          # two that never start (no CPU):
    window(0.1)
    window(0.1)
    assert pool.target == 4
    window(0.1)                                                # held at most hold_limit windows
    assert pool.target == 3 and len(ctl.decisions) == 3        # 4 no faster than 2: 2 + headroom


def test_a_worker_that_never_starts_holds_one_judgement_not_every_window():
    """hold_limit bounds the wait per change: once it is spent, the windows that follow
    are measured although a worker still has not answered (no CPU for it)."""
    pool, ctl, window = held_controller(settle=1)
    window(0.2)
    assert pool.target == 2                                    # first measurement: one more
    pool.starting = 1                                          # it never answers
    window(0.1)
    window(0.1)                                                # held: hold_limit windows
    window(0.1)                                                # measured, dropped by settle
    assert pool.target == 2 and len(ctl.decisions) == 1
    window(0.1)                                                # measured: no second hold
    assert pool.target == 4 and ctl.decisions[-1].change.reason == "linear gain: try 2 more"
    window(0.1)                                                # a change that starts workers:
    assert ctl._held == 1                                      # held again
    ctl.observe(Measurement(0.1))                              # settle
    ctl.observe(Measurement(0.1))                              # 4 no faster than 2: 2 + headroom
    assert pool.target == 3 and ctl._held == 1                 # a removal: no new wait


def test_controller_places_local_workers_and_falls_back_once():
    pool = RecordingPool(workers=0)
    local = []
    place = Placement.start_with(PlacementConfig(settle=0))
    ctl = Controller(pool, place, local.append, every=1, fallback_local=2)
    assert pool.target == 1 and local == [0]
    for bt in (0.2, 0.1, 0.1, 0.1):                            # remote plateau at 2, then a local worker
        ctl.observe(Measurement(bt))
    # the ramp: 1 -> 2 halved batch time (linear): 4; no gain: back to 2 (no headroom in
    # placement: TRIM owns the remote count); a local one
    assert [(d.change.remote, d.change.local) for d in ctl.decisions] == [(2, 0), (4, 0), (2, 0), (2, 1)]
    assert ctl.local == 1 and local[-1] == 1 and pool.target == 2
    f = Feeder(pool, window=1)
    ctl(f)
    assert f.local_share == pytest.approx(1 / 3)
    pool.broken = "ConnectionError: gone"
    ctl(f)
    ctl(f)
    assert ctl.fell_back and local[-1] == 2 and local.count(2) == 1 and f.local_share == 1.0


def test_remote_addresses(monkeypatch):
    assert resolve("ray://10.0.0.1:10001") == "ray://10.0.0.1:10001"
    for bad in ("10.0.0.1:10001", "ray://host", "ray://:1", "ray://h:99999"):
        with pytest.raises(ValueError, match="ray://HOST:PORT"):
            resolve(bad)
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert resolve("auto", "ray://mgr:10001") == "ray://mgr:10001"   # the cache manager's first
    assert resolve("auto") == "ray://head:10001"
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")                  # a driver's address: not ours
    assert resolve("auto") is None
    monkeypatch.delenv("RAY_ADDRESS")
    assert resolve("auto") is None


def test_the_default_key_tells_apart_what_makes_the_outputs_differ(tmp_path):
    """start() without key=. Before: the key was the prefix's fingerprint alone, so jobs over
    the same files decoded otherwise, or seeded otherwise, put different outputs under one
    key, and each read the other's as its own."""
    path = indexed_items(tmp_path / "ds", 8)
    pipe = Pipeline([Slow(0.0), Jitter()])
    a = CachedDataset(path, cache=False, decode=decode, transform=pipe)
    wide = CachedDataset(path, cache=False, decode=decode_wide, transform=pipe)
    again = CachedDataset(path, cache=False, decode=decode, transform=pipe)
    K = item_digest(a, 3)

    def key(ds, p=pipe, job_seed=0, **kw):  # the derived key item 3's output goes under
        spec = make_spec(ds, p, job_seed, 1, **kw)
        return derived_key(K, spec.fingerprint, spec.key_seed)

    outputs = [pipe.call_step(0, ds.read([3])[0], None) for ds in (a, wide)]
    assert not np.array_equal(*outputs) and key(a) != key(wide)       # another decode: other outputs
    assert key(a) == key(again)                                         # equal outputs: shared
    seeded = Pipeline([decode, Tint(), Jitter()])                       # Tint: drawn alike every epoch
    plain = CachedDataset(path, cache=False, transform=seeded)
    assert make_spec(plain, seeded, 0, 1).prefix == 2
    assert key(plain, seeded, 0) != key(plain, seeded, 1) and key(plain, seeded, 0) == key(plain, seeded, 0)
    with pytest.raises(Uncacheable, match="decode takes the entry"):    # not a function of the content
        key(CachedDataset(path, cache=False, decode=decode_entry, transform=pipe))
    with pytest.raises(ValueError, match="key_seed= is the seed of a given key="):
        key(a, key_seed=1)
    assert make_spec(a, pipe, 0, 1, key="theirs", key_seed=7).fingerprint == "theirs"  # as given
    with pytest.raises(Uncacheable, match="no cacheable prefix"):
        key(a, Pipeline([Jitter(), Slow(0.0)]))


def test_workers_stop_while_the_reordered_pipeline_cannot_be_keyed_and_come_back(tmp_path):
    """refresh() with an order the trainer keys nothing by. Before: the workers went on
    making items under the old key, which nothing read, and took each batch's share."""
    from preprocess.remote.workers import RemoteWorkers

    path = indexed_items(tmp_path / "ds", 8)
    pipe = Pipeline([Slow(0.0), Jitter()])
    ds = CachedDataset(path, cache=False, decode=decode, transform=pipe)
    pool = RecordingPool(workers=0)
    local = []
    pool.spec = make_spec(ds, pipe, 0, 1)
    pool.set_spec = lambda spec: setattr(pool, "spec", spec)
    ctl = Controller(pool, Placement.start_with(PlacementConfig(settle=0)), local.append, every=1)
    rw = RemoteWorkers(pool, Feeder(pool, window=1, on_batch=ctl), ctl)
    assert pool.size == 1 and rw.feeder.local_share == 0.0
    with pytest.warns(RuntimeWarning, match="remote workers stopped.*keys no transformed items"):
        rw.refresh(ds, pipe, 0, key="", prefix=1)              # autocache keeps nothing now
    assert pool.size == 0 and local[-1] == 1 and rw.feeder.local_share == 1.0
    rw.refresh(ds, pipe, 0, key="", prefix=1)                  # still: no second warning
    assert list(rw.batches(iter(batches(16, 8)), 1)) == batches(16, 8)
    assert pool.sent == [] and rw.feeder.stats.local_items == 16 and ctl.decisions == []
    rw.refresh(ds, pipe, 0, key="k2", prefix=1)                # keyed again: back to the policy's counts
    assert pool.size == 1 and pool.spec.fingerprint == "k2" and pool.spec.version == 2
    assert rw.feeder.local_share == 0.0 and local[-1] == 0
    list(rw.batches(iter(batches(16, 8)), 2))
    assert rw.feeder.stats.remote_items == 16


def test_a_resume_after_the_pool_broke_keeps_the_fall_back():
    pool = RecordingPool(workers=0)
    local = []
    ctl = Controller(pool, Placement.start_with(PlacementConfig(settle=0)), local.append, every=1, fallback_local=2)
    f = Feeder(pool, window=1)
    pool.broken = "ConnectionError: gone"
    ctl(f)
    assert ctl.fell_back and local[-1] == 2
    ctl.pause()
    ctl.resume()                                               # a keyable order again, but no cluster
    assert local[-1] == 2 and pool.target == 0 and ctl.local_share() == 1.0
