"""The loader's count of batches delivered (saved in its state since the ranks were padded
to len(loader)): a state without it (an older version's, or one of another batch size)
counts on from the batches its items make, and a loader alone (world_size 1) still goes by
the items left, which its sampler yields (a transform's skipped items are tried again).
Real files, real preprocessing in process."""
import os
import struct
import sys
from collections import Counter

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from clients.sampler import SubstitutableBatchSampler  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess_steps import index_of  # noqa: E402
from test_review_loader_ranks import FailSet  # noqa: E402

pytestmark = pytest.mark.timeout(120)
B = 5


def indexed_items(root, n):
    return write_files_digest(root, (struct.pack("<q", i) + os.urandom(8) for i in range(n)))


def as_older_version(state):
    """A state as the loader saved it before batches were counted."""
    s = dict(state["sampler"])
    s.pop("batches_delivered")
    s.pop("batch_size")
    return {"sampler": s}


def take(loader, k):
    it = iter(loader)
    out = [list(next(it)) for _ in range(k)]
    del it
    return out


def test_an_older_state_resumed_twice_keeps_its_count_alone(tmp_path):
    """Resumed from an older state, the count of batches started at 0: saved again and
    resumed, len() said 18 batches where 14 came."""
    ds = CachedDataset(indexed_items(tmp_path / "ds", 100), cache=False)
    ld = ds.loader(B)
    take(ld, 4)
    again = ds.loader(B)
    again.load_state_dict(as_older_version(ld.state_dict()))
    take(again, 2)
    third = ds.loader(B)
    third.load_state_dict(again.state_dict())
    assert len(third) == sum(1 for _ in third) == 14


def test_an_older_state_resumed_twice_yields_each_item_of_a_ranks_share_once(tmp_path):
    """Under DDP the rank padded to the len() of a count that restarted at 0: 4 batches
    of its share's items again (70 items of a 50-item share, 20 twice)."""
    n, W = 100, 2
    ds = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False, transform=Pipeline([index_of]))

    def make():
        return ds.loader(B, rank=0, world_size=W, num_workers=0, cost_dir=False)

    seen, ld = [], make()
    try:
        seen += [i for b in take(ld, 4) for i in b]
        state = as_older_version(ld.state_dict())
    finally:
        ld.close()
    ld = make()
    try:
        ld.load_state_dict(state)
        seen += [i for b in take(ld, 2) for i in b]
        state = ld.state_dict()
    finally:
        ld.close()
    ld = make()
    try:
        ld.load_state_dict(state)
        assert len(ld) == 4
        seen += [i for b in ld for i in b]
    finally:
        ld.close()
    share = SubstitutableBatchSampler(n, B, None, rank=0, world_size=W).share.items(0)
    assert Counter(seen) == Counter(share)


def _skipping_loader(path, bad):
    ds = CachedDataset(path, cache=False, transform=Pipeline([index_of, FailSet(bad)]))
    return ds.loader(B, on_error="skip", cost_dir=False, seed=1, num_workers=0)


def test_alone_a_resumed_epoch_yields_its_items_left_and_len_says_so(tmp_path):
    """world_size 1, in process, one item skipped in each of the first two batches: a state
    saved after them resumed into 3 batches (the skipped items are tried again) where len()
    said 2, and a state saved after 2 of those said the epoch was over: 2 good items of it
    were never yielded."""
    n = 20
    path = indexed_items(tmp_path / "ds", n)
    order = list(SubstitutableBatchSampler(n, B, None, seed=1))
    bad = [order[0][0], order[1][0]]
    seen, ld = [], _skipping_loader(path, bad)
    try:
        seen += [i for b in take(ld, 2) for i in b]
        state = ld.state_dict()
    finally:
        ld.close()
    ld = _skipping_loader(path, bad)
    try:
        ld.load_state_dict(state)
        assert len(ld) == -(-(n - len(seen)) // B)  # the skipped items are tried again
        seen += [i for b in take(ld, 2) for i in b]
        state = ld.state_dict()
    finally:
        ld.close()
    assert state["sampler"]["epoch"] == 0
    ld = _skipping_loader(path, bad)
    try:
        ld.load_state_dict(state)
        seen += [i for b in ld for i in b]
        assert ld.epoch_stats[-1].epoch == 0 and ld.epoch_stats[-1].complete
    finally:
        ld.close()
    assert sorted(seen) == sorted(set(range(n)) - set(bad))
