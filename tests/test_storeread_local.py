"""Local store reads skip fsspec's file object; they must return what fsspec's cat_file does."""
import os

import fsspec
import pytest

from clients.storeread import cat_local


@pytest.fixture
def blob(tmp_path):
    data = os.urandom(300_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    return str(path), data


@pytest.mark.parametrize("start, end", [
    (None, None), (0, 10), (5, 5), (1000, 250_000), (299_990, 300_000), (299_990, 400_000),
    (400_000, 500_000), (0, None), (123, None),
])
def test_cat_local_returns_what_fsspec_returns(blob, start, end):
    path, data = blob
    fs = fsspec.filesystem("file")
    got = cat_local(path, start, end)
    assert got == fs.cat_file(path, start=start, end=end)
    assert got == data[(start or 0):end]
    assert isinstance(got, bytes)


def test_cat_local_refuses_a_backwards_or_negative_range(blob):
    path, _ = blob
    with pytest.raises(ValueError, match="0 <= start <= end"):
        cat_local(path, 10, 5)
    with pytest.raises(ValueError, match="0 <= start <= end"):
        cat_local(path, -1, 5)


def test_cat_local_missing_file_is_the_same_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        cat_local(str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError):
        fsspec.filesystem("file").cat_file(str(tmp_path / "gone"))


def test_a_grown_file_is_still_caught_by_the_digest(tmp_path):
    """Whole files are read whole, so an item that grew after the digest fails its size check."""
    import hashlib

    from clients.digest import DigestBuilder, ItemMismatch
    from clients.storeread import read_item

    root = tmp_path / "ds"
    root.mkdir()
    data = os.urandom(5000)
    (root / "a").write_bytes(data)
    b = DigestBuilder(str(root), "files")
    b.add(hashlib.sha256(data).digest(), len(data), "a")
    digest = b.build()
    fs = fsspec.filesystem("file")
    assert read_item(digest, 0, fs, verify=True) == data
    (root / "a").write_bytes(data + b"more")
    with pytest.raises(ItemMismatch, match="does not match the digest"):
        read_item(digest, 0, fs, verify=True)
