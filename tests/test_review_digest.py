"""tools/digest review: progress within a file, HTTP names as the files' names, local
paths holding '::', and the memory the tool holds per item."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import io
import multiprocessing
import os
import sys
import tarfile
import tracemalloc
from pathlib import Path
from typing import Any

import fsspec
import pytest
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import objstore  # noqa: E402

from clients import digest_scan, itemscan  # noqa: E402
from clients.digest import Digest  # noqa: E402
from clients.digest_tool import main  # noqa: E402
from clients.storeread import read_item, read_items  # noqa: E402
from clients.tfrecord import encode_record  # noqa: E402

MiB = 1 << 20


def _tfrecord(path: Path, n: int, size: int) -> list[bytes]:
    recs = [i.to_bytes(4, "little") * (size // 4) for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(encode_record(r) for r in recs))
    return recs


# -- 1. progress moves within a file -------------------------------------------------


class _Bar(tqdm):
    """A real bar, enabled, writing nowhere: records its count at each update."""
    seen: list[int] = []

    def update(self, n: float | None = 1) -> bool | None:
        out = super().update(n)
        _Bar.seen.append(self.n)
        return out


def test_progress_moves_within_one_large_tfrecord(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tfrecord(tmp_path / "d" / "big.tfrecord", 80, 64 * 1024)
    size = (tmp_path / "d" / "big.tfrecord").stat().st_size
    _Bar.seen = []
    monkeypatch.setattr(digest_scan, "progress", lambda total, quiet, desc: _Bar(
        total=total, file=io.StringIO(), mininterval=0, disable=False))
    assert main([str(tmp_path / "d"), "-o", str(tmp_path / "o.dig"), "-f", "tfrecord", "-q", "-j", "1"]) == 0
    assert _Bar.seen[-1] == size  # framing counted: the bar ends at the files' total
    assert len([n for n in _Bar.seen if 0 < n < size]) >= 3, _Bar.seen  # was one update, at the end


@pytest.mark.parametrize("kind", ["files", "tfrecord", "tar"])
def test_scans_tell_their_bytes_as_they_read(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "f"
    if kind == "tfrecord":
        _tfrecord(path, 40, 100 * 1024)
    elif kind == "tar":
        with tarfile.open(path, "w") as tf:
            for i in range(4):
                ti = tarfile.TarInfo(f"k{i}.bin")
                ti.size = MiB
                tf.addfile(ti, io.BytesIO(bytes([i]) * MiB))
    else:
        path.write_bytes(os.urandom(3 * MiB + 5))
    told: list[int] = []
    items = itemscan.scan_local_batch(kind, [(str(path), "f")], True, told.append)
    assert sum(told) == path.stat().st_size and len(told) >= 3, told
    assert len(items) == {"files": 1, "tfrecord": 40, "tar": 4}[kind]


def test_worker_processes_tell_a_shared_counter(tmp_path: Path) -> None:
    _tfrecord(tmp_path / "a", 30, 100 * 1024)
    _tfrecord(tmp_path / "b", 10, 1000)
    read = multiprocessing.Value("Q", 0)
    with cf.ProcessPoolExecutor(2, initializer=itemscan.report_to, initargs=(read,)) as ex:
        items = ex.submit(itemscan.scan_local_batch, "tfrecord", [(str(tmp_path / n), n) for n in "ab"]).result()
    assert read.value == (tmp_path / "a").stat().st_size + (tmp_path / "b").stat().st_size
    assert [len(items.file(k)) for k in range(2)] == [30, 10]


# -- 2. HTTP digests record the files' names --------------------------------------------


NAMES = {"cls a/a b.jpg": b"one", "cls a/c%20d.jpg": b"two", "cls b/\u00e9#q?+;.jpg": b"three"}


def test_http_digest_records_names_as_local_does(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for rel, data in NAMES.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    local, remote = str(tmp_path / "l.dig"), str(tmp_path / "h.dig")
    assert main([str(src), "-o", local, "-q", "--targets", "dir"]) == 0
    with objstore.ObjectStore(src) as store:
        assert main([store.url, "-o", remote, "-q", "--targets", "dir"]) == 0
        d, want = Digest.load(remote), Digest.load(local)
        assert d.paths == want.paths == sorted(NAMES)  # were 'cls%20a/a%20b.jpg', ...
        assert d.fingerprint == want.fingerprint and d.classes == ["cls a", "cls b"]
        assert [read_item(d, i, verify=True) for i in range(len(d))] == [NAMES[p] for p in d.paths]
        fs = fsspec.filesystem("http")
        assert read_items(d, range(len(d)), fs, verify=True) == [NAMES[p] for p in d.paths]
        assert main(["verify", remote, "-q"]) == 0
        # the root as the user types it, unencoded; the items still read back
        assert main([f"{store.url}/cls a", "-o", remote, "-q"]) == 0
        d = Digest.load(remote)
        assert d.paths == ["a b.jpg", "c%20d.jpg"] and read_item(d, 1, verify=True) == b"two"


def test_http_tfrecord_with_a_space_reads_back_by_range(tmp_path: Path) -> None:
    recs = _tfrecord(tmp_path / "src" / "shard 0#.tfrecord", 5, 100)
    with objstore.ObjectStore(tmp_path / "src") as store:
        assert main([store.url, "-o", str(tmp_path / "h.dig"), "-q", "-f", "tfrecord"]) == 0
        d = Digest.load(tmp_path / "h.dig")
        assert d.paths == ["shard 0#.tfrecord"]
        assert read_items(d, range(5), fsspec.filesystem("http"), verify=True) == recs
        assert main(["verify", str(tmp_path / "h.dig"), "-q"]) == 0


# -- 3. local paths holding '::' ---------------------------------------------------------


def test_local_path_with_double_colon(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "x::y" / "data"
    src.mkdir(parents=True)
    (src / "a.txt").write_bytes(b"hello")
    out = str(tmp_path / "o.dig")
    assert main([str(src), "-o", out, "-q"]) == 0, capsys.readouterr().err  # was 'source not found'
    d = Digest.load(out)
    assert d.root == f"file://{src}" and d.paths == ["a.txt"]
    assert read_item(d, 0, verify=True) == b"hello"  # was a read of tmp_path/'x'/'a.txt'
    assert main(["verify", out, "-q"]) == 0
    monkeypatch.chdir(tmp_path)  # relative, and also a chain's spelling: refused, naming both
    (tmp_path / "memory::z").mkdir()
    assert main(["memory::z", "-o", out, "-q"]) == 1
    err = capsys.readouterr().err
    assert "both a local path and an fsspec URL chain" in err and "./memory::z" in err
    (tmp_path / "memory::z" / "b.txt").write_bytes(b"b")
    assert main(["./memory::z", "-o", out, "-q"]) == 0 and Digest.load(out).paths == ["b.txt"]


# -- 4. memory per item --------------------------------------------------------------------


def _peak_per_item(argv: list[str], n: int) -> float:
    tracemalloc.start()
    try:
        assert main(argv) == 0
        return tracemalloc.get_traced_memory()[1] / n
    finally:
        tracemalloc.stop()


def test_memory_per_record_is_compact(tmp_path: Path) -> None:
    n = 60_000
    _tfrecord(tmp_path / "d" / "one.tfrecord", n, 8)
    _tfrecord(tmp_path / "w" / "w.tfrecord", 2, 8)
    out = str(tmp_path / "o.dig")
    assert main([str(tmp_path / "w"), "-o", out, "-q", "-f", "tfrecord"]) == 0  # imports done
    per_item = _peak_per_item([str(tmp_path / "d"), "-o", out, "-q", "-f", "tfrecord", "-j", "1"], n)
    # The digest's own columns take 84 bytes an item; a tuple of Python objects per item
    # took about 600 at the peak.
    assert per_item < 300, per_item
    d = Digest.load(out)
    assert len(d) == n and d.sha256(7) == hashlib.sha256((7).to_bytes(4, "little") * 2).digest()


def test_file_items_index_as_item_tuples() -> None:
    items: Any = itemscan.FileItems(named=True)
    items.append(12, 3, b"s" * 32, b"b" * 32, "k.jpg")
    items.append(40, 0, b"t" * 32, b"c" * 32, "k.cls")
    items.end_file()
    assert list(items) == [(12, 3, b"s" * 32, "k.jpg", b"b" * 32), (40, 0, b"t" * 32, "k.cls", b"c" * 32)]
    assert items[-1] == items[1] and items.file(0) == range(2)
    with pytest.raises(IndexError):
        items[2]


# -- 5. HTTP digests the tool wrote before it recorded names still read ------------------


def test_http_digest_of_the_previous_tool_still_reads(tmp_path: Path) -> None:
    """tools/digest 1 recorded an HTTP listing's names percent-encoded, as listed: a digest
    of it read after names were recorded unencoded (and quoted on read) asked for
    'a%2520b.jpg' (FileNotFoundError in read_item, read_items, CachedDataset, verify)."""
    from clients.digest import DigestBuilder
    from clients.samples import Samples

    src = tmp_path / "src"
    files = {"a b.jpg": b"one", "\u00fc#1.jpg": b"two", "q?+.jpg": b"three", "100%.jpg": b"four"}
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    with objstore.ObjectStore(src) as store:
        # what tools/digest 1 wrote: the listing's names, its meta's tool
        b = DigestBuilder(store.url, "files", {"created": "2026-01-01T00:00:00+00:00",
                                               "tool": "mlcache tools/digest 1"})
        listed = sorted(fsspec.filesystem("http").find(store.url))
        for url in listed:
            name = url[len(store.url) + 1:]
            assert name not in files  # encoded, as the old tool recorded it
            data = fsspec.filesystem("http").cat_file(url)
            b.add(hashlib.sha256(data).digest(), len(data), name)
        old = tmp_path / "old.dig"
        b.build().save(old)
        d = Digest.load(old)
        want = [fsspec.filesystem("http").cat_file(f"{store.url}/{p}") for p in d.paths]
        assert [read_item(d, i, verify=True) for i in range(len(d))] == want
        assert read_items(d, range(len(d)), fsspec.filesystem("http"), verify=True) == want
        assert main(["verify", str(old), "-q"]) == 0
        # a new digest of the same store: names recorded, still quoted on read
        new = tmp_path / "new.dig"
        assert main([store.url, "-o", str(new), "-q"]) == 0
        n = Digest.load(new)
        assert n.paths == sorted(files) and [read_item(n, i, verify=True) for i in range(len(n))] == [
            files[p] for p in n.paths]
    # a WebDataset sample's __url__ from an old HTTP tar digest: the listed URL, not quoted again
    t = DigestBuilder("http://h:1/shards", "tar", {"tool": "mlcache tools/digest 1"})
    t.add(b"s" * 32, 3, "shard%200.tar", 512, name="k.jpg")
    assert Samples(t.build()).assemble(t.build(), [0], [b"abc"])[0]["__url__"] == "http://h:1/shards/shard%200.tar"
