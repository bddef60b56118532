"""Stores and files that would digest 'fine' and fail later: an HTTP server that
ignores Range (python -m http.server), compressed TFRecords."""
import functools
import gzip
import subprocess
import sys
import threading
import zlib
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import fsspec
import pytest

from clients.digest import Digest, ItemMismatch
from clients.storeread import read_item
from clients.tfrecord import encode_record

REPO = Path(__file__).resolve().parents[1]


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "tools" / "digest"), *args, "-q"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest's output clean
        pass


@pytest.fixture
def no_range_store(tmp_path):
    """A loopback HTTP server with directory listings that answers every GET in full."""
    root = tmp_path / "www"
    root.mkdir()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield root, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_store_ignoring_range_caught_at_digest_time(tmp_path, no_range_store):
    root, url = no_range_store
    (root / "a.tfrecord").write_bytes(b"".join(encode_record(bytes([k]) * (50 + k)) for k in range(4)))
    r = run_tool(f"{url}/", "-o", str(tmp_path / "x.dig"), "--format", "tfrecord")
    assert r.returncode == 1, r.stderr
    assert "ignores range requests: asked for bytes 0-0 of a.tfrecord, got 270 bytes" in r.stderr
    assert "python -m http.server does not" in r.stderr and not (tmp_path / "x.dig").exists()
    # before the scan: a file the scan would stop at is never reached
    (root / "b.tfrecord").write_bytes(b"not a tfrecord file")
    r = run_tool(f"{url}/", "-o", str(tmp_path / "x.dig"), "--format", "tfrecord")
    assert r.returncode == 1 and "ignores range requests" in r.stderr and "bad length crc" not in r.stderr
    (root / "b.tfrecord").unlink()
    # a digest made elsewhere and read through such a store names the cause too
    assert run_tool(str(root), "-o", str(tmp_path / "l.dig"), "--format", "tfrecord").returncode == 0
    d = Digest.load(tmp_path / "l.dig")
    remote = Digest.from_arrays(url, d.kind, d.hashes, d.sizes, d.offsets, d.path_index, d.paths)
    with pytest.raises(ItemMismatch, match="returned 270 bytes for a 51-byte range; does it ignore range"):
        read_item(remote, 1, fsspec.filesystem("http"), verify=True)


@pytest.mark.parametrize("kind, compress", [("GZIP", gzip.compress), ("ZLIB", zlib.compress)])
def test_compressed_tfrecords_named(tmp_path, kind, compress):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "c.tfrecord").write_bytes(compress(b"".join(encode_record(b"x" * 40) for _ in range(3))))
    r = run_tool(str(tmp_path / "d"), "-o", str(tmp_path / "c.dig"), "--format", "tfrecord")
    assert r.returncode == 1
    assert f"c.tfrecord: {kind}-compressed (TFRecordWriter with compression_type='{kind}')" in r.stderr
    assert "write the TFRecords uncompressed" in r.stderr
