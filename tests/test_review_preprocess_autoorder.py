"""AutoOrder checks its swaps on the 16 sample items only. A reorder that passes there
but gives another item another output must not be served silently: the whole order is
checked against the written one on other items before it serves any, and where one
differs the written order runs (a warning names the item). Real files, real loader."""
import logging
import os
import random
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from clients.dataset import CachedDataset  # noqa: E402
from preprocess import Pipeline, step  # noqa: E402
from preprocess.measure import agree  # noqa: E402
from preprocess_steps import HalveBut, index_of, scale_values, with_values  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402

pytestmark = pytest.mark.timeout(180)
N, B, SEED, SAMPLE = 40, 8, 5, 16  # SAMPLE: the scheduler's SAMPLE_ITEMS


class ReverseOn:
    """Reverses the values of the given items (identity on the others: neutral)."""

    def __init__(self, indices):
        self.indices = frozenset(indices)

    def __call__(self, item):
        i, v = item
        return (i, v[::-1].copy()) if i in self.indices else item


def ramp(i):
    return (i, np.arange(64, dtype=np.float64) + i)


def sampled():
    return random.Random(f"{SEED}/sample").sample(range(N), SAMPLE)  # as Scheduler._profile draws them


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_reorder_that_differs_off_the_sample_is_not_served(tmp_path, caplog, num_workers):
    caplog.set_level(logging.WARNING, logger="preprocess")
    odd = next(i for i in range(N) if i not in sampled())
    # reversing then halving differs from halving then reversing, but only on `odd`
    steps = [index_of, ramp, ReverseOn({odd}), HalveBut(())]
    written = Pipeline(list(steps))
    ds = CachedDataset(indexed_items(tmp_path / "ds", N), cache=False, transform=Pipeline(steps, auto_order=True))
    loader = ds.loader(B, num_workers=num_workers, seed=SEED, cost_dir=False)
    try:
        engine = loader.preprocess
        assert odd not in engine.sample_indices
        got = {item[0]: item for b in loader for item in b}
        assert sorted(got) == list(range(N))
        bad = [i for i in range(N) if not agree(got[i], written.apply(i.to_bytes(8, "little") + bytes(24)))]
        assert bad == [], f"served other items than the written order makes: {bad}"
        assert engine.pipeline.order == (0, 1, 2, 3)
        assert f"gave item {odd} (" in engine.pipeline.order_report
        assert any("went back to the written order" in r.getMessage() for r in caplog.records)
    finally:
        loader.close()
        ds.close()


def test_a_reorder_that_holds_on_other_items_is_kept(tmp_path):
    """Scaling and halving commute on every item: AutoOrder's order stands."""
    pipe = Pipeline([index_of, with_values, scale_values, step(HalveBut(()))], auto_order=True)
    ds = CachedDataset(indexed_items(tmp_path / "ds", N), cache=False, transform=pipe)
    loader = ds.loader(B, num_workers=0, seed=SEED, cost_dir=False)
    try:
        assert loader.preprocess.pipeline.order == (0, 1, 3, 2), loader.preprocess.pipeline.order_report
        assert sorted(i for b in loader for i, _ in b) == list(range(N))
    finally:
        loader.close()
        ds.close()
