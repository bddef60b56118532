"""Autocache defects found in review: real cache server, real files."""
import math
import os
import random
import struct
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.autocache import transform_key  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from preprocess import Pipeline, step  # noqa: E402
from test_autocache_defects import fail_on_3, index_of, plus1, times10  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def test_an_epoch_with_skipped_items_is_decided(tmp_path, server, monkeypatch):
    """Before: the threshold compared items finished, skipped ones left out: an epoch shorter
    than a batch with one item skipped (on_error="skip") never reached it, and "auto"
    measured (and put speculatively) every epoch for ever."""
    import manager.policy.autocache as policy

    monkeypatch.setattr(policy, "CLEAR", math.inf)  # measured, not decided on the estimate
    path = write_files_digest(tmp_path / "ds", (struct.pack("<q", i) + bytes(56) for i in range(6)))
    ds = CachedDataset(path, cache=server.address, transform=Pipeline([index_of, fail_on_3, times10, plus1]))
    lo = ds.loader(8, num_workers=0, seed=3, autocache="auto", epochs=3, cost_dir=False, on_error="skip")
    try:
        assert lo.autocache.state == "measuring"
        for _ in range(2):
            assert sorted(x for b in lo for x in b) == [10 * i + 1 for i in range(6) if i != 3]
        assert lo.epoch_stats[-1].preprocess.skipped == 1
        assert lo.autocache.state == "decided", lo.autocache.reason
        assert not lo.autocache.shared.keep()
    finally:
        lo.close()


def _as_array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).astype(np.float32)


def _tile_marked(x: np.ndarray) -> np.ndarray:
    """Inflates the marked items only: none of the sample's, so AutoOrder's first order
    (neutral) is revised after the first epoch (inflating)."""
    return np.tile(x, 4) if x[1] == 255 else x


def _flip(x: np.ndarray) -> np.ndarray:
    return x[::-1].copy() if np.random.rand() < 0.5 else x


def _ends(x: np.ndarray) -> float:
    return float(x[0] * 1000 + x[-1])  # the item and whether it was flipped


def test_a_revised_order_moves_the_caching_point(tmp_path, server):
    """Before: AutoOrder's revision after the first epoch moved the random flip before
    the (then inflating) tile, so the cacheable prefix shrank from 2 steps to 1; the
    loader kept its caching point of 2 and put the flip's outputs, a random step's,
    under a key without the epoch: from the third epoch every item came flipped as in
    the second."""
    n, seed = 64, 3
    sample = set(random.Random(f"{seed}/sample").sample(range(n), 16))

    def blob(i: int) -> bytes:
        b = bytearray(64)
        b[0], b[-1] = i, 200
        if i not in sample:
            b[1] = b[-2] = 255
        return bytes(b)

    path = write_files_digest(tmp_path / "ds", (blob(i) for i in range(n)))
    p = Pipeline([_as_array, _tile_marked, step(_flip, random=True), _ends], auto_order=True)
    ds = CachedDataset(path, cache=server.address, transform=p)
    lo = ds.loader(8, num_workers=0, seed=seed, autocache="transformed", cost_dir=False)
    try:
        assert lo.autocache.cut == 2
        epochs = [sorted(x for b in lo for x in b) for _ in range(4)]
        assert lo.preprocess.pipeline.order == (0, 2, 1, 3)  # revised: the flip first
        assert lo.autocache.cut == 1 and lo.autocache.key == transform_key(ds, lo.preprocess.pipeline, 1, lo.autocache.seed)
        assert epochs[2] != epochs[3]  # the flip draws anew each epoch
    finally:
        lo.close()
