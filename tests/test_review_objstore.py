"""tools/objstore.py: the per-connection cap over keep-alive requests, listings with
names that are not UTF-8, and flags that would serve wrongly (port, chunk size)."""
from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import objstore  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_per_connection_cap_paces_small_requests_on_one_connection(tmp_path):
    # 50 ranged reads of 2 KB on one keep-alive connection: each is within the
    # bucket's burst (16 KiB), so only a bucket kept per connection paces them:
    # 100 KB at 100 KB/s takes at least (100 - 16.4) KB / 100 KB/s = 0.84 s.
    (tmp_path / "obj.bin").write_bytes(os.urandom(100_000))
    with objstore.ObjectStore(tmp_path, per_connection_bandwidth="100KB") as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=20)
        try:
            t0, n = time.monotonic(), 0
            for i in range(50):
                conn.request("GET", "/obj.bin", headers={"Range": f"bytes={i * 2000}-{i * 2000 + 1999}"})
                r = conn.getresponse()
                assert r.status == 206
                n += len(r.read())
            elapsed = time.monotonic() - t0
        finally:
            conn.close()
    assert n == 100_000
    assert elapsed >= 0.7, f"100 KB over one connection capped at 100 KB/s took {elapsed:.3f} s"


def test_listing_leaves_out_names_that_are_not_utf8(tmp_path):
    with open(os.path.join(os.fsencode(tmp_path), b"bad\xff.bin"), "wb") as f:
        f.write(b"x")
    (tmp_path / "good.bin").write_bytes(b"y")
    with objstore.ObjectStore(tmp_path) as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=20)
        try:
            conn.request("GET", "/")
            r = conn.getresponse()
            body = r.read().decode()
        finally:
            conn.close()
    assert r.status == 200, body
    assert '<a href="/good.bin">' in body and "bad" not in body


@pytest.mark.parametrize("port", [70000, -1])
def test_port_out_of_range_is_refused(tmp_path, port):
    with pytest.raises(ValueError, match="port"):
        objstore.ObjectStore(tmp_path, port=port).start()
    r = subprocess.run([sys.executable, objstore.__file__, "--root", str(tmp_path), "--port", str(port)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "port must be 0-65535" in r.stderr, (r.stdout, r.stderr)


def test_zero_chunk_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="chunk size"):
        objstore.ObjectStore(tmp_path, chunk_size=0)
    r = subprocess.run([sys.executable, objstore.__file__, "--root", str(tmp_path), "--chunk-size", "0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "chunk size" in r.stderr, (r.stdout, r.stderr)


EXAMPLE_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "example_data.py")


@pytest.mark.parametrize("flag", ["--size", "--per-class", "--classes"])
def test_example_data_refuses_sizes_below_one(tmp_path, flag):
    r = subprocess.run([sys.executable, EXAMPLE_DATA, str(tmp_path / "d"), flag, "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{flag} must be at least 1" in r.stderr, (r.stdout, r.stderr)
