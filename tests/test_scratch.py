"""Scratch directories of same-host followers: removed on close or collection, and by
the next reader's sweep once their owner has ended without either (os._exit, kill -9)."""
import gc
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from cacheserver.client import scratch
from cacheserver.client.scratch import LOCK, PREFIX, STAGING, Scratch, sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_OWNER = textwrap.dedent("""
    import os, sys
    from cacheserver.client.scratch import Scratch
    s = Scratch()
    print(s.name, flush=True)
    if sys.argv[1] == "exit":
        os._exit(0)  # as a loader worker leaves: no close, no finalizers
    sys.stdin.read()  # lives until the test closes its stdin
""")


@pytest.fixture
def tmpdir_only(tmp_path, monkeypatch):
    """Scratch directories and sweeps in tmp_path, not the machine's temp dir."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(scratch, "_swept", False)
    return tmp_path


def _owner(tmp_path, how: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-c", _OWNER, how], env=env, cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    name = p.stdout.readline().strip()
    assert name.startswith(str(tmp_path / PREFIX)), name
    return p, name


def _ours(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path) if n.startswith((PREFIX, STAGING)))


def test_close_removes_the_directory(tmpdir_only):
    s = Scratch()
    assert os.path.isfile(os.path.join(s.name, LOCK))
    assert _ours(tmpdir_only) == [os.path.basename(s.name)]  # under its final name, nothing staged
    s.close()
    assert not os.path.exists(s.name)
    s.close()  # twice: nothing more


def test_a_dropped_scratch_is_removed_when_collected(tmpdir_only):
    s = Scratch()
    name = s.name
    del s
    gc.collect()
    assert not os.path.exists(name)


def test_a_forked_child_closing_an_inherited_scratch_keeps_its_parents(tmpdir_only):
    s = Scratch()
    pid = os.fork()
    if pid == 0:  # the child: as a forked loader worker closing what it inherited
        try:
            s.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    try:
        assert os.path.isdir(s.name)
        assert sweep(str(tmpdir_only)) == 0  # still locked: the parent's lock outlived the child's copy
    finally:
        s.close()
    assert not os.path.exists(s.name)


def test_a_directory_left_by_an_ended_owner_is_swept(tmpdir_only):
    p, name = _owner(tmpdir_only, "exit")
    assert p.wait(20) == 0
    assert os.path.isdir(name), "os._exit left nothing behind: the test shows nothing"
    assert sweep(str(tmpdir_only)) == 1
    assert not os.path.exists(name)


def test_a_live_owners_directory_is_kept_until_it_is_killed(tmpdir_only):
    p, name = _owner(tmpdir_only, "live")
    try:
        assert sweep(str(tmpdir_only)) == 0
        assert os.path.isdir(name)
    finally:
        p.kill()
        p.wait(20)
    assert os.path.isdir(name)
    assert sweep(str(tmpdir_only)) == 1  # killed: swept now
    assert not os.path.exists(name)


def test_an_owner_that_exits_normally_removes_its_own(tmpdir_only):
    p, name = _owner(tmpdir_only, "live")
    p.stdin.close()
    assert p.wait(20) == 0
    assert not os.path.exists(name)  # the finalizer ran at exit


def test_the_first_scratch_of_a_process_sweeps(tmpdir_only):
    p, left = _owner(tmpdir_only, "exit")
    p.wait(20)
    s = Scratch()
    try:
        assert not os.path.exists(left)
    finally:
        s.close()


def test_other_entries_are_left_alone_and_lockless_ones_only_when_old(tmpdir_only):
    root = tmpdir_only
    (root / "unrelated").mkdir()
    (root / (PREFIX + "a-file")).write_text("x")  # not a directory: no lock inside
    legacy = root / (PREFIX + "legacy")  # made by a client before locks
    staged = root / (STAGING + "crashed")  # a process that died between mkdtemp and rename
    legacy.mkdir()
    staged.mkdir()
    os.symlink(root / "unrelated", root / (STAGING + "link"))
    assert sweep(str(root)) == 0
    assert legacy.is_dir() and staged.is_dir()
    old = 2 * scratch.STALE_S
    for d in (legacy, staged):
        os.utime(d, (os.stat(d).st_atime - old, os.stat(d).st_mtime - old))
    assert sweep(str(root)) == 2
    assert not legacy.exists() and not staged.exists()
    assert (root / (PREFIX + "a-file")).exists() and (root / "unrelated").is_dir()


def test_a_local_reader_keeps_its_scratch_until_closed(tmpdir_only):
    from cacheserver.client.localread import LocalReader
    from cacheserver.counters import Counters
    from cacheserver.eviction import make_policy
    from cacheserver.store import Store

    s = Store(str(tmpdir_only / "st"), 64 << 20, make_policy("lru"), Counters())
    try:
        s.put_many([(b"k" * 32, b"v" * 1000)])
        reader = LocalReader(s.db_path)
        (name,) = [n for n in _ours(tmpdir_only)]
        assert os.path.isfile(tmpdir_only / name / "LOG")  # the secondary's info log is there
        reader.close()
        assert _ours(tmpdir_only) == []
    finally:
        s.close()
