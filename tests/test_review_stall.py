"""Review of the stuck-step watcher (preprocess/stall.py) as the pool and the engine use
it, with real spawned workers and real files: a pool whose workers are ended for a
timeout keeps going past the worker-id cap, and a watcher delayed after reading the
slots (a thread preempted on a loaded machine, the GIL held by the training loop)
does not end a step that finished within step_timeout. Epochs run in a thread joined
under a bound; nothing asserts on timing."""
import os
import sys
import threading
import time
from collections import Counter

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import preprocess.pool as pool_mod  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess.stall import FIELDS, NOT_RUNNING, Slot, StallWatch, Watchdog  # noqa: E402
from preprocess_steps import HangOn, SleepOn, index_of  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402
from test_review_preprocess_stall import epoch_in_thread  # noqa: E402

pytestmark = pytest.mark.timeout(240)
HANG_S = 120.0   # a stuck step: never waited out
BOUND_S = 150.0  # an epoch, worker start-ups on a loaded machine included


def run_epoch(loader):
    """(Counter of the items yielded, the error raised or None), the epoch run in a thread."""
    t, box = epoch_in_thread(loader)
    t.join(BOUND_S)
    assert not t.is_alive(), "the epoch hung"
    items = Counter()
    for b in box["batches"]:
        items.update(b)
    return items, box["error"]


def test_workers_ended_for_a_timeout_do_not_use_up_the_worker_ids(tmp_path, monkeypatch):
    """Every worker ended for step_timeout retired its id for good: after MAX_IDS (128) of
    them over the loader's life (one stuck item an epoch, on_error='skip', for 128 epochs)
    the next replacement raised WorkerDied ('... died; not starting more'). The cap is
    lowered here to 2 ids so that three stuck items reach it."""
    monkeypatch.setattr(pool_mod, "MAX_IDS", 2)
    n, B, stuck = 12, 4, {2, 5, 9}
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False,
                       transform=Pipeline([index_of, HangOn(stuck, HANG_S)]))
    loader = ds.loader(B, num_workers=1, seed=0, cost_dir=False, on_error="skip", step_warning=None,
                       step_timeout=1.0)
    try:
        got, error = run_epoch(loader)
        assert error is None, error
        assert got == Counter(i for i in range(n) if i not in stuck), got  # each other item once
        st = loader.epoch_stats[-1].preprocess
        assert st.timed_out == 3 and st.skipped == 3
        assert loader.preprocess.pool.size == 1
    finally:
        loader.close()
        ds.close()


def test_more_workers_than_ids_is_refused_by_name(tmp_path, monkeypatch):
    """num_workers past the ids there are: a ValueError naming the limit, not
    'max() arg is an empty sequence' from inside the pool."""
    monkeypatch.setattr(pool_mod, "MAX_IDS", 2)
    ds = CachedDataset(indexed_items(tmp_path / "ds", 4), cache=False, transform=Pipeline([index_of]))
    try:
        with pytest.raises(ValueError, match="at most 2 preprocessing workers"):
            ds.loader(2, num_workers=3, seed=0, cost_dir=False)
    finally:
        ds.close()


class _LateDispatcher:
    """pool.progress as the dispatcher sees it when it is held up right after reading the
    slots: once it reads item `item` running, it returns only after that step has ended
    and `late_s` past the step's start (the step's other reads pass through)."""

    def __init__(self, pool, item, late_s):
        self.pool, self.progress, self.item, self.late_s = pool, pool.progress, item, late_s
        self.held = 0

    def __call__(self):
        running = self.progress()
        mine = [r for r in running if r[1] == self.item]
        if mine and not self.held:
            self.held += 1
            started = mine[0][3]
            deadline = time.monotonic() + 60
            while any(r[1] == self.item for r in self.progress()) and time.monotonic() < deadline:
                time.sleep(0.01)
            while time.monotonic_ns() < started + self.late_s * 1e9:
                time.sleep(0.01)
        return running


def test_a_step_that_ended_within_the_timeout_is_not_timed_out_by_a_late_watcher(tmp_path):
    """The watcher took 'now' after reading the slots: a dispatcher held up between the
    two counted the delay as the step's time, ended the worker of an item that had
    finished well within step_timeout and failed it with StepTimeout."""
    n, B, slow = 8, 4, 3
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False,
                       transform=Pipeline([index_of, SleepOn({slow}, 0.5)]))
    loader = ds.loader(B, num_workers=1, seed=0, cost_dir=False, step_warning=None, step_timeout=3.0)
    pool = loader.preprocess.pool
    late = pool.progress = _LateDispatcher(pool, slow, 3.5)
    try:
        got, error = run_epoch(loader)
        assert late.held == 1
        assert error is None, error
        assert got == Counter(range(n)), got
        assert loader.epoch_stats[-1].preprocess.timed_out == 0
    finally:
        loader.close()
        ds.close()


def test_the_watchdog_thread_does_not_end_a_step_that_ended_within_the_timeout():
    """The same in the watchdog thread (steps in the loader's process, a Ray worker, which
    ends its own process past the timeout): held up after reading its slot, it called
    on_timeout for a step that had run 0.6 s of a 2 s limit."""
    class LateSlot(Slot):
        held = 0

        def read(self):
            r = super().read()
            if r is not None and not self.held:
                self.held += 1
                deadline = time.monotonic() + 30
                while self.a[self.base + 1] != NOT_RUNNING and time.monotonic() < deadline:
                    time.sleep(0.01)  # the step ends meanwhile
                while time.monotonic_ns() < r[2] + 2.5e9:
                    time.sleep(0.01)  # past its start + step_timeout
            return r

    slot = LateSlot([NOT_RUNNING] * FIELDS)
    timed_out = []
    with Watchdog(StallWatch(None, 2.0, str, str, str), {"w": slot}, lambda r, secs: timed_out.append(r)):
        slot.item(7)
        slot.at(0)
        time.sleep(0.6)  # the step
        slot.idle()
        deadline = time.monotonic() + 30
        while not slot.held and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(3.0)  # the watchdog's look after its delay
    assert slot.held and timed_out == [], timed_out


def test_close_stops_the_watchdog_of_an_in_process_epoch_whose_iterator_is_kept(tmp_path):
    """num_workers=0: each epoch's watchdog thread lived as long as its iterator, after the
    loader's close() too (an iterator kept in a notebook's variables: a thread each)."""
    def watchdogs():
        return {t for t in threading.enumerate() if t.name == "preprocess-watchdog"}

    before = watchdogs()
    ds = CachedDataset(indexed_items(tmp_path / "ds", 16), cache=False, transform=Pipeline([index_of]))
    loader = ds.loader(4, num_workers=0, seed=0, cost_dir=False, step_warning=5.0)
    kept = []
    try:
        for _ in range(2):  # two epochs started, neither finished nor closed
            it = iter(loader)
            assert len(next(it)) == 4
            kept.append(it)
        assert len(watchdogs() - before) == 2
    finally:
        loader.close()
        ds.close()
    assert watchdogs() - before == set()
    assert len(kept) == 2


class HangFirstTime:
    """Hangs on the given indices in a pool worker while `marker` does not exist (a step
    stuck until its worker is ended; the item's re-run then passes)."""

    def __init__(self, indices, marker):
        self.indices, self.marker = frozenset(indices), marker

    def __call__(self, i):
        import multiprocessing
        worker = multiprocessing.current_process().name.startswith("preprocess-")
        if worker and i in self.indices and not os.path.exists(self.marker):
            time.sleep(HANG_S)
        return i


def test_a_warned_step_whose_worker_died_is_not_said_to_have_gone_on(tmp_path, caplog):
    """A step warned about, then its worker killed (as the out-of-memory killer does): the
    watcher said 'item 5 ... went on after 1.2 s or more', as if the step had ended; the
    item was re-run by a new worker."""
    import logging
    import signal
    caplog.set_level(logging.WARNING, logger="preprocess")
    n, B, stuck = 8, 4, 5
    marker = str(tmp_path / "unstuck")
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False,
                       transform=Pipeline([index_of, HangFirstTime({stuck}, marker)]))
    loader = ds.loader(B, num_workers=1, seed=0, cost_dir=False, step_warning=0.3)
    pool = loader.preprocess.pool
    box = {}
    t = threading.Thread(target=lambda: box.update(run=run_epoch(loader)), daemon=True)
    try:
        t.start()
        deadline = time.monotonic() + BOUND_S
        while not any("has run for" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.05)
        warned = [r.getMessage() for r in caplog.records if "has run for" in r.getMessage()]
        assert warned and f"item {stuck} " in warned[0], warned
        open(marker, "w").close()
        os.kill(next(iter(pool.procs.values())).pid, signal.SIGKILL)
        t.join(BOUND_S + 10)
        got, error = box["run"]
        assert error is None, error
        assert got == Counter(range(n)), got
        assert loader.epoch_stats[-1].preprocess.rerun >= 1
        went_on = [r.getMessage() for r in caplog.records if "went on" in r.getMessage()]
        assert went_on == [], went_on
    finally:
        loader.close()
        ds.close()
