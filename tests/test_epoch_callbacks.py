"""A front end's epoch callbacks (clients/epochs.py: on_epoch_start, on_batch_time, on_epoch_end)
that raise. The user's exception reaches the training loop, and nothing of the job's coordination
stays begun: a loader's epoch stream in the chunk accounting (clients/coordination.py) holds the
chunks it has not read while its epoch is in progress, so a stream started by an epoch that never
ran (nor ended) kept every other loader of the job from releasing a chunk. Real cachemanager and
cacheserver on loopback (tests/procs.py)."""
import os
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from test_dataset import make_dataset  # noqa: E402
import test_review_loaders_chunks_s32 as s32  # noqa: E402
from test_review_loaders_chunks_s32 import N, Watch  # noqa: E402

pytestmark = pytest.mark.timeout(240)
chunked = s32.chunked  # the fixture: a manager chunking the dataset into ten chunks, and the dataset


class Refused(Exception):
    """The user's callback's own error."""


def refuse(*_):
    raise Refused("the user's callback refused")


def test_a_raising_epoch_start_callback_leaves_no_chunk_held(chunked):
    """An eval loader's on_epoch_start callback raises: the user sees its error, and the train
    loader's epoch then releases the chunks it reads (the eval epoch that never ran holds none)."""
    _, ds = chunked
    train = ds.loader(batch_size=10, substitute=False, seed=1)
    evaluate = ds.loader(batch_size=25, substitute=False, seed=2)
    watch = Watch(ds, train=train, eval=evaluate)
    evaluate.on_epoch_start.append(refuse)
    with pytest.raises(Refused):
        for _ in evaluate:
            pass
    assert [s.epoch for s in evaluate.epoch_stats] == []  # no epoch ran
    for _ in train:
        pass
    assert watch.releases, "train read every chunk while eval ran no epoch: releases were due"
    assert watch.early() == [], watch.early()
    evaluate.on_epoch_start.remove(refuse)  # the loader still runs whole epochs afterwards
    assert sum(len(b) for b in evaluate) == N and evaluate.epoch_stats[-1].complete


def test_a_raising_epoch_end_callback_still_ends_the_epoch(chunked):
    """An eval epoch left after one batch, whose on_epoch_end callback (first in the list) raises
    as the epoch closes: the user sees the error, the epoch is recorded as stopped early, and it
    holds no chunk: train's reads alone release the chunks it reads to the end."""
    _, ds = chunked
    train = ds.loader(batch_size=10, substitute=False, seed=1)
    evaluate = ds.loader(batch_size=25, substitute=False, seed=2)
    watch = Watch(ds, train=train, eval=evaluate)
    evaluate.on_epoch_end.insert(0, refuse)
    it = iter(evaluate)
    next(it)
    with pytest.raises(Refused):
        it.close()  # the loop leaves the epoch: its end runs the callbacks
    watch.end("eval")
    assert evaluate.epoch_stats[-1].complete is False and evaluate.epoch_stats[-1].items == 25
    for _ in train:
        pass
    assert watch.releases, "train read every chunk after eval stopped: releases were due"
    assert watch.early() == [], watch.early()


def test_a_raising_batch_time_callback_counts_no_batch_not_handed_over(tmp_path):
    """on_batch_time raising at the third batch: that batch is not handed over, and the epoch's
    record and state say so (two batches, their items; a resume reads the third again)."""
    path, _ = make_dataset(tmp_path / "ds", n=40, seed=5)
    ds = CachedDataset(path, cache=False)
    try:
        loader = ds.loader(batch_size=4, substitute=False, seed=1)
        calls = []

        def third(end, duration):
            calls.append(duration)
            if len(calls) == 3:
                refuse()
        loader.on_batch_time.append(third)
        got = []
        with pytest.raises(Refused):
            for batch in loader:
                got.append(batch)
        st = loader.epoch_stats[-1]
        assert (len(got), st.batches, st.items, st.complete) == (2, 2, 8, False), st
        assert len(loader.batch_times) == 2
        assert loader.state_dict()["sampler"]["items_delivered"] == 8
    finally:
        ds.close()
