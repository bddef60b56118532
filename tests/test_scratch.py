"""Scratch directories of same-host followers: removed on close, and by the next
reader's sweep once their owner has ended without closing (os._exit, kill -9)."""
import os
import subprocess
import sys
import textwrap

from cacheserver.client.scratch import LOCK, PREFIX, Scratch, sweep

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


def _owner(tmp_path, how: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-c", _OWNER, how], env=env, cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    name = p.stdout.readline().strip()
    assert name.startswith(str(tmp_path / PREFIX)), name
    return p, name


def test_close_removes_the_directory():
    s = Scratch()
    assert os.path.isfile(os.path.join(s.name, LOCK))
    s.close()
    assert not os.path.exists(s.name)
    s.close()  # twice: nothing more


def test_a_directory_left_by_an_ended_owner_is_swept(tmp_path):
    p, name = _owner(tmp_path, "exit")
    assert p.wait(20) == 0
    assert os.path.isdir(name), "os._exit left nothing behind: the test shows nothing"
    assert sweep(str(tmp_path)) == 1
    assert not os.path.exists(name)


def test_a_live_owners_directory_is_kept(tmp_path):
    p, name = _owner(tmp_path, "live")
    try:
        assert sweep(str(tmp_path)) == 0
        assert os.path.isdir(name)
    finally:
        p.stdin.close()
        p.wait(20)
    assert sweep(str(tmp_path)) == 1  # ended without closing: swept now
    assert not os.path.exists(name)


def test_other_entries_are_left_alone(tmp_path):
    (tmp_path / "unrelated").mkdir()
    (tmp_path / (PREFIX + "a-file")).write_text("x")  # not a directory: no lock inside
    young = tmp_path / (PREFIX + "being-made")  # a reader between mkdtemp and its lock
    young.mkdir()
    assert sweep(str(tmp_path)) == 0
    assert (tmp_path / "unrelated").is_dir() and young.is_dir()
    old = 2 * 3600
    os.utime(young, (os.stat(young).st_atime - old, os.stat(young).st_mtime - old))
    assert sweep(str(tmp_path)) == 1  # lockless and old: from before owners held locks
    assert not young.exists() and (tmp_path / (PREFIX + "a-file")).exists()
