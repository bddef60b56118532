"""Same-host coalescing through CachedDataset (claims off, an embedded cache to insert into):
every claim of a batch is let go whatever its store read does, and the dataset's
coalescing directory goes when the dataset is closed."""
import os

import pytest

pytest.importorskip("torch")

from test_dataset import make_dataset  # noqa: E402

from clients.coalesce import PREFIX, HostCoalescer  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from clients.digest import ItemMismatch  # noqa: E402


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_failed_store_read_lets_go_of_every_claim_of_its_batch(tmp_path, shm):
    """Item 1 is being read by another reader (its claim held) and item 0 has changed in the
    store: the batch raises, and neither its own claim nor its claim on item 1 stays open."""
    path, items = make_dataset(tmp_path / "ds", n=4)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "cache"), coalesce=True, claims=False)
    try:
        assert ds.read([3]) == [items[3]]  # the process's state is open: it is no leak
        other = HostCoalescer(ds.dataset_tag)
        held = other.claim(ds.ids_for([1])[0])
        assert held.first
        with open(tmp_path / "ds" / "img00000.bin", "r+b") as f:
            f.write(b"changed")
        before = _fds()
        for _ in range(3):
            with pytest.raises(ItemMismatch):
                ds.read([0, 1])
        assert _fds() == before
        held.release()
        mine = other.claim(ds.ids_for([0])[0])
        assert mine.first  # the failed batch's own claim was let go too
        mine.release()
        assert ds.read([1]) == [items[1]]
        other.close()
    finally:
        ds.close()


def test_closing_the_dataset_removes_its_coalescing_directory(tmp_path, shm):
    path, items = make_dataset(tmp_path / "ds", n=4)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "cache"), coalesce=True, claims=False)
    assert ds.read([0, 1]) == [items[0], items[1]]
    assert os.listdir(shm) == [PREFIX + ds.dataset_tag]
    ds.close()
    assert os.listdir(shm) == []
