"""tools/objstore.py: the capped HTTP object store standing in for GCS/S3."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import objstore  # noqa: E402

pytestmark = pytest.mark.timeout(60)

SIZE = 1000


def _payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    d = tmp_path_factory.mktemp("objroot")
    (d / "obj.bin").write_bytes(_payload(SIZE))
    (d / "empty.bin").write_bytes(b"")
    (d / "sub" / "deep").mkdir(parents=True)
    (d / "sub" / "a.bin").write_bytes(_payload(300, 1))
    (d / "sub" / "deep" / "b.bin").write_bytes(_payload(70_000, 2))
    (d / "sub" / "with space.bin").write_bytes(b"spaced")
    (d / "emptydir").mkdir()
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret").write_bytes(b"secret")
    os.symlink(outside / "secret", d / "escape")
    os.symlink(d / "obj.bin", d / "alias.bin")
    return d


@pytest.fixture(scope="module")
def store(root):
    with objstore.ObjectStore(root) as s:
        yield s


def request(url: str, method: str = "GET", path: str = "/", headers: dict | None = None,
            timeout: float = 20.0):
    """(status, headers, body) for one raw request; ``path`` goes out verbatim."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


# ---------------------------------------------------------------- plain reads

def test_get_whole_object(store):
    status, headers, body = request(store.url, path="/obj.bin")
    assert status == 200
    assert body == _payload(SIZE)
    assert headers["content-length"] == str(SIZE)
    assert headers["accept-ranges"] == "bytes"
    assert "content-range" not in headers


def test_head_has_length_and_no_body(store):
    status, headers, body = request(store.url, "HEAD", "/sub/deep/b.bin")
    assert status == 200
    assert headers["content-length"] == "70000"
    assert body == b""
    status, headers, body = request(store.url, "HEAD", "/obj.bin", {"Range": "bytes=10-19"})
    assert status == 206
    assert headers["content-length"] == "10"
    assert headers["content-range"] == f"bytes 10-19/{SIZE}"
    assert body == b""


def test_empty_object(store):
    status, headers, body = request(store.url, path="/empty.bin")
    assert (status, headers["content-length"], body) == (200, "0", b"")
    status, headers, _ = request(store.url, path="/empty.bin", headers={"Range": "bytes=0-"})
    assert status == 416
    assert headers["content-range"] == "bytes */0"
    status, _, _ = request(store.url, path="/empty.bin", headers={"Range": "bytes=-5"})
    assert status == 416


DATA = _payload(SIZE)


@pytest.mark.parametrize("rng,start,end", [
    ("bytes=0-0", 0, 1),
    ("bytes=10-19", 10, 20),
    ("bytes=0-999", 0, 1000),
    ("bytes=999-999", 999, 1000),
    ("bytes=500-", 500, 1000),
    ("bytes=999-", 999, 1000),
    ("bytes=500-5000", 500, 1000),   # last clamped to the size
    ("bytes=-1", 999, 1000),
    ("bytes=-10", 990, 1000),
    ("bytes=-5000", 0, 1000),        # suffix longer than the object: all of it
])
def test_range_read(store, rng, start, end):
    status, headers, body = request(store.url, path="/obj.bin", headers={"Range": rng})
    assert status == 206
    assert body == DATA[start:end]
    assert headers["content-length"] == str(end - start)
    assert headers["content-range"] == f"bytes {start}-{end - 1}/{SIZE}"


@pytest.mark.parametrize("rng", ["bytes=1000-", "bytes=1000-2000", "bytes=5000-6000", "bytes=-0"])
def test_unsatisfiable_range_is_416(store, rng):
    status, headers, body = request(store.url, path="/obj.bin", headers={"Range": rng})
    assert status == 416
    assert headers["content-range"] == f"bytes */{SIZE}"


@pytest.mark.parametrize("rng", ["bytes=5-3", "bytes=0-1,5-6", "items=0-5", "bytes=abc", "bytes=-"])
def test_ignored_range_serves_whole_object(store, rng):
    # RFC 9110: a server may ignore an invalid or multi-range Range header.
    status, headers, body = request(store.url, path="/obj.bin", headers={"Range": rng})
    assert status == 200
    assert body == DATA
    assert "content-range" not in headers


def test_etag_and_last_modified(store):
    _, headers, _ = request(store.url, "HEAD", "/obj.bin")
    assert headers["etag"].startswith('"')
    assert headers["last-modified"].endswith("GMT")


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("path", ["/missing.bin", "/sub/missing", "/obj.bin/child", "/nodir/x"])
def test_missing_is_404(store, path):
    assert request(store.url, path=path)[0] == 404


@pytest.mark.parametrize("path", [
    "/../etc/passwd", "/sub/../../etc/passwd", "/%2e%2e/etc/passwd", "/sub/%2E%2E/%2e%2e/x",
    "/sub%2F..%2F..%2Fetc", "/..%5c..%5cetc", "/%ff%fe",
])
def test_traversal_is_rejected(store, path):
    status, _, body = request(store.url, path=path)
    assert status in (403, 404)
    assert b"root:" not in body


def test_symlink_out_of_root_is_rejected_inside_is_served(store):
    assert request(store.url, path="/escape")[0] == 403
    status, _, body = request(store.url, path="/alias.bin")
    assert (status, body) == (200, DATA)


def test_symlink_out_of_root_served_when_allowed(root):
    with objstore.ObjectStore(root, follow_symlinks=True) as s:
        assert request(s.url, path="/escape")[2] == b"secret"


@pytest.mark.parametrize("method", ["PUT", "POST", "DELETE"])
def test_writes_are_not_allowed(store, method):
    assert request(store.url, method, "/obj.bin")[0] == 405


# ---------------------------------------------------------------- listings and fsspec

def test_directory_listing_html(store):
    for path in ("/sub/", "/sub"):
        status, headers, body = request(store.url, path=path)
        assert status == 200
        assert headers["content-type"].startswith("text/html")
        text = body.decode()
        assert '<a href="/sub/a.bin">' in text
        assert '<a href="/sub/deep/">' in text
        assert '<a href="/sub/with%20space.bin">' in text
    text = request(store.url, path="/")[2].decode()
    assert '<a href="/obj.bin">' in text and '<a href="/emptydir/">' in text
    assert "escape" not in text  # escaping symlinks are left out


def test_fsspec_find_ls_and_cat_file(store, root):
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp")
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    u = store.url
    expected = sorted(f"{u}/{p}" for p in [
        "alias.bin", "empty.bin", "obj.bin", "sub/a.bin", "sub/deep/b.bin", "sub/with%20space.bin"])
    assert fs.find(u) == expected
    assert fs.find(u + "/") == expected
    assert fs.find(u + "/sub") == [x for x in expected if x.startswith(u + "/sub/")]
    # (fs.find on an empty directory URL returns the URL itself: fsspec's HTTP
    # filesystem takes any URL that answers a HEAD for a file.)
    assert fs.ls(u + "/emptydir", detail=False) == []
    assert sorted(fs.ls(u + "/sub", detail=False)) == [
        f"{u}/sub/a.bin", f"{u}/sub/deep/", f"{u}/sub/with%20space.bin"]
    assert fs.info(u + "/sub/deep/b.bin")["size"] == 70_000

    big = _payload(70_000, 2)
    store.reset_stats()
    assert fs.cat_file(u + "/sub/deep/b.bin", 100, 200) == big[100:200]
    assert fs.cat_file(u + "/sub/deep/b.bin", 69_990) == big[69_990:]
    assert fs.cat_file(u + "/sub/deep/b.bin", -10) == big[-10:]
    assert fs.cat_file(u + "/sub/deep/b.bin") == big
    assert fs.cat_file(u + "/sub/with%20space.bin") == b"spaced"
    # The ranged reads moved only their bytes.
    st = store.stats()
    assert st["by_path"]["sub/deep/b.bin"]["bytes"] == 100 + 10 + 10 + 70_000
    with fs.open(u + "/sub/deep/b.bin", "rb", block_size=4096) as f:
        f.seek(50_000)
        assert f.read(1000) == big[50_000:51_000]


# ---------------------------------------------------------------- caps

def _read_concurrently(url: str, paths: list[str]) -> tuple[int, float]:
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(paths)) as ex:
        bodies = list(ex.map(lambda p: request(url, path=p)[2], paths))
    return sum(len(b) for b in bodies), time.monotonic() - t0


@pytest.fixture(scope="module")
def big_root(tmp_path_factory):
    d = tmp_path_factory.mktemp("bigroot")
    for i in range(4):
        (d / f"part-{i}.bin").write_bytes(os.urandom(2_000_000))
    return d


def test_store_wide_bandwidth_cap_is_shared(big_root):
    # 4 concurrent readers, 8 MB in all, through a 20 MB/s store: >= 0.4 s ideal.
    with objstore.ObjectStore(big_root, bandwidth="20MB") as s:
        n, elapsed = _read_concurrently(s.url, [f"/part-{i}.bin" for i in range(4)])
        assert n == 8_000_000
        assert elapsed >= 0.3, f"8 MB through a 20 MB/s cap took only {elapsed:.3f} s"
        assert s.stats()["bytes_served"] == 8_000_000


def test_per_connection_cap(big_root):
    with objstore.ObjectStore(big_root, per_connection_bandwidth="10MB") as s:
        assert s.bandwidth is None
        n, elapsed = _read_concurrently(s.url, ["/part-0.bin"])
        assert n == 2_000_000
        assert elapsed >= 0.15, f"2 MB through a 10 MB/s stream cap took only {elapsed:.3f} s"


def test_latency_is_applied(root):
    with objstore.ObjectStore(root, latency="200ms") as s:
        assert s.latency == pytest.approx(0.2)
        for method, path in [("GET", "/obj.bin"), ("HEAD", "/obj.bin"), ("GET", "/missing")]:
            t0 = time.monotonic()
            request(s.url, method, path)
            assert time.monotonic() - t0 >= 0.18


def test_many_concurrent_connections(root):
    with objstore.ObjectStore(root, bandwidth="50MB", latency="5ms") as s:
        with concurrent.futures.ThreadPoolExecutor(64) as ex:
            results = list(ex.map(lambda i: request(s.url, path="/sub/deep/b.bin")[2], range(200)))
        assert all(r == _payload(70_000, 2) for r in results)
        st = s.stats()
        assert st["requests"] == 200 and st["bytes_served"] == 200 * 70_000


def test_stop_with_slow_download_in_flight(big_root):
    s = objstore.ObjectStore(big_root, bandwidth="100KB").start()
    errors = []

    def slow():
        try:
            request(s.url, path="/part-0.bin", timeout=30)
        except Exception as exc:  # cut off by the stop, as expected
            errors.append(exc)

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    s.stop()
    assert time.monotonic() - t0 < 10
    t.join(30)
    assert not t.is_alive()


# ---------------------------------------------------------------- accounting

def test_stats_api_and_http(root):
    with objstore.ObjectStore(root) as s:
        request(s.url, path="/obj.bin")
        request(s.url, path="/obj.bin", headers={"Range": "bytes=0-99"})
        request(s.url, "HEAD", "/sub/a.bin")
        request(s.url, path="/missing")
        st = s.stats()
        assert st["requests"] == 4
        assert st["bytes_served"] == SIZE + 100
        assert st["by_path"]["obj.bin"] == {"requests": 2, "bytes": SIZE + 100}
        assert st["by_path"]["sub/a.bin"] == {"requests": 1, "bytes": 0}
        assert st["by_status"] == {"200": 2, "206": 1, "404": 1}

        status, headers, body = request(s.url, path="/_stats")
        assert status == 200 and headers["content-type"].startswith("application/json")
        assert json.loads(body) == st  # /_stats itself is not counted
        assert "by_path" not in json.loads(request(s.url, path="/_stats?by_path=0")[2])

        status, _, body = request(s.url, "POST", "/_stats/reset")
        assert status == 200 and json.loads(body)["bytes_served"] == SIZE + 100
        assert s.stats() == {"requests": 0, "bytes_served": 0, "by_status": {}, "by_path": {}}
        assert request(s.url, "GET", "/_stats/reset")[0] == 405

        request(s.url, path="/sub/a.bin")
        assert s.reset_stats()["bytes_served"] == 300
        assert s.stats()["bytes_served"] == 0


# ---------------------------------------------------------------- parsing and lifecycle

@pytest.mark.parametrize("text,value", [
    ("200MB", 200e6), ("1GiB", 2.0**30), ("1GiB/s", 2.0**30), ("64KB", 64e3),
    (5_000_000, 5e6), (None, None), (0, None), ("0", None), ("unlimited", None),
])
def test_parse_bandwidth(text, value):
    assert objstore.parse_bandwidth(text) == value


@pytest.mark.parametrize("text,value", [
    ("20ms", 0.02), ("0.5s", 0.5), ("500us", 0.0005), ("2", 2.0), (0.25, 0.25), (None, 0.0),
])
def test_parse_duration(text, value):
    assert objstore.parse_duration(text) == pytest.approx(value)


@pytest.mark.parametrize("bad", ["fast", "10 parsecs", "-1ms"])
def test_parse_rejects(bad):
    with pytest.raises(ValueError):
        objstore.parse_duration(bad)
    with pytest.raises(ValueError):
        objstore.parse_bandwidth(bad)


def test_token_bucket_paces_reservations():
    b = objstore.TokenBucket(rate=1_000_000, burst=100_000)
    assert b.reserve(100_000) <= 1e-6       # the burst goes at once (float rounding aside)
    d = b.reserve(100_000)                  # the next 100 KB waits ~0.1 s
    assert 0.05 < d <= 0.1 + 1e-3


def test_missing_root_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        objstore.ObjectStore(tmp_path / "nope")


def test_start_stop_and_context_manager(root):
    s = objstore.ObjectStore(root, host="127.0.0.1", port=0)
    assert s.url == ""
    s.start()
    assert s.url.startswith("http://127.0.0.1:") and s.port > 0
    assert request(s.url, path="/obj.bin")[0] == 200
    with pytest.raises(RuntimeError):
        s.start()
    s.stop()
    s.stop()  # idempotent
    with pytest.raises(OSError):
        request(s.url, path="/obj.bin", timeout=2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_subprocess_ready_and_clean_exit(root, sig):
    proc, url = objstore.spawn(root, bandwidth="100MB", latency="1ms", stderr=subprocess.DEVNULL)
    with proc:
        try:
            assert url.startswith("http://127.0.0.1:")
            status, _, body = request(url, path="/obj.bin", headers={"Range": "bytes=-10"})
            assert (status, body) == (206, DATA[-10:])
            assert json.loads(request(url, path="/_stats")[2])["bytes_served"] == 10
            proc.send_signal(sig)
            assert proc.wait(15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_cli_prints_ready_line(root):
    script = os.path.abspath(objstore.__file__)
    proc = subprocess.Popen([sys.executable, script, "--root", str(root), "--port", "0",
                             "--bandwidth", "200MB", "--latency", "20ms",
                             "--per-connection-bandwidth", "50MB"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    with proc:
        try:
            line = proc.stdout.readline()
            assert line.startswith("READY http://127.0.0.1:")
            url = line.split()[1]
            assert request(url, path="/sub/a.bin")[2] == _payload(300, 1)
            proc.terminate()
            assert proc.wait(15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_spawn_reports_failure(tmp_path):
    with pytest.raises(RuntimeError, match="before READY"):
        objstore.spawn(tmp_path / "nope", stderr=subprocess.DEVNULL, timeout=15)
