"""Random steps and steps left behind in the loader's own process (num_workers=0,
step_timeout): a step stuck inside one item's random step must not hold up the seeding
of every later item (each would time out, named, until the process ends), and the
others still draw exactly what their seeds give (docs/preprocess.md, Steps: seeded from
(seed, epoch, item digest, written position)). The stuck step holds while a flag file
exists (at most HANG_S, far past any bound): a passing test was not waiting it out.
Epochs run in a thread joined under a bound, so a hang fails the test."""
import os
import random
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from clients.dataset import CachedDataset  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess.autoorder import choose_order  # noqa: E402
from preprocess.inline import InlineRunner, Overdue  # noqa: E402
from preprocess.items import item_digest  # noqa: E402
from preprocess.pipeline import ItemContext  # noqa: E402
from preprocess.profile import trace  # noqa: E402
from preprocess.seeding import item_seed  # noqa: E402
from preprocess.stall import StallWatch  # noqa: E402
from preprocess_steps import HalveBut, index_of, scale_values, with_values  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402
from test_review_preprocess_bounds import run_epoch  # noqa: E402

pytestmark = pytest.mark.timeout(180)
HANG_S = 120.0


def hold_while(flag):
    deadline = time.monotonic() + HANG_S
    while os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.02)


class DrawThenHold:
    """A random step: draws from random's and numpy's global generators, then, on item
    `index` while `flag` exists, holds (inside the step, so inside its seeding)."""
    random = True

    def __init__(self, index, flag):
        self.index, self.flag = index, str(flag)

    def __call__(self, i):
        a, b = random.random(), float(np.random.random())
        if i == self.index:
            hold_while(self.flag)
        return (i, a, b)


class DrawAround:
    """A random step whose draws straddle a pause: anything re-seeding the global
    generators during it (another thread) changes its second draw."""
    random = True

    def __call__(self, i):
        a = random.random()
        time.sleep(0.05)
        return (i, a, random.random())


def slow_identity(i):
    time.sleep(0.01)
    return i


def seeded_draws(ds, seed, epoch, i, step):
    """What the docs say item i's random step draws: random's then numpy's generator,
    each seeded from item_seed(seed, epoch, the item's digest, the step's position)."""
    s = item_seed(seed, epoch, item_digest(ds, i), step)
    return random.Random(s).random(), float(np.random.RandomState(s & 0xFFFFFFFF).random_sample())


def test_a_step_stuck_in_a_random_step_holds_up_no_other_items_seeding(tmp_path):
    n, B, stuck, seed = 8, 4, 2, 7
    flag = tmp_path / "hold"
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False,
                       transform=Pipeline([index_of, DrawThenHold(stuck, flag)]))
    loader = ds.loader(B, num_workers=0, seed=seed, cost_dir=False, step_warning=None, step_timeout=1.0,
                       on_error="skip")
    flag.touch()  # after the sample was profiled: only the epoch's run holds
    try:
        epoch = loader.batch_sampler.epoch
        box, secs = run_epoch(loader)
        assert box["error"] is None, box["error"]
        got = {y[0]: y[1:] for b in box["batches"] for y in b}
        assert sorted(got) == [i for i in range(n) if i != stuck], got   # none but the stuck one timed out
        assert got == {i: seeded_draws(ds, seed, epoch, i, 1) for i in got}
        st = loader.epoch_stats[-1].preprocess
        assert st.timed_out == 1 and st.skipped == 1, (st.timed_out, st.errors)
        flag.unlink()  # the stuck step returns: its thread runs nothing more
        epoch = loader.batch_sampler.epoch
        box, _ = run_epoch(loader)
        assert box["error"] is None, box["error"]
        got = {y[0]: y[1:] for b in box["batches"] for y in b}
        assert got == {i: seeded_draws(ds, seed, epoch, i, 1) for i in range(n)}
    finally:
        if flag.exists():
            flag.unlink()
        loader.close()
        ds.close()


class DrawThenHoldSeen(DrawThenHold):
    """DrawThenHold that keeps the threads it held in."""

    def __init__(self, index, flag):
        super().__init__(index, flag)
        self.threads = []

    def __call__(self, i):
        if i == self.index:
            self.threads.append(threading.current_thread())
        return super().__call__(i)


class Record:
    """Appends its input to `seen` (a step after the stuck one)."""

    def __init__(self):
        self.seen = []

    def __call__(self, x):
        self.seen.append(x[0])
        return x


def test_a_thread_left_behind_runs_no_further_step_once_its_stuck_one_returns(tmp_path, caplog):
    """Its result is thrown away; a later random step of it would re-seed the generators
    under another item's draws, and one stuck again would hold the lock for good. Its
    stuck random step ran on without the lock while another item's ran: a warning says so."""
    import logging
    caplog.set_level(logging.WARNING, logger="preprocess")
    flag = tmp_path / "hold"
    flag.touch()
    after = Record()
    hold = DrawThenHoldSeen(0, flag)
    pipe = Pipeline([hold, after, DrawThenHold(-1, flag)])
    runner = InlineRunner(StallWatch(None, 0.5, str, str, str), by_context=True)
    ctx = ItemContext(7, 0, b"d" * 32)
    try:
        with pytest.raises(Overdue):
            runner.call(pipe.apply, 0, ctx)
        [left] = hold.threads
        assert runner.call(pipe.apply, 1, ctx)[0][0] == 1  # a fresh thread seeds while the stuck one holds
    finally:
        flag.unlink()
        runner.close()
    left.join(10)
    assert not left.is_alive()
    assert after.seen == [1], after.seen   # item 0's thread stopped after its stuck step
    assert any("step 0 (DrawThenHoldSeen), left behind after step_timeout, returned" in r.getMessage()
               for r in caplog.records)


def test_making_a_loader_does_not_reseed_another_loaders_random_steps(tmp_path):
    """Loader A iterates (num_workers=0) in a thread while loader B is made in this one:
    B's determinism check seeds the global generators too, under the same lock as A's
    random steps, so A's items draw what their seeds give and B's steps are not caught
    drawing because A drew."""
    n, B, seed = 16, 4, 3
    path = indexed_items(tmp_path / "ds", n)
    a_ds = CachedDataset(path, cache=False, transform=Pipeline([index_of, DrawAround()]))
    a = a_ds.loader(B, num_workers=0, seed=seed, cost_dir=False)
    epoch = a.batch_sampler.epoch
    stop = threading.Event()
    caught = []

    def make_loaders():
        while not stop.is_set():
            ds = CachedDataset(path, cache=False, transform=Pipeline([index_of, slow_identity]))
            ld = ds.loader(B, num_workers=0, seed=0, cost_dir=False)
            caught.append(dict(ld.preprocess.pipeline.caught_random))
            ld.close()
            ds.close()

    maker = threading.Thread(target=make_loaders, daemon=True)
    maker.start()
    try:
        deadline = time.monotonic() + 60
        while not caught and time.monotonic() < deadline:  # B's are being made all through A's epoch
            time.sleep(0.01)
        box, _ = run_epoch(a)
    finally:
        stop.set()
        maker.join(60)
        a.close()
        a_ds.close()
    assert not maker.is_alive()
    assert box["error"] is None, box["error"]
    assert caught and not any(caught), caught
    got = {y[0]: y[1:] for b in box["batches"] for y in b}
    want = {}
    for i in range(n):
        r = random.Random(item_seed(seed, epoch, item_digest(a_ds, i), 1))
        want[i] = (r.random(), r.random())
    assert got == want


def test_a_thread_waiting_for_the_seeding_lock_stops_waiting_once_fenced():
    from preprocess.seeding import Abandoned, SeedLock
    lock, box = SeedLock(), {}
    holder = lock.acquire()

    def wait_for_it():
        try:
            lock.acquire()
        except Abandoned as e:
            box["error"] = e

    t = threading.Thread(target=wait_for_it, daemon=True)
    t.start()
    t.join(0.2)
    assert t.is_alive()                      # one seeded step at a time
    lock.fence(t)
    t.join(5)
    assert not t.is_alive() and isinstance(box.get("error"), Abandoned)
    assert lock.release(holder) == 0         # the holder was not fenced: an ordinary release


class HalveHold:
    """Halves an item's values (deflating), holding first while `flag` exists."""

    def __init__(self, flag):
        self.flag = str(flag)

    def __call__(self, item):
        hold_while(self.flag)
        return (item[0], item[1][::2])


def test_autoorder_left_behind_does_not_change_the_order_later(tmp_path):
    """choose_order stuck in a swap's check past step_timeout (making the loader fails):
    once its step returns, the thread left behind must not reorder the pipeline (a user's
    object, perhaps in a new loader by then) with an order nobody verified."""
    flag = tmp_path / "hold"
    pipe = Pipeline([with_values, scale_values, HalveHold(flag)], auto_order=True)
    ctxs = [ItemContext(0, -1, bytes([k]) * 32) for k in range(4)]
    tr = trace(pipe, list(range(4)), ctxs)
    flag.touch()
    hold_seen = []
    runner = InlineRunner(StallWatch(None, 0.5, str, str, str), by_context=True)
    try:
        with pytest.raises(Overdue):
            runner.call(lambda: (hold_seen.append(threading.current_thread()), choose_order(pipe, tr)))
    finally:
        flag.unlink()
        runner.close()
    hold_seen[0].join(10)
    assert not hold_seen[0].is_alive()
    assert pipe.order == (0, 1, 2) and pipe.order_report == "as written", pipe.describe()


class ScaleHoldInLoader:
    """scale_values; in the loader's own process (not its workers), holds while `flag` exists."""

    def __init__(self, flag):
        self.flag = str(flag)

    def __call__(self, item):
        import multiprocessing
        if not multiprocessing.current_process().name.startswith("preprocess-"):
            hold_while(self.flag)
        return scale_values(item)


def test_a_revision_over_step_timeout_keeps_the_order_and_fails_nothing(tmp_path, caplog):
    """After the first epoch AutoOrder revises the order on the sample in the loader's
    process; a step stuck there past step_timeout must neither fail the epoch whose items
    were all made (on_error="skip") nor leave an order nobody verified."""
    import logging
    caplog.set_level(logging.WARNING, logger="preprocess")
    n, B, seed = 40, 8, 5
    sample = random.Random(f"{seed}/sample").sample(range(n), 16)  # as Scheduler._profile draws them
    flag = tmp_path / "hold"
    # halving is neutral on the sample, deflating on the epoch: the revision runs after it
    pipe = Pipeline([index_of, with_values, ScaleHoldInLoader(flag), HalveBut(sample)], auto_order=True)
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False, transform=pipe)
    loader = ds.loader(B, num_workers=1, seed=seed, cost_dir=False, step_warning=None, step_timeout=1.0,
                       on_error="skip")
    try:
        assert loader.preprocess.pipeline.order == (0, 1, 2, 3)
        flag.touch()
        for _ in range(2):
            box, _ = run_epoch(loader)
            assert box["error"] is None, box["error"]
            assert sorted(i for b in box["batches"] for i, _ in b) == list(range(n))
            assert loader.preprocess.pipeline.order == (0, 1, 2, 3)
        assert any("AutoOrder kept the order" in r.getMessage() and "step_timeout" in r.getMessage()
                   for r in caplog.records)
    finally:
        if flag.exists():
            flag.unlink()
        loader.close()
        ds.close()
