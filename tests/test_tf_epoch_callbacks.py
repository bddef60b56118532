"""tf_dataset's epoch callbacks (ds.mlcache.on_epoch_start, on_batch_time) that raise: the
user's error reaches the training loop, and the tf_dataset's epoch stream in the job's chunk
accounting is not left begun (it would keep every other loader of the dataset from releasing a
chunk: tests/test_epoch_callbacks.py). Plain reads (Feed) and parallel reads (TicketFeed). Real
cachemanager and cacheserver on loopback, real tf.data."""
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (the 'tf' extra)")
pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from cacheserver.vocab import Option  # noqa: E402
from clients import tf_dataset  # noqa: E402
import test_review_loaders_chunks_s32 as s32  # noqa: E402
from test_review_loaders_chunks_s32 import N, Watch  # noqa: E402
from test_epoch_callbacks import Refused  # noqa: E402

pytestmark = pytest.mark.timeout(240)
chunked = s32.chunked  # the fixture: a manager chunking the dataset into ten chunks, and the dataset
# tf_dataset's reads: one batch a call (Feed), batches read ahead (Feed and a prefetch), two at once (TicketFeed)
PATHS = {"plain": {"read_ahead": 0}, "ahead": {"read_ahead": 4}, "parallel": {"read_ahead": 0, "read_parallel": 2}}


def refuse_at(n: int):
    """A callback that raises at its n-th call."""
    calls = []

    def cb(*_):
        calls.append(1)
        if len(calls) == n:
            raise Refused("the user's callback refused")
    cb.calls = calls
    return cb


def released_by_a_loader_after(m, ds, hook: str, at: int, **options) -> list:
    """A tf_dataset of the chunked dataset whose `hook` callback raises at its `at`-th call (and is
    called no more after: TensorFlow's calls after the error start no other epoch); then a PyTorch
    loader of its CachedDataset reads a whole epoch: the chunk releases that epoch made."""
    tds = tf_dataset(ds.digest, manager=m.address, job="tf-callbacks", read_batch=10,
                     substitute=False, seed=1, **options)
    src = tds.mlcache
    try:
        assert src.cached.coordinator.plan.option == Option.CHUNKED
        cb = refuse_at(at)
        getattr(src, hook).append(cb)
        with pytest.raises(tf.errors.OpError, match="the user's callback refused"):
            for _ in tds:
                pass
        assert all(not s.complete for s in src.epoch_stats)  # none was recorded whole
        assert len(cb.calls) == at, f"called {len(cb.calls)} times for {at} (an epoch begun after the error)"
        train = src.cached.loader(batch_size=10, substitute=False, seed=2)
        watch = Watch(src.cached, train=train)
        assert sum(len(b) for b in train) == N
        assert watch.early() == [], watch.early()
        return watch.releases
    finally:
        src.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_raising_epoch_start_callback_leaves_no_chunk_held(chunked, path):
    """on_epoch_start raises: no epoch is left begun. (Read ahead or in parallel, TensorFlow
    calls again after the error; that call once began a second epoch, which held its chunks
    until the next iteration: the epoch now begins at the call after the token's, so the call
    after the error ends the iteration: clients/tf_batches.py.)"""
    m, ds = chunked
    assert released_by_a_loader_after(m, ds, "on_epoch_start", 1, **PATHS[path]), \
        "the loader read every chunk while the tf_dataset ran no epoch: releases were due"


@pytest.mark.parametrize("path", PATHS)
def test_a_raising_batch_time_callback_ends_the_epoch(chunked, path):
    """The second batch's callback raises: the tf_dataset's epoch ends there (stopped early;
    read in parallel, it stayed open until the next iteration), and holds no chunk while the
    loader reads."""
    m, ds = chunked
    assert released_by_a_loader_after(m, ds, "on_batch_time", 2, **PATHS[path]), \
        "the loader read every chunk after the tf_dataset's epoch failed: releases were due"
