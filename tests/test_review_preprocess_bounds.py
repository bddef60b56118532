"""step_timeout in the loader's own process (num_workers=0): a step stuck on an item, or
a store read that hangs (a FIFO in place of the item's file: a real blocking open),
fails its item naming the item and the step (or the read), or skips it, instead of
holding up the epoch for ever; the other items come exactly once. The stuck step
sleeps HANG_S, far longer than any bound: a test that passes was not waiting it out.
Epochs run in a thread joined under a bound, so a hang fails the test."""
import os
import sys
import time
from collections import Counter

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from clients.dataset import CachedDataset  # noqa: E402
from preprocess import Pipeline, StepTimeout  # noqa: E402
from preprocess_steps import index_of  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402
from test_review_preprocess_stall import epoch_in_thread  # noqa: E402

pytestmark = pytest.mark.timeout(180)
HANG_S = 120.0
BOUND_S = 60.0


class HangWhenFlagged:
    """Sleeps HANG_S on the given indices once `flag` exists (created after the loader has
    profiled its sample, so only the epoch's run of the step hangs)."""

    def __init__(self, indices, flag):
        self.indices, self.flag = frozenset(indices), str(flag)

    def __call__(self, i):
        if i in self.indices and os.path.exists(self.flag):
            time.sleep(HANG_S)
        return i


def run_epoch(loader):
    t0 = time.monotonic()
    t, box = epoch_in_thread(loader)
    t.join(BOUND_S)
    assert not t.is_alive(), "the epoch hung"
    return box, time.monotonic() - t0


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_in_process_step_over_step_timeout_fails_its_item(tmp_path, on_error):
    n, B, stuck = 8, 4, 5
    flag = tmp_path / "hang"
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False,
                       transform=Pipeline([index_of, HangWhenFlagged({stuck}, flag)]))
    loader = ds.loader(B, num_workers=0, seed=0, cost_dir=False, step_warning=None, step_timeout=1.0,
                       on_error=on_error)
    flag.touch()
    try:
        box, secs = run_epoch(loader)
        assert secs < 30
        if on_error == "raise":
            e = box["error"]
            assert isinstance(e, StepTimeout), e
            assert f"item {stuck} (0000{stuck} @ 0+32): step 1 (HangWhenFlagged) ran for" in str(e)
            assert "over step_timeout=1 s" in str(e) and "loader's own process" in str(e)
            return
        assert box["error"] is None, box["error"]
        got = Counter(i for b in box["batches"] for i in b)
        assert got == Counter(i for i in range(n) if i != stuck), got
        st = loader.epoch_stats[-1].preprocess
        assert st.timed_out == 1 and st.skipped == 1
        flag.unlink()  # the next epoch is whole: the abandoned thread holds nothing it needs
        box, _ = run_epoch(loader)
        assert box["error"] is None and sorted(i for b in box["batches"] for i in b) == list(range(n))
    finally:
        loader.close()
        ds.close()


def test_in_process_hung_read_fails_only_the_hung_item(tmp_path):
    """The item's file becomes a FIFO after the loader is made: opening it blocks for ever."""
    n, B, stuck = 8, 4, 2
    root = tmp_path / "ds"
    ds = CachedDataset(indexed_items(root, n), cache=False, transform=Pipeline([index_of]))
    loader = ds.loader(B, num_workers=0, seed=0, cost_dir=False, step_warning=None, step_timeout=1.0,
                       on_error="skip")
    name = ds.digest.location(stuck)[0]
    full = next(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f == os.path.basename(name))
    os.unlink(full)
    os.mkfifo(full)
    try:
        box, secs = run_epoch(loader)
        assert box["error"] is None, box["error"]
        got = Counter(i for b in box["batches"] for i in b)
        assert got == Counter(i for i in range(n) if i != stuck), got
        st = loader.epoch_stats[-1].preprocess
        assert st.timed_out == 1 and st.skipped == 1
        assert f"item {stuck} (" in st.errors[0] and "reading it" in st.errors[0], st.errors
    finally:
        try:  # let the abandoned read go on (to end of file), so its thread ends
            os.close(os.open(full, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        loader.close()
        ds.close()


@pytest.mark.parametrize("task_items", [1, 4])
def test_worker_hung_read_fails_only_the_hung_item(tmp_path, task_items):
    """The same in a worker process: its read of a task hangs; the worker is stopped, and
    only the hung item fails (the task's others are read again, one by one)."""
    n, B, stuck = 8, 4, 2
    root = tmp_path / "ds"
    ds = CachedDataset(indexed_items(root, n), cache=False, transform=Pipeline([index_of]))
    loader = ds.loader(B, num_workers=1, seed=0, cost_dir=False, step_warning=None, step_timeout=1.0,
                       on_error="skip", task_items=task_items)
    name = ds.digest.location(stuck)[0]
    full = next(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f == os.path.basename(name))
    os.unlink(full)
    os.mkfifo(full)
    try:
        box, secs = run_epoch(loader)
        assert box["error"] is None, box["error"]
        got = Counter(i for b in box["batches"] for i in b)
        assert got == Counter(i for i in range(n) if i != stuck), got
        st = loader.epoch_stats[-1].preprocess
        assert st.timed_out == 1 and st.skipped == 1
        assert f"item {stuck} (" in st.errors[0] and "reading it" in st.errors[0], st.errors
    finally:
        loader.close()
        ds.close()


def test_a_step_stuck_on_a_sample_item_fails_making_the_loader(tmp_path):
    """The sample is profiled in the loader's process when the loader is made (whatever
    num_workers): with step_timeout a stuck step there fails it, naming the item and step."""
    import threading

    from preprocess_steps import HangOn
    n, stuck = 8, 3
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False,
                       transform=Pipeline([index_of, HangOn({stuck}, HANG_S, everywhere=True)]))
    box = {}

    def make():
        try:
            box["loader"] = ds.loader(4, num_workers=1, seed=0, cost_dir=False, step_warning=None, step_timeout=1.0)
        except BaseException as e:  # noqa: B036 (reported to the test)
            box["error"] = e

    t = threading.Thread(target=make, daemon=True)
    t.start()
    t.join(BOUND_S)
    try:
        assert not t.is_alive(), "making the loader hung on the stuck sample step"
        e = box.get("error")
        assert isinstance(e, StepTimeout), box
        assert f"item {stuck} (0000{stuck} @ 0+32; a sample item" in str(e) and "step 1 (HangOn)" in str(e)
    finally:
        if "loader" in box:
            box["loader"].close()
        ds.close()
