"""tools/digest: a remote object that is replaced while it is read by ranges is never
recorded as a mix of two versions (HTTP through tools/objstore.py, S3 through moto)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from procs import endpoint_process, free_port

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import objstore  # noqa: E402

from clients import itemscan  # noqa: E402
from clients.itemscan import ScanError, scan_remote  # noqa: E402
from clients.tfrecord import encode_record  # noqa: E402

MiB = 1 << 20
SIZE = 4 * MiB


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Objects of a few MiB read by several range requests, as large ones are.
    monkeypatch.setattr(itemscan, "REMOTE_BLOCK", 256 * 1024)
    monkeypatch.setattr(itemscan, "SMALL_REMOTE", 0)


def _versions(n: int) -> list[bytes]:
    return [bytes([v]) * SIZE for v in range(1, n + 1)]


def _replacer(write: Callable[[bytes], None], versions: list[bytes]) -> Callable[[int], None]:
    """A progress report that replaces the object at its first report of each read (after
    the first MiB has been hashed, while the rest is still to be fetched); a read again
    starts by taking back what the last one told (a negative report)."""
    left = list(versions)
    armed = [True]

    def report(n: int) -> None:
        if n < 0:
            armed[0] = True
        elif armed[0] and left:
            armed[0] = False
            write(left.pop(0))
    return report


@pytest.fixture
def http_store(tmp_path: Path) -> Iterator[tuple[Any, str, Path]]:
    (tmp_path / "d").mkdir()
    with objstore.ObjectStore(tmp_path) as store:
        yield fsspec.filesystem("http", skip_instance_cache=True), store.url + "/d", tmp_path / "d"


def _write_file(path: Path) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:  # a new file renamed over the old one, as uploads do
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return write


def test_http_object_replaced_while_read_is_read_again(http_store: tuple[Any, str, Path]) -> None:
    fs, url, root = http_store
    old, new = _versions(2)
    (root / "a.bin").write_bytes(old)
    items = scan_remote(fs, "files", f"{url}/a.bin", "a.bin", None,
                        report=_replacer(_write_file(root / "a.bin"), [new]))
    (_, size, sha, _, b3), = list(items)
    assert (size, sha) == (SIZE, hashlib.sha256(new).digest())  # the version it became, whole


def test_http_object_that_keeps_changing_is_refused_by_name(http_store: tuple[Any, str, Path]) -> None:
    fs, url, root = http_store
    versions = _versions(8)  # a new version under every read
    (root / "busy.bin").write_bytes(versions[0])
    with pytest.raises(ScanError, match=r"^busy\.bin changed while it was read \(.*ETag.*\), \d+ times"):
        scan_remote(fs, "files", f"{url}/busy.bin", "busy.bin", None,
                    report=_replacer(_write_file(root / "busy.bin"), versions[1:]))


@pytest.mark.parametrize("crc", [False, True])
def test_http_tfrecord_replaced_while_read_records_one_version(http_store: tuple[Any, str, Path],
                                                               crc: bool) -> None:
    # Without CRC checks a mix goes unnoticed; with them it must not be blamed on the data.
    fs, url, root = http_store
    old = [bytes([1]) * 64 * 1024] * 48
    new = [bytes([2]) * 64 * 1024] * 48
    (root / "r.tfrecord").write_bytes(b"".join(map(encode_record, old)))
    items = scan_remote(fs, "tfrecord", f"{url}/r.tfrecord", "r.tfrecord", None, crc,
                        report=_replacer(_write_file(root / "r.tfrecord"),
                                         [b"".join(map(encode_record, new))]))
    assert len(items) == 48 and {sha for _, _, sha, _, _ in items} == {hashlib.sha256(new[0]).digest()}


@pytest.mark.skipif(importlib.util.find_spec("moto") is None or importlib.util.find_spec("s3fs") is None,
                    reason="moto and s3fs are not installed (pip install 'moto[server]' s3fs)")
def test_s3_object_replaced_while_read_is_read_again(tmp_path: Path) -> None:
    import s3fs

    port = free_port()
    with endpoint_process(["moto_server", "-H", "127.0.0.1", "-p", str(port)], port,
                          str(tmp_path / "moto.log")) as endpoint:
        s3 = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing", skip_instance_cache=True)
        s3.mkdir("mlcache-change")
        old, new, newer, newest = _versions(4)
        s3.pipe_file("mlcache-change/a.bin", old)
        listed = s3.find("mlcache-change", detail=True)  # the listing the tool scans from, cached
        assert listed["mlcache-change/a.bin"]["size"] == SIZE

        def write(data: bytes) -> None:
            s3.pipe_file("mlcache-change/a.bin", data)
        items = scan_remote(s3, "files", "mlcache-change/a.bin", "a.bin", SIZE, report=_replacer(write, [new]))
        assert list(items)[0][2] == hashlib.sha256(new).digest()

        s3.pipe_file("mlcache-change/a.bin", old)
        with pytest.raises(ScanError, match=r"^a\.bin changed while it was read \(.*ETag"):
            scan_remote(s3, "files", "mlcache-change/a.bin", "a.bin", SIZE,
                        report=_replacer(write, [new, newer, newest]))


@pytest.mark.skipif(importlib.util.find_spec("gcp_storage_emulator") is None
                    or importlib.util.find_spec("gcsfs") is None,
                    reason="gcp-storage-emulator and gcsfs are not installed")
def test_gcs_object_replaced_while_read_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    argv = ["gcp-storage-emulator", "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"]
    with endpoint_process(argv, port, str(tmp_path / "gcs.log")) as url:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        from gcsfs.core import GCSFileSystem  # the plain class (see test_digest_gcs.py)

        gcs = GCSFileSystem(token="anon", skip_instance_cache=True)
        gcs.mkdir("mlcache-change")
        old, new = _versions(2)
        gcs.pipe_file("mlcache-change/a.bin", old)
        if gcs.cat_file("mlcache-change/a.bin") != old:
            pytest.skip("the emulator altered the upload; nothing to test against")

        def write(data: bytes) -> None:
            gcs.pipe_file("mlcache-change/a.bin", data)
        items = scan_remote(gcs, "files", "mlcache-change/a.bin", "a.bin", SIZE, report=_replacer(write, [new]))
        assert list(items)[0][2] == hashlib.sha256(gcs.cat_file("mlcache-change/a.bin")).digest()
