"""Fingerprints of tf.data chains (preprocess/tf_fingerprint.py): what they see and ignore."""
import os
import subprocess
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (the 'tf' extra): "
                                              "pip install -e '.[tf]' to run the tf.data tests")
import numpy as np  # noqa: E402

from preprocess.tf_fingerprint import UnfingerprintableChain, chain_fingerprint  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(x):
    return tf.strings.length(x) + 1


def parse_renamed(record):
    return tf.strings.length(record) + 1


def key(chain, spec=None):
    return chain_fingerprint(chain, spec).key


def test_stable_across_rebuilds_and_processes():
    k = key(lambda d: d.map(parse).batch(8))
    assert k == key(lambda d: d.map(parse).batch(8))
    assert k.startswith(f"tf{tf.__version__}/")
    code = ("import os; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'; import tensorflow as tf; "
            "from preprocess.tf_fingerprint import chain_fingerprint; "
            "print(chain_fingerprint(lambda d: d.map(lambda r: tf.strings.length(r) + 1).batch(8)).key)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == k


def test_names_are_ignored():
    k = key(lambda d: d.map(parse))
    assert key(lambda d: d.map(parse_renamed)) == k
    assert key(lambda d: d.map(parse, name="my_map")) == k
    assert key(lambda d: d.map(lambda z: tf.add(tf.strings.length(z, name="len"), 1, name="plus"))) == k


def test_what_shapes_the_graph_counts():
    k = key(lambda d: d.map(parse))
    different = [
        lambda d: d.map(lambda x: tf.strings.length(x) + 2),            # a constant
        lambda d: d.map(lambda x: tf.strings.length(x) + np.int32(3)),  # a captured numpy value
        lambda d: d.map(parse).map(lambda n: n * 2),                    # another op
        lambda d: d.map(parse, num_parallel_calls=4),                   # parallelism counts too
    ]
    keys = [key(c) for c in different]
    assert k not in keys and len(set(keys)) == len(keys)
    assert key(lambda d: d.map(lambda x: tf.strings.length(x) + np.int32(2))) == keys[0]  # a value, not how given
    assert key(lambda d: d.map(parse), tf.TensorSpec([2], tf.string)) != k  # the source's spec


def test_seeds_op_level_count_shuffle_seeds_are_ignored():
    r1 = chain_fingerprint(lambda d: d.map(lambda x: tf.random.uniform([], seed=1)))
    r2 = chain_fingerprint(lambda d: d.map(lambda x: tf.random.uniform([], seed=2)))
    assert r1.key != r2.key and r1.random and r2.random
    assert not chain_fingerprint(lambda d: d.map(parse)).random
    # TensorFlow's fingerprint skips shuffle seeds (documented in the module)
    assert key(lambda d: d.shuffle(10, seed=1)) == key(lambda d: d.shuffle(10, seed=2))
    assert key(lambda d: d.shuffle(10, seed=1)) != key(lambda d: d.shuffle(20, seed=1))


@pytest.mark.parametrize("chain,why", [
    (lambda d: d.map(lambda x: tf.py_function(lambda s: 1, [x], tf.int32)), "calls Python"),
    (lambda d: d.map(lambda x: tf.numpy_function(lambda s: np.int32(1), [x], tf.int32)), "calls Python"),
], ids=["py_function", "numpy_function"])
def test_python_code_is_refused(chain, why):
    with pytest.raises(UnfingerprintableChain, match=why):
        chain_fingerprint(chain)


def test_captured_variables_are_refused_and_non_datasets_named():
    v = tf.Variable(3)
    with pytest.raises(UnfingerprintableChain, match="reads a tf.Variable"):
        chain_fingerprint(lambda d: d.map(lambda x: tf.strings.length(x) + v))
    with pytest.raises(TypeError, match="must return a tf.data.Dataset, got int"):
        chain_fingerprint(lambda d: 3)
