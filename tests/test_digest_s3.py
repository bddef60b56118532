"""tools/digest and CachedDataset against s3:// through s3fs and a local moto S3 server."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import endpoint_process, free_port
from test_digest_tool import make_tars

from clients.digest import Digest, ItemMismatch
from clients.storeread import read_item, read_items

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("moto") is None,
    reason="moto is not installed (pip install 'moto[server]')",
)
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "digest"
CREDS = {"key": "testing", "secret": "testing"}  # moto accepts any


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3 endpoint (moto's server process) on loopback."""
    port = free_port()
    log = str(tmp_path_factory.mktemp("s3") / "moto.log")
    with endpoint_process(["moto_server", "-H", "127.0.0.1", "-p", str(port)], port, log) as url:
        yield url


@pytest.fixture
def s3(endpoint: str) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True, **CREDS)


def opts(endpoint: str) -> list[str]:
    return ["-s", f"endpoint_url={endpoint}", "-s", f"key={CREDS['key']}", "-s", f"secret={CREDS['secret']}"]


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def test_s3_files_tar_and_verify(s3: s3fs.S3FileSystem, endpoint: str, tmp_path: Path) -> None:
    s3.mkdir("mlcache-s3-tool")
    files = {f"mlcache-s3-tool/imgs/{d}/{i}.jpg": os.urandom(700 + 31 * i) for i in range(8) for d in "ab"}
    s3.pipe(files)
    out = str(tmp_path / "s.dig")
    p = run_tool("s3://mlcache-s3-tool/imgs", "-o", out, "-q", *opts(endpoint))
    assert p.returncode == 0, p.stderr
    d = Digest.load(out)
    assert d.root == "s3://mlcache-s3-tool/imgs" and len(d) == 16
    assert {d.location(i).path: d.sha256(i) for i in range(len(d))} == {
        k.removeprefix("mlcache-s3-tool/imgs/"): hashlib.sha256(v).digest() for k, v in files.items()}
    p = run_tool("verify", out, "-q", *opts(endpoint))
    assert p.returncode == 0 and "OK: 16 of 16" in p.stdout, p.stderr

    # WebDataset tar shards: each member is an item, read back by range.
    members = make_tars(tmp_path / "tars")
    s3.put(str(tmp_path / "tars" / "shard-*.tar"), "mlcache-s3-tool/tars/")
    tars = str(tmp_path / "t.dig")
    p = run_tool("s3://mlcache-s3-tool/tars", "-o", tars, "-f", "tar", "-q", *opts(endpoint))
    assert p.returncode == 0, p.stderr
    d = Digest.load(tars)
    assert [read_item(d, i, s3) for i in range(len(d))] == members
    assert read_items(d, range(len(d)), s3) == members  # one cat_ranges call on s3fs's loop

    # An object changed after digesting: verify names it; a read raises.
    s3.pipe_file("mlcache-s3-tool/imgs/b/3.jpg", b"changed")
    p = run_tool("verify", out, "-q", *opts(endpoint))
    assert p.returncode == 1 and "b/3.jpg" in p.stderr, p.stderr
    d = Digest.load(out)
    with pytest.raises(ItemMismatch):
        read_items(d, range(len(d)), s3, verify=True)

    p = run_tool("s3://mlcache-s3-none/x", "-o", str(tmp_path / "n.dig"), "-q", *opts(endpoint))
    assert p.returncode == 1 and "source not found: s3://mlcache-s3-none/x" in p.stderr, p.stderr


def test_cached_dataset_reads_s3_through_the_cache(s3: s3fs.S3FileSystem, endpoint: str,
                                                   tmp_path: Path) -> None:
    """Misses are read from s3:// (batched, on s3fs's event loop); the next epoch is all hits."""
    pytest.importorskip("torch")
    from clients.dataset import CachedDataset

    s3.mkdir("mlcache-s3-ds")
    items = {f"mlcache-s3-ds/train/{i:03d}.jpg": os.urandom(1000 + 37 * i) for i in range(60)}
    s3.pipe(items)
    out = str(tmp_path / "ds.dig")
    p = run_tool("s3://mlcache-s3-ds/train", "-o", out, "-q", *opts(endpoint))
    assert p.returncode == 0, p.stderr
    ds = CachedDataset(out, cache_dir=str(tmp_path / "emb"), capacity="16MB",
                       storage_options={"endpoint_url": endpoint, **CREDS})
    try:
        loader = ds.loader(batch_size=8, seed=0)
        want = sorted(hashlib.sha256(v).hexdigest() for v in items.values())
        for _ in range(2):
            assert sorted(hashlib.sha256(x).hexdigest() for b in loader for x in b) == want
        st = loader.epoch_stats
        assert [s.misses for s in st] == [60, 0] and [s.hits for s in st] == [0, 60]
        assert st[0].store_bytes == sum(map(len, items.values())) and st[1].store_bytes == 0
    finally:
        ds.close()
