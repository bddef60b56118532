"""tf_dataset end to end: real TFRecord files written by TensorFlow, real cache servers,
real tf.data pipelines and a real Keras model."""
import os
import subprocess
import sys
from collections import Counter

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (the 'tf' extra): "
                                              "pip install -e '.[tf]' to run the tf.data tests")

from clients import tf_dataset  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from clients.digest_tool import main as digest_main  # noqa: E402
from procs import cachemanager, cacheserver, tf_config_code, two_ranks, wait_ring  # noqa: E402
from tfexamples import digested_shards, parse, write_shards  # noqa: E402

N = 240


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """(digest path, TFRecord paths, records in file order)."""
    return digested_shards(str(tmp_path_factory.mktemp("tfdata")), N)


@pytest.fixture
def ring3(tmp_path):
    servers = [cacheserver(str(tmp_path / f"s{i}"), "256MB").start() for i in range(3)]
    yield servers
    for s in servers:
        s.kill()


def epoch(ds) -> list[bytes]:
    return [bytes(x) for x in ds.as_numpy_iterator()]


def test_records_are_byte_identical_to_tfrecord_dataset(shards, ring3):
    digest, paths, records = shards
    ds = tf_dataset(digest, cache=",".join(s.address for s in ring3), seed=1)
    try:
        assert ds.element_spec == tf.TensorSpec([], tf.string)
        assert int(ds.cardinality()) == N
        reference = [bytes(x) for x in tf.data.TFRecordDataset(paths).as_numpy_iterator()]
        assert reference == records
        got = epoch(ds)
        assert Counter(got) == Counter(reference)  # every record, each exactly once
        assert got != reference  # in the sampler's order, not the files'
        st = ds.mlcache.epoch_stats[-1]
        assert (st.items, st.misses, st.hits) == (N, N, 0)
        assert st.store_bytes == sum(map(len, records)) and st.batches == -(-N // 64)
    finally:
        ds.mlcache.close()


@pytest.mark.parametrize("fraction", [0.0, 0.1, 1.0])
def test_exactly_once_per_epoch_with_partial_cache(shards, ring3, fraction):
    digest, _, records = shards
    spec = ",".join(s.address for s in ring3)
    warm = CachedDataset(digest, cache=spec)
    ds = tf_dataset(digest, cache=spec, insert=False, read_batch=20, seed=2)
    try:
        n_cached = int(N * fraction)
        warm.__getitems__(list(range(n_cached)))  # cache exactly this fraction
        got = epoch(ds)
        assert Counter(got) == Counter(records)
        st = ds.mlcache.epoch_stats[-1]
        assert st.hits == n_cached and st.misses == N - n_cached and st.items == N
        if 0 < fraction < 1:  # substitutable hits: the cached items come first
            assert ds.mlcache.sampler.stats.planned_hits == n_cached
            assert set(got[:n_cached]) == set(records[:n_cached])
            assert st.substituted > 0
    finally:
        ds.mlcache.close()
        warm.close()


@pytest.mark.parametrize("read_ahead,read_parallel", [(0, 1), (4, 1), (4, 3)],
                         ids=["in-tf-thread", "read-ahead", "parallel-reads"])
def test_repeat_gives_new_epochs_with_new_orders(shards, tmp_path, read_ahead, read_parallel):
    digest, _, records = shards
    ds = tf_dataset(digest, cache_dir=str(tmp_path / "emb"), capacity="64MB", seed=3, read_ahead=read_ahead,
                    read_parallel=read_parallel)
    try:
        got = epoch(ds.repeat(3))
        orders = [got[k * N:(k + 1) * N] for k in range(3)]
        for order in orders:
            assert Counter(order) == Counter(records)
        assert orders[0] != orders[1] != orders[2]
        e = ds.mlcache.epoch_stats
        assert [s.epoch for s in e] == [0, 1, 2]
        assert e[0].misses == N and e[1].hits == N and e[2].hits == N and e[2].store_bytes == 0
    finally:
        ds.mlcache.close()


def test_parallel_reads_keep_the_serial_order_and_the_counts(shards, tmp_path):
    """read_parallel=3 reads three batches at once: the same items in the same order per
    seed as one at a time (tickets are planned in order and handed on in order), each
    exactly once, and the same hit, miss and insert counts (the counters take concurrent adds)."""
    digest, _, records = shards
    made = {p: tf_dataset(digest, cache_dir=str(tmp_path / f"emb{p}"), capacity="64MB", seed=7, miss_seed=1,
                          read_batch=16, read_parallel=p) for p in (1, 3)}
    try:
        runs = {p: [epoch(ds), epoch(ds)] for p, ds in made.items()}  # a cold epoch, then all hits
        assert runs[3] == runs[1]
        for got in runs[3]:
            assert Counter(got) == Counter(records)
        for p, ds in made.items():
            e = ds.mlcache.epoch_stats
            assert [(s.misses, s.hits, s.inserted, s.items, s.batches, s.complete) for s in e] == [
                (N, 0, N, N, N // 16, True), (0, N, 0, N, N // 16, True)], p
    finally:
        for ds in made.values():
            ds.mlcache.close()


@pytest.mark.parametrize("read_parallel", [1, 3], ids=["serial", "parallel-reads"])
def test_server_killed_mid_epoch_no_error_exactly_once(shards, ring3, read_parallel):
    digest, _, records = shards
    ds = tf_dataset(digest, cache=",".join(s.address for s in ring3), read_batch=16, read_ahead=2, seed=4,
                    read_parallel=read_parallel)
    try:
        assert Counter(epoch(ds)) == Counter(records)  # epoch 1 fills the cache
        seen = []
        for k, x in enumerate(ds.as_numpy_iterator()):
            seen.append(bytes(x))
            if k == 40:
                ring3[1].proc.kill()  # SIGKILL a server mid-epoch
        assert Counter(seen) == Counter(records)
        st = ds.mlcache.epoch_stats[-1]
        assert st.misses > 0 and st.hits > 0  # its items became misses, the rest still hit
    finally:
        ds.mlcache.close()


def test_model_fit_two_epochs(shards, ring3):
    digest, _, records = shards
    ds = tf_dataset(digest, cache=ring3[0].address, seed=5)  # one address: expanded to its peers

    def features(record):
        ex = parse(record)
        return ex["x"], ex["label"]

    try:
        train = ds.map(features, num_parallel_calls=tf.data.AUTOTUNE).batch(32).prefetch(2)
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(16, activation="relu"),
                                     tf.keras.layers.Dense(4)])
        model.compile(optimizer=tf.keras.optimizers.Adam(0.05),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        hist = model.fit(train, epochs=2, verbose=0, shuffle=False)  # the sampler shuffles
        assert len(hist.history["loss"]) == 2
        assert hist.history["loss"][1] < hist.history["loss"][0]
        e = ds.mlcache.epoch_stats
        assert len(e) == 2 and all(s.items == N for s in e)
        assert e[0].misses == N and e[1].hits == N  # the second epoch read only the cache
    finally:
        ds.mlcache.close()


@pytest.mark.parametrize("read_parallel", [1, 3], ids=["serial", "parallel-reads"])
def test_an_abandoned_iteration_is_stopped_early_and_the_next_is_a_whole_epoch(shards, tmp_path, read_parallel):
    digest, _, records = shards
    ds = tf_dataset(digest, cache_dir=str(tmp_path / "emb"), capacity="64MB", seed=5, read_batch=16,
                    read_parallel=read_parallel)
    try:
        it = iter(ds)
        first = [bytes(next(it).numpy()) for _ in range(20)]  # then left: its epoch is not finished
        del it
        got = epoch(ds)
        assert Counter(got) == Counter(records) and got[:20] != first
        e = ds.mlcache.epoch_stats
        assert [(s.epoch, s.complete) for s in e] == [(0, False), (1, True)]
        assert e[0].items < N and e[1].items == N
        epoch(ds.take(5))
        ds.mlcache.close()  # ends the iteration left open: recorded as stopped early
        assert [(s.epoch, s.complete) for s in ds.mlcache.epoch_stats[2:]] == [(2, False)]
    finally:
        ds.mlcache.close()


@pytest.mark.parametrize("read_parallel", [1, 3], ids=["serial", "parallel-reads"])
@pytest.mark.parametrize("change", [-1, 1], ids=["fewer", "more"])
def test_an_epoch_with_a_wrong_item_count_fails(shards, tmp_path, read_parallel, change):
    """The exactly-once check: an epoch that yields fewer or more items than the share
    (here a read that loses or repeats an item) fails the user's loop, never passes silently."""
    digest, _, _ = shards
    ds = tf_dataset(digest, cache_dir=str(tmp_path / "emb"), capacity="64MB", read_batch=16,
                    read_parallel=read_parallel)
    src, read = ds.mlcache, ds.mlcache.read
    src.read = lambda batch: read(batch[:-1] if change < 0 else batch + batch[:1]) if batch else read(batch)
    try:
        with pytest.raises(tf.errors.OpError, match=str(N)):
            for _ in ds.map(parse).batch(64):  # as a training loop takes it
                pass
    finally:
        src.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("read_parallel", [1, 3], ids=["serial", "parallel-reads"])
def test_store_changed_since_digest_fails_the_epoch_naming_the_item(tmp_path, read_parallel):
    paths, _ = write_shards(str(tmp_path / "d"), 50, shards=2)
    assert digest_main([str(tmp_path / "d"), "-o", str(tmp_path / "d.dig"), "-f", "tfrecord", "-q"]) == 0
    with open(paths[1], "r+b") as f:  # the first record of the second file
        f.seek(100)
        f.write(b"XXXX")
    ds = tf_dataset(str(tmp_path / "d.dig"), cache=False, read_batch=8, read_parallel=read_parallel)
    try:
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"ItemMismatch: item 25 \(train-00001-of-00002"):
            epoch(ds)
        st = ds.mlcache.epoch_stats
        assert len(st) == 1 and not st[0].complete  # a failed epoch is recorded as stopped early
    finally:
        ds.mlcache.close()


def test_with_a_manager_ring_registration_and_batch_reports(shards, tmp_path):
    import time

    from manager.manager_client import ManagerClient

    digest, _, records = shards
    m = cachemanager(str(tmp_path / "mgr")).start()
    servers = [cacheserver(str(tmp_path / f"s{i}"), "256MB", 0, "--manager", m.address).start() for i in range(2)]
    ds = None
    try:
        wait_ring(m.address, 2)
        ds = tf_dataset(digest, manager=m.address, job="tf-job", n_gpus=2, read_batch=16, seed=6)
        assert sorted(ds.mlcache.cached.cache_spec.split(",")) == sorted(s.address for s in servers)
        assert ds.mlcache.cached.coordinator.reports.sampler is ds.mlcache.sampler  # hit fractions go with batch times
        got = epoch(ds.repeat(2))
        assert Counter(got[:N]) == Counter(records) and Counter(got[N:]) == Counter(records)
        assert sum(s.inserted for s in ds.mlcache.epoch_stats) > 0  # the plan allowed caching (hits: probing decides)
        # with no chunk work in its plan the coordinator reports every quiet_report_seconds (2 s)
        deadline = time.monotonic() + 3 * ds.mlcache.cached.coordinator.quiet_report_seconds
        with ManagerClient(m.address, timeout=2) as mc:
            while True:
                job = next(j for j in mc.status_dict()["jobs"] if j["job"] == "tf-job")
                if int(job.get("batches", 0)) >= 20 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        assert job["n_gpus"] == 2 and job["batches"] >= 20  # 2 epochs x 15 batch times reported
    finally:
        if ds is not None:
            ds.mlcache.close()
        for s in servers:
            s.kill()
        m.kill()


def test_bad_arguments_say_what_is_wrong(shards):
    digest, _, _ = shards
    with pytest.raises(TypeError, match="does not take decode=: .* decode in a .map"):
        tf_dataset(digest, cache=False, decode=lambda b: b)
    with pytest.raises(TypeError, match="does not take target="):
        tf_dataset(digest, cache=False, target="class")
    with pytest.raises(ValueError, match="read_batch must be >= 1"):
        tf_dataset(digest, cache=False, read_batch=0)
    with pytest.raises(ValueError, match="read_parallel must be >= 1"):
        tf_dataset(digest, cache=False, read_parallel=0)
    with pytest.raises(ValueError, match="names no server"):
        tf_dataset(digest, cache=" , ")
    with pytest.raises(ValueError, match="pass rank= and world_size= together"):
        tf_dataset(digest, cache=False, rank=1)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        tf_dataset(digest, cache=False, rank=2, world_size=2)


@pytest.mark.parametrize("shards", [1, 2], ids=["one-file", "hashed-in-parallel"])
def test_gzip_tfrecords_are_refused_at_digest_time(tmp_path, capsys, shards):
    write_shards(str(tmp_path / "gz"), 10, shards=shards, compression="GZIP")
    assert digest_main([str(tmp_path / "gz"), "-o", str(tmp_path / "gz.dig"), "-f", "tfrecord", "-q"]) != 0
    err = capsys.readouterr().err
    assert "compress" in err.lower(), err
    assert not (tmp_path / "gz.dig").exists()


def test_tf_dataset_is_exported_lazily():
    """`import clients` loads no TensorFlow; `from clients import tf_dataset` works."""
    code = ("import sys, clients; assert 'tensorflow' not in sys.modules, 'tensorflow imported early'; "
            "from clients import tf_dataset; from clients.tf_source import tf_dataset as t; "
            "assert tf_dataset is t and 'tf_dataset' in clients.__all__")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.timeout(180)
def test_tf_data_service_cannot_run_it_in_an_out_of_process_worker(shards):
    """Why remote TF work goes through our workers (docs/client.md): a tf.data service
    worker in another process has no Python function behind the source's py_func."""
    digest, _, _ = shards
    dispatcher = tf.data.experimental.service.DispatchServer()
    address = dispatcher.target.split("://")[1]
    code = ("import os, time; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'; import tensorflow as tf; "
            "s = tf.data.experimental.service; "
            f"w = s.WorkerServer(s.WorkerConfig(dispatcher_address='{address}')); time.sleep(120)")
    worker = subprocess.Popen([sys.executable, "-c", code])
    ds = tf_dataset(digest, cache=False)
    try:
        remote = ds.apply(tf.data.experimental.service.distribute("parallel_epochs", dispatcher.target))
        with pytest.raises(tf.errors.InvalidArgumentError, match="Could not find callback"):
            next(iter(remote))
    finally:
        ds.mlcache.close()
        worker.kill()
        worker.wait(10)


def test_readme_tf_block_runs_as_pasted(tmp_path):
    """README's tf_dataset block, after its Use steps' server, data and digest."""
    import re
    from pathlib import Path

    from test_readme import EXAMPLE_DIR, _blocks

    root = Path(__file__).resolve().parents[1]
    use = (root / "README.md").read_text().split("## Use", 1)[1].split("\n## ", 1)[0]
    block = _blocks(use, "python")[1]
    assert "tf_dataset(" in block
    where = str(tmp_path / "ex")
    server = cacheserver(str(tmp_path / "srv"), "256MB").start()
    try:
        env = dict(os.environ, PYTHONPATH=str(root))
        for argv in ([sys.executable, "tools/example_data.py", f"{where}/train"],
                     [sys.executable, "tools/digest", f"{where}/train", "-o", f"{where}/train.dig", "--targets", "dir"]):
            subprocess.run(argv, cwd=root, env=env, check=True, capture_output=True, timeout=120)
        script = block.replace(EXAMPLE_DIR, where).replace("127.0.0.1:7070", server.address)
        r = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                           timeout=180)
        assert r.returncode == 0, r.stderr[-3000:]
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("epoch ")]
        assert len(lines) == 2 and lines[0].startswith("epoch 0: 120 items")
        assert re.search(r"hit rate 100%", lines[1]), lines
    finally:
        server.kill()


def test_tar_shards_yield_their_members_not_samples(tmp_path):
    """One element per digest entry: a WebDataset shard's members, each its own bytes."""
    import io
    import random
    import tarfile

    rng = random.Random(7)
    members = {f"{k:04d}.{ext}": rng.randbytes(rng.randint(10, 3000)) for k in range(20) for ext in ("jpg", "cls")}
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "train-0000.tar", "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert digest_main([str(tmp_path / "shards"), "-o", str(tmp_path / "t.dig"), "-f", "tar", "-q"]) == 0
    ds = tf_dataset(str(tmp_path / "t.dig"), cache=False, read_batch=8)
    try:
        assert Counter(epoch(ds)) == Counter(members.values())
    finally:
        ds.mlcache.close()


@pytest.mark.timeout(300)
def test_ranks_in_two_processes_share_each_epoch(shards, ring3):
    """rank/world_size (DDP, or tf.distribute's input pipelines): two real processes,
    disjoint shares that make up the dataset, in every epoch, hits substituted per share."""
    digest, _, records = shards
    spec = ",".join(s.address for s in ring3)
    code = ("import os, sys; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'; from clients import tf_dataset; "
            "r = int(sys.argv[1]); "
            f"ds = tf_dataset({digest!r}, cache={spec!r}, seed=9, rank=r, world_size=2, read_batch=16); "
            "assert int(ds.cardinality()) == len(ds.mlcache.cached) // 2; "
            "[print(e, bytes(x).hex()) for e in range(2) for x in ds.as_numpy_iterator()]; "
            "ds.mlcache.close()")
    outs = two_ranks(code)
    for e in ("0", "1"):
        shares = [[bytes.fromhex(h) for ep, h in (ln.split() for ln in out.splitlines()) if ep == e]
                  for out, _ in outs]
        assert len(shares[0]) == len(shares[1]) == N // 2
        assert Counter(shares[0]) + Counter(shares[1]) == Counter(records)  # disjoint, complete


@pytest.mark.timeout(300)
def test_multi_worker_strategy_keeps_each_ranks_whole_share(shards):
    """MultiWorkerMirroredStrategy.experimental_distribute_dataset (what Keras fit does under
    it) auto-shards a dataset with no files by element: on a rank's share that kept half
    of each share (60 of 120 per worker). The share must pass through whole."""
    import hashlib

    digest, _, records = shards
    code = (tf_config_code(2) +
            "import hashlib, tensorflow as tf; from clients import tf_dataset; "
            "strategy = tf.distribute.MultiWorkerMirroredStrategy(); "
            f"ds = tf_dataset({digest!r}, cache=False, seed=3, rank=r, world_size=2, read_batch=16); "
            "dist = strategy.experimental_distribute_dataset(ds.batch(8)); "
            "[print(hashlib.sha256(x).hexdigest()) for b in dist for t in strategy.experimental_local_results(b) "
            "for x in t.numpy()]; "
            "ds.mlcache.close()")
    outs = two_ranks(code)
    shares = [out.split() for out, _ in outs]  # item hashes: short lines, no pipe fills while the other waits
    assert [len(s) for s in shares] == [N // 2, N // 2]
    assert Counter(shares[0]) + Counter(shares[1]) == Counter(hashlib.sha256(r).hexdigest() for r in records)


@pytest.mark.parametrize("how", ["serial", "parallel-reads", "autocache-compute"])
def test_a_closed_dataset_lets_go_of_its_client_and_says_it_is_closed(shards, tmp_path, how):
    """TensorFlow keeps the Python callables of a dataset's sources (numpy_function's,
    from_generator's) for the life of the process: closed and dropped, a tf_dataset still
    held its TFSource and CachedDataset (2 more fds of shared memory per dataset made), and
    iterating it after close() quietly reopened the client. Closed, it lets go of them and
    an iteration says it was closed."""
    import gc
    import weakref

    digest, _, _ = shards
    kw = (dict(transform=lambda d: d.map(parse), autocache="compute") if how == "autocache-compute"
          else dict(read_parallel=3 if how == "parallel-reads" else 1))
    ds = tf_dataset(digest, cache_dir=str(tmp_path / "emb"), capacity="64MB", read_batch=16, **kw)
    assert len(list(ds.as_numpy_iterator())) == N
    ds.mlcache.close()
    with pytest.raises(tf.errors.OpError, match="this tf_dataset was closed"):
        next(iter(ds))
    source, cached = weakref.ref(ds.mlcache), weakref.ref(ds.mlcache.cached)
    del ds
    gc.collect()
    assert source() is None and cached() is None


@pytest.mark.parametrize("how", ["serial", "parallel-reads", "autocache-compute"])
def test_two_iterators_at_once_say_why_and_the_later_gets_a_whole_epoch(shards, tmp_path, how):
    """Two iterators of one tf_dataset open at once shared one epoch's batches, and both
    failed TensorFlow's cardinality check ("expected to contain 240 elements but
    contained only 64"), which says nothing of why. The later one now gets a whole
    epoch and the earlier one's next call says what happened and what to do."""
    digest, _, records = shards
    kw = (dict(transform=lambda d: d, autocache="compute") if how == "autocache-compute"
          else dict(read_parallel=3 if how == "parallel-reads" else 1))
    ds = tf_dataset(digest, cache_dir=str(tmp_path / "emb"), capacity="64MB", seed=2, read_batch=16, **kw)
    try:
        a = iter(ds)
        next(a)
        b = iter(ds)
        assert Counter(bytes(x.numpy()) for x in b) == Counter(records)
        with pytest.raises(tf.errors.OpError, match="two iterators of this tf_dataset were open at once.*"
                                                    "one pass at a time"):
            for _ in range(N):
                next(a)
        del a, b
        assert Counter(epoch(ds)) == Counter(records)  # a pass after them is whole
        assert [(s.epoch, s.complete) for s in ds.mlcache.epoch_stats] == [(0, False), (1, True), (2, True)]
    finally:
        ds.mlcache.close()
