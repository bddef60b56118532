"""tools/digest: a hashing worker process that dies (killed: out of memory) is reported
naming the file it was on, not only that a worker died."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import fsspec
import pytest

from clients.digest_scan import scan_files
from clients.digest_source import SourceFile, ToolError
from clients.tfrecord import encode_record


def _holder(fifo: str) -> int | None:
    for p in multiprocessing.active_children():
        try:
            fds = os.listdir(f"/proc/{p.pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{p.pid}/fd/{fd}") == fifo:
                    return p.pid
            except OSError:
                continue
    return None


def _reader_of(fifo: str, deadline: float) -> int:
    """The pid of the pool process that holds `fifo` open (its open returns a moment
    after the writer's)."""
    while (pid := _holder(fifo)) is None:
        assert time.monotonic() < deadline, f"no pool process has {fifo} open"
        time.sleep(0.02)
    return pid


def _open_writer(fifo: str, deadline: float) -> int:
    """Open `fifo` for writing once a worker opened it for reading (ENXIO until then)."""
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to find the worker")
def test_worker_killed_while_hashing_a_file_is_named(tmp_path: Path) -> None:
    records = b"".join(encode_record(bytes([i]) * 1000) for i in range(20))
    for name in ("a.tfrecord", "b.tfrecord", "d.tfrecord"):
        (tmp_path / name).write_bytes(records)
    fifo = str(tmp_path / "c.tfrecord")  # a file the worker blocks on until killed
    os.mkfifo(fifo)
    files = [SourceFile(str(tmp_path / n), n, len(records) if n != "c.tfrecord" else 0)
             for n in ("a.tfrecord", "b.tfrecord", "c.tfrecord", "d.tfrecord")]
    failed: list[str] = []

    def run() -> None:
        try:
            scan_files(fsspec.filesystem("file"), files, "tfrecord", 2, True, True)
        except ToolError as e:
            failed.append(str(e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    fd = _open_writer(fifo, time.monotonic() + 60)
    try:
        os.kill(_reader_of(fifo, time.monotonic() + 30), signal.SIGKILL)  # as the OOM killer does
        t.join(60)
    finally:
        os.close(fd)
    assert not t.is_alive(), "scan_files did not return after its worker died"
    assert len(failed) == 1
    assert failed[0].startswith("a hashing worker process died while hashing c.tfrecord"), failed[0]
    assert "a.tfrecord" not in failed[0] and "d.tfrecord" not in failed[0]
