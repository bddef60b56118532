"""The loader with a transform that skips items (on_error="skip") across ranks and
resumes: every rank yields as many batches (DDP's collectives wait for each rank's),
no empty batch, and a state saved after an epoch resumes into the next one.
Real spawned ranks (gloo on loopback) and preprocessing workers, real files."""
import datetime
import json
import os
import struct
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from clients.sampler import SubstitutableBatchSampler  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess_steps import index_of  # noqa: E402
from procs import free_port, run_ranks as spawn_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(240)
B, W = 5, 2


class FailSet:
    """Raises on the given item indices (a transform step; pickles for spawned workers)."""

    def __init__(self, bad):
        self.bad = set(bad)

    def __call__(self, i):
        if i in self.bad:
            raise ValueError(f"bad item {i}")
        return i


def indexed_items(root, n):
    return write_files_digest(root, (struct.pack("<q", i) + os.urandom(8) for i in range(n)))


def share(n, rank, epoch=0, drop_last=False, seed=0):
    sampler = SubstitutableBatchSampler(n, B, None, seed=seed, rank=rank, world_size=W, drop_last=drop_last)
    return sampler.share.items(epoch)


def loader(path, bad, **kw):
    ds = CachedDataset(path, cache=False, transform=Pipeline([index_of, FailSet(bad)]))
    return ds.loader(B, on_error="skip", cost_dir=False, **kw)


def _ddp_rank(rank, port, path, bad, drop_last, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=30))
    try:
        ld = loader(path, bad, num_workers=1, drop_last=drop_last)  # rank, world size: torch.distributed's
        sizes = []
        for batch in ld:
            dist.all_reduce(torch.ones(1))  # as DDP's gradient sync: every rank must come
            sizes.append(len(batch))
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"sizes": sizes, "len": len(ld)}, f)
        ld.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n, drop_last", [(20, True), (22, False)])
def test_ddp_ranks_yield_as_many_batches_when_the_transform_skips_items(tmp_path, n, drop_last):
    """One item of rank 0's share fails: its workers regroup the rest into fewer batches
    (20 items, drop_last: 1 full batch against 2; 22: 2 against 3), and rank 1 waited
    in all_reduce for ever. Now rank 0 pads, as DistributedSampler pads a share."""
    path = indexed_items(tmp_path / "ds", n)
    bad = [share(n, 0, drop_last=drop_last)[0]]
    spawn_ranks(_ddp_rank, (free_port(), path, bad, drop_last, str(tmp_path)), W)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(W)]
    want = (n // W) // B if drop_last else -(-(-(-n // W)) // B)
    assert [len(r["sizes"]) for r in ranks] == [want, want] == [r["len"] for r in ranks]
    assert all(s == B for s in ranks[0]["sizes"])  # the padding is full batches


def test_a_state_saved_after_an_epoch_with_skipped_items_resumes_into_the_next_epoch(tmp_path):
    """The skipped item stayed 'not delivered': a state saved after the whole epoch resumed
    into that epoch again (its skipped item, an empty epoch), one epoch behind the loop."""
    n = 9
    path = indexed_items(tmp_path / "ds", n)
    ld = loader(path, [3], num_workers=0, seed=1)
    assert sorted(i for b in ld for i in b) == [i for i in range(n) if i != 3]
    state = ld.state_dict()
    assert state["sampler"]["epoch"] == 1
    again = loader(path, [3], num_workers=0, seed=1)
    again.load_state_dict(state)
    assert sorted(i for b in again for i in b) == [i for i in range(n) if i != 3]
    assert [(s.epoch, s.complete) for s in again.epoch_stats] == [(1, True)]


def test_a_resumed_epoch_whose_last_item_is_skipped_is_empty_and_counted(tmp_path):
    """Resumed with only a failing item left, the epoch yields no batch (not an empty
    one), is recorded as that epoch, and the next iteration is the next epoch."""
    n = 11
    path = indexed_items(tmp_path / "ds", n)
    order = [i for b in SubstitutableBatchSampler(n, B, None, seed=2) for i in b]
    bad = order[-1]  # the plain permutation's last item: alone in the sampler's last batch
    ld = loader(path, [bad], num_workers=0, seed=2)
    it = iter(ld)
    next(it), next(it)
    state = ld.state_dict()
    assert state["sampler"]["epoch"] == 0 and state["sampler"]["items_delivered"] == 10
    again = loader(path, [bad], num_workers=0, seed=2)
    again.load_state_dict(state)
    assert list(again) == []
    assert [(s.epoch, s.complete, s.batches) for s in again.epoch_stats] == [(0, True, 0)]
    assert sorted(i for b in again for i in b) == [i for i in range(n) if i != bad]
    assert again.epoch_stats[-1].epoch == 1


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resumed_ranks_yield_as_many_batches_and_no_empty_one(tmp_path, num_workers):
    """Saved mid-epoch on both ranks; rank 0's one item left fails. It yielded an empty
    batch (in process) or none (workers) against rank 1's one: now both yield one, full."""
    n, states = 22, []
    path = indexed_items(tmp_path / "ds", n)
    s0 = share(n, 0)
    for r in range(W):
        ld = loader(path, [], num_workers=0, rank=r, world_size=W)
        it = iter(ld)
        next(it), next(it)
        states.append(ld.state_dict())
        ld.close()
    left = set(s0) - {i for i, d in enumerate(_bits(states[0], n)) if d}
    assert len(left) == 1
    got = []
    for r in range(W):
        ld = loader(path, left if r == 0 else [], num_workers=num_workers, rank=r, world_size=W)
        try:
            ld.load_state_dict(states[r])
            got.append([list(b) for b in ld])
            assert ld.epoch_stats[-1].complete and ld.state_dict()["sampler"]["epoch"] == 1
        finally:
            ld.close()
    assert [len(b) for b in got[0]] == [B] and len(got[1]) == 1
    assert set(got[0][0]) <= set(s0) - left


def _bits(state, n):
    import numpy as np

    return np.unpackbits(np.frombuffer(state["sampler"]["delivered"], np.uint8), count=n)


def test_a_rank_whose_every_item_fails_says_so(tmp_path):
    """Nothing to pad with: a clear error, not a rank that yields nothing (or empty
    batches) while the others wait for it in a collective."""
    n = 20
    path = indexed_items(tmp_path / "ds", n)
    ld = loader(path, share(n, 0), num_workers=0, rank=0, world_size=W)
    with pytest.raises(RuntimeError, match="rank 0 of 2: the transform failed on every item of its share"):
        list(ld)


def test_a_state_resumed_with_another_batch_size_counts_its_batches_by_items(tmp_path):
    """Batches delivered are counted in the state (the same on every rank); resumed with
    another batch size, the items left say how many batches come."""
    n = 20
    path = indexed_items(tmp_path / "ds", n)
    ds = CachedDataset(path, cache=False)
    ld = ds.loader(4)
    it = iter(ld)
    next(it), next(it)
    state = ld.state_dict()
    again = ds.loader(8)
    again.load_state_dict(state)
    assert len(again) == 2 and sum(len(b) for b in again) == 12
