"""Same-host coalescing (clients/coalesce.py) and its directories (clients/shareddir.py):
a directory is removed once no process uses it, never while one does, and what a process
that crashed left behind is removed by a later user's sweep. Real processes, real flocks."""
import fcntl
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from clients import coalesce, shareddir
from clients.coalesce import PREFIX, BatchClaims, HostCoalescer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = b"\x07" * 33

# A user of namespace argv[2] under argv[1]: claims KEY (and keeps it when argv[3] is "crash"),
# says so, then lives until its stdin closes, or ends at once as a crashed process would.
_USER = textwrap.dedent("""
    import os, sys
    from clients.coalesce import HostCoalescer
    c = HostCoalescer(sys.argv[2], directory=sys.argv[1])
    claim = c.claim(b"\\x07" * 33)
    print(claim.first, flush=True)
    if sys.argv[3] == "crash":
        os._exit(1)  # no close, no finalizers: the claim's file and the directory stay
    claim.release()
    sys.stdin.read()
    print(os.path.isdir(c.dir), flush=True)  # still there for this user, whoever left meanwhile
""")


@pytest.fixture
def root(tmp_path, monkeypatch):
    """Coalescing directories in tmp_path, swept afresh by this process."""
    monkeypatch.setattr(coalesce, "_swept", set())
    return str(tmp_path)


def _user(root: str, namespace: str, how: str = "live") -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", _USER, root, namespace, how], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    return p, p.stdout.readline().strip()


def _ours(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if PREFIX in n or "mlcache-coalesce-" in n)


def test_the_last_user_to_leave_removes_the_directory(root):
    a, b = HostCoalescer("ds", directory=root), HostCoalescer("ds", directory=root)
    assert a.dir == b.dir and _ours(root) == [PREFIX + "ds"]  # made under its final name, nothing staged
    claim = a.claim(KEY)
    assert claim.first and not b.claim(KEY).first
    claim.release()
    a.close()
    assert os.path.isdir(b.dir)  # b still uses it
    assert b.claim(KEY).first
    b.close()
    assert _ours(root) == []
    b.close()  # twice: nothing more


def test_a_process_that_ends_normally_removes_its_directory(root):
    p, first = _user(root, "ds")
    assert first == "True" and _ours(root) == [PREFIX + "ds"]
    p.communicate("", timeout=60)
    assert _ours(root) == []


def test_a_directory_in_use_by_a_live_process_is_kept(root):
    """Another process (a loader worker, another job) uses the directory: this process's
    leaving, and its sweeps, leave it; the other can still claim in it; it goes with the last."""
    p, _ = _user(root, "ds")
    try:
        mine = HostCoalescer("ds", directory=root)
        mine.close()
        assert shareddir.sweep(root, PREFIX) == 0
        assert _ours(root) == [PREFIX + "ds"]
    finally:
        out, _ = p.communicate("", timeout=60)
    assert out.split() == ["True"]  # its directory was there to the end
    assert _ours(root) == []


def test_what_a_crashed_process_left_is_removed_by_a_later_user(root):
    p, first = _user(root, "a", "crash")
    assert first == "True" and p.wait(60) == 1
    assert _ours(root) == [PREFIX + "a"]
    assert sorted(os.listdir(os.path.join(root, PREFIX + "a"))) == [shareddir.LOCK, KEY.hex()]
    q, _ = _user(root, "b", "crash")  # a later user of another dataset sweeps it away
    assert q.wait(60) == 1
    assert _ours(root) == [PREFIX + "b"]
    c = HostCoalescer("b", directory=root)  # and one of the same dataset: starts afresh
    assert os.listdir(c.dir) == [shareddir.LOCK]  # the crashed claim's file is gone
    assert c.claim(KEY).first
    c.close()
    assert _ours(root) == []


def test_a_forked_child_leaving_keeps_its_parents_directory(root):
    c = HostCoalescer("ds", directory=root)
    pid = os.fork()
    if pid == 0:  # as a forked loader worker closing what it inherited
        try:
            c.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.isdir(c.dir) and shareddir.sweep(root, PREFIX) == 0
    c.close()
    assert _ours(root) == []


def test_stale_leftovers_are_swept_and_older_clients_directories_kept(root):
    """A staging directory of a crashed maker goes once stale; a directory of a client from
    before their removal (no lock file) stays, however old: that client may still run."""
    old = time.time() - shareddir.STALE_S - 60
    for name in (f".{PREFIX}x-new-1", "mlcache-coalesce-old"):
        os.makedirs(os.path.join(root, name, "sub"))
        os.utime(os.path.join(root, name), (old, old))
    HostCoalescer("ds", directory=root).close()
    assert _ours(root) == ["mlcache-coalesce-old"]


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's directory needs root")
def test_a_directory_another_user_made_under_the_name_is_not_used(root):
    """/dev/shm is everyone's: another user may make the directory first (names are
    predictable), plant links in it or hold its lock for good. It is refused, and a
    dataset then reads its misses without coalescing."""
    path = os.path.join(root, PREFIX + "ds")
    os.makedirs(path)
    open(os.path.join(path, shareddir.LOCK), "w").close()
    for p in (path, os.path.join(path, shareddir.LOCK)):
        os.chown(p, 65534, 65534)
    os.chmod(path, 0o777)
    with pytest.raises(PermissionError, match="not a directory of this user's"):
        HostCoalescer("ds", directory=root)
    os.chown(path, 0, 0)  # the user's own, but others may write in it
    with pytest.raises(PermissionError):
        HostCoalescer("ds", directory=root)


def test_a_claim_does_not_follow_a_link(root):
    c = HostCoalescer("ds", directory=root)
    try:
        target = os.path.join(root, "elsewhere")
        os.symlink(target, os.path.join(c.dir, KEY.hex()))
        with pytest.raises(OSError):
            c.claim(KEY)
        assert not os.path.exists(target)
    finally:
        c.close()


_CHURN = textwrap.dedent("""
    import os, sys, time
    from clients import shareddir
    from clients.coalesce import PREFIX, HostCoalescer
    root, start, until = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    time.sleep(max(0.0, start - time.time()))  # all together
    rounds = 0
    while time.time() < until:
        c = HostCoalescer("ds", directory=root)
        claim = c.claim(os.urandom(8))  # a file in the directory: fails if it was removed
        shareddir.sweep(root, PREFIX)  # others leave and sweep as this one uses it
        assert os.path.exists(claim.path), "the directory was removed under its user"
        claim.release()
        c.close()
        rounds += 1
    print(rounds)
""")


def test_users_joining_leaving_and_sweeping_at_once_never_lose_their_directory(root):
    """Processes join, claim, sweep and leave the same namespace over and over: removals
    race joins, and no user ever finds its directory gone while it uses it."""
    start = time.time() + 1.0  # once all have started
    procs = [subprocess.Popen([sys.executable, "-c", _CHURN, root, str(start), str(start + 2.0)], cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in outs]
    assert all(int(out) > 20 for out, _ in outs), outs  # they did race
    assert _ours(root) == []


def _waiting_on(ino: int) -> bool:
    """Whether a process waits for an flock of inode ino (Linux's /proc/locks: "->")."""
    with open("/proc/locks") as f:
        return any("->" in line and f":{ino} " in line for line in f)


def test_a_user_that_waited_on_a_removal_joins_a_directory_that_exists(root):
    """A process opens the lock file just as a remover holds it: when it gets its lock the
    directory is gone, and it must make a new one, not use the old one's lock."""
    path = os.path.join(root, PREFIX + "ds")
    crashed, _ = _user(root, "ds", "crash")
    assert crashed.wait(60) == 1  # left its directory behind: nobody uses it
    fd = os.open(os.path.join(path, shareddir.LOCK), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the test removes it, as remove_unused does
    p = subprocess.Popen([sys.executable, "-c", _USER, root, "ds", "live"], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _waiting_on(os.fstat(fd).st_ino):  # the user blocks on the remover's lock
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        gone = os.path.join(root, ".gone")
        os.rename(path, gone)  # then the remover takes the directory away
        shutil.rmtree(gone)
    finally:
        os.close(fd)
    out, _ = p.communicate("", timeout=60)
    assert p.returncode == 0 and out.split() == ["True", "True"]  # claimed in a directory that exists
    assert _ours(root) == []


def test_batch_claims_are_all_released_when_the_read_raises(root):
    other, c = HostCoalescer("ds", directory=root), HostCoalescer("ds", directory=root)
    keys = [bytes([k]) * 33 for k in range(3)]
    held = other.claim(keys[1])  # another reader is reading item 1
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeError):
        with BatchClaims(c, keys) as claims:
            assert (claims.mine, claims.others) == ([0, 2], [1])
            raise RuntimeError("the store read failed")
    assert len(os.listdir("/proc/self/fd")) == fds  # no claim's descriptor left open
    held.release()
    for k in keys:  # nothing held: each is anyone's to claim
        again = other.claim(k)
        assert again.first
        again.release()
    other.close()
    c.close()


def test_batch_claims_without_a_coalescer_are_all_mine():
    with BatchClaims(None, [b"a", b"b"]) as claims:
        assert (claims.mine, claims.others) == ([0, 1], [])
        claims.release_mine()
        claims.wait_others()


def test_a_batch_waits_once_for_a_reader_stuck_on_its_items(root):
    """Before: each waited item had its own time limit, so a live reader stuck on 20 of a
    batch's items held the batch up for 20 limits."""
    stuck = HostCoalescer("ds", directory=root)
    c = HostCoalescer("ds", directory=root, wait_seconds=0.2)
    keys = [bytes([k]) * 33 for k in range(20)]
    held = [stuck.claim(k) for k in keys]   # a reader that never finishes
    with BatchClaims(c, keys) as claims:
        assert claims.others == list(range(20))
        t0 = time.monotonic()
        claims.wait_others()
        waited = time.monotonic() - t0
    assert 0.2 <= waited < 1.0              # one limit for the batch (per item: 4 s)
    for h in held:
        h.release()
    stuck.close()
    c.close()
