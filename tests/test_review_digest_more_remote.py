"""tools/digest on remote stores (tools/objstore.py over HTTP): an object listed as small
that has grown since is not read whole into memory; a long listing shows progress."""

from __future__ import annotations

import hashlib
import io
import os
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import objstore  # noqa: E402

from clients.digest_source import list_source  # noqa: E402
from clients import itemscan  # noqa: E402
from clients.itemscan import SMALL_REMOTE, scan_remote  # noqa: E402

MiB = 1 << 20
GROWN = 96 * MiB  # three times SMALL_REMOTE: held whole, it shows


@pytest.fixture
def http_store(tmp_path: Path) -> Iterator[tuple[Any, str, Path]]:
    (tmp_path / "d").mkdir()
    with objstore.ObjectStore(tmp_path) as store:
        yield fsspec.filesystem("http", skip_instance_cache=True), store.url + "/d", tmp_path / "d"


@pytest.mark.parametrize("listed", [0, MiB])
def test_object_grown_since_listed_small_is_read_in_bounded_memory(
        http_store: tuple[Any, str, Path], listed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Read by blocks of 1 MiB (fsspec's cache holds a few), the object is not held whole.
    monkeypatch.setattr(itemscan, "REMOTE_BLOCK", MiB)
    fs, url, root = http_store
    data = os.urandom(MiB) * (GROWN // MiB)
    (root / "big.bin").write_bytes(data)  # the listing said `listed` bytes: it has grown since
    assert listed <= SMALL_REMOTE < GROWN
    tracemalloc.start()
    try:
        items = scan_remote(fs, "files", f"{url}/big.bin", "big.bin", listed)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    (_, size, sha, _, _), = list(items)
    assert (size, sha) == (GROWN, hashlib.sha256(data).digest())  # the object as it is, whole
    assert peak < GROWN // 4, f"{peak / MiB:.0f} MiB held to hash a {GROWN // MiB} MiB object"


def test_small_object_as_listed_is_one_get(http_store: tuple[Any, str, Path]) -> None:
    fs, url, root = http_store
    data = os.urandom(3 * MiB)
    (root / "s.bin").write_bytes(data)
    items = scan_remote(fs, "files", f"{url}/s.bin", "s.bin", len(data))
    assert list(items)[0][1:3] == (len(data), hashlib.sha256(data).digest())


class _Terminal(io.StringIO):
    def isatty(self) -> bool:  # tqdm shows its bar on terminals only
        return True


def test_remote_listing_shows_progress(http_store: tuple[Any, str, Path],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    fs, url, root = http_store
    for i in range(30):
        (root / f"f{i:02}.bin").write_bytes(b"x")
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    _, files = list_source(fs, url, url, [], [], quiet=False)
    assert len(files) == 30
    shown = err.getvalue()
    assert "listing" in shown and "30 files" in shown, shown


def test_local_listing_shows_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(12):
        (tmp_path / f"f{i:02}.bin").write_bytes(b"x")
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    _, files = list_source(fsspec.filesystem("file"), str(tmp_path), str(tmp_path), [], [], quiet=False)
    assert len(files) == 12 and "12 files" in err.getvalue(), err.getvalue()


def test_quiet_listing_shows_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.bin").write_bytes(b"x")
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    list_source(fsspec.filesystem("file"), str(tmp_path), str(tmp_path), [], [], quiet=True)
    assert err.getvalue() == ""


def test_slow_remote_listing_is_redrawn_while_it_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A store that takes seconds to answer (a bucket of millions lists for minutes): the
    # bar's clock moves meanwhile, not a still line that looks hung.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.bin").write_bytes(b"x")
    err = _Terminal()
    with objstore.ObjectStore(tmp_path, latency=1.6) as store:
        fs = fsspec.filesystem("http", skip_instance_cache=True)
        monkeypatch.setattr(sys, "stderr", err)
        list_source(fs, store.url + "/d", store.url + "/d", [], [], quiet=False)
    frames = err.getvalue().split("\r")
    assert any(f.startswith("listing: 0 files [00:01") for f in frames), frames
