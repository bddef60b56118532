"""tools/digest on awkward input: names that are not UTF-8, corrupt tar shards, the
output inside the source, a bad -o, files changing while read, large listings."""

from __future__ import annotations

import concurrent.futures as cf
import csv
import errno
import io
import os
import tarfile
import uuid
from pathlib import Path

import fsspec
import pytest

from clients import digest_tool, itemscan, targets
from clients.digest import Digest
from clients.digest_tool import main


def _err(capsys: pytest.CaptureFixture[str], argv: list[str], rc: int = 1) -> str:
    assert main([*argv, "-q"]) == rc
    return capsys.readouterr().err


def _no_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("hashing started")
    monkeypatch.setattr(digest_tool, "scan_files", refuse)


def test_file_name_not_utf8_named_before_hashing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "d"
    src.mkdir()
    (src / "ok.txt").write_bytes(b"a")
    with open(os.fsencode(src) + b"/bad\xff.txt", "wb") as f:
        f.write(b"b")
    out = str(tmp_path / "o.dig")
    with monkeypatch.context() as m:
        _no_hashing(m)
        msg = _err(capsys, [str(src), "-o", out])
    assert "b'bad\\xff.txt'" in msg and "not valid UTF-8" in msg and "--exclude" in msg
    assert not Path(out).exists()
    assert main([str(src), "-o", out, "-q", "--exclude", "bad*"]) == 0
    assert Digest.load(out).paths == ["ok.txt"]


def _tar(members: list[tuple[str, bytes]], **kw: object) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", **kw) as tf:
        for nm, data in members:
            ti = tarfile.TarInfo(nm)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_tar_member_name_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str], workers: str) -> None:
    src = tmp_path / "t"
    src.mkdir()
    (src / "a.tar").write_bytes(_tar([("0.jpg", b"x")]))
    (src / "b.tar").write_bytes(_tar([("k\xff.jpg", b"abc")], format=tarfile.GNU_FORMAT, encoding="latin-1"))
    msg = _err(capsys, [str(src), "-o", str(tmp_path / "o.dig"), "-f", "tar", "-j", workers])
    assert "b.tar: member name b'k\\xff.jpg' is not valid UTF-8" in msg
    assert not (tmp_path / "o.dig").exists()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_tar_with_corrupt_later_header(tmp_path: Path, capsys: pytest.CaptureFixture[str], workers: str) -> None:
    raw = _tar([("x.jpg", b"b" * 10), ("\u00e9" * 200 + ".jpg", b"c" * 10)], format=tarfile.PAX_FORMAT)
    # the second member's pax header is intact, the header it describes is garbage
    src = tmp_path / "t"
    src.mkdir()
    (src / "a.tar").write_bytes(raw[:2048] + b"\x01" * 512 + raw[2560:])
    msg = _err(capsys, [str(src), "-o", str(tmp_path / "o.dig"), "-f", "tar", "-j", workers])
    assert "a.tar: corrupt tar archive" in msg and "Traceback" not in msg


def test_output_inside_source_is_not_an_item(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "d"
    src.mkdir()
    (src / "a.txt").write_bytes(b"data")
    (src / ".train.dig.x1y2.tmp").write_bytes(b"left by a killed run")
    out = src / "train.dig"
    for _ in range(2):  # the second run finds the first one's digest in SRC
        assert main([str(src), "-o", str(out), "-q"]) == 0
    assert Digest.load(out).paths == ["a.txt"]
    assert main(["verify", str(out), "-q"]) == 0
    (src / "a.txt").unlink()
    # SRC holds only the digest and a killed run's temp file: nothing to digest
    assert "empty dataset" in _err(capsys, [str(src), "-o", str(out)])


def test_unusable_output_fails_before_hashing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "d"
    src.mkdir()
    (src / "a.txt").write_bytes(b"data")
    (tmp_path / "outdir").mkdir()
    _no_hashing(monkeypatch)
    msg = _err(capsys, [str(src), "-o", str(tmp_path / "outdir")], rc=2)
    assert f"output {str(tmp_path / 'outdir')!r} is a directory" in msg
    assert "is a directory" in _err(capsys, [str(src), "-o", ""], rc=2)

    def no_room(*a: object, **k: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(digest_tool.tempfile, "mkstemp", no_room)
    msg = _err(capsys, [str(src), "-o", str(tmp_path / "o.dig")])
    assert f"cannot write {tmp_path / 'o.dig'}: Read-only file system" in msg


def test_write_error_names_the_output(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "d"
    src.mkdir()
    (src / "a.txt").write_bytes(b"data")

    def full(self: Digest, path: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Digest, "save", full)
    msg = _err(capsys, [str(src), "-o", str(tmp_path / "o.dig")])
    assert f"cannot write {tmp_path / 'o.dig'}: No space left on device" in msg and "None" not in msg


def test_labels_csv_with_quoted_newline_in_a_path(tmp_path: Path) -> None:
    labels = tmp_path / "labels.csv"
    with open(labels, "w", newline="") as f:  # as csv.writer quotes it
        w = csv.writer(f)
        w.writerow(["path", "label"])
        w.writerows([["new\nline.png", "cat"], ["x.png", "dog"], ["y\u2028z.png", "dog"]])
    assert targets.load_labels(labels) == {"new\nline.png": "cat", "x.png": "dog", "y\u2028z.png": "dog"}
    labels.write_text('path,label\n"a\nb.png",cat,extra\n')
    with pytest.raises(targets.TargetError, match="line 3: expected 'path,label'"):
        targets.load_labels(labels)


def test_labels_file_with_a_byte_order_mark(tmp_path: Path) -> None:
    (tmp_path / "l.csv").write_bytes(b"\xef\xbb\xbfa.png,cat\nb.png,dog\n")  # Excel's "CSV UTF-8"
    assert targets.load_labels(tmp_path / "l.csv") == {"a.png": "cat", "b.png": "dog"}
    (tmp_path / "l.json").write_bytes(b'\xef\xbb\xbf{"a.png": 1}')
    assert targets.load_labels(tmp_path / "l.json") == {"a.png": 1}


def test_file_changing_while_hashed_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "d"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 1000)
    real = itemscan.scan

    def appended_meanwhile(kind: str, f: object, name: str, crc: bool = True, **kw: object) -> object:
        items = real(kind, f, name, crc, **kw)
        with open(src / "a.bin", "ab") as g:  # a writer still copying the dataset in
            g.write(b"more")
        return items
    monkeypatch.setattr(itemscan, "scan", appended_meanwhile)
    msg = _err(capsys, [str(src), "-o", str(tmp_path / "o.dig"), "-j", "1"])
    assert "a.bin changed while it was read" in msg and not (tmp_path / "o.dig").exists()


class _Counting(cf.ThreadPoolExecutor):
    """Records the most futures submitted and not yet done at any time."""
    most = 0

    def submit(self, *a: object, **k: object) -> cf.Future:  # type: ignore[override]
        fut = super().submit(*a, **k)
        self._live = getattr(self, "_live", 0) + 1
        _Counting.most = max(_Counting.most, self._live)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: cf.Future) -> None:
        self._live -= 1


def test_remote_scan_and_verify_keep_few_futures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One future per object of a big bucket costs ~2 KiB each up front: submit as they finish."""
    fs = fsspec.filesystem("memory")
    prefix = f"/digest-review-{uuid.uuid4().hex}"
    fs.pipe({f"{prefix}/ds/{i:04d}.bin": b"%d" % i for i in range(400)})
    monkeypatch.setattr(cf, "ThreadPoolExecutor", _Counting)
    out = str(tmp_path / "m.dig")
    try:
        _Counting.most = 0
        assert main([f"memory://{prefix}/ds", "-o", out, "-q", "-j", "4"]) == 0
        assert len(Digest.load(out)) == 400 and _Counting.most <= 32
        _Counting.most = 0
        assert main(["verify", out, "-q", "-j", "4"]) == 0
        assert _Counting.most <= 32
    finally:
        fs.rm(prefix, recursive=True)


def test_save_puts_the_digest_on_disk_before_it_replaces_the_old_one(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: no fsync, so a power loss after the rename could leave an empty file where a
    good digest was (ext4 and xfs may commit the rename before the data)."""
    src = tmp_path / "d"
    src.mkdir()
    (src / "a.txt").write_bytes(b"abc")
    out = tmp_path / "x.dig"
    assert main([str(src), "-o", str(out), "-q"]) == 0
    good = Digest.load(out)
    events: list[tuple[str, object]] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", None)), real_replace(a, b))[1])
    good.save(out)
    assert events == [("fsync", False), ("replace", None), ("fsync", True)]  # data, rename, directory
    assert Digest.load(out).fingerprint == good.fingerprint
