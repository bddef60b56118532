"""The sampler's epochs and resume as users drive them: a state saved with numpy's
integers for the seed or the epoch is read back by torch.load's default (weights_only);
a state whose rest makes no batch of the resuming loader resumes into the next epoch,
not an empty one; an integer label too large for the digest's targets is named before
hashing. Real files, real loaders (embedded cache), real tools/digest runs."""
import os
import struct
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from clients.sampler import SubstitutableBatchSampler  # noqa: E402
from filedigest import write_files_digest  # noqa: E402

pytestmark = pytest.mark.timeout(120)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def indexed(root, n):
    return write_files_digest(root, (struct.pack("<q", i) + os.urandom(8) for i in range(n)))


def index(x):
    return struct.unpack_from("<q", x)[0]


def test_a_state_with_numpy_seed_and_epoch_loads_with_torch_loads_default(tmp_path):
    """seed=np.int64(3) (a sweep over np.arange) or set_epoch(np.int64(1)) put numpy
    scalars in the state: torch.load refused the checkpoint (weights_only, its default)."""
    path = indexed(tmp_path / "ds", 23)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"), capacity="16MB")
    ld = ds.loader(4, seed=np.int64(3))
    ld.batch_sampler.set_epoch(np.int64(1))
    it = iter(ld)
    first = [index(x) for _ in range(2) for x in next(it)]
    torch.save({"loader": ld.state_dict()}, tmp_path / "ckpt.pt")
    del it
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]
    again = ds.loader(4, seed=3)
    again.load_state_dict(state)
    rest = [index(x) for b in again for x in b]
    assert Counter(first + rest) == Counter(range(23))
    assert again.epoch_stats[-1].epoch == 1
    with pytest.raises(TypeError, match="seed must be an integer, got None"):
        ds.loader(4, seed=None)
    ds.close()


@pytest.mark.parametrize("kw", [dict(batch_size=8, drop_last=True), dict(batch_size=10, drop_last=True)])
def test_a_state_whose_rest_makes_no_batch_here_resumes_into_the_next_epoch(tmp_path, kw):
    """Saved with 7 items left (103 items, batches of 8), resumed by a loader that drops a
    short last batch: the epoch yielded nothing (len 0; a loop averaging over it divides
    by 0). Now it is over, as a state saved at an epoch's last batch."""
    path = indexed(tmp_path / "ds", 103)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"), capacity="16MB")
    ld = ds.loader(8, seed=1)
    it = iter(ld)
    for _ in range(12):
        next(it)
    state = ld.state_dict()
    del it
    assert state["sampler"]["epoch"] == 0 and state["sampler"]["items_delivered"] == 96
    again = ds.loader(seed=1, **kw)
    again.load_state_dict(state)
    assert len(again) == 103 // kw["batch_size"]
    got = [index(x) for b in again for x in b]
    assert len(got) == len(set(got)) == 103 // kw["batch_size"] * kw["batch_size"]
    assert [s.epoch for s in again.epoch_stats] == [1]
    ds.close()


def test_a_ranks_state_resumed_with_a_larger_batch_size_counts_alike():
    """Under DDP the same: every rank's rest makes no batch of 8 (drop_last), so every
    rank goes on to the next epoch, with as many batches."""
    n, W = 103, 2
    lens = []
    for r in range(W):
        s = SubstitutableBatchSampler(n, 5, None, seed=2, rank=r, world_size=W, drop_last=True)
        it = iter(s)
        for _ in range(9):  # 45 of the share's 51 items (10 batches)
            next(it)
            s.delivered()
        t = SubstitutableBatchSampler(n, 8, None, seed=2, rank=r, world_size=W, drop_last=True)
        t.load_state_dict(s.state_dict())
        lens.append((t.epoch, len(t), len(list(t))))
    assert lens == [(1, 6, 6)] * W


def test_an_integer_label_outside_int64_is_named_before_hashing(tmp_path):
    """An id-like label (20 digits) parsed as an integer crashed tools/digest with an
    OverflowError traceback after the whole scan, writing nothing."""
    (tmp_path / "d").mkdir()
    for k in range(3):
        (tmp_path / "d" / f"f{k}").write_bytes(os.urandom(9))
    (tmp_path / "l.csv").write_text("f0,1\nf1,2\nf2,99999999999999999999\n")
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "digest"), str(tmp_path / "d"),
                        "-o", str(tmp_path / "x.dig"), "--targets", str(tmp_path / "l.csv"), "-q"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "label '99999999999999999999' of 'f2' is an integer outside the 64-bit range" in r.stderr
    assert not (tmp_path / "x.dig").exists()
    from clients.targets import from_labels

    assert from_labels(["a", "b"], {"a": -2**63, "b": 2**63 - 1}) == ([-2**63, 2**63 - 1], [])
