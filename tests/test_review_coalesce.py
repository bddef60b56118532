"""Review of same-host coalescing (clients/coalesce.py, clients/procstate.py's use of it):
never two winners of one item at once, a batch that cannot claim its misses still reads
them, and a reader that would insert nothing makes nobody wait. Real processes and flocks."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from clients.coalesce import HostCoalescer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]))

# Claims the same item over and over until argv[3] (a time); a winner marks its turn with an
# O_EXCL file, which a second winner at the same moment finds there. Prints rounds, overlaps.
_HAMMER = textwrap.dedent("""
    import errno, os, sys, time
    from clients.coalesce import HostCoalescer
    root, start, until = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    c = HostCoalescer("ds", directory=root)
    marker = os.path.join(root, "winner")
    time.sleep(max(0.0, start - time.time()))  # all together
    rounds = overlaps = 0
    while time.time() < until:
        claim = c.claim(b"\\x01" * 33)
        if claim.first:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                mine = True
            except FileExistsError:
                overlaps, mine = overlaps + 1, False
            time.sleep(0.0005)  # reading the item
            if mine:
                os.unlink(marker)
        else:
            claim.wait(5)
        claim.release()
        rounds += 1
    c.close()
    print(rounds, overlaps)
""")


def test_two_processes_never_both_win_one_item(shm):
    """Before: a winner unlinks its claim file as it lets go, and a process that had opened
    that file just before locked it afterwards: it won too, beside a newcomer that made the
    file afresh, and both read the item from the store (thousands of times in 5 s)."""
    start = time.time() + 1.0
    procs = [subprocess.Popen([sys.executable, "-c", _HAMMER, shm, str(start), str(start + 3.0)], cwd=ROOT,
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in outs]
    counts = [tuple(map(int, out.split())) for out, _ in outs]
    assert sum(r for r, _ in counts) > 100, counts  # they did race
    assert sum(o for _, o in counts) == 0, counts
    assert os.listdir(shm) == []


# A dataset reads a batch of 299 misses with only 100 descriptors to spare: a claim holds one.
_FEW_FDS = textwrap.dedent("""
    import os, pathlib, resource, sys
    from test_dataset import make_dataset
    from clients import coalesce
    from clients.dataset import CachedDataset
    tmp = pathlib.Path(sys.argv[1])
    coalesce.DEFAULT_DIR = str(tmp / "shm")
    path, items = make_dataset(tmp / "ds", n=300, lo=50, hi=200)
    ds = CachedDataset(path, cache_dir=str(tmp / "cache"), claims=False)
    assert ds.read([0]) == [items[0]]  # the process's state is open
    assert ds._proc().coalescer is not None
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    assert ds.read(list(range(1, 300))) == [items[i] for i in range(1, 300)]
    assert ds.read(list(range(1, 300))) == [items[i] for i in range(1, 300)]  # inserted: hits
    ds.close()
    print("ok")
""")


def test_a_batch_with_more_misses_than_free_descriptors_is_read_not_failed(tmp_path):
    """Before: each miss's claim opened a file, and a batch with more misses than the process
    had descriptors left (batch_size 1024 under the usual ulimit -n 1024) raised EMFILE out
    of the read, although coalescing is only an optimization."""
    (tmp_path / "shm").mkdir()
    p = subprocess.run([sys.executable, "-c", _FEW_FDS, str(tmp_path)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.split() == ["ok"], p.stderr[-3000:]
    assert "read without coalescing" in p.stderr  # said once why
    assert os.listdir(tmp_path / "shm") == []


# Holds the claim of argv[3]'s id in namespace argv[2] until its stdin closes.
_HOLDER = textwrap.dedent("""
    import sys
    from clients.coalesce import HostCoalescer
    c = HostCoalescer(sys.argv[2], directory=sys.argv[1])
    claim = c.claim(bytes.fromhex(sys.argv[3]))
    print(claim.first, flush=True)
    sys.stdin.read()
    claim.release()
    c.close()
""")


@pytest.mark.parametrize("how", [dict(cache=False), dict(insert=False)])
def test_a_reader_that_inserts_nothing_neither_waits_nor_is_waited_for(tmp_path, shm, how):
    """Before: a dataset with no cache (cache=False, the baseline) or insert=False coalesced
    too: it waited for another process reading the same item (30 s at most) only to read it
    itself afterwards, as nothing could come out of the cache for it; and as a winner it
    made the others wait for an insert it never makes."""
    pytest.importorskip("torch")
    from test_dataset import make_dataset

    from clients.dataset import CachedDataset

    path, items = make_dataset(tmp_path / "ds", n=4)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "cache"), claims=False, **how)
    holder = None
    try:
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, shm, ds.dataset_tag, ds.ids_for([1])[0].hex()],
                                  cwd=ROOT, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "True"  # another process is reading item 1
        t = time.monotonic()
        assert ds.read([1, 2]) == [items[1], items[2]]
        assert time.monotonic() - t < 10  # before: 30 s, waiting for the holder
        other = HostCoalescer(ds.dataset_tag)
        claim = other.claim(ds.ids_for([2])[0])
        assert claim.first  # nobody holds item 2, which this one read
        claim.release()
        other.close()
    finally:
        if holder is not None:
            holder.communicate("", timeout=60)
        ds.close()
    assert os.listdir(shm) == []
