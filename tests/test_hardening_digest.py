"""Issue 12 items 8-10: digest paths that leave the root, store reads checked
whatever verify_hash says, symlinks to files, all through real processes."""
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from clients.digest import Digest, DigestBuilder, DigestError

REPO = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _escaping_digest(tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A well-formed digest whose entry 1 is ``path`` (written with the check off,
    as an older or hostile writer would)."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"outside the dataset")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "ok").write_bytes(b"inside")
    monkeypatch.setattr(Digest, "_check_paths", lambda self: None)
    blobs = [b"inside", secret.read_bytes()]
    d = Digest.from_arrays(f"file://{tmp_path / 'data'}", "files",
                           b"".join(hashlib.sha256(b).digest() for b in blobs),
                           [len(b) for b in blobs], [0, 0], [0, 1], ["ok", path])
    out = tmp_path / "bad.dig"
    d.save(out)
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("path", ["../secret", "a/../../secret", "/etc/passwd"])
def test_escaping_path_refused_at_make_and_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                path: str) -> None:
    b = DigestBuilder("file:///x", "files")
    b.add(bytes(32), 1, "fine/..name")  # '..' inside a name is not a component
    with pytest.raises(DigestError, match=r"item 1: path .* (has a '\.\.' component|is absolute)"):
        b.add(bytes(32), 1, path)
    out = _escaping_digest(tmp_path, path, monkeypatch)
    with pytest.raises(DigestError, match="item 1: path"):
        Digest.load(out)
    for cmd in (["verify", str(out)], ["info", str(out)]):
        p = run("tools/digest", *cmd)
        assert p.returncode == 1 and "OK" not in p.stdout, p.stdout
        assert f"item 1: path {path!r}" in p.stderr and "must stay under the root" in p.stderr
    code = ("import sys; from clients.dataset import CachedDataset\n"
            f"CachedDataset({str(out)!r}, cache=False, insert=False)[1]\n")
    p = run("-c", code)
    assert p.returncode == 1 and f"item 1: path {path!r}" in p.stderr
    assert "outside the dataset" not in p.stdout + p.stderr


def test_store_read_checked_with_verify_hash_off(tmp_path: Path) -> None:
    src = tmp_path / "data"
    src.mkdir()
    for k in range(3):
        (src / f"f{k}").write_bytes(bytes([k]) * 100)
    out = tmp_path / "d.dig"
    assert run("tools/digest", str(src), "-o", str(out), "-q").returncode == 0
    (src / "f1").write_bytes(b"X" * 100)  # changed after the digest; same size
    code = ("from clients.dataset import CachedDataset\n"
            f"ds = CachedDataset({str(out)!r}, cache=False, insert=False, verify_hash=False)\n"
            "print(ds[0][:3]); print(ds[1][:3])\n")
    p = run("-c", code)
    assert p.returncode == 1, p.stdout
    assert "item 1 (f1 @ 0+100) does not match the digest" in p.stderr
    assert "XXX" not in p.stdout


def test_symlinks(tmp_path: Path) -> None:
    src = tmp_path / "data"
    src.mkdir()
    (tmp_path / "real").write_bytes(b"real bytes")
    (src / "a").write_bytes(b"aaa")
    (src / "link").symlink_to(tmp_path / "real")
    out = tmp_path / "d.dig"
    p = run("tools/digest", str(src), "-o", str(out), "-q")
    assert p.returncode == 0, p.stderr
    d = Digest.load(out)
    assert d.paths == ["a", "link"] and int(d.size(1)) == len(b"real bytes")
    p = run("tools/digest", "verify", str(out))
    assert p.returncode == 0 and "OK: 2 of 2" in p.stdout, p.stderr
    (tmp_path / "dir").mkdir()
    (src / "dlink").symlink_to(tmp_path / "dir")
    p = run("tools/digest", str(src), "-o", str(out), "-q")
    assert p.returncode == 1 and "cannot read dlink: a symlink to a directory (not followed)" in p.stderr
    (src / "dlink").unlink()
    (src / "dangling").symlink_to(tmp_path / "nowhere")
    p = run("tools/digest", str(src), "-o", str(out), "-q")
    assert p.returncode == 1 and "cannot read dangling: a broken symlink" in p.stderr
