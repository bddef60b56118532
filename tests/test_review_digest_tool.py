"""Review of tools/digest: local names the digest format refuses as entries."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients import digest_tool
from clients.digest import Digest
from clients.digest_tool import main


@pytest.mark.parametrize("name, why", [("\\lead", "is absolute"), ("..\\up", "has a '..' component")])
def test_backslash_name_refused_before_hashing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch, name: str, why: str) -> None:
    # A legal Linux name that the digest refuses as a path (a backslash reads as a separator)
    # used to fail in DigestBuilder after the whole dataset was hashed, as "item 0: path ...".
    src = tmp_path / "d"
    src.mkdir()
    (src / "ok.txt").write_bytes(b"a")
    (src / name).write_bytes(b"b")
    out = tmp_path / "o.dig"

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("hashing started")
    with monkeypatch.context() as m:
        m.setattr(digest_tool, "scan_files", refuse)
        assert main([str(src), "-o", str(out), "-q"]) == 1
    msg = capsys.readouterr().err
    assert repr(name) in msg and why in msg and "--exclude" in msg, msg
    assert not out.exists()
    assert main([str(src), "-o", str(out), "-q", "--exclude", name]) == 0
    assert Digest.load(out).paths == ["ok.txt"]


def test_stale_temp_of_an_output_named_like_a_glob_is_not_an_item(tmp_path: Path) -> None:
    # Digest.save's temp file, left by a killed run, was matched as a glob: with '[1]' in the
    # output's name it was not recognised, and the half-written digest became an item.
    (tmp_path / "ok").write_bytes(b"a")
    (tmp_path / ".d[1].dig.k3j2_x.tmp").write_bytes(b"half a digest")
    (tmp_path / ".d[1].dig.notes").write_bytes(b"b")  # not a temp file: an item
    out = tmp_path / "d[1].dig"
    assert main([str(tmp_path), "-o", str(out), "-q"]) == 0
    assert Digest.load(out).paths == [".d[1].dig.notes", "ok"]
    assert main([str(tmp_path), "-o", str(out), "-q"]) == 0  # the output itself is skipped too
    assert Digest.load(out).paths == [".d[1].dig.notes", "ok"]
