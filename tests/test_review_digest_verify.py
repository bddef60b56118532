"""tools/digest verify: a file that changed size is told by its size, not by reading it
whole; the progress bar moves within a large file."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import objstore  # noqa: E402

from clients import digest_verify  # noqa: E402
from clients.digest_tool import main  # noqa: E402

MiB = 1 << 20
GROWN = 24 * MiB  # under itemscan.SMALL_REMOTE: read in one request, before


def _dataset(root: Path) -> None:
    root.mkdir()
    (root / "a.bin").write_bytes(os.urandom(1000))
    (root / "b.bin").write_bytes(os.urandom(3000))
    (root / "empty.bin").write_bytes(b"")


@pytest.fixture
def http_digest(tmp_path: Path) -> Iterator[tuple[objstore.ObjectStore, Path, str]]:
    _dataset(tmp_path / "d")
    with objstore.ObjectStore(tmp_path) as store:
        out = str(tmp_path / "d.dig")
        assert main([store.url + "/d", "-o", out, "-q"]) == 0
        yield store, tmp_path / "d", out


def _verify(out: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(["verify", out, "-q"])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


@pytest.mark.parametrize("path", ["small", "streamed"])
def test_http_grown_file_is_told_by_its_size(http_digest: tuple[objstore.ObjectStore, Path, str], path: str,
                                             capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    store, root, out = http_digest
    if path == "streamed":  # files over SMALL_REMOTE are streamed
        monkeypatch.setattr(digest_verify, "SMALL_REMOTE", 0)
    assert _verify(out, capsys)[0] == 0
    with open(root / "a.bin", "r+b") as f:
        f.truncate(GROWN)
    store.reset_stats()
    rc, text = _verify(out, capsys)
    assert rc == 1 and f"a.bin @ 0+1000: size mismatch (store has {GROWN} bytes)" in text, text
    served = store.stats()["by_path"]["d/a.bin"]["bytes"]
    assert served <= 1001, served  # was the whole 24 MiB, to find it no longer 1000 bytes


def test_http_shrunk_and_filled_empty_files(http_digest: tuple[objstore.ObjectStore, Path, str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    store, root, out = http_digest
    (root / "b.bin").write_bytes(b"x" * 10)
    (root / "empty.bin").write_bytes(b"y" * GROWN)
    store.reset_stats()
    rc, text = _verify(out, capsys)
    assert rc == 1 and "b.bin @ 0+3000: size mismatch (store has 10 bytes)" in text, text
    assert f"empty.bin @ 0+0: size mismatch (store has {GROWN} bytes)" in text, text
    assert store.stats()["by_path"].get("d/empty.bin", {}).get("bytes", 0) == 0
    assert "a.bin" not in text


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_local_grown_file_is_not_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _dataset(tmp_path / "d")
    out = str(tmp_path / "d.dig")
    assert main([str(tmp_path / "d"), "-o", out, "-q", "-j", "1"]) == 0
    with open(tmp_path / "d" / "a.bin", "r+b") as f:
        f.truncate(256 * MiB)  # sparse: cheap to make, not to read
    before = _rchar()
    rc, text = _verify(out, capsys)
    read = _rchar() - before
    assert rc == 1 and f"size mismatch (store has {256 * MiB} bytes)" in text, text
    assert read < 16 * MiB, read  # the digest and the other files, not the 256 MiB


class _Bar(tqdm):
    """A real bar, enabled, writing nowhere: records its count at each update."""
    seen: list[float] = []

    def update(self, n: float | None = 1) -> bool | None:
        out = super().update(n)
        _Bar.seen.append(self.n)
        return out


def test_verify_progress_moves_within_a_large_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d").mkdir()
    size = 16 * MiB
    (tmp_path / "d" / "big.bin").write_bytes(os.urandom(size))
    monkeypatch.setattr(digest_verify, "SMALL_REMOTE", 0)  # streamed, as files over 32 MiB are
    # A store slow enough that reading the file takes several of the bar's ticks.
    with objstore.ObjectStore(tmp_path, bandwidth="32MB") as store:
        out = str(tmp_path / "d.dig")
        assert main([store.url + "/d", "-o", out, "-q"]) == 0
        _Bar.seen = []
        monkeypatch.setattr(digest_verify, "progress", lambda total, quiet, desc: _Bar(
            total=total, file=io.StringIO(), mininterval=0, disable=False))
        assert _verify(out, capsys)[0] == 0
    assert _Bar.seen[-1] == size
    assert [n for n in _Bar.seen if 0 < n < size], _Bar.seen  # was one update, at the end
