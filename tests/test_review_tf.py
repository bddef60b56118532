"""Review of the tf.data client (clients/tf_source.py, tf_batches.py): the interpreter's exit
with an iterator still open, a dataset dropped without close(), and bad arguments. Real
cacheserver processes, real TFRecord files, real TensorFlow pipelines."""
import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (the 'tf' extra): "
                                              "pip install -e '.[tf]' to run the tf.data tests")

from clients import tf_dataset  # noqa: E402
from procs import ROOT, pid_alive, wait_until  # noqa: E402
from tfexamples import digested_shards, parse  # noqa: E402

N = 240

# Three datasets, one per feed (tf_batches: Feed, TicketFeed, Starter), each with an iterator
# left open at exit while its read-ahead thread (ours, or the prefetch tf.data injects) reads.
# Its last atexit handler (registered first) counts the reads that start after the others ran:
# a TensorFlow thread calling into Python once the interpreter finalizes never returns.
_OPEN_AT_EXIT = """
import atexit, os, sys, threading, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
ending, late = threading.Event(), []


def last_at_exit():
    ending.set()
    time.sleep(1.5)  # what still reads ahead reads on meanwhile
    if late:
        print(f"{len(late)} reads started after the atexit handlers", flush=True)
        os._exit(3)


atexit.register(last_at_exit)
from clients import tf_dataset  # noqa: E402

digest, cache = sys.argv[1:3]


def slowed(ds):
    src = ds.mlcache
    if src.autocache is not None:  # from_generator's generator (Starter)
        start = src.starter.start

        def slow():
            for x in start():
                late.extend([1] if ending.is_set() else [])
                time.sleep(0.1)
                yield x
        src.starter.start = slow
    else:
        read = src.read

        def slow(batch):
            late.extend([1] if ending.is_set() else [])
            time.sleep(0.3)
            return read(batch)
        src.read = slow
    return ds


made = [tf_dataset(digest, cache=cache, read_batch=16, **kw) for kw in
        (dict(), dict(read_parallel=3), dict(transform=lambda d: d, autocache="compute"))]
assert sum(1 for _ in made[0]) == 240  # an epoch fills the cache: the reads at exit are hits
made = [slowed(ds) for ds in made]
its = [iter(ds) for ds in made]  # left open: the exit destroys them
for it in its:
    next(it)
print("exiting", flush=True)
"""


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return digested_shards(str(tmp_path_factory.mktemp("tfrev")), N)


@pytest.mark.timeout(180)
def test_an_iterator_open_at_exit_does_not_hang_the_exit(shards, server):
    """A TensorFlow thread calling into Python once the interpreter finalizes never returns,
    and the iterator destroyed after that waited for it forever: a script that ended with an
    iterator open (a global `it = iter(ds)`) while its read-ahead read hung at exit (most runs
    where the read waited on a thread pool, as store reads and hash checks do). The read-ahead
    read on through the atexit handlers; it now stops before the interpreter finalizes."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", _OPEN_AT_EXIT, shards[0], server.address], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process did not exit (stdout {out!r}); stderr tail: {err[-2000:]}")
    assert proc.returncode == 0 and "exiting" in out, out + err[-3000:]


def _store_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("store-fetch")]


def test_a_dataset_dropped_without_close_lets_go_of_its_client(shards, server):
    """TensorFlow keeps the feeds' Python callables for the process's life, and they held
    the TFSource: a tf_dataset dropped without close() kept its cache client, store-read
    threads and sockets until the process ended. Collected, it is closed."""
    assert not _store_threads()
    ds = tf_dataset(shards[0], cache=server.address, read_batch=16)
    it = iter(ds.map(parse).batch(8))
    next(it)  # an iteration left open, then everything dropped
    source, cached = weakref.ref(ds.mlcache), weakref.ref(ds.mlcache.cached)
    assert _store_threads()
    del ds, it
    gc.collect()
    assert source() is None and cached() is None
    wait_until(lambda: not _store_threads(), "the store-read threads to end", timeout=10)


def _features(record):
    return parse(record)["x"]


@pytest.mark.timeout(240)
def test_a_dataset_with_a_map_fn_dropped_without_close_stops_its_workers(shards, server):
    """The same with map_fn=: its preprocessing worker processes ran until the process ended."""
    ds = tf_dataset(shards[0], cache=server.address, read_batch=32, map_fn=_features, num_workers=1)
    assert sum(1 for _ in ds) == N
    pids = [p.pid for p in ds.mlcache.preprocess.pool.procs.values()]
    assert pids and all(pid_alive(p) for p in pids)
    del ds
    gc.collect()
    wait_until(lambda: not any(pid_alive(p) for p in pids), "the preprocessing workers to stop", timeout=30)


def test_bad_reading_arguments_say_what_is_wrong(shards):
    digest = shards[0]
    with pytest.raises(ValueError, match=r"need world_size >= 1 .* world_size=0"):
        tf_dataset(digest, cache=False, rank=0, world_size=0)  # was taken as world_size=1
    with pytest.raises(ValueError, match="read_ahead must be >= 0, got -1"):
        tf_dataset(digest, cache=False, read_ahead=-1)
    with pytest.raises(TypeError, match="read_parallel must be an integer, got float 2.0"):
        tf_dataset(digest, cache=False, read_parallel=2.0)
    with pytest.raises(TypeError, match="read_batch must be an integer, got str '8'"):
        tf_dataset(digest, cache=False, read_batch="8")
    import numpy as np

    ds = tf_dataset(digest, cache=False, read_batch=np.int64(16), read_ahead=np.int32(0))  # numpy ints are ints
    try:
        assert sum(1 for _ in ds) == N
    finally:
        ds.mlcache.close()
