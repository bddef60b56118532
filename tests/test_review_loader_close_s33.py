"""Review (s33): a loader closed (loader.close()) while an iterator of its epoch is still held.
close() shuts its persistent DataLoader workers down, and torch's iterator then just ends: the
epoch ended after the batches in hand as if whole (complete=True, the sampler's epoch over), so
the loop silently skipped the rest of its items and a checkpoint resumed past them. The epoch
now raises, saying so, and stays unfinished (its state resumes the items never read)."""
import os
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from filedigest import write_files_digest  # noqa: E402

pytestmark = pytest.mark.timeout(240)
N, B = 64, 8


@pytest.fixture
def ds(tmp_path):
    path = write_files_digest(tmp_path / "ds", (os.urandom(100) for _ in range(N)))
    ds = CachedDataset(path, cache=False)
    yield ds
    ds.close()


def test_an_epoch_whose_workers_close_stopped_raises_and_is_not_over(ds):
    loader = ds.loader(batch_size=B, num_workers=1, seed=3)
    it = iter(loader)
    first = next(it)
    loader.close()
    with pytest.raises(RuntimeError, match=r"closed \(loader.close\(\)\) during epoch 0.* 8 of its items "
                                           r"were handed over"):
        for _ in it:
            pass
    st = loader.epoch_stats[-1]
    assert (st.complete, st.items) == (False, B) and st.misses >= B  # the workers read ahead
    state = loader.state_dict()["sampler"]
    assert (state["epoch"], state["items_delivered"]) == (0, B)  # the epoch resumes what it never read
    again = ds.loader(batch_size=B, seed=3)
    again.load_state_dict(loader.state_dict())
    rest = [i for b in again.batch_sampler for i in b]
    assert len(first) == B and len(rest) == len(set(rest)) == N - B
    assert sum(len(b) for b in loader) == N  # the loader reads on with new workers
    assert loader.epoch_stats[-1].complete


def test_a_loader_without_workers_closed_mid_epoch_reads_its_epoch_on(ds):
    loader = ds.loader(batch_size=B, num_workers=0)
    it = iter(loader)
    n = len(next(it))
    loader.close()  # nothing of its own to stop: its epoch goes on
    n += sum(len(b) for b in it)
    assert n == N and loader.epoch_stats[-1].complete
