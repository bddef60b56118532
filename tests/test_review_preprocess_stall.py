"""A step stuck on an item (a user function blocked on I/O, a deadlock): with real
spawned workers and real files, a warning names the step and the item within a second
or so (repeated at a growing interval), and with step_timeout the item fails naming
them (or is skipped) and its worker is replaced, instead of the epoch hanging silently.
The stuck step sleeps HANG_S, far longer than any bound here: a test that passes was
not waiting it out. Epochs run in a thread joined under a bound, so a hang fails the
test instead of holding up the suite."""
import logging
import os
import re
import sys
import threading
import time
from collections import Counter

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from clients.dataset import CachedDataset  # noqa: E402
from preprocess import Pipeline, StepTimeout  # noqa: E402
from preprocess.stall import FIELDS, NOT_RUNNING, Slot, StallWatch, local_slot  # noqa: E402
from preprocess.worker import BACKGROUND, MAIN, SLOTS  # noqa: E402
from preprocess_steps import HangOn, SleepOn, index_of  # noqa: E402
from procs import pid_alive  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402

pytestmark = pytest.mark.timeout(180)
HANG_S = 120.0  # the stuck step: never waited out
BOUND_S = 60.0  # worker start-up on a loaded machine included; each case takes a few seconds


def epoch_in_thread(loader):
    box = {"batches": [], "error": None}

    def run():
        try:
            for b in loader:
                box["batches"].append(b)
        except BaseException as e:  # noqa: B036 (reported to the test)
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def logged(caplog, needle, count=1, seconds=BOUND_S):
    """The first `count` messages of the preprocess logger containing needle, waiting for them."""
    deadline = time.monotonic() + seconds
    while True:
        msgs = [r.getMessage() for r in caplog.records if r.name == "preprocess" and needle in r.getMessage()]
        if len(msgs) >= count or time.monotonic() > deadline:
            return msgs
        time.sleep(0.05)


def test_stall_watch_warns_at_a_growing_interval_and_returns_a_timeout_once(caplog):
    caplog.set_level(logging.WARNING, logger="preprocess")
    watch = StallWatch(1.0, 10.0, lambda j: f"s{j}", lambda i: f"#{i}", lambda who: f"at {who}")
    r = ("w", 7, 2, 0)
    s = 1_000_000_000
    for t in (0.5, 1.0, 1.5, 2.1, 3.0, 4.3):  # warned at 1.0, then at 2x: 2.1, then 4.2 -> 4.3
        assert watch.check([r], int(t * s)) == []
    msgs = [m.getMessage() for m in caplog.records]
    assert len(msgs) == 3 and all("item #7: step 2 (s2)" in m and "(at w)" in m for m in msgs)
    assert "it fails at step_timeout=10 s" in msgs[0]
    assert watch.check([r], 10 * s) == [(r, 10.0)]
    assert watch.check([r], 11 * s) == []              # returned once: its caller ends it
    assert watch.check([], 12 * s) == [] and len(caplog.records) == 3  # ended: no "went on"
    watch.check([("w", 8, 0, 0)], 2 * s)
    watch.check([], 3 * s)
    assert "item #8: step 0 (s0) went on after 3.0 s or more" in caplog.records[-1].getMessage()
    assert watch.warned == 2


def test_slots_read_none_between_steps_and_items():
    slot = local_slot()
    assert slot.read() is None
    slot.item(4)
    assert slot.read() is None         # an item between steps is not stuck in one
    slot.at(1)
    item, step, since, run = slot.read()
    assert (item, step, run) == (4, 1, NOT_RUNNING) and abs(since - time.monotonic_ns()) < 1e9
    slot.out()
    assert slot.read() is None


def test_a_workers_slots_keep_each_threads_run_in_its_own_fields():
    """A worker's `running`: one layout, FIELDS per thread, the run of its item among them.
    Before: the runs were kept in two entries after both slots (Slot(run_at=), read_run())."""
    shared = [NOT_RUNNING] * SLOTS
    assert SLOTS == 2 * FIELDS
    main, bg = Slot(shared, MAIN), Slot(shared, BACKGROUND)
    bg.item(9, run=3)
    bg.at(0)
    assert main.read() is None and bg.read()[:2] == (9, 0) and bg.read()[3] == 3
    main.item(5, run=4)
    main.at(2)
    assert main.read()[:2] == (5, 2) and main.read()[3] == 4 and bg.read()[3] == 3
    assert shared[BACKGROUND * FIELDS:] == list(bg.read())  # the background thread's fields, all of them
    assert main.current() == (5, 4) and bg.current() == (9, 3)
    main.idle()
    assert main.read() is None and main.current()[0] == NOT_RUNNING and bg.read()[3] == 3


@pytest.mark.parametrize("kw", [dict(step_warning=0), dict(step_warning=-1), dict(step_timeout="5"),
                                dict(step_timeout=True)])
def test_limits_out_of_range_are_refused(tmp_path, kw):
    ds = CachedDataset(indexed_items(tmp_path / "ds", 4), cache=False, transform=Pipeline([index_of]))
    with pytest.raises(ValueError, match="must be a number of seconds > 0"):
        ds.loader(2, num_workers=1, cost_dir=False, **kw)
    ds.close()


def test_a_step_stuck_in_a_worker_is_warned_about_naming_the_step_and_the_item(tmp_path, caplog):
    """Before: nothing was ever said; the training loop just stopped."""
    caplog.set_level(logging.WARNING, logger="preprocess")
    n, B, stuck = 16, 4, 5
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False,
                       transform=Pipeline([index_of, HangOn({stuck}, HANG_S)]))
    loader = ds.loader(B, num_workers=1, seed=0, cost_dir=False, step_warning=0.5)
    t, box = epoch_in_thread(loader)
    try:
        msgs = logged(caplog, "has run for", count=2)
        assert len(msgs) == 2, msgs
        assert all(f"item {stuck} (0000{stuck} @ 0+32): step 1 (HangOn) has run for" in m for m in msgs), msgs
        assert "worker 0, pid" in msgs[0] and "main thread" in msgs[0] and "step_timeout=" in msgs[0]
        secs = [float(re.search(r"has run for ([\d.]+) s", m).group(1)) for m in msgs]
        assert secs[0] >= 0.5 and secs[1] >= 1.8 * secs[0], secs  # repeated at a growing interval
        assert t.is_alive() and box["error"] is None               # only warned: the step still runs
    finally:
        loader.close()
        ds.close()
    t.join(30)
    assert not t.is_alive()


def test_step_timeout_fails_the_item_naming_the_step_and_stops_its_worker(tmp_path):
    n, B, stuck = 16, 4, 5
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False,
                       transform=Pipeline([index_of, HangOn({stuck}, HANG_S)]))
    loader = ds.loader(B, num_workers=2, seed=0, cost_dir=False, step_warning=None, step_timeout=1.0)
    pool = loader.preprocess.pool
    pids = {wid: p.pid for wid, p in pool.procs.items()}
    try:
        t0 = time.monotonic()
        t, box = epoch_in_thread(loader)
        t.join(BOUND_S)
        assert not t.is_alive(), "the epoch hung on the stuck step"
        assert time.monotonic() - t0 < BOUND_S
        e = box["error"]
        assert isinstance(e, StepTimeout), e
        assert f"item {stuck} (0000{stuck} @ 0+32): step 1 (HangOn) ran for" in str(e)
        assert "over step_timeout=1 s" in str(e) and "worker process" in str(e)
        wid = int(re.search(r"worker process \((\d+)\)", str(e)).group(1))
        assert not pid_alive(pids[wid])                            # stopped, not left sleeping
    finally:
        loader.close()
        ds.close()


def test_step_timeout_in_the_background_thread_skips_the_item_and_later_epochs_are_whole(tmp_path, caplog):
    """The item moves to the worker's background thread after a slow first step, then its
    next step hangs there; on_error='skip': every other item comes exactly once, in this
    epoch and the next (run by the replacement worker), the stuck one is counted."""
    caplog.set_level(logging.WARNING, logger="preprocess")
    n, B, stuck = 16, 4, 5
    # SleepOn's 0.1 s is far over the slow-item timeout (the sample's items take microseconds),
    # far under step_warning: only HangOn is a stall, however loaded the machine (at a load of 9
    # on 2 cores, SleepOn at step_warning=0.3 and an item's 0.4 s read were counted as stalls too)
    pipe = Pipeline([index_of, SleepOn({stuck}, 0.1), HangOn({stuck}, HANG_S)])
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False, transform=pipe)
    loader = ds.loader(B, num_workers=2, seed=0, cost_dir=False, on_error="skip", step_warning=1.0,
                       step_timeout=2.5)
    try:
        for epoch in range(2):
            t, box = epoch_in_thread(loader)
            t.join(BOUND_S)
            assert not t.is_alive() and box["error"] is None, box["error"]
            got = Counter(i for b in box["batches"] for i in b)
            assert got == Counter(i for i in range(n) if i != stuck), got
            st = loader.epoch_stats[-1].preprocess
            assert st.timed_out == 1 and st.skipped == 1 and st.stalled == 1
            assert f"item {stuck} (0000{stuck} @ 0+32): step 2 (HangOn) ran for" in st.errors[0]
        warned = logged(caplog, "has run for")
        assert warned and "background thread" in warned[0], warned
        assert len(logged(caplog, "the item is skipped", count=2)) == 2
    finally:
        loader.close()
        ds.close()


def test_in_process_steps_are_warned_about(tmp_path, caplog):
    """num_workers=0, and the sample profiled when the loader is made: without step_timeout
    the step is named (and its going on) and runs to its end (with it:
    test_review_preprocess_bounds.py)."""
    caplog.set_level(logging.WARNING, logger="preprocess")
    n, B, stuck = 8, 4, 3
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False,
                       transform=Pipeline([index_of, HangOn({stuck}, 2.0, everywhere=True)]))
    loader = ds.loader(B, num_workers=0, seed=0, cost_dir=False, step_warning=0.8)  # far above a loaded read
    try:
        sample = logged(caplog, "a sample item", count=1, seconds=0)
        assert sample and f"item {stuck} (0000{stuck} @ 0+32; a sample item" in sample[0], sample
        assert "step 1 (HangOn)" in sample[0] and "in the loader's own process" in sample[0]
        caplog.clear()
        assert sorted(i for b in loader for i in b) == list(range(n))
        msgs = [r.getMessage() for r in caplog.records]
        assert any(f"item {stuck} (0000{stuck} @ 0+32): step 1 (HangOn) has run for" in m for m in msgs), msgs
        assert any("went on after" in m for m in msgs), msgs
        assert loader.epoch_stats[-1].preprocess.stalled == 1
    finally:
        loader.close()
        ds.close()
