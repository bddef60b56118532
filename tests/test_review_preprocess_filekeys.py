"""Steps that read a file when they run (a vocabulary, a mean/std table) are keyed by the
file's content, not its name: after the file changes, a transformed-mode job over a real
cache server makes its items anew instead of being served those made with the old file.
And a pathlib path keeps one key whatever it cached of itself (str(), hash())."""
import os
import pathlib
import sys
import time

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from clients.dataset import CachedDataset  # noqa: E402
from preprocess import Pipeline, autocache  # noqa: E402
from preprocess.fingerprint import fingerprint  # noqa: E402
from preprocess_steps import index_of  # noqa: E402
from test_autocache import wait_kept  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402

pytestmark = pytest.mark.timeout(180)
N, B = 16, 4


class AddFromFile:
    """Adds the number written in `table` (read at each call, as a vocabulary would be)."""

    def __init__(self, table):
        self.table = table

    def __call__(self, i):
        with open(self.table) as fh:
            return i + int(fh.read())


def plus_one(i):
    return i + 1


def epoch_items(path, server, table):
    ds = CachedDataset(path, cache=server.address,
                       transform=Pipeline([index_of, AddFromFile(table), autocache, plus_one]))
    loader = ds.loader(B, num_workers=0, seed=1, autocache="transformed", cost_dir=False)
    try:
        items = sorted(x for b in loader for x in b)
        wait_kept(ds, loader, N)
        return items
    finally:
        loader.close()
        ds.close()


@pytest.mark.parametrize("as_path", [False, True])
def test_a_changed_file_a_step_reads_is_not_served_from_the_cache(tmp_path, server, as_path):
    path = indexed_items(tmp_path / "ds", N)
    table = tmp_path / "table.txt"
    table.write_text("10")
    name = table if as_path else str(table)
    assert epoch_items(path, server, name) == [i + 11 for i in range(N)]
    table.write_text("50")  # same size: only the content tells
    assert epoch_items(path, server, name) == [i + 51 for i in range(N)]
    table.write_text("10")  # back to the first content: its items are hits again, and right
    assert epoch_items(path, server, name) == [i + 11 for i in range(N)]


def test_file_keys_follow_content_and_are_stable(tmp_path):
    f = tmp_path / "t.bin"
    f.write_bytes(b"a" * 100)
    old = os.stat(f).st_mtime_ns
    k1 = fingerprint(AddFromFile(str(f)))
    f.write_bytes(b"b" * 100)
    os.utime(f, ns=(old, old))  # same size and mtime (a rewrite within one clock tick): content decides
    assert fingerprint(AddFromFile(str(f))) != k1
    p = pathlib.Path(f)
    before = fingerprint(p)
    str(p), hash(p)  # pathlib caches these in its slots
    assert fingerprint(p) == before == fingerprint(pathlib.Path(str(f)))
    assert fingerprint(AddFromFile(str(tmp_path / "absent"))) == fingerprint(AddFromFile(str(tmp_path / "absent")))


def test_an_unreadable_named_file_refuses_a_key(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    from preprocess import Uncacheable
    f = tmp_path / "secret"
    f.write_text("1")
    f.chmod(0)
    try:
        with pytest.raises(Uncacheable, match="secret.*cannot be read"):
            fingerprint(AddFromFile(str(f)))
    finally:
        f.chmod(0o600)


def test_a_hash_is_not_remembered_while_the_file_is_fresh(tmp_path):
    f = tmp_path / "t.bin"
    f.write_bytes(b"x" * 10)
    k1 = fingerprint(str(f))
    t = time.time_ns()
    f.write_bytes(b"y" * 10)
    os.utime(f, ns=(t, t))
    assert fingerprint(str(f)) != k1
