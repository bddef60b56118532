"""Review s32 of preprocess/: (1) WorkerDied named the items a dead worker held by number
only, and named an item an earlier epoch left behind in it as one it was running for this
epoch; (2) two threads of one worker stuck past step_timeout at once: only the first was
recorded, so the other's item (this epoch's) ran again, to hang for a second step_timeout
(or, had its hang passed, to be yielded although its step ran past the limit). Real spawned
workers, real files; epochs run in a thread joined under a bound."""
import os
import re
import sys
import time

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from clients.dataset import CachedDataset  # noqa: E402
from clients.sampler import SubstitutableBatchSampler  # noqa: E402
from preprocess import Pipeline, WorkerDied  # noqa: E402
from preprocess.worker import MAIN  # noqa: E402
from preprocess_steps import (HoldUpLoaderOn, KillWhile, MoveSlow, SleepOnce, SleepOutsideWorkers,  # noqa: E402
                              index_of)
from test_preprocess_loader import indexed_items  # noqa: E402
from test_review_preprocess_stall import epoch_in_thread  # noqa: E402

pytestmark = pytest.mark.timeout(240)
N, B, SEED = 24, 2, 7
HANG_S = 60.0    # a hung step: never waited out
TIMEOUT_S = 2.0  # step_timeout
HOLD_S = 5.0     # the loader's result reader held up: over TIMEOUT_S with room to spare
BOUND_S = 90.0
NAMED = re.compile(r"item (\d+) \((\S+ @ \d+\+\d+)\)")  # an item by index and place (path @ offset+length)


def sampler_order():
    return [i for b in SubstitutableBatchSampler(N, B, None, seed=SEED) for i in b]


def wait_main_idle(pool, wid=0, seconds=10.0):
    """Until worker wid's main thread has run no item for a while (epoch 1's last task done)."""
    deadline, idle_since = time.monotonic() + seconds, None
    while time.monotonic() < deadline:
        if any(who[:2] == (wid, MAIN) for who, *_ in pool.progress()):
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > 0.5:
            return
        time.sleep(0.02)
    raise AssertionError("the worker's main thread did not go idle")


def test_worker_died_names_this_epochs_items_by_place_and_an_earlier_epochs_as_such(tmp_path):
    """Epoch 1 is left early while its item h runs on in the worker's background thread;
    in epoch 2 every worker is killed on its first item (a crashing decoder). Before: the
    first death read "running item k (...), item h (...)", h epoch 1's, and the items held
    were numbers ("holding items [3, 9]")."""
    h = sampler_order()[0]  # epoch 1's first item: slow, so it moves to the background
    kill = str(tmp_path / "kill")
    pipe = Pipeline([index_of, MoveSlow(h), SleepOnce(h, str(tmp_path / "span"), HANG_S), KillWhile(kill)])
    ds = CachedDataset(indexed_items(tmp_path / "ds", N), cache=False, transform=pipe)
    lo = ds.loader(B, num_workers=1, seed=SEED, cost_dir=False, step_warning=None, auto_order=False)
    try:
        for _ in lo:
            break  # epoch 1 left: h is in its long step in the background thread
        assert os.path.exists(tmp_path / "span")
        wait_main_idle(lo.preprocess.pool)
        open(kill, "w").close()
        t, box = epoch_in_thread(lo)
        t.join(BOUND_S)
        assert not t.is_alive(), "epoch 2 did not end"
        e = box["error"]
        assert isinstance(e, WorkerDied), e
        deaths = str(e).split("giving up. ", 1)[1].split("; ")
        assert len(deaths) == 4, str(e)
        first = deaths[0]
        assert first.startswith("worker 0 was killed by SIGKILL") and ", running item " in first, first
        running = first.split(", running ", 1)[1].split(", and an item an earlier epoch", 1)[0]
        running = running.split(", holding ", 1)[0]
        assert len(NAMED.findall(running)) == 1, first  # the main thread's item of epoch 2 only
        assert f"and an item an earlier epoch left behind (not this epoch's): item {h} (" in first, first
        for d in deaths:
            held = d.split(", holding ", 1)
            assert len(held) == 2 and NAMED.fullmatch(held[1].split(", ")[0]), d  # named by place
            assert not re.search(r"items \[", d), d
    finally:
        lo.close()
        ds.close()


def test_two_threads_of_one_worker_over_step_timeout_fail_both_items_at_once(tmp_path):
    """x moves to the worker's background thread and hangs there; z's output holds up the
    loader's reader of results for HOLD_S; y, right after z in the main thread, hangs too.
    The first look after HOLD_S finds both steps over step_timeout. Both hangs pass once
    (SleepOnce): an item run again would not hang again. Before: only y (the main thread's,
    read first) was recorded; x ran again in the replacement worker and was yielded, its
    step's timeout never counted: a hang that lasted would have cost a second step_timeout."""
    x, z, y = sampler_order()[:3]
    pipe = Pipeline([index_of, SleepOutsideWorkers(0.05), MoveSlow(x, 0.5), HoldUpLoaderOn(z, HOLD_S),
                     SleepOnce(x, str(tmp_path / "x"), HANG_S), SleepOnce(y, str(tmp_path / "y"), HANG_S)])
    ds = CachedDataset(indexed_items(tmp_path / "ds", N), cache=False, transform=pipe)
    lo = ds.loader(B, num_workers=1, seed=SEED, cost_dir=False, on_error="skip", step_warning=None,
                   step_timeout=TIMEOUT_S, auto_order=False)
    try:
        t, box = epoch_in_thread(lo)
        t.join(BOUND_S)
        assert not t.is_alive(), "the epoch did not end"
        assert box["error"] is None, box["error"]
        assert os.path.exists(tmp_path / "x") and os.path.exists(tmp_path / "y")  # both hung
        got = sorted(i for b in box["batches"] for i in b)
        assert got == sorted(set(range(N)) - {x, y}), f"x={x}, y={y}: {got}"
        st = lo.epoch_stats[-1].preprocess
        assert (st.timed_out, st.skipped) == (2, 2), (st.timed_out, st.skipped, st.errors)
        assert sorted(int(re.match(r"item (\d+) ", e).group(1)) for e in st.errors) == sorted([x, y]), st.errors
        assert all("over step_timeout=2 s" in e for e in st.errors), st.errors
    finally:
        lo.close()
        ds.close()
