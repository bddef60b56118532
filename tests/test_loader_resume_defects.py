"""Defects found in the loader's edges: a chunk release that a restarted manager
refuses, integer arguments of the wrong type, a state that is not the loader's."""
import time

import pytest

pytest.importorskip("torch")

from clients.dataset import CachedDataset  # noqa: E402
from clients.sampler import SubstitutableBatchSampler  # noqa: E402
from procs import cachemanager, free_port  # noqa: E402
from test_dataset import make_dataset  # noqa: E402


def test_a_release_refused_by_a_manager_restarted_on_an_empty_state_dir_does_not_break_training(tmp_path):
    """Releases run in the training loop's thread (the sampler's on_batch): a manager that
    forgot the job answers NOT_FOUND, which must back off like an outage, not raise there."""
    from manager.manager_client import Plan

    port = free_port()
    m = cachemanager(str(tmp_path / "m1"), port).start()
    path, _ = make_dataset(tmp_path / "ds", n=40, seed=7)
    ds = CachedDataset(path, cache=False, manager=m.address, job="job-forgotten")
    try:
        m.kill()
        m = cachemanager(str(tmp_path / "m2"), port).start()  # it knows no job, nor the dataset
        coord = ds.coordinator
        coord._set_plan(Plan(ds.dataset_tag, "chunked", 2, 40, 20, 0, None, (0,), 99))
        for b in range(8):  # chunk 0 (half the items) is read after the fourth batch
            coord.consumed(list(range(5 * b, 5 * b + 5)))
        assert 0 not in coord._released  # tried again after the back-off
        assert coord._release_after > time.monotonic()
    finally:
        ds.close()
        m.kill()


@pytest.mark.parametrize("kw, says", [
    (dict(batch_size=None), "batch_size must be an integer, got None"),
    (dict(batch_size=2.5), "batch_size must be an integer, got 2.5"),
    (dict(batch_size=4, lookahead=2.5), "lookahead must be an integer"),
    (dict(batch_size=4, rank=1.0, world_size=2), "rank must be an integer, got 1.0"),
])
def test_integer_arguments_of_another_type_are_named(tmp_path, kw, says):
    """Refused when the loader is made, naming the argument, not with a TypeError from
    inside the first epoch ('slice indices must be integers') or about '<' and None."""
    ds = CachedDataset(make_dataset(tmp_path / "ds", n=10)[0], cache=False)
    with pytest.raises(TypeError, match=says):
        list(ds.loader(**kw))
    with pytest.raises(TypeError, match=says.split(",")[0]):
        list(SubstitutableBatchSampler(10, kw["batch_size"], lambda idx: [0] * len(idx),
                                       **{k: v for k, v in kw.items() if k != "batch_size"}))


def test_numpy_and_torch_integers_are_taken_as_ints(tmp_path):
    import numpy as np
    import torch

    ds = CachedDataset(make_dataset(tmp_path / "ds", n=10)[0], cache=False)
    loader = ds.loader(batch_size=np.int64(4), rank=torch.tensor(1), world_size=np.int32(2))
    assert sum(len(b) for b in loader) == 5
    st = loader.state_dict()["sampler"]
    assert type(st["rank"]) is int and type(st["world_size"]) is int  # torch.load(weights_only=True) reads it


def test_a_state_that_is_not_the_loaders_is_refused_clearly(tmp_path):
    ds = CachedDataset(make_dataset(tmp_path / "ds", n=10)[0], cache=False)
    loader = ds.loader(batch_size=4)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(ValueError, match="takes what this loader's state_dict\\(\\) returned .*got a dict with keys "
                                         "\\['batch_size', 'batches_delivered', 'dataset', 'delivered', 'drop_last', "
                                         "'epoch'"):
        ds.loader(batch_size=4).load_state_dict(state["sampler"])  # the sampler's part alone
    with pytest.raises(ValueError, match="got NoneType"):
        ds.loader(batch_size=4).load_state_dict(None)
