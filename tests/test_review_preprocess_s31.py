"""Review s31 of preprocess/: (1) an item an earlier epoch left behind in a worker (its
iterator left early) that starts a new step after the next epoch began and hangs there
must not be taken for that epoch's copy of the item (engine.py told them apart by when
the step began); (2) files a step reads whose names the fingerprint cannot see. Real
spawned workers, real files."""
import logging
import os
import sys
import time

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from clients.dataset import CachedDataset  # noqa: E402
from clients.sampler import SubstitutableBatchSampler  # noqa: E402
from preprocess import Pipeline, StepTimeout  # noqa: E402
from preprocess.stall import READ  # noqa: E402
from preprocess_steps import MoveSlow, SleepOnce, index_of  # noqa: E402
from procs import wait_until  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402
from test_review_preprocess_stall import epoch_in_thread  # noqa: E402

pytestmark = pytest.mark.timeout(240)
N, B, SEED = 24, 2, 7
SPAN_S = 2.0     # the left-behind item is in this step when the next epoch begins
TIMEOUT_S = 4.0  # step_timeout: over SPAN_S, far under HANG_S
HANG_S = 60.0    # the hung step: never waited out
BOUND_S = 90.0


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_an_abandoned_epochs_item_hung_in_a_step_begun_in_the_next_epoch_fails_none_of_its_items(
        tmp_path, caplog, on_error):
    """Epoch 1's iterator is left after its first batch while its item h is in a worker's
    background thread, in a step that ends SPAN_S later, in epoch 2; h's next step then
    hangs. Epoch 2's own copy of h waits behind it in the same worker. Past step_timeout
    the worker is stopped: the hang is epoch 1's, so epoch 2's h must run again and epoch
    2 yield every item once (exactly_once). Before: the hung step began after epoch 2 did,
    so it was taken for epoch 2's: with on_error="raise" epoch 2 failed with StepTimeout
    for an item whose epoch-2 copy never ran the step; with "skip" h was lost from it."""
    caplog.set_level(logging.WARNING, logger="preprocess")
    h = next(iter(SubstitutableBatchSampler(N, B, None, seed=SEED)))[0]  # epoch 1's first batch
    pipe = Pipeline([index_of, MoveSlow(h), SleepOnce(h, str(tmp_path / "span"), SPAN_S),
                     SleepOnce(h, str(tmp_path / "hang"), HANG_S)])
    ds = CachedDataset(indexed_items(tmp_path / "ds", N), cache=False, transform=pipe)
    lo = ds.loader(B, num_workers=1, seed=SEED, cost_dir=False, on_error=on_error,
                   step_timeout=TIMEOUT_S, step_warning=1.0)
    try:
        for _ in lo:
            break  # epoch 1 left early: h runs on in the worker's background thread
        # the batch does not wait for h's background thread to begin its SPAN_S step (a loaded
        # machine runs it late): wait for it, then epoch 2 begins well within that step
        wait_until(lambda: os.path.exists(tmp_path / "span"), "epoch 1's h to begin its SPAN_S step", BOUND_S)
        first = lo.preprocess.last_run
        t, box = epoch_in_thread(lo)  # epoch 2 begins while h (epoch 1's) is still in its SPAN_S step
        wait_until(lambda: lo.preprocess.last_run is not first, "epoch 2 to begin", BOUND_S)
        assert not os.path.exists(tmp_path / "hang"), "h's SPAN_S step ended before epoch 2 began"
        t.join(BOUND_S)
        assert not t.is_alive(), "epoch 2 did not end"
        assert os.path.exists(tmp_path / "hang"), "epoch 1's h never reached its hanging step"
        assert box["error"] is None, f"epoch 2 failed for epoch 1's hung item: {box['error']!r}"
        got = sorted(i for b in box["batches"] for i in b)
        assert got == list(range(N)), f"epoch 2 did not yield every item once (h={h}): {got}"
        st = lo.epoch_stats[-1].preprocess
        assert (st.timed_out, st.skipped) == (0, 0)
        msgs = [r.getMessage() for r in caplog.records if r.name == "preprocess"]
        assert any(f"item {h} " in m and "over step_timeout" in m and "an earlier epoch left behind" in m
                   for m in msgs), msgs
        assert any(f"item {h} " in m and "has run for" in m and "an earlier epoch left behind" in m
                   for m in msgs), msgs  # the stall warning says whose item it is
    finally:
        lo.close()
        ds.close()


def test_this_epochs_item_over_step_timeout_still_fails(tmp_path):
    """The other side of the identity: a step of this epoch's item over step_timeout
    fails it (StepTimeout), the run number notwithstanding."""
    h = next(iter(SubstitutableBatchSampler(N, B, None, seed=SEED)))[0]
    pipe = Pipeline([index_of, SleepOnce(h, str(tmp_path / "hang"), HANG_S)])
    ds = CachedDataset(indexed_items(tmp_path / "ds", N), cache=False, transform=pipe)
    lo = ds.loader(B, num_workers=1, seed=SEED, cost_dir=False, step_timeout=TIMEOUT_S, step_warning=None)
    try:
        t, box = epoch_in_thread(lo)
        t.join(BOUND_S)
        assert not t.is_alive()
        assert isinstance(box["error"], StepTimeout) and f"item {h} " in str(box["error"]), box["error"]
    finally:
        lo.close()
        ds.close()


# ---- (2) files a step reads under names built at run time ------------------------------

class TableFrom:
    """Adds the number in `<root>/<name>.txt` to the item: the file's name is built when the
    step runs, so the fingerprint never sees it (a vocabulary, a mean/std table)."""

    def __init__(self, root, name="table"):
        self.root, self.name = root, name

    def __call__(self, i):
        with open(os.path.join(self.root, self.name + ".txt")) as f:
            return i + int(f.read())


class DeclaredTable(TableFrom):
    """TableFrom declaring what it reads as an attribute."""

    def __init__(self, root, name="table"):
        super().__init__(root, name)
        self.reads = [root]


def _table(root, value):
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "table.txt"), "w") as f:
        f.write(str(value))


def test_a_declared_directory_enters_the_key_and_an_undeclared_one_does_not(tmp_path):
    """Before: no way to declare the file (step() had no reads=): the key stayed the same
    after the table changed, so items cached under it went stale silently."""
    from preprocess.steps import step
    root = str(tmp_path / "tables")
    _table(root, 1)
    plain = Pipeline([index_of, TableFrom(root)]).fingerprint()
    declared = Pipeline([index_of, step(TableFrom(root), reads=root)]).fingerprint()
    by_attr = Pipeline([index_of, DeclaredTable(root)]).fingerprint()
    assert declared == Pipeline([index_of, step(TableFrom(root), reads=[root])]).fingerprint()  # stable
    _table(root, 2)
    assert Pipeline([index_of, TableFrom(root)]).fingerprint() == plain  # the gap: unseen, as documented
    assert Pipeline([index_of, step(TableFrom(root), reads=root)]).fingerprint() != declared
    assert Pipeline([index_of, DeclaredTable(root)]).fingerprint() != by_attr
    again = Pipeline([index_of, step(TableFrom(root), reads=root)]).fingerprint()
    with open(os.path.join(root, "other.txt"), "w") as f:
        f.write("x")  # a file added under a declared directory changes the key too
    assert Pipeline([index_of, step(TableFrom(root), reads=root)]).fingerprint() != again


def test_a_declared_input_that_is_missing_or_not_a_path_is_refused_by_name(tmp_path):
    from preprocess import Uncacheable
    from preprocess.steps import step
    missing = str(tmp_path / "nope")
    with pytest.raises(Uncacheable, match="nope"):
        Pipeline([index_of, step(TableFrom(missing), reads=missing)]).fingerprint()
    with pytest.raises(TypeError, match="reads="):
        step(TableFrom(missing), reads=3)


def test_a_step_reading_a_file_its_fingerprint_cannot_see_is_warned_about(tmp_path, caplog):
    """Before: nothing said that the key does not follow the table the step reads."""
    caplog.set_level(logging.WARNING, logger="preprocess")
    root = str(tmp_path / "tables")
    _table(root, 1)
    ds = CachedDataset(indexed_items(tmp_path / "ds", N), cache=False,
                       transform=[index_of, TableFrom(root)])
    lo = ds.loader(B, num_workers=0, seed=SEED, cost_dir=False)
    try:
        table = os.path.join(root, "table.txt")
        assert lo.preprocess.unkeyed_reads == {1: [table]}
        msgs = [r.getMessage() for r in caplog.records if r.name == "preprocess"]
        assert any("step 1 (TableFrom)" in m and table in m and "reads=" in m for m in msgs), msgs
        assert sorted(i for b in lo for i in b) == [i + 1 for i in range(N)]
    finally:
        lo.close()
        ds.close()
    caplog.clear()
    for k, steps in enumerate(([index_of, DeclaredTable(root)], [index_of, TableFile(table)])):
        ds = CachedDataset(indexed_items(tmp_path / f"ds{k}", N), cache=False, transform=steps)
        lo = ds.loader(B, num_workers=0, seed=SEED, cost_dir=False)
        try:
            assert lo.preprocess.unkeyed_reads == {}  # declared, or named whole among its attributes
        finally:
            lo.close()
            ds.close()
    assert not [r for r in caplog.records if "does not cover" in r.getMessage()]


class TableFile:
    """Reads a file it names whole: the fingerprint keys it by its content already."""

    def __init__(self, path):
        self.path = path

    def __call__(self, i):
        with open(self.path) as f:
            return i + int(f.read())


def test_items_cached_under_a_declared_table_are_not_served_after_it_changes(tmp_path, server):
    """End to end, with a real cache server: autocache keeps the transformed items under the
    pipeline's key; the declared table changes; the next loader makes them anew."""
    from preprocess.steps import step
    root = str(tmp_path / "tables")
    path = indexed_items(tmp_path / "ds", N)

    def epoch(value):
        _table(root, value)
        ds = CachedDataset(path, cache=server.address, transform=[index_of, step(TableFrom(root), reads=root)])
        lo = ds.loader(B, num_workers=0, seed=SEED, cost_dir=False, autocache="transformed")
        try:
            return sorted(i for b in lo for i in b), lo.autocache.key
        finally:
            lo.close()
            ds.close()

    first, key1 = epoch(1)
    assert first == [i + 1 for i in range(N)]
    again, key2 = epoch(1)
    assert again == first and key2 == key1  # the same table: the same key (the kept items serve)
    changed, key3 = epoch(5)
    assert key3 != key1 and changed == [i + 5 for i in range(N)], changed


def test_an_abandoned_epochs_hung_read_is_reported_as_its_own_and_marks_no_item_of_the_next(tmp_path, caplog):
    """Epoch 1's iterator is left while its worker's read of item f hangs (a FIFO in place of
    f's file); f's file is whole again for epoch 2, whose tasks wait behind that read. Past
    step_timeout the worker is stopped: the hung read is epoch 1's, logged as such, and epoch
    2's items are not sent one per task from then on (they did not hang). Before: the read's
    run was not looked at: no word of the hang, and every item the worker held was read alone."""
    caplog.set_level(logging.WARNING, logger="preprocess")
    root = tmp_path / "ds"
    ds = CachedDataset(indexed_items(root, N), cache=False, transform=Pipeline([index_of]))
    lo = ds.loader(B, num_workers=1, seed=SEED, cost_dir=False, step_warning=None, step_timeout=2.0,
                   task_items=1)
    f = [i for b in SubstitutableBatchSampler(N, B, None, seed=SEED) for i in b][B]  # right after the first batch
    name = os.path.basename(ds.digest.location(f)[0])
    full = next(os.path.join(d, n) for d, _, fs in os.walk(root) for n in fs if n == name)
    with open(full, "rb") as fh:
        data = fh.read()
    os.unlink(full)
    os.mkfifo(full)
    try:
        for _ in lo:
            deadline = time.monotonic() + 1.0  # within step_timeout: epoch 1 must not stop the worker
            while not any(r[1:3] == (f, READ) for r in lo.preprocess.pool.progress()):
                assert time.monotonic() < deadline, "the worker did not start reading f"
                time.sleep(0.01)
            break  # epoch 1 left: its worker is blocked reading f
        os.unlink(full)
        with open(full, "wb") as fh:
            fh.write(data)  # epoch 2 reads f whole
        t, box = epoch_in_thread(lo)
        t.join(BOUND_S)
        assert not t.is_alive() and box["error"] is None, box["error"]
        assert sorted(i for b in box["batches"] for i in b) == list(range(N))
        st = lo.epoch_stats[-1].preprocess
        assert (st.timed_out, st.skipped) == (0, 0) and st.rerun >= 1  # the worker was stopped
        msgs = [r.getMessage() for r in caplog.records if r.name == "preprocess"]
        assert any(f"item {f} " in m and "reading it" in m and "an earlier epoch left behind" in m
                   for m in msgs), msgs
        assert lo.preprocess.last_run.solo == set()
    finally:
        lo.close()
        ds.close()
