"""tf_dataset(map_fn=...): a `.map` of TF ops run in our preprocessing worker processes
(spawned for real, killed for real), keyed by the TF chain's fingerprint."""
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (the 'tf' extra): "
                                              "pip install -e '.[tf]' to run the tf.data tests")

from clients import tf_dataset  # noqa: E402
from clients.digest_tool import main as digest_main  # noqa: E402
from preprocess import Pipeline, PipelineError  # noqa: E402
from preprocess.tf_fingerprint import UnfingerprintableChain, chain_fingerprint  # noqa: E402
from preprocess.tf_map import TFMap  # noqa: E402
from procs import cacheserver, tf_config_code, two_ranks  # noqa: E402
from tfexamples import digested_shards, parse, write_shards  # noqa: E402

N = 240
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return digested_shards(str(tmp_path_factory.mktemp("tfw")), N)


def features(record):
    ex = parse(record)
    return {"label": ex["label"], "x": ex["x"] * 2.0, "size": tf.strings.length(ex["image"])}


def features_renamed(rec):  # the same graph under other names
    e = parse(rec)
    return {"label": e["label"], "x": e["x"] * 2.0, "size": tf.strings.length(e["image"])}


def as_rows(elements) -> Counter:
    return Counter((int(e["label"]), tuple(float(v) for v in e["x"]), int(e["size"])) for e in elements)


def reference(paths) -> Counter:
    return as_rows(tf.data.TFRecordDataset(paths).map(features).as_numpy_iterator())


@pytest.fixture(scope="module")
def mapped(shards, tmp_path_factory):
    """tf_dataset(map_fn=features) with 2 worker processes over a cache server (one
    start-up of the workers, which import TensorFlow, for the tests that use them)."""
    tmp = tmp_path_factory.mktemp("mapped")
    server = cacheserver(str(tmp / "srv"), "256MB").start()
    ds = tf_dataset(shards[0], cache=server.address, seed=1, read_batch=32, map_fn=features, num_workers=2,
                    cost_dir=str(tmp / "costs"))
    yield ds
    ds.mlcache.close()
    server.kill()


def test_map_runs_in_worker_processes_and_equals_tf_map(shards, mapped):
    _, paths, _ = shards
    ds = mapped
    assert ds.element_spec["x"] == tf.TensorSpec([4], tf.float32)
    pool = ds.mlcache.preprocess.pool
    assert len(pool.procs) == 2 and all(p.is_alive() and p.pid != os.getpid() for p in pool.procs.values())
    for e in range(2):  # epoch 0 fills the cache, epoch 1 reads it: the workers read both
        got = list(ds.as_numpy_iterator())
        assert as_rows(got) == reference(paths)  # every record, once, mapped as TensorFlow maps it
        st = ds.mlcache.epoch_stats[-1]
        assert st.items == N and st.preprocess.items == N and st.preprocess.workers[0] == 2
    first, second = ds.mlcache.epoch_stats[-2:]
    assert first.misses >= N - 16 and second.hits == N  # (the 16 items profiled first were cached then)
    batched = next(iter(ds.batch(16)))  # stacked per component, then unbatched: batches as usual
    assert batched["x"].shape == (16, 4)


def test_a_worker_killed_mid_epoch_its_items_run_again(shards, mapped):
    _, paths, _ = shards
    ds = mapped
    got, killed = [], None
    for k, x in enumerate(ds.as_numpy_iterator()):
        got.append(x)
        if k == 20:
            killed = next(iter(ds.mlcache.preprocess.pool.procs.values()))
            os.kill(killed.pid, signal.SIGKILL)
    assert as_rows(got) == reference(paths)  # exactly once, though a worker died holding items
    killed.join(10)
    assert not killed.is_alive() and killed.exitcode == -signal.SIGKILL
    assert ds.mlcache.epoch_stats[-1].complete and ds.mlcache.epoch_stats[-1].items == N
    assert len(ds.mlcache.preprocess.pool.procs) == 2  # replaced


def test_an_abandoned_epoch_then_full_epochs_by_repeat(shards, mapped):
    _, paths, _ = shards
    ds = mapped
    for k, _ in enumerate(ds.as_numpy_iterator()):
        if k == 10:
            break  # the iterator is dropped mid-epoch: the workers' queued tasks are dropped
    st = ds.mlcache.epoch_stats[-1]
    assert not st.complete and st.items < N
    got = list(ds.repeat(2).as_numpy_iterator())
    assert as_rows(got[:N]) == reference(paths) and as_rows(got[N:]) == reference(paths)
    assert [s.complete for s in ds.mlcache.epoch_stats[-2:]] == [True, True]


def test_outputs_of_varying_shape_go_one_by_one(shards, tmp_path):
    """An output whose shape varies per item cannot be stacked into a batch."""
    digest, paths, records = shards
    ds = tf_dataset(digest, cache=False, map_fn=_raw_bytes, num_workers=0, cost_dir=False)  # 0: in this process
    try:
        assert ds.element_spec == tf.TensorSpec([None], tf.uint8)
        got = Counter(bytes(x) for x in ds.as_numpy_iterator())
        assert got == Counter(records)
    finally:
        ds.mlcache.close()


def _raw_bytes(record):
    return tf.io.decode_raw(record, tf.uint8)


def test_a_failing_map_names_the_item_and_the_step(tmp_path):
    write_shards(str(tmp_path / "d"), 20, shards=1)
    assert digest_main([str(tmp_path / "d"), "-o", str(tmp_path / "d.dig"), "-f", "tfrecord", "-q"]) == 0
    with pytest.raises(PipelineError, match="TFMap"):  # fails on every sample item while preparing
        tf_dataset(str(tmp_path / "d.dig"), cache=False, map_fn=_wrong_feature, num_workers=1, cost_dir=False)


def _wrong_feature(record):
    return tf.io.parse_single_example(record, {"absent": tf.io.FixedLenFeature([], tf.int64)})["absent"]


def _label_0_only(record):
    ex = parse(record)
    with tf.control_dependencies([tf.debugging.assert_equal(ex["label"], tf.constant(0, tf.int64))]):
        return tf.identity(ex["x"])


def test_on_error_skip_leaves_out_failing_items_even_whole_batches(shards):
    digest, paths, records = shards
    ds = tf_dataset(digest, cache=False, map_fn=_label_0_only, num_workers=0, on_error="skip", read_batch=2,
                    cost_dir=False)
    try:
        got = Counter(tuple(float(v) for v in x) for x in ds.as_numpy_iterator())
        want = Counter(tuple(float(v) for v in e["x"]) for e in tf.data.TFRecordDataset(paths).map(parse)
                       .as_numpy_iterator() if int(e["label"]) == 0)
        assert got == want and sum(want.values()) == N // 4
        st = ds.mlcache.epoch_stats[-1]
        assert st.complete and st.preprocess.skipped == N - N // 4
    finally:
        ds.mlcache.close()


@pytest.mark.timeout(300)
def test_skips_under_a_multi_worker_strategy_leave_ranks_uneven_and_nothing_waits(shards):
    """With on_error="skip" ranks make different numbers of items (no cardinality is asserted),
    and the PyTorch loader pads its ranks for DDP. tf.distribute needs no padding: a
    MultiWorkerMirroredStrategy's distributed iterator hands a rank that has run out empty
    batches while another still has items, so the per-step all-reduce below ends on both
    (it would wait for ever on one were the ranks left to end apart)."""
    digest, _, _ = shards
    code = (tf_config_code(2) + "sys.path.insert(0, 'tests'); import tensorflow as tf; "
            "from clients import tf_dataset; from test_tf_workers import _label_0_only; "
            "strategy = tf.distribute.MultiWorkerMirroredStrategy(); "
            f"ds = tf_dataset({digest!r}, cache=False, seed=3, rank=r, world_size=2, read_batch=8, "
            "map_fn=_label_0_only, num_workers=0, on_error='skip', cost_dir=False); "
            "dist = strategy.experimental_distribute_dataset(ds.batch(4)); "
            "step = lambda b: strategy.reduce('SUM', strategy.run(lambda x: tf.shape(x)[0], args=(b,)), axis=None); "
            "sizes = [int(step(b)) for b in dist]; "
            "print(len(sizes), sum(sizes), ds.mlcache.epoch_stats[-1].items); ds.mlcache.close()")
    outs = [[int(v) for v in out.split()] for out, _ in two_ranks(code)]
    (steps0, total0, mine0), (steps1, total1, mine1) = outs
    assert mine0 != mine1, "the seed should leave the ranks uneven"
    assert steps0 == steps1 and total0 == total1 == mine0 + mine1 == N // 4


def test_keys_are_the_tf_chains_fingerprint():
    step = TFMap(features)
    assert step.key == chain_fingerprint(lambda d: d.map(features)).key
    assert not step.random
    p = Pipeline([step]).fingerprint()
    assert p == Pipeline([TFMap(features)]).fingerprint()  # rebuilt: the same key
    assert p == Pipeline([TFMap(features_renamed)]).fingerprint()  # names do not count
    assert p != Pipeline([TFMap(parse)]).fingerprint()  # another graph, another key
    code = ("import os, sys; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'; sys.path.insert(0, 'tests'); "
            "from test_tf_workers import features; from preprocess import Pipeline; "
            "from preprocess.tf_map import TFMap; print(Pipeline([TFMap(features)]).fingerprint())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == p  # another process: the same key


def test_random_maps_are_random_steps_and_python_is_refused():
    noisy = TFMap(lambda r: tf.strings.length(r) + tf.random.uniform([], 0, 3, tf.int32))
    assert noisy.random
    assert Pipeline([_as_step(noisy)]).cacheable_prefix() == 0  # nothing after it is cached
    with pytest.raises(UnfingerprintableChain, match="py_function"):
        TFMap(lambda r: tf.py_function(lambda x: x, [r], tf.string))


def _as_step(fn):
    from preprocess import step
    return step(fn, random=fn.random)


def test_worker_options_need_a_map(shards):
    digest, _, _ = shards
    with pytest.raises(ValueError, match="num_workers: options of the preprocessing workers"):
        tf_dataset(digest, cache=False, num_workers=2)
    with pytest.raises(TypeError, match="transform= is a function of a tf.data.Dataset"):
        tf_dataset(digest, cache=False, transform=parse)  # a function of one item: that is map_fn=


def test_the_step_runs_where_the_users_code_is_absent(tmp_path):
    """What a remote worker gets: the pickled step carries its graph, so a process that
    cannot import the function (a lambda over a closure here) still runs it."""
    import pickle

    scale = 3

    step = TFMap(lambda r: tf.strings.length(r) * scale)
    code = ("import os, pickle, sys; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'; "
            "step = pickle.loads(sys.stdin.buffer.read()); print(int(step(b'abcd')))")
    env = dict(os.environ, PYTHONPATH=ROOT)  # our package only: not the tests, not this module
    r = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(step), capture_output=True,
                       cwd=str(tmp_path), env=env, timeout=180)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert r.stdout.decode().strip().splitlines()[-1] == "12"


@pytest.mark.xdist_group("ray")
@pytest.mark.timeout(300)
def test_the_step_runs_in_a_ray_worker(tmp_path, shared_head):
    """A Ray task (a worker process Ray starts) runs the shipped step; skipped without
    the `ray` extra (make venv does not install it). On the tests' shared Ray head (conftest),
    joined as a job whose workers find our package but not the tests."""
    step = TFMap(features)
    records = [bytes(r) for r in tf.data.TFRecordDataset(write_shards(str(tmp_path / "d"), 8, 1)[0])
               .as_numpy_iterator()]
    from rayhead import disconnect
    ray = shared_head.connect(runtime_env={"env_vars": {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ROOT}})
    try:
        def run_step(step, records):  # local: Ray ships it by value (no test module there)
            return [step(r) for r in records]

        remote = ray.remote(run_step)
        got = ray.get(remote.remote(step, records), timeout=240)
    finally:
        disconnect(ray)
    assert as_rows(got) == as_rows([step(r) for r in records])


def test_outputs_round_trip_through_the_transformed_item_codec(shards):
    """What autocache stores of a TF map's output (preprocess/codec.py: no pickle)."""
    import numpy as np

    from preprocess import codec

    _, paths, _ = shards
    rec = next(tf.data.TFRecordDataset(paths).as_numpy_iterator())
    for fn in (parse, features):
        out = TFMap(fn)(rec)
        back = codec.decode(codec.encode(out))
        assert back.keys() == out.keys()
        for k, v in out.items():
            assert type(back[k]) is type(v) and np.array_equal(back[k], v), k


def test_map_fn_outputs_kept_by_autocache_hit_in_epoch_two(shards, tmp_path):
    digest, paths, _ = shards
    server = cacheserver(str(tmp_path / "srv"), "256MB").start()
    ds = tf_dataset(digest, cache=server.address, seed=1, read_batch=32, map_fn=features, num_workers=0,
                    autocache="transformed", cost_dir=str(tmp_path / "costs"))
    try:
        assert ds.mlcache.autocache.mode == "transformed" and ds.mlcache.autocache.key
        e1 = as_rows(ds.as_numpy_iterator())
        s1 = ds.mlcache.epoch_stats[-1]
        assert s1.transformed["puts"] == N and s1.items == N
        e2 = as_rows(ds.as_numpy_iterator())
        s2 = ds.mlcache.epoch_stats[-1]
        assert (s2.transformed["hits"], s2.transformed["misses"]) == (N, 0)
        assert s2.store_bytes == 0 and s2.misses == 0  # the outputs were read, not the records
        assert e1 == e2 == reference(paths)  # every item once, as TensorFlow maps it
        assert "autocache transformed (fixed)" in s2.line()
    finally:
        ds.mlcache.close()
        server.kill()


def test_map_fn_with_autocache_auto_decides_in_the_first_epoch(shards, tmp_path):
    digest, paths, _ = shards
    server = cacheserver(str(tmp_path / "srv"), "256MB").start()
    ds = tf_dataset(digest, cache=server.address, seed=1, read_batch=32, map_fn=features, num_workers=0,
                    autocache="auto", epochs=3, cost_dir=str(tmp_path / "costs"))
    try:
        for _ in range(2):
            assert as_rows(ds.as_numpy_iterator()) == reference(paths)
            assert ds.mlcache.epoch_stats[-1].items == N
        ac = ds.mlcache.autocache
        # decided after a measured part of the first epoch, or before it where the estimate is clear
        assert ac.state in ("decided", "estimated") and ac.mode in ("source", "transformed", "compute"), ac.line()
        assert f"autocache {ac.mode} ({ac.state})" in ds.mlcache.epoch_stats[-1].line()
    finally:
        ds.mlcache.close()
        server.kill()
