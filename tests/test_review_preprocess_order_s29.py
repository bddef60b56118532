"""An item an epoch left behind (exactly_once=False) in a worker's background thread runs
on after the next epoch's first task reached that worker. If AutoOrder revised the order
after the first epoch, that item must still finish in the order it started in: its output
at the caching point is kept under the old order's key, which another loader of the same
pipeline (the job restarted: its sample gives the first order again) reads back. And a
step of such an item over step_timeout must fail no item of the next epoch (engine.py told
an item's copies in two epochs apart by its index only). Real spawned workers, a real cache
server, real files."""
import os
import random
import sys
import time

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from clients.dataset import CachedDataset  # noqa: E402
from clients.sampler import SubstitutableBatchSampler  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess.measure import agree  # noqa: E402
from preprocess_steps import HalveBut, MoveSlow, SleepOnce, in_worker, index_of, scale_values, with_values  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402

pytestmark = pytest.mark.timeout(240)
N, B, SEED, SAMPLE = 40, 8, 5, 16  # SAMPLE: the scheduler's SAMPLE_ITEMS
MOVE_S = 0.05   # over the first timeout (the sample's items take microseconds): the item goes to the background
SCALE_S = 1.5   # the background thread is still in this step when the next epoch's first task arrives


class SlowValues:
    """with_values, slow on one item in the pool's workers."""

    def __init__(self, slow):
        self.slow = slow

    def __call__(self, i):
        if i == self.slow and in_worker():
            time.sleep(MOVE_S)
        return with_values(i)


class SlowScale:
    """scale_values, slow on one item in the pool's workers."""

    def __init__(self, slow):
        self.slow = slow

    def __call__(self, item):
        if item[0] == self.slow and in_worker():
            time.sleep(SCALE_S)
        return scale_values(item)


def test_an_item_left_behind_finishes_in_its_own_order(tmp_path, server):
    """Before: the worker set the new order when epoch 2's first task came; the item of
    epoch 1 still in its background thread (in scale, position 2) then ran order[3] of the
    new order, scale again, and never halved: that wrong output went into the cache under
    the first order's key, and the next loader of the pipeline served it."""
    sampled = random.Random(f"{SEED}/sample").sample(range(N), SAMPLE)  # as Scheduler._profile draws them
    slow = next(i for i in range(N) if i not in sampled)

    def pipe():  # HalveBut: neutral on the sample, deflating in the epoch: revised after epoch 1
        return Pipeline([index_of, SlowValues(slow), SlowScale(slow), HalveBut(sampled)], auto_order=True)

    path = indexed_items(tmp_path / "ds", N)
    ds = CachedDataset(path, cache=server.address, transform=pipe())
    lo = ds.loader(B, num_workers=1, seed=SEED, cost_dir=False, autocache="transformed", exactly_once=False)
    try:
        first_key = lo.autocache.key
        assert lo.preprocess.pipeline.order == (0, 1, 2, 3)
        got = {i for b in lo for i, _ in b}
        assert slow not in got  # still in the background when the epoch ended: dropped
        assert lo.preprocess.pipeline.order == (0, 1, 3, 2), lo.preprocess.pipeline.order_report
        list(lo)  # epoch 2: its first task reaches the worker while the item of epoch 1 runs
        assert lo.autocache.key != first_key
    finally:
        lo.close()  # the workers finish their background items and puts first
        ds.close()
    written = Pipeline([index_of, with_values, scale_values, HalveBut(sampled)])
    ds2 = CachedDataset(path, cache=server.address, transform=pipe())
    lo2 = ds2.loader(B, num_workers=0, seed=SEED, cost_dir=False, autocache="transformed")
    try:
        assert lo2.autocache.key == first_key  # the job restarted: the first order's kept items
        got = {item[0]: item for b in lo2 for item in b}
        assert sorted(got) == list(range(N))
        bad = [i for i in range(N) if not agree(got[i], written.apply(i.to_bytes(8, "little")))]
        assert bad == [], f"kept items other than the pipeline makes: {bad} (the slow one: {slow})"
    finally:
        lo2.close()
        ds2.close()


def test_an_item_left_behind_over_step_timeout_fails_no_item_of_the_next_epoch(tmp_path):
    """Item h hangs once, in the background, in epoch 1 (exactly_once=False: the epoch ends
    without it). Its step passes step_timeout during epoch 2, whose own copy of h waits in
    the same worker's background queue: the worker is stopped, and the hang, an earlier
    epoch's, must only be reported; epoch 2's h runs again. Fails: epoch 2 raises
    StepTimeout for h, whose epoch-2 copy never ran the step."""
    timeout_s = 3.0
    seed = next(s for s in range(100) if _second_epoch_first(s) not in _sampled(s))
    h = _second_epoch_first(seed)  # epoch 2's first task: its copy is held before the hang is over the limit
    pipe = Pipeline([index_of, MoveSlow(h), SleepOnce(h, str(tmp_path / "hung"), 30.0)])
    ds = CachedDataset(indexed_items(tmp_path / "ds", N), cache=False, transform=pipe)
    lo = ds.loader(2, num_workers=1, seed=seed, cost_dir=False, exactly_once=False, step_timeout=timeout_s,
                   step_warning=None)
    try:
        assert h not in {i for b in lo for i in b}  # epoch 1 ended with h hung in the background
        assert os.path.exists(tmp_path / "hung")
        it = iter(lo)
        next(it)
        time.sleep(timeout_s + 1.5)  # the epoch stays open (its batches wait) while the hang passes the limit
        rest = [i for b in it for i in b]
        assert len(rest) >= N - 2 - 2  # at most h itself dropped again (exactly_once=False)
        assert lo.epoch_stats[-1].preprocess.timed_out == 0
    finally:
        lo.close()
        ds.close()


def _sampled(seed):
    return set(random.Random(f"{seed}/sample").sample(range(N), SAMPLE))


def _second_epoch_first(seed):
    s = SubstitutableBatchSampler(N, 2, None, seed=seed)
    list(s)
    return next(iter(s))[0]
