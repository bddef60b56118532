"""tools/digest against gs:// through gcsfs and a local gcp-storage-emulator."""

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

from clients.digest import Digest
from clients.storeread import read_item
from clients.tfrecord import encode_record

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gcp_storage_emulator") is None,
    reason="gcp-storage-emulator is not installed (pip install gcp-storage-emulator)",
)
gcsfs_core = pytest.importorskip("gcsfs.core", reason="gcsfs is not installed (pip install gcsfs)")

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "digest"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = str(tmp_path_factory.mktemp("gcs") / "emulator.log")
    argv = ["gcp-storage-emulator", "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"]
    with endpoint_process(argv, port, log) as url:
        yield url


@pytest.fixture
def gcs_env(emulator: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {"STORAGE_EMULATOR_HOST": emulator, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return {**os.environ, **env}


def run_tool(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    # Two workers: the emulator is correct but garbles many concurrent reads.
    if args[0] not in ("info", "verify"):
        args = (*args, "--workers", "2")
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=env)


def test_gcs_files_and_tfrecord(gcs_env: dict[str, str], tmp_path: Path) -> None:
    # The plain class: gcsfs.GCSFileSystem may be the gRPC "extended" one if
    # gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set.
    fs = gcsfs_core.GCSFileSystem(token="anon", skip_instance_cache=True)
    fs.mkdir("mlcache-test")
    files = {f"mlcache-test/imgs/{d}/{i}.jpg": os.urandom(500 + i) for i in range(6) for d in "ab"}
    recs = [os.urandom(200 + i) for i in range(8)]
    files["mlcache-test/tfr/part-0"] = b"".join(map(encode_record, recs[:5]))
    files["mlcache-test/tfr/part-1"] = b"".join(map(encode_record, recs[5:]))
    for path, data in files.items():  # one at a time: the emulator garbles concurrent traffic
        fs.pipe_file(path, data)
    # Ground truth is what the store serves: the emulator now and then stores a binary
    # upload altered, and a digest must describe the store, not our intent.
    files = {path: fs.cat_file(path) for path in files}
    recs_stored = files["mlcache-test/tfr/part-0"] + files["mlcache-test/tfr/part-1"]
    if recs_stored != b"".join(map(encode_record, recs)):
        pytest.skip("the emulator altered the tfrecord upload; nothing to test against")

    out = str(tmp_path / "g.dig")
    p = run_tool(gcs_env, "gs://mlcache-test/imgs", "-o", out, "-s", "token=anon", "-q")
    assert p.returncode == 0, p.stderr
    d = Digest.load(out)
    assert d.root == "gs://mlcache-test/imgs" and len(d) == 12
    want = {k.removeprefix("mlcache-test/imgs/"): hashlib.sha256(v).digest()
            for k, v in files.items() if "/imgs/" in k}
    assert {d.location(i).path: d.sha256(i) for i in range(len(d))} == want
    p = run_tool(gcs_env, "verify", out, "-s", "token=anon", "-q")
    assert p.returncode == 0 and "OK: 12 of 12" in p.stdout, p.stderr

    p = run_tool(gcs_env, "gs://mlcache-test/tfr", "-o", out, "-f", "tfrecord", "-s", "token=anon", "-q")
    assert p.returncode == 0, p.stderr
    d = Digest.load(out)
    assert [read_item(d, i, fs) for i in range(len(d))] == recs  # range reads via gcsfs

    fs.pipe("mlcache-test/tfr/part-1", b"".join(map(encode_record, [recs[5], b"other", recs[7]])))
    p = run_tool(gcs_env, "verify", out, "-s", "token=anon", "-q")
    assert p.returncode == 1 and "item 6: part-1 @ " in p.stderr, p.stderr

    p = run_tool(gcs_env, "gs://mlcache-test/nothing-here", "-o", out, "-s", "token=anon", "-q")
    assert p.returncode == 1 and "source not found: gs://mlcache-test/nothing-here" in p.stderr


def test_cached_dataset_reads_gs_through_the_cache(gcs_env: dict[str, str], tmp_path: Path) -> None:
    """A miss reads gs:// through gcsfs; the next epoch is served by the cache.
    Runs in a subprocess so gcsfs is first imported with the emulator's env set."""
    pytest.importorskip("torch")
    fs = gcsfs_core.GCSFileSystem(token="anon", skip_instance_cache=True)
    fs.mkdir("mlcache-ds")
    items = {f"mlcache-ds/train/{i:03d}.jpg": os.urandom(1000 + 37 * i) for i in range(40)}
    for path, data in items.items():
        fs.pipe_file(path, data)
    items = {path: fs.cat_file(path) for path in items}  # what the store serves (see above)
    out = str(tmp_path / "ds.dig")
    p = run_tool(gcs_env, "gs://mlcache-ds/train", "-o", out, "-s", "token=anon", "-q")
    assert p.returncode == 0, p.stderr
    script = f"""
import hashlib, json
from clients.dataset import CachedDataset
# The emulator is correct but collapses under concurrent reads: fetch 2 at a time.
ds = CachedDataset({out!r}, cache_dir={str(tmp_path / 'emb')!r}, capacity="16MB",
                   storage_options={{"token": "anon"}}, fetch_threads=2)
loader = ds.loader(batch_size=8, seed=0)
epochs = [sorted(hashlib.sha256(x).hexdigest() for b in loader for x in b) for _ in range(2)]
st = loader.epoch_stats
print(json.dumps(dict(epochs=epochs, misses=[s.misses for s in st], hits=[s.hits for s in st])))
ds.close()
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       cwd=REPO, env={**gcs_env, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    res = json.loads(r.stdout.strip().splitlines()[-1])
    want = sorted(hashlib.sha256(v).hexdigest() for v in items.values())
    for e, got in enumerate(res["epochs"]):
        assert got == want, (e, len(got), len(set(got)), sorted(set(got) - set(want))[:3], sorted(set(want) - set(got))[:3])
    assert res["misses"] == [40, 0] and res["hits"] == [0, 40]
