"""tools/digest end to end: local dirs, HTTP, memory://; info, verify, errors."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import re
import subprocess
import sys
import tarfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import blake3
import fsspec
import numpy as np
import pytest

from clients.digest import Digest
from clients.storeread import read_item
from clients.digest_tool import main
from clients.tfrecord import encode_record

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "digest"


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def _blob(rng: np.random.Generator, hi: int = 4000) -> bytes:
    return rng.bytes(int(rng.integers(0, hi)))


def make_files(root: Path, n: int = 12, seed: int = 0) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        rel = f"{['a', 'b/c', 'b'][i % 3]}/item-{i:03d}.jpg"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        out[rel] = _blob(rng)
        (root / rel).write_bytes(out[rel])
    return out


def make_tfrecords(root: Path, files: int = 3, per: int = 20, seed: int = 1) -> list[bytes]:
    rng = np.random.default_rng(seed)
    recs = []
    root.mkdir(parents=True, exist_ok=True)
    for k in range(files):
        mine = [_blob(rng) for _ in range(per)]
        (root / f"train-{k:05d}-of-{files:05d}").write_bytes(b"".join(map(encode_record, mine)))
        recs += mine
    return recs


def make_tars(root: Path, shards: int = 2, per: int = 5, seed: int = 2) -> list[bytes]:
    rng = np.random.default_rng(seed)
    members = []
    root.mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        with tarfile.open(root / f"shard-{k:04d}.tar", "w") as tf:
            for j in range(per):
                for ext, data in (("jpg", _blob(rng)), ("cls", str(j).encode())):
                    ti = tarfile.TarInfo(f"{k:04d}{j:04d}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
                    members.append(data)
    (root / "README.md").write_text("not a shard")  # skipped by the default --include *.tar
    return members


def columns(d: Digest) -> tuple:
    return (d.root, d.kind, d.hashes.tobytes(), d.sizes.tobytes(),
            [d.location(i) for i in range(len(d))])


# -- local, through the executable ----------------------------------------------------------


def test_cli_files_end_to_end(tmp_path: Path) -> None:
    src = tmp_path / "data"
    items = make_files(src)
    out = tmp_path / "ds.dig"
    p = run_tool(str(src), "-o", str(out), "--workers", "2")
    assert p.returncode == 0, p.stderr
    assert "12 items in 12 files" in p.stderr
    d = Digest.load(out)
    assert d.root == f"file://{src}" and d.kind.value == "files"
    assert [d.location(i).path for i in range(len(d))] == sorted(items)
    assert all(d.sha256(i) == hashlib.sha256(items[d.location(i).path]).digest() for i in range(len(d)))
    # format 3: each item's BLAKE3 too, the fast check of cached values
    assert d.version == 3
    assert all(d.blake3[i].tobytes() == blake3.blake3(items[d.location(i).path]).digest() for i in range(len(d)))
    assert (out.stat().st_mode & 0o777) == 0o600  # a digest is a read capability

    p = run_tool("info", str(out))
    assert p.returncode == 0, p.stderr
    assert d.fingerprint.hex() in p.stdout and re.search(r"items:\s+12\b", p.stdout)
    assert f"({d.total_bytes} bytes)" in p.stdout and "kind:" in p.stdout and "files" in p.stdout

    p = run_tool("verify", str(out))
    assert p.returncode == 0 and "OK: 12 of 12" in p.stdout, p.stderr

    # Same size, one flipped byte: only the hash can tell.
    victim = d.location(4).path
    raw = bytearray((src / victim).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (src / victim).write_bytes(bytes(raw))
    (src / d.location(7).path).unlink()
    p = run_tool("verify", str(out))
    assert p.returncode == 1
    assert f"item 4: {victim} @ 0+{len(raw)}: sha256 mismatch" in p.stderr
    assert f"item(s) 7 ({d.location(7).path}): cannot read" in p.stderr
    assert "FAILED: 2 problem(s) in 12 checked items" in p.stderr
    p = run_tool("verify", str(out), "--sample", "3", "--seed", "1")
    assert p.returncode in (0, 1) and ("3 checked" in p.stderr or "3 of 12" in p.stdout)


@pytest.mark.parametrize("fmt", ["tfrecord", "tar"])
def test_records_deterministic_across_workers(tmp_path: Path, fmt: str) -> None:
    src = tmp_path / "data"
    expected = make_tfrecords(src) if fmt == "tfrecord" else make_tars(src)
    digests = []
    for workers in ("1", "2", "3"):
        out = tmp_path / f"{workers}.dig"
        assert main([str(src), "-o", str(out), "--format", fmt, "-j", workers, "-q"]) == 0
        digests.append(Digest.load(out))
    assert columns(digests[0]) == columns(digests[1]) == columns(digests[2])
    d = digests[0]
    assert len(d) == len(expected)
    for i, blob in enumerate(expected):
        assert read_item(d, i) == blob  # location = offset of the data in the file
        assert d.blake3[i].tobytes() == blake3.blake3(blob).digest()
    assert main(["verify", str(tmp_path / "1.dig"), "-q"]) == 0


def test_single_file_source_and_filters(tmp_path: Path) -> None:
    src = tmp_path / "data"
    make_tfrecords(src, files=2, per=3)
    out = tmp_path / "one.dig"
    assert main([str(src / "train-00001-of-00002"), "-o", str(out), "-f", "tfrecord", "-q"]) == 0
    d = Digest.load(out)
    assert d.root == f"file://{src}" and d.paths == ["train-00001-of-00002"] and len(d) == 3
    assert main([str(src), "-o", str(out), "-f", "tfrecord", "-q", "--exclude", "*00000*"]) == 0
    assert Digest.load(out).paths == ["train-00001-of-00002"]
    assert main([str(src), "-o", str(out), "-q", "--include", "*00000-*"]) == 0
    assert Digest.load(out).paths == ["train-00000-of-00002"]


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["SRC"],  # no -o
    ["SRC", "-o", "OUT", "--workers", "0"],
    ["SRC", "-o", "OUT", "--storage-option", "novalue"],
    ["SRC", "-o", "OUT", "--format", "zip"],
    ["SRC", "-o", "/nonexistent-dir/x.dig"],
    ["verify"],
    ["info", "a", "b"],
])
def test_usage_errors_exit_2(tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.replace("SRC", str(tmp_path)).replace("OUT", str(tmp_path / "o.dig")) for a in argv]
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize(("word", "meant"), [("inf", "info"), ("verfy", "verify"), ("crate", "create")])
def test_misspelled_command_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, word: str, meant: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # nothing named `word` here
    (tmp_path / "x.dig").write_bytes(b"")
    assert main([word, "x.dig"]) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and f"unknown command '{word}' (did you mean '{meant}'?)" in err
    assert "-o/--output" not in err


def test_source_named_like_command_still_digests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    files = make_files(tmp_path / "inf", n=3)
    assert main(["inf", "-o", "o.dig", "-q"]) == 0  # an existing path always wins
    assert sorted(Digest.load(tmp_path / "o.dig").paths) == sorted(files)
    capsys.readouterr()
    # Paths and URLs are never taken for commands: they fail as sources, not as typos.
    assert main(["./verfy", "-o", "o.dig", "-q"]) == 1
    assert main(["memory://inf", "-o", "o.dig", "-q"]) == 1
    assert main(["create", "verfy", "-o", "o.dig", "-q"]) == 1  # after `create` it is a SRC
    assert "unknown command" not in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-h"]) == 0
    assert "info FILE" in capsys.readouterr().out


def test_runtime_errors_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "o.dig")

    def err(argv: list[str]) -> str:
        assert main(argv) == 1
        return capsys.readouterr().err

    assert "source not found: " in err([str(tmp_path / "missing"), "-o", out])
    (tmp_path / "empty").mkdir()
    assert "empty dataset" in err([str(tmp_path / "empty"), "-o", out])
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "part-0").write_bytes(b"")
    assert "empty dataset: 1 file(s)" in err([str(tmp_path / "zero"), "-o", out, "-f", "tfrecord"])

    src = tmp_path / "data"
    make_files(src, n=3)
    (src / "dangling").symlink_to(tmp_path / "nowhere")
    assert "cannot read dangling: a broken symlink" in err([str(src), "-o", out])

    bad = tmp_path / "tfr"
    make_tfrecords(bad, files=2, per=4)
    raw = bytearray((bad / "train-00001-of-00002").read_bytes())
    raw[30] ^= 1  # inside the first record's data
    (bad / "train-00001-of-00002").write_bytes(bytes(raw))
    msg = err([str(bad), "-o", out, "-f", "tfrecord", "-j", "2"])
    assert "train-00001-of-00002: bad data crc in record at offset 0" in msg
    assert "not an uncompressed tar" in err([str(bad), "-o", out, "-f", "tar", "--include", "*"])
    assert not Path(out).exists()  # nothing half-written

    (tmp_path / "junk.dig").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    assert "not a digest file" in err(["info", str(tmp_path / "junk.dig")])
    assert "No such file" in err(["verify", str(tmp_path / "none.dig")])


# -- remote: HTTP and memory:// ---------------------------------------------------------------


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """http.server plus single-range GETs, like any object store or CDN."""

    def log_message(self, *args: object) -> None:
        pass

    def send_head(self):  # type: ignore[no-untyped-def]
        rng = self.headers.get("Range")
        path = self.translate_path(self.path)
        if not rng or os.path.isdir(path):
            return super().send_head()
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng)
        try:
            data = Path(path).read_bytes()
        except OSError:
            self.send_error(404)
            return None
        start = int(m[1]) if m else 0
        end = min(int(m[2]) if m and m[2] else len(data) - 1, len(data) - 1)
        if not m or start >= len(data):
            self.send_error(416)
            return None
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        return io.BytesIO(data[start:end + 1])


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    served = tmp_path / "www"
    served.mkdir()
    srv = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(RangeHandler, directory=str(served)))
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}", served
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def test_http_files_and_tfrecord(http_root: tuple[str, Path], tmp_path: Path) -> None:
    url, served = http_root
    items = make_files(served / "imgs", n=6)
    recs = make_tfrecords(served / "tfr", files=2, per=5)
    out = str(tmp_path / "h.dig")

    assert main([f"{url}/imgs", "-o", out, "-q", "-j", "4"]) == 0
    d = Digest.load(out)
    assert d.root == f"{url}/imgs" and len(d) == 6
    assert {d.location(i).path: d.sha256(i) for i in range(6)} == {
        k: hashlib.sha256(v).digest() for k, v in items.items()}
    assert main(["verify", out, "-q"]) == 0

    assert main([f"{url}/tfr", "-o", out, "-q", "-f", "tfrecord"]) == 0
    d = Digest.load(out)
    assert len(d) == 10 and [read_item(d, i) for i in range(10)] == recs  # range reads
    assert main(["verify", out, "-q"]) == 0
    first = served / "tfr" / d.location(7).path
    raw = bytearray(first.read_bytes())
    raw[d.location(7).offset] ^= 1
    first.write_bytes(bytes(raw))
    assert main(["verify", out, "-q"]) == 1


def test_memory_fs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fs = fsspec.filesystem("memory")
    prefix = f"/digest-test-{uuid.uuid4().hex}"
    blobs = {f"{prefix}/ds/x/{i}.bin": os.urandom(100 + i) for i in range(5)}
    fs.pipe(blobs)
    out = str(tmp_path / "m.dig")
    try:
        assert main([f"memory://{prefix}/ds", "-o", out, "-q"]) == 0
        d = Digest.load(out)
        assert d.root == f"memory://{prefix}/ds" and d.paths == [f"x/{i}.bin" for i in range(5)]
        assert main(["verify", out, "-q"]) == 0
        fs.pipe(f"{prefix}/ds/x/3.bin", b"changed")
        assert main(["verify", out, "-q"]) == 1
        assert "item 3: x/3.bin @ 0+103: size mismatch (store has 7 bytes)" in capsys.readouterr().err
    finally:
        fs.rm(prefix, recursive=True)


def _with_blake3_wrong(path: str, bad: int) -> None:
    """Rewrite the digest at path with item `bad`'s BLAKE3 changed, its SHA-256 kept."""
    d = Digest.load(path)
    b3 = d.blake3.copy()
    b3[bad] ^= 0xFF
    Digest.from_arrays(d.root, d.kind, d.hashes, d.sizes, d.offsets, d.path_index, d.paths, d.meta,
                       blake3=b3).save(path)


@pytest.mark.parametrize("fmt", ["files", "tfrecord", "tfrecord-few"])
def test_verify_checks_the_blake3_column(tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    """Clients check cache and store reads against the BLAKE3 column (format 3), so verify
    must too: a digest whose BLAKE3 disagrees with the data is not OK."""
    if fmt == "files":
        make_files(tmp_path / "ds", n=5)
    else:
        make_tfrecords(tmp_path / "ds", files=1, per=3 if fmt == "tfrecord-few" else 8)
    out = str(tmp_path / "d.dig")
    assert main([str(tmp_path / "ds"), "-o", out, "-q", "-f", fmt.split("-")[0]]) == 0
    assert main(["verify", out, "-q"]) == 0
    _with_blake3_wrong(out, 2)
    capsys.readouterr()
    assert main(["verify", out, "-q"]) == 1
    assert "item 2: " in capsys.readouterr().err
