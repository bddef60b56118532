"""Hung store reads are warned about (clients/readwatch.py): a real store whose read
blocks, a FIFO in place of one of a digest's files (open() blocks until a writer
comes), in this process, in a forked child and in a spawned DataLoader worker."""
import errno
import hashlib
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("torch")

from clients import readwatch  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from filedigest import write_files_digest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOBS = [hashlib.sha256(bytes([i])).digest() * (i + 1) for i in range(6)]
HUNG = 2  # the item whose file is a FIFO


@pytest.fixture
def store(tmp_path):
    """(digest path, FIFO path): item HUNG's file replaced by a FIFO once digested; a
    read blocked on it at the end is let go (its bytes written), and the FIFO removed."""
    digest = write_files_digest(tmp_path / "ds", BLOBS)
    fifo = str(tmp_path / "ds" / f"{HUNG:05d}")
    os.remove(fifo)
    os.mkfifo(fifo)
    yield digest, fifo
    release(fifo)
    os.remove(fifo)


def release(fifo: str) -> bool:
    """Writes the item's bytes to a reader blocked on the FIFO; False if none is there."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:  # no reader has it open
            return False
        raise
    try:
        os.set_blocking(fd, True)
        os.write(fd, BLOBS[HUNG])
    finally:
        os.close(fd)
    return True


def wait_for(cond, limit: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"gave up after {limit} s waiting for {what}"
        time.sleep(0.02)


def watch_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "clients.readwatch"]


def test_hung_read_warned_repeated_then_went_on(store, caplog):
    digest, fifo = store
    caplog.set_level(logging.WARNING, logger="clients.readwatch")
    ds = CachedDataset(digest, cache=False, read_warning=0.2)
    got: list = []
    t = threading.Thread(target=lambda: got.append(ds.read(list(range(6)))), daemon=True)
    t.start()
    try:
        wait_for(lambda: sum("in flight" in m for m in watch_messages(caplog)) >= 2, what="two warnings")
        assert t.is_alive()  # nothing abandoned the read
        first, second = [m for m in watch_messages(caplog) if "in flight" in m][:2]
        assert "6 items (0, 1, 2, 3 and 2 more)" in first
        assert "00000" in first and os.path.dirname(fifo) in first  # the first item's path, the store
        assert "mount" in first and "the read goes on" in first
        secs = [float(m.split("in flight for ")[1].split(" s")[0]) for m in (first, second)]
        # at a growing interval: twice the first warning's age, which the message rounds to 0.1 s
        # (a first warning at 0.96 s, late on a loaded machine, reads 1.0 and its next 1.93 reads 1.9)
        assert 0.2 <= secs[0] < secs[1] and secs[1] >= 2 * secs[0] - 0.1
        assert not any("went on" in m for m in watch_messages(caplog))
        wait_for(lambda: release(fifo), limit=5, what="the reader on the FIFO")
        t.join(10)
        assert not t.is_alive() and got == [BLOBS]
        wait_for(lambda: any("went on after" in m for m in watch_messages(caplog)), limit=5, what="went on")
        went = [m for m in watch_messages(caplog) if "went on" in m]
        assert len(went) == 1 and "6 items (0, 1, 2, 3 and 2 more)" in went[0]
    finally:
        release(fifo)
        t.join(10)
        ds.close()


def test_one_item_named_and_quick_reads_not_warned(store, caplog):
    digest, fifo = store
    caplog.set_level(logging.WARNING, logger="clients.readwatch")
    ds = CachedDataset(digest, cache=False, read_warning=0.2)
    assert ds.read([0, 1]) == BLOBS[:2]
    t = threading.Thread(target=ds.read, args=([HUNG],), daemon=True)
    t.start()
    try:
        wait_for(lambda: watch_messages(caplog), what="a warning")
        msg = watch_messages(caplog)[0]
        assert f"store read of item {HUNG}, the first at {HUNG:05d} in store" in msg, msg
        assert f"process {os.getpid()}" in msg
    finally:
        wait_for(lambda: release(fifo), limit=5, what="the reader on the FIFO")
        t.join(10)
        ds.close()
    assert not t.is_alive()
    wait_for(lambda: any("went on" in m for m in watch_messages(caplog)), limit=5, what="went on")
    assert not any("item 0" in m or "items (0" in m for m in watch_messages(caplog))  # the quick read


def test_off_and_bad_values(store, caplog):
    digest, fifo = store
    caplog.set_level(logging.WARNING, logger="clients.readwatch")
    for bad in (0, -1, "60", True, float("nan")):
        with pytest.raises(ValueError, match="read_warning must be a number of seconds > 0"):
            CachedDataset(digest, cache=False, read_warning=bad)
    ds = CachedDataset(digest, cache=False, read_warning=None)
    t = threading.Thread(target=ds.read, args=([HUNG],), daemon=True)
    t.start()
    try:
        wait_for(lambda: release(fifo), limit=5, what="the reader on the FIFO")  # hangs till now
        t.join(10)
    finally:
        release(fifo)
        ds.close()
    assert not t.is_alive() and not watch_messages(caplog)


def test_watcher_ends_when_idle_and_starts_again(store, monkeypatch):
    digest, _ = store
    monkeypatch.setattr(readwatch, "IDLE_EXIT_S", 0.3)
    ds = CachedDataset(digest, cache=False, read_warning=0.5)
    assert ds.read([0]) == BLOBS[:1]
    assert readwatch.WATCH.running
    ds.close()
    wait_for(lambda: not readwatch.WATCH.running, limit=10, what="the idle watcher to end")
    ds = CachedDataset(digest, cache=False, read_warning=0.5)
    assert ds.read([1]) == BLOBS[1:2]
    assert readwatch.WATCH.running  # a new one for the next read
    ds.close()
    threads = [t for t in threading.enumerate() if t.name == "store-read-watch"]
    assert len(threads) == 1 and threads[0].daemon


class Output:
    """A process's stdout and stderr as they come (bounded waits; unbuffered reads)."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        self.out, self.err = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        self.text = {self.out: "", self.err: ""}
        self.sel = selectors.DefaultSelector()
        for f in (self.proc.stdout, self.proc.stderr):
            self.sel.register(f, selectors.EVENT_READ)

    def _take(self, limit: float) -> None:
        for key, _ in self.sel.select(limit):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                self.sel.unregister(key.fileobj)
            self.text[key.fd] += chunk.decode(errors="replace")

    def until(self, want: str, fd: int, limit: float = 60.0) -> str:
        """fd's text so far, once it holds `want`."""
        deadline = time.monotonic() + limit
        while want not in self.text[fd]:
            left = deadline - time.monotonic()
            assert left > 0 and self.sel.get_map(), f"no {want!r} in {self.text}"
            self._take(min(left, 1.0))
        return self.text[fd]

    def finish(self, limit: float = 60.0) -> int:
        """The exit status once both streams end (killed past `limit`)."""
        deadline = time.monotonic() + limit
        while self.sel.get_map() and time.monotonic() < deadline:
            self._take(min(1.0, max(0.0, deadline - time.monotonic())))
        if self.proc.poll() is None and self.sel.get_map():
            self.proc.kill()
        rc = self.proc.wait(10)
        self.sel.close()
        self.proc.stdout.close()
        self.proc.stderr.close()
        return rc


FORKED = """
import os, sys
sys.path.insert(0, {root!r})
from clients import readwatch
from clients.dataset import CachedDataset
ds = CachedDataset({digest!r}, cache=False, read_warning=0.2)
ds.read([0])
assert readwatch.WATCH.running  # the parent's watcher: the child has no such thread
pid = os.fork()
if pid == 0:
    code = 0 if ds.read([{hung}])[0] == {blob!r} else 3
    os._exit(code)
print("child", pid, flush=True)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_forked_child_watches_its_own_reads(store):
    digest, fifo = store
    script = FORKED.format(root=ROOT, digest=digest, hung=HUNG, blob=BLOBS[HUNG])
    p = Output([sys.executable, "-c", script])
    child = None
    try:
        child = int(p.until("\n", p.out).split()[-1])
        seen = p.until("in flight", p.err)
        assert f"item {HUNG}, the first at {HUNG:05d}" in seen and f"process {child}" in seen, seen
        wait_for(lambda: release(fifo), limit=5, what="the child on the FIFO")
        p.until("went on after", p.err, limit=10)
    finally:
        release(fifo)
        if child is not None and p.proc.poll() is None and not p.text[p.err].count("went on"):
            kill(child)  # the forked child (the script waits for it) is ours to end
        rc = p.finish()
    assert rc == 0, p.text


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


SPAWNED = """
import sys
sys.path.insert(0, {root!r})
from clients.dataset import CachedDataset
if __name__ == "__main__":
    ds = CachedDataset({digest!r}, cache=False, read_warning=0.2)
    got = [x for batch in ds.loader(batch_size=2, num_workers=1) for x in batch]
    print("items", len(got), sorted(got) == sorted({blobs!r}), flush=True)
    ds.close()
"""


def test_dataloader_worker_warns(store, tmp_path):
    digest, fifo = store
    main = tmp_path / "train.py"
    main.write_text(SPAWNED.format(root=ROOT, digest=digest, blobs=BLOBS))
    p = Output([sys.executable, str(main)])
    try:
        seen = p.until("in flight", p.err, limit=120)
        assert f"{HUNG:05d}" in seen and "DataLoader worker 0" in seen, seen
        wait_for(lambda: release(fifo), limit=5, what="the worker on the FIFO")
        p.until("went on after", p.err, limit=10)
        p.until("items 6", p.out, limit=120)
    finally:
        release(fifo)
        rc = p.finish()
    assert rc == 0 and "items 6 True" in p.text[p.out], p.text
